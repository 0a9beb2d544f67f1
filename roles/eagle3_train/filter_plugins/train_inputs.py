# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The eagle3_train role's inputs, checked against one declarative table before anything changes.

``train_input_errors``: every problem with the role's variables, one line each, naming the variable, the value
received and what is allowed (validate.yml fails with all of them at once). Every ``-e`` value arrives as a
string, so integers, floats and booleans are accepted as strings too: booleans are what Ansible's ``bool``
filter accepts (true/false, yes/no, on/off, 1/0, any case), so the use sites can apply ``| bool`` safely.
A variable with the role's prefix that the table does not know is reported as a likely typo.

``seq_len_refusal``: the verdict on an explicit max_seq_len from the memory planner's JSON (plan.yml).

This file defines two filters, so ansible-doc reads their documentation from a file per filter beside it:
train_input_errors.yml and seq_len_refusal.yml.
"""

from __future__ import annotations

import difflib
import json
import math
import re

SEQ_BLOCK = 128  # flex_attention's block size: every length is a multiple of it (eagle3.plan.SEQ_BLOCK)
PREFIX = "eagle3_train_"

_BOOL_TRUE = {"true", "yes", "on", "1"}  # exactly what ansible.builtin.bool accepts (lower-cased)
_BOOL_FALSE = {"false", "no", "off", "0"}
_BOOL_ALLOWED = "true or false (also yes/no, on/off, 1/0, any case)"

# name -> (kind, constraints). Kinds: seq_len, bool, int, float, nproc, node_rank, abspath, str ("empty": may be
# empty), str_list, int_list, dict.
# int/float/int_list: "min"/"max" inclusive, "below" exclusive. dict: "forbid" keys that the role sets itself.
# tests/test_train_validation.py holds this table, defaults/main.yml and meta/argument_specs.yml to the same names.
VARIABLES: dict[str, dict] = {
    "eagle3_train_max_seq_len": {"kind": "seq_len"},
    "eagle3_train_allow_unplanned_seq_len": {"kind": "bool"},
    "eagle3_train_prefix": {"kind": "abspath"},
    "eagle3_train_config_dir": {"kind": "abspath"},
    "eagle3_train_run_dir": {"kind": "abspath"},
    "eagle3_train_data_dir": {"kind": "abspath"},
    "eagle3_train_synth_if_missing": {"kind": "bool"},
    "eagle3_train_synth_args": {"kind": "str_list"},
    "eagle3_train_venv": {"kind": "abspath"},
    "eagle3_train_venv_provided": {"kind": "bool"},
    "eagle3_train_python": {"kind": "str"},
    "eagle3_train_nproc": {"kind": "nproc"},
    "eagle3_train_cpu_workers": {"kind": "int", "min": 1},
    "eagle3_train_nodes": {"kind": "str_list"},
    "eagle3_train_node_rank": {"kind": "node_rank"},
    "eagle3_train_node_addr": {"kind": "str"},
    "eagle3_train_rdzv_port": {"kind": "int", "min": 1, "max": 65535},
    "eagle3_train_run_id": {"kind": "str"},
    "eagle3_train_rdzv_timeout": {"kind": "int", "min": 1},
    "eagle3_train_socket_ifname": {"kind": "str", "empty": True},
    "eagle3_train_nccl_ib_hca": {"kind": "str", "empty": True},
    "eagle3_train_state_dir": {"kind": "abspath"},
    "eagle3_train_config": {"kind": "dict", "forbid": ("max_seq_len", "data_dir", "run_dir")},
    "eagle3_train_config_overrides": {"kind": "dict", "forbid": ("max_seq_len", "data_dir", "run_dir")},
    "eagle3_train_env": {"kind": "dict"},
    "eagle3_train_plan_memory_gb": {"kind": "float", "min": 0.0},
    "eagle3_train_plan_margin": {"kind": "float", "min": 0.0, "below": 1.0},
    "eagle3_train_min_steps": {"kind": "int", "min": 1},
    "eagle3_train_health_timeout": {"kind": "int", "min": 1},
    "eagle3_train_health_poll": {"kind": "int", "min": 1},
    "eagle3_train_stall_timeout": {"kind": "int", "min": 1},
    "eagle3_train_stop_timeout": {"kind": "int", "min": 1},
    "eagle3_train_kill_after": {"kind": "int", "min": 1},
    "eagle3_train_restart_sec": {"kind": "int", "min": 0},
    "eagle3_train_restart_delays": {"kind": "int_list", "min": 0},
    "eagle3_train_restart_limit": {"kind": "int", "min": 1},
    "eagle3_train_enabled": {"kind": "bool"},
    "eagle3_train_start_ct": {"kind": "bool"},
    "eagle3_train_lock_wait": {"kind": "int", "min": 0},
}

# Where the role's own settings go instead of a trainer config key.
_FORBIDDEN_KEY_HINT = {
    "max_seq_len": "set it with -e max_seq_len=N (or auto)",
    "data_dir": "set eagle3_train_data_dir",
    "run_dir": "set eagle3_train_run_dir",
}


def show(value) -> str:
    """The value as the user wrote it (strings bare, the rest as JSON).

    >>> show("abc"), show(""), show(None), show(True), show(1.5), show([1, "a"])
    ('abc', '""', 'null', 'true', '1.5', '[1, "a"]')
    """
    if isinstance(value, str):
        return str(value) if value else '""'
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def as_bool(value) -> bool | None:
    """True/False for what ``| bool`` accepts, None for anything else.

    >>> [as_bool(v) for v in (True, "False", "YES", "off", 1, "0", "maybe", " true", 2, None)]
    [True, False, True, False, True, False, None, None, None, None]
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.lower()
        if v in _BOOL_TRUE:
            return True
        if v in _BOOL_FALSE:
            return False
    return None


def as_int(value) -> int | None:
    """The integer an input means (an int, or a string of digits), None when it is not one.

    >>> [as_int(v) for v in (5, "5", " 12 ", "-3", "1e3", "5.0", 5.0, True, None)]
    [5, 5, 12, -3, None, None, 5, None, None]
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
        return int(value)
    return None


def as_float(value) -> float | None:
    """The finite number an input means, None when it is not one.

    >>> [as_float(v) for v in (1.6, "1.6", 2, "0", "nan", "x", False)]
    [1.6, 1.6, 2.0, 0.0, None, None, None]
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


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
    integer = spec["kind"] == "int"
    number = as_int(value) if integer else as_float(value)
    allowed = _range_text(spec, "a whole number" if integer else "a number")
    if number is None:
        return (
            f"{name}={show(value)} is not {'a whole number' if integer else 'a number'}; allowed: {allowed}"
        )
    if (
        ("min" in spec and number < spec["min"])
        or ("max" in spec and number > spec["max"])
        or ("below" in spec and number >= spec["below"])
    ):
        return f"{name}={show(value)} is out of range; allowed: {allowed}"
    return None


def _check_seq_len(name: str, value) -> str | None:
    """max_seq_len: a positive multiple of 128, or auto (the wording molecule's invalid-input case checks)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if re.fullmatch(r"[0-9]+", text) and int(text) > 0:
        n = int(text)
        if n % SEQ_BLOCK == 0:
            return None
        below = (n // SEQ_BLOCK) * SEQ_BLOCK if n >= SEQ_BLOCK else SEQ_BLOCK
        return (
            f"{name}={text} is not a multiple of {SEQ_BLOCK} (the flex_attention block size); try {below} "
            f"or {(n // SEQ_BLOCK + 1) * SEQ_BLOCK}; allowed: a positive multiple of {SEQ_BLOCK}, or auto"
        )
    flag = "max_seq_len" if name == "max_seq_len" else name
    return (
        f'{name}={show(value)} is neither a positive multiple of {SEQ_BLOCK} nor "auto"; try -e {flag}=16384 '
        f"or -e {flag}=auto"
    )


def check(name: str, value, spec: dict) -> str | None:
    """One variable against its table entry: None when it is fine, else the line that says why not."""
    kind = spec["kind"]
    if kind == "seq_len":
        return _check_seq_len(name, value)
    if kind == "bool":
        if as_bool(value) is None:
            return f"{name}={show(value)} is not a boolean; allowed: {_BOOL_ALLOWED}"
    elif kind in ("int", "float"):
        return _check_number(name, value, spec)
    elif kind == "nproc":
        if str(value).strip().lower() == "auto":
            return None
        n = as_int(value)
        if n is None or n < 1:
            return f"{name}={show(value)} is not a worker count; allowed: auto (one per GPU) or a whole number >= 1"
    elif kind == "node_rank":
        if str(value).strip().lower() == "auto":
            return None
        n = as_int(value)
        if n is None or n < 0:
            return (
                f"{name}={show(value)} is not a node rank; allowed: auto (the host's position in eagle3_train_nodes) "
                "or a whole number >= 0"
            )
    elif kind == "abspath":
        if not isinstance(value, str) or not value.startswith("/"):
            return f"{name}={show(value)} is not an absolute path; allowed: an absolute path on the target, e.g. /var/lib/eagle3"
    elif kind == "str":
        if spec.get("empty") and value in ("", None):
            return None
        if (
            not isinstance(value, str)
            or not value.strip()
            or (spec.get("empty") and any(c.isspace() for c in value))
        ):
            allowed = "empty or a name without spaces" if spec.get("empty") else "a non-empty string"
            return f"{name}={show(value)} is empty or not a string; allowed: {allowed}"
    elif kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            return (
                f"{name}={show(value)} is not a list of strings; allowed: a list such as "
                f'["--num-samples", "256"] (on the command line: -e \'{{"{name}": [...]}}\')'
            )
    elif kind == "int_list":
        numbers = [as_int(v) for v in value] if isinstance(value, list) else [None]
        allowed = f"a non-empty list of {_range_text(spec, 'whole numbers')}, e.g. [10, 30, 90]"
        if not numbers or any(n is None for n in numbers):
            return f"{name}={show(value)} is not a list of whole numbers; allowed: {allowed}"
        if any(n < spec.get("min", n) or n > spec.get("max", n) for n in numbers):
            return f"{name}={show(value)} has a number out of range; allowed: {allowed}"
    elif kind == "dict":
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
    else:  # pragma: no cover - a table entry with an unknown kind is a bug in this file
        raise ValueError(f"{name}: unknown kind {kind!r}")
    return None


def train_input_errors(values: dict, aliases: dict | None = None, known: list | None = None) -> list[str]:
    """Every problem with the role's variables, in the table's order, then the unknown names.

    `values`: the variables whose names start with eagle3_train_ (validate.yml collects them with the
    varnames lookup, so a mistyped name shows up here). `aliases`: the name to report instead, when the user
    set a short form (max_seq_len for eagle3_train_max_seq_len). `known`: more names that are the role's (those of
    defaults/main.yml: a variable added there before this table learns it is not called a typo).

    >>> train_input_errors({"eagle3_train_cpu_workers": "0", "eagle3_train_venv_provided": "no"})
    ['eagle3_train_cpu_workers=0 is out of range; allowed: a whole number >= 1']
    >>> train_input_errors({"eagle3_train_max_seq_len": "1000"}, {"eagle3_train_max_seq_len": "max_seq_len"})
    ['max_seq_len=1000 is not a multiple of 128 (the flex_attention block size); try 896 or 1024; allowed: a positive multiple of 128, or auto']
    >>> train_input_errors({"eagle3_train_synth_if_mising": True})
    ['eagle3_train_synth_if_mising=true is not a variable of the eagle3_train role; did you mean eagle3_train_synth_if_missing?']
    """
    aliases = aliases or {}
    errors = []
    for name, spec in VARIABLES.items():
        if name in values:
            problem = check(aliases.get(name, name), values[name], spec)
            if problem:
                errors.append(problem)
    for name in sorted(set(values) - set(VARIABLES) - set(known or ())):
        if not name.startswith(PREFIX) or name.startswith(PREFIX + "_"):
            continue  # not the role's (eagle3_train__* are the role's own facts)
        close = difflib.get_close_matches(name, list(VARIABLES), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "known: see roles/eagle3_train/defaults/main.yml"
        errors.append(f"{name}={show(values[name])} is not a variable of the eagle3_train role; {hint}")
    return errors


def seq_len_refusal(plan: dict, requested, memory_source: str = "") -> str:
    """Why an explicit max_seq_len cannot run, from `python -m eagle3 plan --json --lengths N` (empty: it fits).

    The planner's max_seq_len is the largest length whose predicted peak fits memory_gb less the margin per
    worker; the table row for the requested length (asked for with --lengths) gives what that length needs.

    >>> plan = {"max_seq_len": 7040, "predicted_gb": 1.437, "memory_gb": 1.6, "margin": 0.1, "budget_gb": 1.44,
    ...         "static_gb": 1.002, "world_size": 2, "source": "analytic",
    ...         "table": [{"max_seq_len": 16384, "predicted_gb": 2.02, "fits": False}]}
    >>> seq_len_refusal(plan, 8192 - 1152)
    ''
    >>> seq_len_refusal({**plan, "max_seq_len": 262144, "table": [{"max_seq_len": 262272, "fits": True}]}, 262272)
    ''
    >>> print(seq_len_refusal(plan, "16384", "eagle3_train_plan_memory_gb"))  # doctest: +NORMALIZE_WHITESPACE
    max_seq_len=16384 does not fit: the memory planner predicts 2.02 GiB per worker at 16384 against a budget of
    1.44 GiB (1.6 GiB per worker from eagle3_train_plan_memory_gb, less the 10% margin of
    eagle3_train_plan_margin; 2 workers; analytic model). The largest max_seq_len that fits is 7040 (predicted
    1.44 GiB). Use -e max_seq_len=7040 (or -e max_seq_len=auto), give the planner more memory per worker, or set
    -e eagle3_train_allow_unplanned_seq_len=true to run 16384 anyway.
    """
    n = int(str(requested).strip())
    largest = plan.get("max_seq_len")
    row = next((r for r in plan.get("table") or [] if r.get("max_seq_len") == n), None)
    if (largest is not None and n <= int(largest)) or (row is not None and row.get("fits")):
        return ""  # (the row decides above the planner's search limit, where `largest` stops)
    needs = f"predicts {row['predicted_gb']:g} GiB per worker at {n}" if row else f"finds that {n} needs more"
    source = f" from {memory_source}" if memory_source else ""
    assumed = (
        f"{float(plan['budget_gb']):g} GiB ({float(plan['memory_gb']):g} GiB per worker{source}, less the "
        f"{float(plan['margin']) * 100:g}% margin of eagle3_train_plan_margin; {plan['world_size']} workers; "
        f"{plan.get('source', 'analytic')} model)"
    )
    fit = (
        f"The largest max_seq_len that fits is {largest} (predicted {plan.get('predicted_gb', 0):.2f} GiB). "
        f"Use -e max_seq_len={largest} (or -e max_seq_len=auto)"
        if largest
        else "No max_seq_len fits. Turn on activation_checkpointing or fsdp in eagle3_train_config_overrides"
    )
    return (
        f"max_seq_len={n} does not fit: the memory planner {needs} against a budget of {assumed}. {fit}, "
        f"give the planner more memory per worker, or set -e eagle3_train_allow_unplanned_seq_len=true to run "
        f"{n} anyway."
    )


class FilterModule:
    def filters(self):
        return {"train_input_errors": train_input_errors, "seq_len_refusal": seq_len_refusal}
