"""ansible-doc reads every module in library/ and roles/*/library/, every filter of the roles and the pct connection without an error
or a warning.

Each module documents the check_mode, diff_mode and platform attributes with a support level, EXAMPLES that are
valid tasks (ansible-playbook --syntax-check resolves each module and keyword), and a RETURN whose every entry has
a description, a type and, at the top, when it is returned. Each filter is documented where ansible-doc -t filter
looks: a DOCUMENTATION string in a plugin file that defines one filter, a <filter>.yml beside a file that defines
several.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DOC = str(Path(sys.executable).parent / "ansible-doc")
# The project's modules and the role-local ones (roles/*/library, found by Ansible only inside their role).
MODULE_DIRS = ["library", *sorted(str(d.relative_to(ROOT)) for d in ROOT.glob("roles/*/library"))]
MODULES = sorted(p.stem for d in MODULE_DIRS for p in (ROOT / d).glob("*.py"))
MODULE_PATH = os.pathsep.join(MODULE_DIRS)
FILTER_DIRS = [*sorted(ROOT.glob("roles/*/filter_plugins")), ROOT / "plugins" / "filter"]

# ansible-core's support levels (ansible-test's validate-modules schema).
SUPPORT = {"full", "partial", "none"}
# RETURN types ansible-doc and ansible-test accept.
RETURN_TYPES = {
    "any",
    "bits",
    "bool",
    "complex",
    "dict",
    "float",
    "int",
    "json",
    "jsonarg",
    "list",
    "path",
    "raw",
    "sid",
    "str",
}


def role_filters() -> dict[str, Path]:
    """Every filter the roles define (FilterModule().filters()), by name -> its plugin file."""
    found = {}
    for folder in FILTER_DIRS:
        for path in sorted(folder.glob("*.py")):
            spec = importlib.util.spec_from_file_location(f"_filters_{path.parent.parent.name}_{path.stem}", path)
            plugin = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(plugin)
            for name in plugin.FilterModule().filters():
                assert name not in found, f"filter {name} defined twice: {found[name]} and {path}"
                found[name] = path
    return found


FILTERS = role_filters()


def ansible_doc(*args: str) -> subprocess.CompletedProcess:
    """ansible-doc from the repository root, under its ansible.cfg, with none of the caller's ANSIBLE_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FILTER_PLUGINS=os.pathsep.join(str(d) for d in FILTER_DIRS),
        ANSIBLE_LOCAL_TEMP=str(Path(os.environ.get("TMPDIR", "/tmp"))),
    )
    return subprocess.run(
        [ANSIBLE_DOC, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def assert_clean(proc: subprocess.CompletedProcess, what: str) -> None:
    """Exit code 0, nothing on stderr, no warning or error anywhere in the output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what}: rc={proc.returncode}\n{out}"
    assert proc.stderr.strip() == "", f"{what} wrote to stderr:\n{proc.stderr}"
    for marker in ("[WARNING]", "[ERROR]", "[DEPRECATION WARNING]"):
        assert marker not in out, f"{what}: {marker}\n{out}"


def test_the_lists_are_not_empty():
    assert len(MODULES) >= 8, MODULES
    assert {
        "pve_gpu_devices",
        "training_summary",
        "role_input_errors",
        "plan_refusal",
        "systemd_arg",
    } <= set(FILTERS)


def test_ansible_doc_reads_every_module_cleanly():
    """`ansible-doc -t module -M library NAME...` for all of them: a broken one is named on stderr."""
    proc = ansible_doc("-t", "module", "-M", MODULE_PATH, *MODULES)
    assert_clean(proc, f"ansible-doc -t module -M {MODULE_PATH}")
    for name in MODULES:
        assert f"> MODULE {name} " in proc.stdout, f"{name} not rendered"


def test_ansible_doc_reads_every_filter_cleanly():
    proc = ansible_doc("-t", "filter", *sorted(FILTERS))
    assert_clean(proc, "ansible-doc -t filter")
    for name in FILTERS:
        assert f"> FILTER {name} " in proc.stdout, f"{name} not rendered"


def test_ansible_doc_reads_the_pct_connection_cleanly():
    """The connection plugin too (ansible.cfg's connection_plugins = plugins/connection)."""
    proc = ansible_doc("-t", "connection", "pct")
    assert_clean(proc, "ansible-doc -t connection pct")
    assert proc.stdout.startswith("> CONNECTION pct ")


@pytest.fixture(scope="module")
def module_docs() -> dict:
    proc = ansible_doc("-t", "module", "-M", MODULE_PATH, "--json", *MODULES)
    assert_clean(proc, "ansible-doc --json (modules)")
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def filter_docs() -> dict:
    proc = ansible_doc("-t", "filter", "--json", *sorted(FILTERS))
    assert_clean(proc, "ansible-doc --json (filters)")
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", MODULES)
def test_module_documents_its_attributes(module_docs, name):
    attributes = module_docs[name]["doc"].get("attributes") or {}
    for key in ("check_mode", "diff_mode"):
        assert key in attributes, f"{name}: no {key} attribute"
        entry = attributes[key]
        assert entry.get("support") in SUPPORT, f"{name}: {key} support {entry.get('support')!r}"
        assert entry.get("description"), f"{name}: {key} has no description (extends action_common_attributes?)"
        if entry["support"] == "partial":
            assert entry.get("details"), f"{name}: partial {key} must say what is partial in details"
    platform = attributes.get("platform") or {}
    assert platform.get("support") == "N/A" and platform.get("platforms"), f"{name}: platform {platform!r}"


def check_return(where: str, entries: dict, top: bool) -> None:
    assert isinstance(entries, dict) and entries, f"{where}: empty"
    for key, entry in entries.items():
        here = f"{where}.{key}"
        assert entry.get("description"), f"{here}: no description"
        assert entry.get("type") in RETURN_TYPES, f"{here}: type {entry.get('type')!r}"
        if top:
            assert entry.get("returned"), f"{here}: no 'returned'"
        if "elements" in entry:
            assert entry["type"] == "list", f"{here}: elements without type list"
        if "contains" in entry:
            assert entry["type"] in ("dict", "list", "complex"), f"{here}: contains under type {entry['type']}"
            check_return(here, entry["contains"], top=False)


@pytest.mark.parametrize("name", MODULES)
def test_module_return_entries_are_complete(module_docs, name):
    check_return(name, module_docs[name]["return"], top=True)


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filter_documentation_has_input_and_value(filter_docs, name):
    doc = filter_docs[name]
    assert doc["doc"]["name"] == name and doc["doc"]["short_description"], name
    assert "_input" in doc["doc"]["options"], f"{name}: the filtered value (_input) is not documented"
    assert doc["examples"], f"{name}: no EXAMPLES"
    check_return(name, doc["return"], top=False)
    assert list(doc["return"]) == ["_value"], name


def example_tasks(text: str, where: str) -> list:
    tasks = yaml.safe_load(text)
    assert isinstance(tasks, list) and tasks, f"{where}: EXAMPLES is not a list of tasks"
    for task in tasks:
        assert isinstance(task, dict) and task.get("name"), f"{where}: a task without a name: {task!r}"
    return tasks


def test_examples_are_valid_tasks(module_docs, filter_docs, tmp_path):
    """Every module's and filter's EXAMPLES, one play each, through ansible-playbook --syntax-check."""
    plays = []
    for name in MODULES:
        tasks = example_tasks(module_docs[name]["examples"], name)
        assert any(name in task or f"ansible.legacy.{name}" in task for task in tasks), f"{name}: not used"
        plays.append({"name": f"EXAMPLES of {name}", "hosts": "localhost", "gather_facts": False, "tasks": tasks})
    for name in sorted(FILTERS):
        tasks = example_tasks(filter_docs[name]["examples"], name)
        assert name in json.dumps(tasks), f"{name}: the examples do not use the filter"
        plays.append({"name": f"EXAMPLES of {name}", "hosts": "localhost", "gather_facts": False, "tasks": tasks})
    playbook = tmp_path / "examples.yml"
    playbook.write_text(yaml.safe_dump(plays, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    # ANSIBLE_LIBRARY, not -M: ansible-playbook's -M did not find the role-local modules here.
    env.update(
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
        ANSIBLE_LIBRARY=os.pathsep.join(str(ROOT / d) for d in MODULE_DIRS),
    )
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "--syntax-check", "-i", "localhost,", str(playbook)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
