# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every role's inputs, checked against one grammar before anything changes.

A value that reaches a shell, a unit file, an LXC config line, a path or a template has a strict grammar here:
paths are absolute, normalised and of a safe character set (no space, quote, ``$``, ``%``, ``;``, backslash,
newline or other control character, nothing outside ASCII), names and ids have their own patterns, free text
(a lock's purpose, a command-line argument passed as one argv entry, a password) may hold anything printable but
never a control character. Where a value lands is quoted for that place as well (``systemd_arg`` in unit files,
``env_file_value`` in EnvironmentFile=, argv lists instead of ``sh -c``), so a check that let something through
would still not become a command.

Filters: ``role_input_errors`` (every problem with a role's variables, one line each, naming the variable, the
value received and what is allowed), ``stray_variables`` (variables that look like ours but are not: a trainer
config key or a role variable without its prefix, a near miss of a variable's name), ``systemd_arg`` and
``env_file_value`` (quoting). Their documentation is in the .yml file of the same name beside this one.

The trainer's config keys are the trainer's own declaration (training/eagle3/config.py, torch-free): an override
is checked by the trainer's code on the controller, before the lock is taken.
"""

from __future__ import annotations

import difflib
import json
import math
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BOOL_TRUE = {"true", "yes", "on", "1"}  # exactly what ansible.builtin.bool accepts (lower-cased)
_BOOL_FALSE = {"false", "no", "off", "0"}
_BOOL_ALLOWED = "true or false (also yes/no, on/off, 1/0, any case)"

PATH_MAX = 4095  # Linux's limits for a path
NAME_MAX = 255  # and for one of its components
# Characters a path may hold: letters, digits and . _ - + @ , : = /. None of them means anything to a shell,
# to systemd's command-line parser (no quotes, $, %, \, whitespace) or to an LXC config line (no whitespace).
PATH_CHARS = r"A-Za-z0-9._+@,:=/\-"
PATH_CHARS_TEXT = "letters, digits and . _ + @ , : = / -"
GLOB_CHARS = PATH_CHARS + r"*?\[\]!"
_PATH = re.compile(rf"[{PATH_CHARS}]+")
_GLOB = re.compile(rf"[{GLOB_CHARS}]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def show(value) -> str:
    """The value as the user wrote it (strings bare, the rest as JSON); control characters, non-ASCII and very
    long values in a form that cannot mislead the reader.

    >>> show("abc"), show(""), show(None), show(True), show(1.5), show([1, "a"])
    ('abc', '""', 'null', 'true', '1.5', '[1, "a"]')
    >>> show("/tmp\\nrm -rf /"), show("/opt/\u00e9")
    ('"/tmp\\\\nrm -rf /"', '"/opt/\\\\u00e9"')
    >>> show("/a" * 100)
    '/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a... (200 characters)'
    """
    if isinstance(value, str):
        if not value:
            return '""'
        text = json.dumps(value) if (_CONTROL.search(value) or not value.isascii()) else value
    else:
        try:
            text = json.dumps(value, sort_keys=True, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return (
        text
        if len(text) <= 80
        else f"{text[:80]}... ({len(value) if isinstance(value, str) else len(text)} characters)"
    )


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


# ---------------------------------------------------------------------------------------------------- grammar
def path_problem(value, glob: bool = False) -> str | None:
    """Why `value` is not an absolute, normalised, safe path (a glob when `glob`), or None.

    >>> path_problem("/var/lib/eagle3/run") is None, path_problem("/dev/nvidia[0-9]*", glob=True) is None
    (True, True)
    >>> path_problem("/tmp; rm -rf /")
    'holds characters a path here may not have (" ", ";")'
    >>> path_problem("/var/../etc"), path_problem("/var/lib/"), path_problem("run")
    ('is not normalised (it would be /etc)', 'is not normalised (it would be /var/lib)', 'is not an absolute path')
    """
    if not isinstance(value, str) or not value.startswith("/"):
        return "is not an absolute path"
    if len(value) > PATH_MAX or any(len(part) > NAME_MAX for part in value.split("/")):
        return f"is too long (at most {PATH_MAX} characters, {NAME_MAX} per folder name)"
    pattern = _GLOB if glob else _PATH
    if not pattern.fullmatch(value):
        chars = GLOB_CHARS if glob else PATH_CHARS
        bad = sorted({c for c in value if not re.fullmatch(f"[{chars}]", c)})
        return f"holds characters a path here may not have ({', '.join(json.dumps(c) for c in bad)})"
    normal = posixpath.normpath(value)
    if normal.startswith("//"):
        normal = normal[1:]
    if normal != value:
        return f"is not normalised (it would be {normal})"
    return None


def _kind(pattern: str, allowed: str, max_len: int = 255):
    compiled = re.compile(pattern)

    def check(value, spec) -> str | None:
        if spec.get("empty") and value in ("", None):
            return None
        if not isinstance(value, str) or not compiled.fullmatch(value):
            return "has the wrong form"
        if len(value) > max_len:
            return f"is longer than {max_len} characters"
        return None

    check.allowed = allowed
    return check


def _text(allowed: str, max_len: int = 4096):
    def check(value, spec) -> str | None:
        if spec.get("empty") and value in ("", None):
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or (not value.strip() and not spec.get("empty")):
            return "is empty or not a string"
        if _CONTROL.search(value):
            return "holds a control character (a newline, tab or the like)"
        if len(value) > max_len:
            return f"is longer than {max_len} characters"
        return None

    check.allowed = allowed
    return check


def _path(glob: bool = False, allowed: str = "an absolute path on the target, e.g. /var/lib/eagle3"):
    def check(value, spec) -> str | None:
        if spec.get("empty") and value in ("", None):
            return None
        return path_problem(value, glob)

    check.allowed = allowed + f" (characters: {PATH_CHARS_TEXT}{' * ? [ ] !' if glob else ''})"
    return check


def _flag():
    def check(value, spec) -> str | None:
        return None if as_bool(value) is not None else "is not a boolean"

    check.allowed = _BOOL_ALLOWED
    return check


def _command():
    name = re.compile(r"[A-Za-z0-9_.+-]{1,255}")

    def check(value, spec) -> str | None:
        if isinstance(value, str) and value.startswith("/"):
            return path_problem(value)
        if not isinstance(value, str) or not name.fullmatch(value):
            return "has the wrong form"
        return None

    check.allowed = (
        "a command name found on PATH (letters, digits, _ . + -) or an absolute path, e.g. python3"
    )
    return check


def _regex():
    def check(value, spec) -> str | None:
        if not isinstance(value, str) or not value or _CONTROL.search(value) or len(value) > 1000:
            return "is not a regular expression"
        try:
            re.compile(value)
        except re.error as e:
            return f"is not a regular expression ({e})"
        return None

    check.allowed = "a Python regular expression (one line, at most 1000 characters)"
    return check


KINDS = {
    "abspath": _path(),
    "path_glob": _path(glob=True, allowed="an absolute path or glob on the target, e.g. /dev/nvidia[0-9]*"),
    "controller_path": _text("a folder on the controller (relative to the playbooks or absolute)"),
    "unit": _kind(
        r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.service",
        "a systemd service name, e.g. eagle3-train.service",
    ),
    "env_marker": _kind(
        r"[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.:/@+-]+", "NAME=VALUE, e.g. EAGLE3_JOB=eagle3-train"
    ),
    "env_name": _kind(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name (letters, digits, _)"),
    "proc_glob": _kind(
        r"[A-Za-z0-9_.:@+*?\[\]-]+", "a process name or glob, e.g. nvidia-persistenced or dcgm*", 64
    ),
    "regex": _regex(),
    "host": _kind(
        r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*",
        "a host name or an IP address",
    ),
    "inventory_host": _kind(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", "an inventory host name"),
    "ifname": _kind(
        r"[A-Za-z0-9_.:-]{1,15}", "a network interface name (at most 15 letters, digits, _ . : -)"
    ),
    "ib_hca": _kind(
        r"[=^]{0,2}[A-Za-z0-9_]+(:[0-9]+)?(,[A-Za-z0-9_]+(:[0-9]+)?)*",
        "NCCL_IB_HCA's syntax, e.g. mlx5_0,mlx5_1",
    ),
    "listen_address": _kind(
        r"([A-Za-z0-9.-]*|\[[0-9A-Fa-f:]+\]):[0-9]{1,5}", "HOST:PORT or :PORT, e.g. 127.0.0.1:9100 or :9100"
    ),
    "run_id": _kind(r"[A-Za-z0-9_.-]{1,64}", "an id of letters, digits, _ . - (at most 64)"),
    "command": _command(),
    "flag": _flag(),
    "text": _text("any printable text on one line"),
    "argv_item": _text(
        "one command-line argument: any printable text on one line (passed as it is, never to a shell)"
    ),
    "secret": _text("any printable text on one line (kept out of logs)"),
    "url": _kind(
        r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~%/+:@=,-]*)?",
        "an http(s) URL without spaces or quotes",
        2048,
    ),
    "deb_suite": _kind(r"[a-z][a-z0-9-]*", "a Debian suite name, e.g. bookworm"),
    "deb_package": _kind(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name, e.g. systemd"),
    "version": _kind(r"[0-9]+(\.[0-9]+)*", "a version of digits and dots, e.g. 570.133.20"),
    "checksum": _kind(
        r"(sha1|sha224|sha256|sha384|sha512|md5):[0-9a-fA-F]+", "ALGORITHM:HEX, e.g. sha256:0123..."
    ),
    "pve_volume": _kind(r"[A-Za-z0-9_.-]+:[A-Za-z0-9_./+-]+", "a Proxmox storage:volume, e.g. local-lvm:64"),
    "pve_property": _kind(
        r"[A-Za-z0-9_.,=:/+-]+", "a Proxmox property string, e.g. name=eth0,bridge=vmbr0,ip=dhcp"
    ),
    "pve_user": _kind(r"[A-Za-z0-9._-]+@[A-Za-z0-9._-]+", "USER@REALM, e.g. root@pam"),
    "pve_token_id": _kind(
        r"[A-Za-z0-9._-]+@[A-Za-z0-9._-]+![A-Za-z0-9._-]+", "USER@REALM!TOKEN, e.g. root@pam!eagle3"
    ),
    "dns_label": _kind(
        r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
        "a host name (letters, digits, -)",
    ),
    "file_mode": _kind(r"0?[0-7]{3}", 'an octal mode such as "0666"'),
    "lxc_line": _kind(
        r"lxc(\.[A-Za-z0-9_-]+)+\s*[:=]\s*[^\x00-\x1f\x7f]+",
        "a raw LXC line 'lxc.KEY: VALUE' on one line",
        4096,
    ),
    "lock_token": _kind(r"[A-Za-z0-9_.:@-]+", "a lock holder's token as the failure printed it"),
}


# ---------------------------------------------------------------------------------------------------- tables
# name -> spec. "kind": a KINDS entry, or one of: seq_len, bool, int, float, nproc, node_rank, list (of "of": a
# kind), int_list, dict (keys "keys", values "values": kinds), trainer_config (a dict the trainer's declaration
# checks; "forbid": keys the role sets itself), raw (checked elsewhere; "why" says where). "empty": "" is allowed.
# int/float/int_list: "min"/"max" inclusive, "below" exclusive. tests/test_role_inputs.py holds every table to its
# role's meta/argument_specs.yml.
ROLE_FORBIDDEN_KEYS = ("max_seq_len", "data_dir", "run_dir")
ROLE_VARIABLES: dict[str, dict[str, dict]] = {
    "eagle3_train": {
        "eagle3_train_max_seq_len": {"kind": "seq_len"},
        "eagle3_train_allow_unplanned_seq_len": {"kind": "bool"},
        "eagle3_train_prefix": {"kind": "abspath"},
        "eagle3_train_config_dir": {"kind": "abspath"},
        "eagle3_train_run_dir": {"kind": "abspath"},
        "eagle3_train_data_dir": {"kind": "abspath"},
        "eagle3_train_synth_if_missing": {"kind": "bool"},
        "eagle3_train_synth_args": {"kind": "list", "of": "argv_item"},
        "eagle3_train_venv": {"kind": "abspath"},
        "eagle3_train_venv_provided": {"kind": "bool"},
        "eagle3_train_python": {"kind": "command"},
        "eagle3_train_nproc": {"kind": "nproc"},
        "eagle3_train_cpu_workers": {"kind": "int", "min": 1},
        "eagle3_train_nodes": {"kind": "list", "of": "inventory_host"},
        "eagle3_train_node_rank": {"kind": "node_rank"},
        "eagle3_train_node_addr": {"kind": "host"},
        "eagle3_train_rdzv_port": {"kind": "int", "min": 1, "max": 65535},
        "eagle3_train_run_id": {"kind": "run_id"},
        "eagle3_train_rdzv_timeout": {"kind": "int", "min": 1},
        "eagle3_train_socket_ifname": {"kind": "ifname", "empty": True},
        "eagle3_train_nccl_ib_hca": {"kind": "ib_hca", "empty": True},
        "eagle3_train_state_dir": {"kind": "abspath"},
        "eagle3_train_config": {"kind": "trainer_config", "forbid": ROLE_FORBIDDEN_KEYS},
        "eagle3_train_config_overrides": {"kind": "trainer_config", "forbid": ROLE_FORBIDDEN_KEYS},
        "eagle3_train_env": {"kind": "dict", "keys": "env_name", "values": "text"},
        "eagle3_train_plan_memory_gb": {"kind": "float", "min": 0.0},
        "eagle3_train_plan_margin": {"kind": "float", "min": 0.0, "below": 1.0},
        "eagle3_train_min_steps": {"kind": "int", "min": 1},
        "eagle3_train_health_timeout": {"kind": "int", "min": 1},
        "eagle3_train_health_poll": {"kind": "int", "min": 1},
        "eagle3_train_stall_timeout": {"kind": "int", "min": 1},
        "eagle3_train_stop_timeout": {"kind": "int", "min": 1},
        "eagle3_train_kill_after": {"kind": "int", "min": 1},
        "eagle3_train_restart_sec": {"kind": "int", "min": 0},
        "eagle3_train_nice": {"kind": "int", "min": -20, "max": 19},
        "eagle3_train_node_exporter": {"kind": "bool"},
        "eagle3_train_node_exporter_listen": {"kind": "listen_address"},
        "eagle3_train_node_exporter_textfile_dir": {"kind": "abspath"},
        "eagle3_train_restart_delays": {"kind": "int_list", "min": 0},
        "eagle3_train_restart_limit": {"kind": "int", "min": 1},
        "eagle3_train_enabled": {"kind": "bool"},
        "eagle3_train_start_ct": {"kind": "bool"},
        "eagle3_train_lock_wait": {"kind": "int", "min": 0},
    },
    "gpu_cleanup": {
        "gpu_cleanup_unit": {"kind": "unit"},
        "gpu_cleanup_marker": {"kind": "env_marker"},
        "gpu_cleanup_devices": {"kind": "list", "of": "path_glob"},
        "gpu_cleanup_protect": {"kind": "list", "of": "proc_glob"},
        "gpu_cleanup_match_cmdline": {"kind": "list", "of": "regex", "empty": True},
        "gpu_cleanup_sweep": {"kind": "list", "of": "path_glob", "empty": True},
        "gpu_cleanup_stop_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_term_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_kill_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_stop_report": {"kind": "abspath", "empty": True},
        "gpu_cleanup_timeout": {"kind": "float", "min": 1.0},
        "gpu_cleanup_gpu_memory_tolerance_mib": {"kind": "int", "min": 0},
        "gpu_cleanup_respawn_window": {"kind": "float", "min": 0.0},
        "gpu_cleanup_spare_unit": {"kind": "bool"},
        "gpu_cleanup_other_units": {"kind": "list", "of": "unit", "empty": True},
    },
    "eagle3_datagen": {
        "eagle3_datagen_target": {"kind": "abspath"},
        "eagle3_datagen_tiny_target": {"kind": "bool"},
        "eagle3_datagen_data": {"kind": "abspath"},
        "eagle3_datagen_out": {"kind": "abspath"},
        "eagle3_datagen_max_len": {"kind": "int", "min": 2},
        "eagle3_datagen_draft_vocab": {"kind": "int", "min": 0},
        "eagle3_datagen_dtype": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "eagle3_datagen_shard_samples": {"kind": "int", "min": 1},
        "eagle3_datagen_regenerate": {"kind": "bool"},
        "eagle3_datagen_temperature": {"kind": "float", "min": 0},
        "eagle3_datagen_seed": {"kind": "int", "min": 0},
        "eagle3_datagen_prefix": {"kind": "abspath"},
        "eagle3_datagen_venv": {"kind": "abspath"},
        "eagle3_datagen_timeout": {"kind": "int", "min": 1},
        "eagle3_datagen_poll": {"kind": "int", "min": 1},
    },
    "eagle3_evaluate": {
        "eagle3_evaluate_target": {"kind": "abspath"},
        "eagle3_evaluate_data": {"kind": "abspath"},
        "eagle3_evaluate_run_dir": {"kind": "abspath"},
        "eagle3_evaluate_checkpoint": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "eagle3_evaluate_k": {"kind": "int", "min": 1, "max": 16},
        "eagle3_evaluate_max_new": {"kind": "int", "min": 1},
        "eagle3_evaluate_prompts": {"kind": "int", "min": 1},
        "eagle3_evaluate_prefix": {"kind": "abspath"},
        "eagle3_evaluate_venv": {"kind": "abspath"},
        "eagle3_evaluate_timeout": {"kind": "int", "min": 1},
    },
    "run_lock": {
        "run_lock_path": {"kind": "abspath"},
        "run_lock_purpose": {"kind": "text", "empty": True},
        "run_lock_playbook": {"kind": "text", "empty": True},
        "run_lock_wait": {"kind": "int", "min": 0},
        "run_lock_ttl": {"kind": "int", "min": 1},
        "run_lock_renew_for": {"kind": "int", "min": 0},
        "run_lock_break": {"kind": "lock_token", "empty": True},
    },
    "ct_running": {
        "ct_running_when_stopped": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "ct_running_start": {"kind": "bool"},
        "ct_running_boot_timeout": {"kind": "int", "min": 1},
    },
    "local_ct": {
        "local_ct_vmid": {"kind": "int", "min": 100, "max": 999999999},
        "local_ct_state": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "local_ct_lxcpath": {"kind": "abspath"},
        "local_ct_suite": {"kind": "deb_suite"},
        "local_ct_mirror": {"kind": "url"},
        "local_ct_rootfs_cache": {"kind": "abspath"},
        "local_ct_packages": {"kind": "list", "of": "deb_package"},
        "local_ct_disabled_units": {"kind": "list", "of": "unit", "empty": True},
        "local_ct_standin_dir": {"kind": "abspath"},
        "local_ct_gpu_devices": {"kind": "raw", "why": "the role's device checks (tasks/present.yml)"},
        "local_ct_train_venv": {"kind": "abspath", "empty": True},
        "local_ct_train_venv_mountpoint": {"kind": "abspath"},
        "local_ct_extra_binds": {"kind": "list", "of": "abspath", "empty": True},
        "local_ct_shared_dirs": {"kind": "list", "of": "bind_pair", "empty": True},
        "local_ct_boot_timeout": {"kind": "int", "min": 1},
        "local_ct_rootfs_build_timeout": {"kind": "int", "min": 1},
    },
    "pve_gpu_host": {
        "pve_gpu_host_root": {"kind": "abspath"},
        "pve_gpu_host_uvm_unit": {"kind": "bool"},
        "pve_gpu_host_uvm_unit_name": {"kind": "unit"},
        "pve_gpu_host_persistenced": {"kind": "bool"},
        "pve_gpu_host_require_control_devices": {"kind": "bool"},
    },
    "gpu_userspace": {
        "gpu_userspace_driver_version": {"kind": "version", "empty": True},
        "gpu_userspace_run_path": {"kind": "abspath", "empty": True},
        "gpu_userspace_run_url": {"kind": "url", "empty": True},
        "gpu_userspace_run_checksum": {"kind": "checksum", "empty": True},
        "gpu_userspace_run_dest": {"kind": "abspath"},
        "gpu_userspace_installer_args": {"kind": "list", "of": "argv_item", "empty": True},
        "gpu_userspace_install_timeout": {"kind": "int", "min": 1},
        "gpu_userspace_smi_timeout": {"kind": "int", "min": 1},
        "gpu_userspace_nvidia_smi": {"kind": "command"},
        "gpu_userspace_lib_dirs": {"kind": "list", "of": "abspath"},
    },
    "pve_gpu_container": {
        "pve_gpu_container_vmid": {"kind": "int", "min": 100, "max": 999999999},
        "pve_gpu_container_node_host": {"kind": "inventory_host"},
        "pve_gpu_container_node": {"kind": "dns_label"},
        "pve_gpu_container_state": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_template": {"kind": "pve_volume"},
        "pve_gpu_container_rootfs": {"kind": "pve_volume"},
        "pve_gpu_container_hostname": {"kind": "dns_label"},
        "pve_gpu_container_cores": {"kind": "int", "min": 1},
        "pve_gpu_container_memory": {"kind": "int", "min": 16},
        "pve_gpu_container_swap": {"kind": "int", "min": 0},
        "pve_gpu_container_net": {"kind": "list", "of": "pve_property", "empty": True},
        "pve_gpu_container_features": {"kind": "dict", "keys": "env_name", "values": "flag"},
        "pve_gpu_container_onboot": {"kind": "bool"},
        "pve_gpu_container_unprivileged": {"kind": "bool"},
        "pve_gpu_container_gpus": {
            "kind": "raw",
            "why": "the pve_gpu_devices filter (GPU numbers on the node)",
        },
        "pve_gpu_container_control_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_device_mode": {"kind": "file_mode", "empty": True},
        "pve_gpu_container_device_gid": {"kind": "run_id", "empty": True},
        "pve_gpu_container_extra_devices": {"kind": "raw", "why": "the pve_lxc module's device checks"},
        "pve_gpu_container_rdma": {"kind": "raw", "why": "auto/true/false (tasks/main.yml)"},
        "pve_gpu_container_host_rdma_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_host_gpu_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_raw_lines": {"kind": "list", "of": "lxc_line", "empty": True},
        "pve_gpu_container_raw_exclusive": {"kind": "bool"},
        "pve_gpu_container_restart": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_task_timeout": {"kind": "int", "min": 1},
        "pve_gpu_container_api_backend": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_api_host": {"kind": "host", "empty": True},
        "pve_gpu_container_api_port": {"kind": "int", "min": 1, "max": 65535, "empty": True},
        "pve_gpu_container_api_user": {"kind": "pve_user", "empty": True},
        "pve_gpu_container_api_password": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_otp": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_token_id": {"kind": "pve_token_id", "empty": True},
        "pve_gpu_container_api_token_secret": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_validate_certs": {"kind": "bool", "empty": True},
        "pve_gpu_container_api_ca_path": {"kind": "abspath", "empty": True},
        "pve_gpu_container_api_timeout": {"kind": "int", "min": 1, "empty": True},
    },
    # The playbooks' own -e variables (status.yml).
    "status": {
        "report": {"kind": "bool"},
        "report_dir": {"kind": "controller_path"},
    },
}

# Variables a role sets itself (register, set_fact) under its prefix: never inputs, never typos.
ROLE_FACTS: dict[str, tuple[str, ...]] = {
    "gpu_cleanup": ("gpu_cleanup_result",),
    "ct_running": ("ct_running_stopped", "ct_running_stopped_status"),
    "run_lock": (
        "run_lock_controller",
        "run_lock_lease",
        "run_lock_verdict",
        "run_lock_first",
        "run_lock_second",
        "run_lock_third",
    ),
    "pve_gpu_container": (
        "pve_gpu_container_ct",
        "pve_gpu_container_power",
        "pve_gpu_container_raw",
        "pve_gpu_container_devices",
    ),
    "pve_gpu_host": (
        "pve_gpu_host_persistenced_unit_file",
        "pve_gpu_host_uvm_unit_file",
        "pve_gpu_host_driver_version",
        "pve_gpu_host_gpu_devices",
        "pve_gpu_host_control_devices",
        "pve_gpu_host_rdma_devices",
    ),
}

# Where the role's own settings go instead of a trainer config key.
_FORBIDDEN_KEY_HINT = {
    "max_seq_len": "set it with -e max_seq_len=N (or auto)",
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


def seq_len_problem(name: str, value, block: int) -> str | None:
    """max_seq_len: a positive multiple of the trainer's length block, or auto (the wording molecule's
    invalid-input case checks).

    >>> seq_len_problem("max_seq_len", "24000", 128)
    'max_seq_len=24000 is not a multiple of 128 (the flex_attention block size); try 23936 or 24064; allowed: a positive multiple of 128, or auto'
    """
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if re.fullmatch(r"[0-9]+", text) and int(text) > 0:
        n = int(text)
        if n % block == 0:
            return None
        below = (n // block) * block if n >= block else block
        return (
            f"{name}={text} is not a multiple of {block} (the flex_attention block size); try {below} "
            f"or {(n // block + 1) * block}; allowed: a positive multiple of {block}, or auto"
        )
    return (
        f'{name}={show(value)} is neither a positive multiple of {block} nor "auto"; try -e {name}=16384 '
        f"or -e {name}=auto"
    )


def _check_scalar(value) -> str | None:
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and not _CONTROL.search(value)):
        return None
    return "is not a plain value (a string on one line, a number or a boolean)"


def _check_kind(kind: str, value, spec: dict) -> str | None:
    """`value` against a KINDS entry (or scalar / bind_pair): the problem, or None."""
    if kind == "scalar":
        return _check_scalar(value)
    if kind == "bind_pair":
        if not isinstance(value, dict) or set(value) != {"host", "ct"}:
            return "is not a {host: PATH, ct: PATH} pair"
        bad = [f"{k} {problem}" for k in ("host", "ct") if (problem := path_problem(value[k]))]
        return "; ".join(bad) or None
    return KINDS[kind](value, spec)


def _allowed(kind: str) -> str:
    if kind == "scalar":
        return "a plain value"
    if kind == "bind_pair":
        return "{host: ABSOLUTE_PATH, ct: ABSOLUTE_PATH}"
    return KINDS[kind].allowed


def check(name: str, value, spec: dict) -> str | None:
    """One variable against its table entry: None when it is fine, else the line that says why not."""
    kind = spec["kind"]
    if kind == "raw":
        return None
    if kind == "seq_len":
        return seq_len_problem(name, value, trainer().SEQ_BLOCK)
    if kind == "bool":
        if spec.get("empty") and value in ("", None):
            return None
        if as_bool(value) is None:
            return f"{name}={show(value)} is not a boolean; allowed: {_BOOL_ALLOWED}"
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
    problem = _check_kind(kind, value, spec)
    return f"{name}={show(value)} {problem}; allowed: {_allowed(kind)}" if problem else None


def _check_list(name: str, value, spec: dict) -> str | None:
    of = spec["of"]
    if not isinstance(value, list):
        return (
            f"{name}={show(value)} is not a list; allowed: a list of {_allowed(of)} "
            f"(on the command line: -e '{{\"{name}\": [...]}}')"
        )
    if not value and not spec.get("empty"):
        return f"{name}=[] is empty; allowed: a non-empty list of {_allowed(of)}"
    for i, item in enumerate(value):
        if of == "argv_item" and isinstance(item, (int, float)) and not isinstance(item, bool):
            continue
        problem = _check_kind(of, item, {})
        if problem:
            return f"{name}[{i}]={show(item)} {problem}; allowed: {_allowed(of)}"
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
        if "keys" in spec and (problem := _check_kind(spec["keys"], key, {})):
            return f"{name} has the key {show(key)}, which {problem}; allowed: {_allowed(spec['keys'])}"
        if "values" in spec and (problem := _check_kind(spec["values"], item, {})):
            return f"{name}.{key}={show(item)} {problem}; allowed: {_allowed(spec['values'])}"
    return None


def trainer():
    """The trainer's config module (training/eagle3/config.py: torch-free, its key declaration and checks)."""
    training = str(ROOT / "training")
    if training not in sys.path:
        sys.path.insert(0, training)
    from eagle3 import config

    return config


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
    values["max_seq_len"] = (
        msl if msl and msl > 0 and msl % config_module.SEQ_BLOCK == 0 else config_module.SEQ_BLOCK
    )
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
            config_module.build_config({"data_dir": "/data", "run_dir": "/run",
                                        "max_seq_len": values["max_seq_len"], key: values[key]}, {})  # fmt: skip
        except config_module.ConfigError as e:
            errors.append(f"{source}: {e} (the trainer refuses it)")
    if errors:
        return errors
    try:  # keys that are fine alone but not together
        config_module.build_config(values, {})
    except config_module.ConfigError as e:
        errors.append(f"eagle3_train_config + eagle3_train_config_overrides: {e} (the trainer refuses it)")
    return errors


def role_input_errors(
    values: dict, role, aliases: dict | None = None, known: list | None = None
) -> list[str]:
    """Every problem with a role's variables, in the table's order, then the unknown names with its prefix.
    `role` may be a list of roles: a playbook checks the variables of every role it will reach, at its start.

    `values`: the variables (collected with the varnames lookup, so a mistyped name shows up too). `aliases`: the
    name to report instead, when the user set a short form (max_seq_len for eagle3_train_max_seq_len). `known`:
    more names that are the role's (those of its defaults/main.yml).

    >>> role_input_errors({"eagle3_train_run_dir": "/tmp; rm -rf /"}, "eagle3_train")
    ['eagle3_train_run_dir=/tmp; rm -rf / holds characters a path here may not have (" ", ";"); allowed: an absolute path on the target, e.g. /var/lib/eagle3 (characters: letters, digits and . _ + @ , : = / -)']
    >>> role_input_errors({"eagle3_train_synth_if_mising": True}, "eagle3_train")
    ['eagle3_train_synth_if_mising=true is not a variable of the eagle3_train role; did you mean eagle3_train_synth_if_missing?']
    """
    if isinstance(role, (list, tuple)):
        return [e for r in role for e in role_input_errors({k: v for k, v in values.items()
                if k.startswith(f"{r}_") or k in ROLE_VARIABLES[r]}, r, aliases, known)]  # fmt: skip
    table = ROLE_VARIABLES[role]
    aliases = aliases or {}
    errors = []
    for name, spec in table.items():
        if name in values:
            problem = check(aliases.get(name, name), values[name], spec)
            if problem:
                errors.append(problem)
    config_ok = not any(
        e.startswith(("eagle3_train_config=", "eagle3_train_config_overrides")) for e in errors
    )
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


# Names a playbook takes without a role prefix: never strays.
PLAYBOOK_NAMES = ("max_seq_len", "report", "report_dir")


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
     'run_dir is not a variable of these playbooks; did you mean eagle3_train_run_dir or eagle3_evaluate_run_dir?']
    """
    known = (
        {n for table in ROLE_VARIABLES.values() for n in table} | set(PLAYBOOK_NAMES) | set(extra_known or ())
    )
    suffixes: dict[str, list[str]] = {}
    for role, table in ROLE_VARIABLES.items():
        for n in table:
            suffix = n[len(role) + 1 :]
            if (
                "_" in suffix
            ):  # run_dir, term_timeout; a one-word suffix (unit, state, path) is too common a name
                suffixes.setdefault(suffix, []).append(n)
    keys = set(trainer().SPECS)
    prefixes = tuple(f"{role}_" for role in ROLE_VARIABLES)
    out = []
    for name in sorted(set(names) - known):
        if name.startswith(
            ("ansible_", "molecule_", "inventory_", "group_", "play", "role_", "omit", *prefixes)
        ):
            continue  # Ansible's own, or a role's (its own check names typos with its prefix)
        if name in suffixes:
            out.append(
                f"{name} is not a variable of these playbooks; did you mean {' or '.join(suffixes[name])}?"
            )
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


# ---------------------------------------------------------------------------------------------------- quoting
def systemd_arg(value) -> str:
    """One argument on a unit file's Exec*= line, quoted for systemd: double quotes with \\ and " escaped, % as
    %% (a specifier otherwise) and $ as $$ (a variable otherwise), so systemd passes exactly `value`.

    >>> systemd_arg("/var/lib/eagle3/run"), systemd_arg("a b"), systemd_arg('50%$x"')
    ('"/var/lib/eagle3/run"', '"a b"', '"50%%$$x\\\\""')
    """
    text = str(value)
    if _CONTROL.search(text):
        raise ValueError(f"{show(text)} holds a control character and cannot be a unit file argument")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'


def systemd_path(value) -> str:
    """A path for a unit setting that takes the rest of the line (WorkingDirectory=, EnvironmentFile=): % doubled.

    >>> systemd_path("/var/lib/50%")
    '/var/lib/50%%'
    """
    text = str(value)
    if _CONTROL.search(text):
        raise ValueError(f"{show(text)} holds a control character and cannot be a unit file path")
    return text.replace("%", "%%")


def env_file_value(value) -> str:
    """A value for systemd's EnvironmentFile=, double-quoted: systemd removes the quotes and the backslashes before
    \\, " and $, and expands nothing, so the process sees exactly `value`. Never a newline (a new variable).

    >>> env_file_value("plain"), env_file_value('x"y$z\\\\w')
    ('"plain"', '"x\\\\"y\\\\$z\\\\\\\\w"')
    """
    text = str(value)
    if _CONTROL.search(text):
        raise ValueError(f"{show(text)} holds a control character and cannot be an environment value")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`") + '"'


class FilterModule:
    def filters(self):
        return {
            "role_input_errors": role_input_errors,
            "stray_variables": stray_variables,
            "systemd_arg": systemd_arg,
            "systemd_path": systemd_path,
            "env_file_value": env_file_value,
        }
