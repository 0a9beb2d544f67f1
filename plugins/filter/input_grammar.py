# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The grammar of role inputs: what each kind of value may be, and the quoting for where a value lands.

A value that reaches a shell, a unit file, an LXC config line, a path or a template has a strict grammar here:
paths are absolute, normalised and of a safe character set (no space, quote, ``$``, ``%``, ``;``, backslash,
newline or other control character, nothing outside ASCII), names and ids have their own patterns, free text
(a lock's purpose, a command-line argument passed as one argv entry, a password) may hold anything printable but
never a control character. Where a value lands is quoted for that place as well (``systemd_arg`` in unit files,
``env_file_value`` in EnvironmentFile=, argv lists instead of ``sh -c``), so a check that let something through
would still not become a command.

``KINDS`` maps a kind's name to its check; role_variables.py gives each role variable its kind and role_inputs.py
checks a role's variables with both. Filters here: ``systemd_arg``, ``systemd_path`` and ``env_file_value``
(quoting), documented in the .yml file of the same name beside this one.
"""

from __future__ import annotations

import ipaddress
import json
import math
import posixpath
import re
import sys
from pathlib import Path

# declared_constants.py beside this file: Ansible loads a plugin by its path, not as part of a package.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from declared_constants import target_module

_BOOL_TRUE = {"true", "yes", "on", "1"}  # exactly what ansible.builtin.bool accepts (lower-cased)
_BOOL_FALSE = {"false", "no", "off", "0"}
BOOL_ALLOWED = "true or false (also yes/no, on/off, 1/0, any case)"

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


def _sweep_glob():
    roots = target_module("job_files").SWEEP_ROOTS

    def check(value, spec) -> str | None:
        return path_problem(value, glob=True) or target_module("job_files").glob_problem(value)

    check.allowed = (
        f"a glob of a GPU job's leftover files directly in {', '.join(roots)}, its name starting with at least 3 "
        "literal characters, e.g. /dev/shm/nccl-*"
    )
    return check


def _owned_dir():
    def check(value, spec) -> str | None:
        if spec.get("empty") and value in ("", None):
            return None
        return path_problem(value) or target_module("owned").system_dir_problem(value)

    check.allowed = (
        "a folder of its own on the target, never a system folder (/, /etc, /usr, /var/lib, ...), "
        f"e.g. /var/lib/eagle3 (characters: {PATH_CHARS_TEXT})"
    )
    return check


# Environment names the workers get from the role or from torchrun, never from eagle3_train_env: the job's marker
# (EAGLE3_JOB, how the clean-up finds an orphaned worker; every EAGLE3_* name is the project's), the trainer's
# location, the collectives' interfaces (their own role variables) and torchrun's rank variables.
WORKER_ENV_RESERVED = {
    "PYTHONPATH": "the role sets it to the trainer's sources",
    "GLOO_SOCKET_IFNAME": "set eagle3_train_socket_ifname",
    "NCCL_SOCKET_IFNAME": "set eagle3_train_socket_ifname",
    "NCCL_IB_HCA": "set eagle3_train_nccl_ib_hca",
    **{
        n: "torchrun sets it for each worker"
        for n in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    },
}
WORKER_ENV_RESERVED_PREFIXES = {
    "EAGLE3_": "the project's own names: EAGLE3_JOB marks every process of the job for the clean-up",
    "TORCHELASTIC_": "torchrun sets it for each worker",
}


def worker_env_problem(name) -> str | None:
    """Why ``name`` may not be set through eagle3_train_env, or None.

    >>> worker_env_problem("NCCL_DEBUG") is None
    True
    >>> print(worker_env_problem("EAGLE3_JOB"))
    is set by the role, not by eagle3_train_env (the project's own names: EAGLE3_JOB marks every process of the job for the clean-up)
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return "has the wrong form"
    why = WORKER_ENV_RESERVED.get(name) or next(
        (w for p, w in WORKER_ENV_RESERVED_PREFIXES.items() if name.startswith(p)), None
    )
    return f"is set by the role, not by eagle3_train_env ({why})" if why else None


def _worker_env_name():
    def check(value, spec) -> str | None:
        return worker_env_problem(value)

    check.allowed = (
        "an environment variable name (letters, digits, _) other than those the role or torchrun sets "
        f"({', '.join(sorted(WORKER_ENV_RESERVED))}, {', '.join(p + '*' for p in WORKER_ENV_RESERVED_PREFIXES)})"
    )
    return check


def _job_env_name():
    def check(value, spec) -> str | None:
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            return "has the wrong form"
        if value.startswith("EAGLE3_"):
            return f"is set by the role ({WORKER_ENV_RESERVED_PREFIXES['EAGLE3_']})"
        return None

    check.allowed = "an environment variable name (letters, digits, _) outside the project's own EAGLE3_*"
    return check


def _flag():
    def check(value, spec) -> str | None:
        return None if as_bool(value) is not None else "is not a boolean"

    check.allowed = BOOL_ALLOWED
    return check


def _command():
    name = re.compile(r"[A-Za-z0-9_.+-]{1,255}")

    def check(value, spec) -> str | None:
        if isinstance(value, str) and value.startswith("/"):
            return path_problem(value)
        if not isinstance(value, str) or not name.fullmatch(value):
            return "has the wrong form"
        return None

    check.allowed = "a command name found on PATH (letters, digits, _ . + -) or an absolute path, e.g. python3"
    return check


_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def bind_address_problem(value) -> str | None:
    """Why `value` is not an address a server can listen on (an IP address, or a host name that does not look like
    a malformed address), or None.

    >>> bind_address_problem("127.0.0.1"), bind_address_problem("::1"), bind_address_problem("ct129.lan")
    (None, None, None)
    >>> bind_address_problem("127.0.0.256"), bind_address_problem("http://x"), bind_address_problem("")
    ('is not an IP address', 'has the wrong form', 'has the wrong form')
    """
    if not isinstance(value, str) or not value:
        return "has the wrong form"
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*", value):
        return "is not an IP address"
    return None if len(value) <= 253 and _HOSTNAME.fullmatch(value) else "has the wrong form"


def _bind_address():
    def check(value, spec) -> str | None:
        return bind_address_problem(value)

    check.allowed = "an IP address (127.0.0.1, ::1, 0.0.0.0 for every interface) or a host name of the CT"
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
    "sweep_glob": _sweep_glob(),
    "owned_dir": _owned_dir(),
    "path_glob": _path(glob=True, allowed="an absolute path or glob on the target, e.g. /dev/nvidia[0-9]*"),
    "controller_path": _text("a folder on the controller (relative to the playbooks or absolute)"),
    "unit": _kind(
        r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.service",
        "a systemd service name, e.g. eagle3-train.service",
    ),
    "env_marker": _kind(r"[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.:/@+-]+", "NAME=VALUE, e.g. EAGLE3_JOB=eagle3-train"),
    "worker_env_name": _worker_env_name(),
    "job_env_name": _job_env_name(),
    "env_value": _kind(
        r"[A-Za-z0-9_.,:/@+=-]+",
        "a value of letters, digits and _ . , : / @ + = - (what device lists, sizes and names need), e.g. 0,1,2,3",
    ),
    "env_name": _kind(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name (letters, digits, _)"),
    "proc_glob": _kind(r"[A-Za-z0-9_.:@+*?\[\]-]+", "a process name or glob, e.g. nvidia-persistenced or dcgm*", 64),
    "regex": _regex(),
    "host": _kind(
        r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*",
        "a host name or an IP address",
    ),
    "bind_address": _bind_address(),
    "model_name": _kind(
        r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]*",
        "a model name of letters, digits and _ . : / @ + -, e.g. kimi-k2.5-eagle3",
    ),
    "inventory_host": _kind(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", "an inventory host name"),
    "ifname": _kind(r"[A-Za-z0-9_.:-]{1,15}", "a network interface name (at most 15 letters, digits, _ . : -)"),
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
    "argv_item": _text("one command-line argument: any printable text on one line (passed as it is, never to a shell)"),
    "secret": _text("any printable text on one line (kept out of logs)"),
    "url": _kind(
        r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~%/+:@=,-]*)?",
        "an http(s) URL without spaces or quotes",
        2048,
    ),
    "deb_suite": _kind(r"[a-z][a-z0-9-]*", "a Debian suite name, e.g. bookworm"),
    "deb_package": _kind(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name, e.g. systemd"),
    "version": _kind(r"[0-9]+(\.[0-9]+)*", "a version of digits and dots, e.g. 570.133.20"),
    "checksum": _kind(r"(sha1|sha224|sha256|sha384|sha512|md5):[0-9a-fA-F]+", "ALGORITHM:HEX, e.g. sha256:0123..."),
    "pve_volume": _kind(r"[A-Za-z0-9_.-]+:[A-Za-z0-9_./+-]+", "a Proxmox storage:volume, e.g. local-lvm:64"),
    "pve_property": _kind(r"[A-Za-z0-9_.,=:/+-]+", "a Proxmox property string, e.g. name=eth0,bridge=vmbr0,ip=dhcp"),
    "pve_user": _kind(r"[A-Za-z0-9._-]+@[A-Za-z0-9._-]+", "USER@REALM, e.g. root@pam"),
    "pve_token_id": _kind(r"[A-Za-z0-9._-]+@[A-Za-z0-9._-]+![A-Za-z0-9._-]+", "USER@REALM!TOKEN, e.g. root@pam!eagle3"),
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


# ---------------------------------------------------------------------------------------------------- kinds
def check_scalar(value) -> str | None:
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and not _CONTROL.search(value)):
        return None
    return "is not a plain value (a string on one line, a number or a boolean)"


def check_kind(kind: str, value, spec: dict) -> str | None:
    """`value` against a KINDS entry (or scalar / bind_pair): the problem, or None."""
    if kind == "scalar":
        return check_scalar(value)
    if kind == "bind_pair":
        if not isinstance(value, dict) or set(value) != {"host", "ct"}:
            return "is not a {host: PATH, ct: PATH} pair"
        bad = [f"{k} {problem}" for k in ("host", "ct") if (problem := path_problem(value[k]))]
        return "; ".join(bad) or None
    return KINDS[kind](value, spec)


def allowed_text(kind: str) -> str:
    if kind == "scalar":
        return "a plain value"
    if kind == "bind_pair":
        return "{host: ABSOLUTE_PATH, ct: ABSOLUTE_PATH}"
    return KINDS[kind].allowed


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
            "systemd_arg": systemd_arg,
            "systemd_path": systemd_path,
            "env_file_value": env_file_value,
        }
