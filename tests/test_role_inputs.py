"""Hostile input to every string variable of train.yml, cleanup.yml, status.yml, provision.yml and the pipeline's
playbooks (datagen.yml, evaluate.yml, serve.yml) is refused before anything changes, or lands inert (an argv entry,
a module parameter, a quoted value), never in a shell.

The grammar is plugins/filter/role_inputs.py (through the inputs role); the tables there are held to every role's
meta/argument_specs.yml, so a new string variable without a grammar fails here. Then: each hostile string against
each variable (pure Python), a property-based test of the path grammar and of the quoting filters, and one real
ansible-playbook run per playbook and role with every string variable hostile at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
spec = importlib.util.spec_from_file_location("role_inputs", ROOT / "plugins" / "filter" / "role_inputs.py")
ri = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ri)
# The grammar of kinds and the quoting filters (role_inputs.py checks a role's variables with them).
spec = importlib.util.spec_from_file_location("input_grammar", ROOT / "plugins" / "filter" / "input_grammar.py")
grammar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grammar)

# The roles of the playbooks (status.yml's own variables are the "status" table).
ROLES = [
    "eagle3_train",
    "gpu_cleanup",
    "run_lock",
    "ct_running",
    "local_ct",
    "pve_gpu_host",
    "pve_gpu_container",
    "gpu_userspace",
    "eagle3_datagen",
    "eagle3_evaluate",
    "eagle3_serve",
]

HOSTILE = [
    "/tmp; rm -rf /",  # a command after the path
    "$(touch /tmp/pwned)",  # command substitution
    "`id`",
    "a b",  # a space: two arguments
    "/opt/x\nExecStartPre=/bin/sh -c id",  # a newline: a new line in a unit or config file
    "/var/lib/../../etc",  # not normalised
    "/opt/\u00e9t\u00e9",  # not ASCII
    "/" + "a" * 5000,  # very long
    "/run/%n",  # a systemd specifier
    '/x"y',  # a quote
    "/x\\y",  # a backslash
    "",  # empty
]
# Kinds whose values are data, never a path, name or command: what they may hold is anything printable on one line,
# and where they land (argv entries, module parameters, quoted env values, a JSON record, no_log) keeps them inert.
INERT = {"text", "argv_item", "secret", "controller_path", "regex", "trainer_config", "raw"}
STRINGISH = {"list", "dict"} | set(grammar.KINDS)
PATH_KINDS = {"abspath", "path_glob", "command", "bind_pair", "owned_dir", "sweep_glob"}


def kind_of(entry: dict) -> str:
    return entry.get("of") or entry.get("values") or entry["kind"]


def argument_spec_options(role: str) -> dict:
    path = ROOT / "roles" / role / "meta" / "argument_specs.yml"
    options = {}
    for entry in yaml.safe_load(path.read_text())["argument_specs"].values():
        options.update(entry.get("options") or {})
    return options


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_of_every_role_has_a_grammar(role):
    declared = set(argument_spec_options(role))
    defaults = set(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {})
    table = set(ri.ROLE_VARIABLES[role])
    assert declared <= table, f"{role}: no grammar for {sorted(declared - table)} (plugins/filter/role_variables.py)"
    assert defaults - {n for n in defaults if "__" in n} <= table, f"{role}: {sorted(defaults - table)}"
    # and the other way: a grammar entry is a variable the role declares and defaults (nothing stale in the table)
    assert table <= declared, f"{role}: {sorted(table - declared)} not in meta/argument_specs.yml"
    assert table <= defaults, f"{role}: {sorted(table - defaults)} without a default in defaults/main.yml"
    assert not set(ri.ROLE_FACTS.get(role, ())) & table, "a variable the role sets itself is not an input"


INVENTORIES = sorted(p for p in (ROOT / "inventory").glob("*/*_vars/*.yml"))


def test_every_variable_an_inventory_sets_is_one_the_project_reads():
    """inventory/example, example-multinode and local set only declared variables: a role's (its table and
    argument_specs, above), the inventory-wide Proxmox API settings the CT role defaults from (pve_api_*), the pct
    connection's options, Ansible's own (ansible_*), and the local inventory's root. A misspelt name fails here
    instead of being silently ignored by every role."""
    known = {name for table in ri.ROLE_VARIABLES.values() for name in table}
    known |= set(
        re.findall(r"\b(pve_api_\w+) \| default", (ROOT / "roles/pve_gpu_container/defaults/main.yml").read_text())
    )
    connection = yaml.safe_load(
        (ROOT / "plugins/connection/pct.py").read_text().split('DOCUMENTATION = r"""')[1].split('"""')[0]
    )
    known |= {v["name"] for option in connection["options"].values() for v in option.get("vars", [])}
    known |= {"eagle3_root"}  # inventory/local: the checkout's root, for the paths below it
    assert len(INVENTORIES) >= 6, INVENTORIES
    for path in INVENTORIES:
        names = set(yaml.safe_load(path.read_text()) or {})
        unknown = sorted(n for n in names - known if not n.startswith("ansible_"))
        assert not unknown, f"{path.relative_to(ROOT)}: {unknown} is no variable of a role, pct or Ansible"


def string_variables():
    for role, table in ri.ROLE_VARIABLES.items():
        for name, entry in table.items():
            if entry["kind"] in STRINGISH:
                yield role, name, entry


@pytest.mark.parametrize(
    ("role", "name", "entry"), list(string_variables()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_hostile_string_is_refused_or_inert(role, name, entry):
    for hostile in HOSTILE:
        value = [hostile] if entry["kind"] == "list" else {"X": hostile} if entry["kind"] == "dict" else hostile
        if entry["kind"] == "trainer_config":
            value = {"run_name": hostile}
        errors = ri.role_input_errors({name: value}, role)
        inert = entry["kind"] in INERT or entry.get("of") in INERT or entry.get("values") in INERT
        if hostile == "" and (entry.get("empty") or inert):
            continue
        if inert and "\n" not in hostile and len(hostile) <= 4096:
            continue  # printable text on one line: allowed, and it lands inert (see the lxc scenario's env case)
        if ".." in hostile and kind_of(entry) not in PATH_KINDS:
            continue  # ".." means something only in a path
        assert errors, f"{name}={hostile!r} was accepted"
        assert errors[0].startswith(name), errors[0]
        assert "allowed:" in errors[0] or "did you mean" in errors[0] or "is not a trainer config key" in errors[0]


@given(st.text(min_size=1, max_size=300))
@settings(max_examples=400, deadline=None)
def test_an_accepted_path_is_absolute_normalised_and_one_inert_word(text):
    """Whatever the text, the path grammar accepts it only if a shell and systemd see exactly one plain word."""
    path = text if text.startswith("/") else "/" + text
    if grammar.path_problem(path) is not None:
        return
    assert posixpath.normpath(path) == path or path == "/"
    assert path.isascii() and not any(c.isspace() for c in path)
    assert shlex.split(path) == [path] and shlex.quote(path) == path  # nothing for a shell to interpret
    assert not set(path) & set("$%;&|<>`'\"\\*?[]{}()!#~")
    assert all(part not in (".", "..") for part in path.split("/"))


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), max_size=200))
@settings(max_examples=300, deadline=None)
def test_systemd_quoting_makes_one_argument_with_no_specifier_or_variable(text):
    quoted = grammar.systemd_arg(text)
    assert quoted.startswith('"') and quoted.endswith('"')
    inner = quoted[1:-1]
    # Every % and $ is doubled, every " and \ escaped: unescaping gives the text back.
    out, i = [], 0
    while i < len(inner):
        c = inner[i]
        if c in "%$":
            assert inner[i + 1] == c, quoted
            out.append(c)
            i += 2
        elif c == "\\":
            assert inner[i + 1] in '\\"', quoted
            out.append(inner[i + 1])
            i += 2
        else:
            assert c != '"', quoted
            out.append(c)
            i += 1
    assert "".join(out) == text


def test_a_control_character_never_reaches_a_unit_or_environment_file():
    for quote in (grammar.systemd_arg, grammar.systemd_path, grammar.env_file_value):
        with pytest.raises(ValueError, match="control character"):
            quote("ok\nExecStartPre=/bin/sh")


# ------------------------------------------------------------------------------- the playbooks, end to end (no CT)
@pytest.fixture
def inventory(tmp_path):
    lxcpath = tmp_path / "lxc"
    lxcpath.mkdir()
    inv = tmp_path / "hosts.yml"
    inv.write_text(f"""\
all:
  vars:
    eagle3_root: {ROOT}
    local_ct_vmid: 9998
    local_ct_lxcpath: {lxcpath}
    local_ct_rootfs_cache: {tmp_path}/rootfs
    local_ct_standin_dir: {tmp_path}/standin
  children:
    local_ct_hosts:
      hosts:
        localhost:
          ansible_connection: local
          ansible_python_interpreter: {sys.executable}
    pve_nodes:
      hosts:
        pve-fake:
          ansible_connection: local
          ansible_python_interpreter: {sys.executable}
    training:
      hosts:
        ct9998:
          ansible_connection: pct
          pct_vmid: 9998
          pct_node: pve-fake
          pct_command: {ROOT}/bin/pct-local --lxcpath {lxcpath}
""")
    return inv


def hostile_values(role: str) -> dict:
    """Every string variable of the role set to a hostile value that its grammar must refuse."""
    values = {}
    for i, (name, entry) in enumerate(sorted(ri.ROLE_VARIABLES[role].items())):
        if entry["kind"] not in STRINGISH or entry["kind"] in INERT or entry.get("of") in INERT:
            continue
        hostile = [h for h in HOSTILE if h][i % (len(HOSTILE) - 1)]
        if entry["kind"] == "list" and entry["of"] == "bind_pair":
            values[name] = [{"host": hostile, "ct": "/srv/shared"}]
        elif entry["kind"] == "list":
            values[name] = [hostile]
        elif entry["kind"] == "dict":
            values[name] = {"A B": hostile}
        else:
            values[name] = hostile
    return values


def run(playbook: str, inventory: Path, extra: dict, *flags: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    args = [
        str(ANSIBLE_PLAYBOOK),
        "-i",
        str(inventory),
        str(ROOT / playbook),
        "-e",
        json.dumps(extra),
        *flags,
    ]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("playbook", "roles", "flags"),
    [
        ("train.yml", ["eagle3_train", "gpu_cleanup", "run_lock"], ()),
        ("cleanup.yml", ["gpu_cleanup", "run_lock"], ()),
        ("datagen.yml", ["eagle3_datagen", "run_lock", "gpu_cleanup"], ()),
        ("evaluate.yml", ["eagle3_evaluate", "run_lock"], ()),
        ("serve.yml", ["eagle3_serve", "run_lock", "gpu_cleanup"], ()),
        ("status.yml", ["status", "gpu_cleanup", "eagle3_train"], ()),
        ("provision.yml", ["local_ct"], ()),
        ("provision.yml", ["pve_gpu_host"], ("--tags", "pve_host")),
        ("provision.yml", ["pve_gpu_container"], ("--tags", "pve_container")),
        ("provision.yml", ["gpu_userspace"], ("--tags", "gpu_userspace")),
    ],
)
def test_a_playbook_refuses_every_hostile_variable_at_once_before_touching_anything(
    inventory, tmp_path, playbook, roles, flags
):
    values = {}
    for role in roles:
        values.update(hostile_values(role) if role != "status" else {"report": "yes; id", "report_dir": "/x\ny"})
    assert values
    marker = tmp_path / "pwned"
    proc = run(playbook, inventory, values, *flags)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:]
    assert "Nothing was changed" in out
    missing = [
        name for name in values if f"{name}=" not in out and f"{name}[0]=" not in out and f"{name} has" not in out
    ]
    assert not missing, f"not named: {missing}\n{out[-6000:]}"
    assert "is stopped" not in out and not marker.exists()
    assert not (tmp_path / "standin").exists() and not any((tmp_path / "lxc").iterdir())
    # Said once, not twice (the [ERROR] block would repeat the message).
    first = next(iter(values))
    assert out.count(f"- {first}=") + out.count(f"- {first}[0]=") == 1, out[-4000:]
