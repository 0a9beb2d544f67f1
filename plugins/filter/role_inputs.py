# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every role's inputs, checked against one grammar before anything changes.

Three files, read in this order: input_grammar.py (what each kind of value may be: paths absolute, normalised and
of a safe character set, names and ids by their patterns, free text without control characters; and the quoting
for where a value lands), role_variables.py (every role's variables and the kind each takes), and this one (a
role's variables checked against both, the trainer's config checked by the trainer's own declaration).

Filters here: ``role_input_errors`` (every problem with a role's variables, one line each, naming the variable, the
value received and what is allowed) and ``stray_variables`` (variables that look like ours but are not: a trainer
config key or a role variable without its prefix, a near miss of a variable's name). Their documentation is in the
.yml file of the same name beside this one.

The trainer's config keys are the trainer's own declaration (training/eagle3/config.py, torch-free): an override
is checked by the trainer's code on the controller, before the lock is taken.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The grammar and the tables beside this file: Ansible loads a plugin by its path, not as part of a package.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from declared_constants import trainer_module
from input_grammar import BOOL_ALLOWED, allowed_text, as_bool, as_float, as_int, check_kind, show
from role_variables import PLAYBOOK_NAMES, ROLE_FACTS, ROLE_VARIABLES


# Where the role's own settings go instead of a trainer config key.
_FORBIDDEN_KEY_HINT = {
    "max_seq_len": "set it with -e max_seq_len=N (or auto)",
    "context_parallel": "set it with -e context_parallel=N (or auto)",
    "data_dir": "set eagle3_train_data_dir",
    "run_dir": "set eagle3_train_run_dir",
}


# ---------------------------------------------------------------------------------------------------- checks
def _range_text(spec: dict, what: str) -> str:
    parts = []
    if "min" in spec:
        parts.append(f">= {spec['min']:g}" if isinstance(spec["min"], float) else f">= {spec['min']}")
    if "max" in spec:
        parts.append(f"<= {spec['max']}")
    if "below" in spec:
        parts.append(f"< {spec['below']:g}")
    return f"{what} {' and '.join(parts)}" if parts else what


def _check_number(name: str, value, spec: dict) -> str | None:
    if spec.get("empty") and value in ("", None):
        return None
    integer = spec["kind"] == "int"
    number = as_int(value) if integer else as_float(value)
    allowed = _range_text(spec, "a whole number" if integer else "a number")
    if number is None:
        return f"{name}={show(value)} is not {'a whole number' if integer else 'a number'}; allowed: {allowed}"
    if (
        ("min" in spec and number < spec["min"])
        or ("max" in spec and number > spec["max"])
        or ("below" in spec and number >= spec["below"])
    ):
        return f"{name}={show(value)} is out of range; allowed: {allowed}"
    return None


def seq_len_problem(name: str, value) -> str | None:
    """max_seq_len: what the trainer accepts (its config declaration's SEQ_MULTIPLE and wording), or auto.

    >>> seq_len_problem("max_seq_len", "24000")
    'max_seq_len=24000 is not a positive multiple of 128 (the flex_attention block size); try 23936 or 24064; allowed: a positive multiple of 128, or auto'
    >>> seq_len_problem("max_seq_len", " Auto "), seq_len_problem("max_seq_len", "16384")
    (None, None)
    """
    config = trainer()
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if re.fullmatch(r"[0-9]+", text) and int(text) > 0:
        n = int(text)
        if config.SEQ_MULTIPLE.holds(n):
            return None
        return (
            f"{name}={text} {config.SEQ_MULTIPLE.says}; {config.suggest_seq_len(n)}; allowed: a positive "
            f"{config.SEQ_MULTIPLE.label}, or auto"
        )
    return (
        f'{name}={show(value)} is neither a positive {config.SEQ_MULTIPLE.label} nor "auto"; try -e {name}=16384 '
        f"or -e {name}=auto"
    )


def context_parallel_problem(name: str, value) -> str | None:
    """context_parallel: a whole number >= 1 (the ranks one packed row is split over), or auto (the planner picks).
    Whether it divides the run's workers is checked once they are counted (context_parallel_refusal).

    >>> context_parallel_problem("context_parallel", " Auto "), context_parallel_problem("context_parallel", "4")
    (None, None)
    >>> print(context_parallel_problem("context_parallel", "2.5"))  # doctest: +NORMALIZE_WHITESPACE
    context_parallel=2.5 is not a context-parallel size; allowed: auto (the memory planner picks the smallest that
    fits) or a whole number >= 1 that divides the run's workers, e.g. -e context_parallel=2
    """
    if str(value).strip().lower() == "auto":
        return None
    n = as_int(value)
    if n is not None and n >= 1:
        return None
    return (
        f"{name}={show(value)} is not a context-parallel size; allowed: auto (the memory planner picks the smallest "
        f"that fits) or a whole number >= 1 that divides the run's workers, e.g. -e {name}=2"
    )


def check(name: str, value, spec: dict) -> str | None:
    """One variable against its table entry: None when it is fine, else the line that says why not."""
    kind = spec["kind"]
    if kind == "raw":
        return None
    if kind == "seq_len":
        return seq_len_problem(name, value)
    if kind == "context_parallel":
        return context_parallel_problem(name, value)
    if kind == "bool":
        if spec.get("empty") and value in ("", None):
            return None
        if as_bool(value) is None:
            return f"{name}={show(value)} is not a boolean; allowed: {BOOL_ALLOWED}"
        return None
    if kind in ("int", "float"):
        return _check_number(name, value, spec)
    if kind in ("nproc", "node_rank"):
        if str(value).strip().lower() == "auto":
            return None
        n = as_int(value)
        if kind == "nproc" and (n is None or n < 1):
            return f"{name}={show(value)} is not a worker count; allowed: auto (one per GPU) or a whole number >= 1"
        if kind == "node_rank" and (n is None or n < 0):
            return (
                f"{name}={show(value)} is not a node rank; allowed: auto (the host's position in eagle3_train_nodes) "
                "or a whole number >= 0"
            )
        return None
    if kind == "list":
        return _check_list(name, value, spec)
    if kind == "int_list":
        numbers = [as_int(v) for v in value] if isinstance(value, list) else [None]
        allowed = f"a non-empty list of {_range_text(spec, 'whole numbers')}, e.g. [10, 30, 90]"
        if not numbers or any(n is None for n in numbers):
            return f"{name}={show(value)} is not a list of whole numbers; allowed: {allowed}"
        if any(n < spec.get("min", n) or n > spec.get("max", n) for n in numbers):
            return f"{name}={show(value)} has a number out of range; allowed: {allowed}"
        return None
    if kind in ("dict", "trainer_config"):
        return _check_dict(name, value, spec)
    problem = check_kind(kind, value, spec)
    return f"{name}={show(value)} {problem}; allowed: {allowed_text(kind)}" if problem else None


def _check_list(name: str, value, spec: dict) -> str | None:
    of = spec["of"]
    if not isinstance(value, list):
        return (
            f"{name}={show(value)} is not a list; allowed: a list of {allowed_text(of)} "
            f"(on the command line: -e '{{\"{name}\": [...]}}')"
        )
    if not value and not spec.get("empty"):
        return f"{name}=[] is empty; allowed: a non-empty list of {allowed_text(of)}"
    forbid = spec.get("forbid", {})
    for i, item in enumerate(value):
        if of == "argv_item" and isinstance(item, (int, float)) and not isinstance(item, bool):
            continue
        problem = check_kind(of, item, {})
        if problem:
            return f"{name}[{i}]={show(item)} {problem}; allowed: {allowed_text(of)}"
        flag = item.split("=", 1)[0].replace("_", "-") if isinstance(item, str) else ""
        if flag in forbid:
            return (
                f"{name}[{i}]={show(item)} sets what the role sets itself; allowed: any other argument "
                f"(for {flag}, set {forbid[flag]})"
            )
    return None


def _check_dict(name: str, value, spec: dict) -> str | None:
    if not isinstance(value, dict):
        return (
            f"{name}={show(value)} is not a mapping; allowed: a mapping of keys to values "
            f"(on the command line: -e '{{\"{name}\": {{...}}}}')"
        )
    bad = [k for k in spec.get("forbid", ()) if k in value]
    if bad:
        hints = "; ".join(f"for {k}, {_FORBIDDEN_KEY_HINT[k]}" for k in bad)
        return (
            f"{name} sets {', '.join(f'{k}={show(value[k])}' for k in bad)}, which the role sets itself; "
            f"allowed: any other trainer key ({hints})"
        )
    for key, item in value.items():
        if "keys" in spec and (problem := check_kind(spec["keys"], key, {})):
            return f"{name} has the key {show(key)}, which {problem}; allowed: {allowed_text(spec['keys'])}"
        if "values" in spec and (problem := check_kind(spec["values"], item, {})):
            return f"{name}.{key}={show(item)} {problem}; allowed: {allowed_text(spec['values'])}"
    return None


def trainer():
    """The trainer's config module (training/eagle3/config.py: torch-free, its key declaration and checks)."""
    return trainer_module("config")


def trainer_config_errors(config: dict, overrides: dict, max_seq_len) -> list[str]:
    """The trainer's own verdict on eagle3_train_config + eagle3_train_config_overrides, naming the variable that
    set the key. max_seq_len "auto" is checked as the planner would give it (a valid length).

    >>> trainer_config_errors({"lr": 0.001}, {"checkpoint_every": -1}, "16384")
    ['eagle3_train_config_overrides: checkpoint_every=-1 must be at least 1 (the trainer refuses it)']
    >>> trainer_config_errors({"epochs": 1}, {"lr": 0.01}, "auto")
    []
    """
    config_module = trainer()
    if not isinstance(config, dict) or not isinstance(overrides, dict):
        return []  # reported by the dict check
    msl = as_int(max_seq_len)
    values = {**config, **overrides, "data_dir": "/data", "run_dir": "/run"}
    values.pop("context_parallel", None)  # the role's own (eagle3_train_context_parallel), refused above
    values["max_seq_len"] = msl if msl and config_module.SEQ_MULTIPLE.holds(msl) else config_module.SEQ_BLOCK
    errors = []
    for key in values:  # one key at a time, so each message names the variable that set it
        if key in ("data_dir", "run_dir", "max_seq_len"):
            continue
        source = "eagle3_train_config_overrides" if key in overrides else "eagle3_train_config"
        if key not in config_module.SPECS:
            close = difflib.get_close_matches(key, list(config_module.SPECS), n=1, cutoff=0.7)
            hint = f"did you mean {close[0]}?" if close else "`python -m eagle3 train --help` lists them"
            errors.append(f"{source}: {show(key)} is not a trainer config key; {hint}")
            continue
        try:
            config_module.build_config(
                {"data_dir": "/data", "run_dir": "/run", "max_seq_len": values["max_seq_len"], key: values[key]}, {}
            )
        except config_module.ConfigError as e:
            errors.append(f"{source}: {e} (the trainer refuses it)")
    if errors:
        return errors
    try:  # keys that are fine alone but not together
        config_module.build_config(values, {})
    except config_module.ConfigError as e:
        errors.append(f"eagle3_train_config + eagle3_train_config_overrides: {e} (the trainer refuses it)")
    return errors


def role_input_errors(values: dict, role, aliases: dict | None = None, known: list | None = None) -> list[str]:
    """Every problem with a role's variables, in the table's order, then the unknown names with its prefix.
    `role` may be a list of roles: a playbook checks the variables of every role it will reach, at its start.

    `values`: the variables (collected with the varnames lookup, so a mistyped name shows up too). `aliases`: the
    name to report instead, when the user set a short form (max_seq_len for eagle3_train_max_seq_len). `known`:
    more names that are the role's (those of its defaults/main.yml).

    >>> role_input_errors({"eagle3_train_run_dir": "/tmp; rm -rf /"}, "eagle3_train")
    ['eagle3_train_run_dir=/tmp; rm -rf / holds characters a path here may not have (" ", ";"); allowed: a folder of its own on the target, never a system folder (/, /etc, /usr, /var/lib, ...), e.g. /var/lib/eagle3 (characters: letters, digits and . _ + @ , : = / -)']
    >>> role_input_errors({"eagle3_train_synth_if_mising": True}, "eagle3_train")
    ['eagle3_train_synth_if_mising=true is not a variable of the eagle3_train role; did you mean eagle3_train_synth_if_missing?']
    """
    if isinstance(role, (list, tuple)):
        return [
            e
            for r in role
            for e in role_input_errors(
                {k: v for k, v in values.items() if k.startswith(f"{r}_") or k in ROLE_VARIABLES[r]}, r, aliases, known
            )
        ]
    table = ROLE_VARIABLES[role]
    aliases = aliases or {}
    errors = []
    for name, spec in table.items():
        if name in values:
            problem = check(aliases.get(name, name), values[name], spec)
            if problem:
                errors.append(problem)
    config_ok = not any(e.startswith(("eagle3_train_config=", "eagle3_train_config_overrides")) for e in errors)
    if role == "eagle3_train" and config_ok:
        errors += trainer_config_errors(
            values.get("eagle3_train_config", {}),
            values.get("eagle3_train_config_overrides", {}),
            values.get("eagle3_train_max_seq_len", "auto"),
        )
    prefix = f"{role}_"
    for name in sorted(set(values) - set(table) - set(known or ()) - set(ROLE_FACTS.get(role, ()))):
        if not name.startswith(prefix) or name.startswith(prefix + "_"):
            continue  # not the role's (<role>__* are the role's own facts)
        close = difflib.get_close_matches(name, list(table), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else f"known: see roles/{role}/defaults/main.yml"
        errors.append(f"{name}={show(values[name])} is not a variable of the {role} role; {hint}")
    return errors


def stray_variables(names: list, extra_known: list | None = None) -> list[str]:
    """Variables that look like ours but are not, each with the variable meant.

    A trainer config key or a role variable's name set without its prefix (``-e checkpoint_every=-1`` does
    nothing: the trainer's keys go in eagle3_train_config_overrides), and near misses of a role variable (a
    wrong or mistyped prefix).

    >>> stray_variables(["checkpoint_every", "run_dir", "eagle_train_run_dir", "ansible_host", "max_seq_len"])
    ... # doctest: +NORMALIZE_WHITESPACE
    ['checkpoint_every is not a variable of these playbooks: a trainer setting goes in
      eagle3_train_config_overrides, e.g. -e \\'{"eagle3_train_config_overrides": {"checkpoint_every": ...}}\\'',
     'eagle_train_run_dir is not a variable of these playbooks; did you mean eagle3_train_run_dir?',
     'run_dir is not a variable of these playbooks; did you mean eagle3_train_run_dir or eagle3_evaluate_run_dir or
      eagle3_serve_run_dir?']
    """
    known = {n for table in ROLE_VARIABLES.values() for n in table} | set(PLAYBOOK_NAMES) | set(extra_known or ())
    suffixes: dict[str, list[str]] = {}
    for role, table in ROLE_VARIABLES.items():
        for n in table:
            suffix = n[len(role) + 1 :]
            if "_" in suffix:  # run_dir, term_timeout; a one-word suffix (unit, state, path) is too common a name
                suffixes.setdefault(suffix, []).append(n)
    keys = set(trainer().SPECS)
    prefixes = tuple(f"{role}_" for role in ROLE_VARIABLES)
    out = []
    for name in sorted(set(names) - known):
        if name.startswith(("ansible_", "molecule_", "inventory_", "group_", "play", "role_", "omit", *prefixes)):
            continue  # Ansible's own, or a role's (its own check names typos with its prefix)
        if name in suffixes:
            out.append(f"{name} is not a variable of these playbooks; did you mean {' or '.join(suffixes[name])}?")
        elif name in keys:
            out.append(
                f"{name} is not a variable of these playbooks: a trainer setting goes in "
                f'eagle3_train_config_overrides, e.g. -e \'{{"eagle3_train_config_overrides": {{"{name}": ...}}}}\''
            )
        else:
            close = difflib.get_close_matches(name, sorted(known - set(PLAYBOOK_NAMES)), n=1, cutoff=0.9)
            if close and "_" in name:
                out.append(f"{name} is not a variable of these playbooks; did you mean {close[0]}?")
    return out


class FilterModule:
    def filters(self):
        return {
            "role_input_errors": role_input_errors,
            "stray_variables": stray_variables,
        }
