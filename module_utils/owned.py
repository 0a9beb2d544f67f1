"""What the project may manage on a target (standard library only): never a system folder, never a folder or a
systemd unit that belongs to something else.

A role creates folders (and sets their mode) and writes, starts and stops systemd units, each named by a variable.
A well-formed value can still point at the wrong thing: ``eagle3_train_config_dir=/etc`` would make /etc mode 0700,
``gpu_cleanup_unit=systemd-journald.service`` would write the training unit over journald's and stop it. So:

- ``system_dir_problem`` (checked on the controller, before anything runs): a managed folder is never one of the
  system's own folders (SYSTEM_DIRS) nor inside a tree that only the system's packages own (SYSTEM_TREES).
- ``dir_problem`` (on the target, read-only): an existing folder that holds files, none of them the project's
  (``marks``: the files the role itself writes there), belongs to something else.
- ``unit_problem`` (on the target, read-only): a unit that is installed and was not written by the project (its
  unit file does not carry UNIT_MARK, or the Description a unit written before the mark existed had) belongs to
  something else.
"""

from __future__ import annotations

import os
import posixpath
import subprocess

# The system's own folders: a role never creates, re-modes or fills one of these itself.
SYSTEM_DIRS = frozenset(
    [
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/media",
        "/mnt",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/local",
        "/usr/local/bin",
        "/usr/local/lib",
        "/usr/sbin",
        "/usr/share",
        "/usr/include",
        "/usr/src",
        "/var/lib",
        "/var/log",
        "/var/cache",
        "/var/tmp",
        "/var/spool",
        "/var/mail",
        "/var/backups",
        "/var/opt",
        "/var/local",
        "/var/run",
        "/var/lock",
        "/run/lock",
        "/run/user",
        "/dev/shm",
        "/etc/systemd",
        "/etc/systemd/system",
        "/etc/default",
        "/etc/ssh",
        "/etc/ssl",
        "/etc/apt",
        "/etc/pve",
        "/var/lib/vz",
        "/var/lib/lxc",
        "/var/lib/dpkg",
        "/var/lib/apt",
    ]
)
# Trees whose every folder is the system's (packages, the kernel's file systems): nothing of the project's lives there.
# (/usr/local is the place for local software, so /usr/local/eagle3 is allowed; /usr/local itself is not.)
SYSTEM_TREES = (
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib",
    "/usr/lib64",
    "/usr/share",
    "/usr/include",
    "/etc/systemd",
    "/etc/pve",
    "/var/lib/dpkg",
    "/var/lib/apt",
)
# The line every unit file the project writes carries (the unit templates put it first).
UNIT_MARK = "# eagle3-pve:"
# How the project's unit files began before UNIT_MARK: still the project's (a later run rewrites them with it).
LEGACY_DESCRIPTION = "Description=EAGLE-3 "


def system_dir_problem(path: str) -> str | None:
    """Why ``path`` may not be a folder a role manages, or None.

    >>> system_dir_problem("/etc/eagle3") is None, system_dir_problem("/usr/local/eagle3") is None
    (True, True)
    >>> system_dir_problem("/etc")
    'is a system folder (a role would create, re-mode or fill it): choose a folder of its own, e.g. /etc/eagle3'
    >>> print(system_dir_problem("/usr/lib/eagle3"))
    lies in /usr/lib, which only the system's packages own: choose a folder of its own, e.g. /opt/eagle3
    """
    path = posixpath.normpath(path) if isinstance(path, str) and path.startswith("/") else path
    if path in SYSTEM_DIRS or path == "//":
        example = f"{path.rstrip('/')}/eagle3" if path not in ("/", "//") else "/opt/eagle3"
        return (
            f"is a system folder (a role would create, re-mode or fill it): choose a folder of its own, e.g. {example}"
        )
    tree = next((t for t in SYSTEM_TREES if isinstance(path, str) and path.startswith(t + "/")), None)
    if tree:
        return f"lies in {tree}, which only the system's packages own: choose a folder of its own, e.g. /opt/eagle3"
    return None


def dir_problem(path: str, marks: list[str]) -> str | None:
    """Why the existing folder ``path`` belongs to something else, or None (absent, empty, or the project's: it
    holds one of ``marks``, the files the role writes there).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> dir_problem(str(d), ["train.yaml"]) is None
    True
    >>> (d / "hostname").write_text("ct129")
    5
    >>> dir_problem(str(d), ["train.yaml"])
    'is a folder of something else (it holds hostname, and no file eagle3-pve writes there: train.yaml)'
    >>> (d / "train.yaml").write_text("{}") and dir_problem(str(d), ["train.yaml"]) is None
    True
    """
    system = system_dir_problem(path)
    if system:
        return system
    try:
        entries = sorted(os.listdir(path))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "is an existing file, not a folder"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not entries or any(m in entries for m in marks):
        return None
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    return f"is a folder of something else (it holds {shown}, and no file eagle3-pve writes there: {', '.join(marks)})"


def unit_file(unit: str, systemctl: str = "systemctl", timeout: float = 10.0) -> tuple[str | None, str]:
    """(the unit's file, or None when the unit is not installed; systemd's LoadState)."""
    try:
        out = subprocess.run(
            [systemctl, "show", "--property=LoadState,FragmentPath", "--", unit],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, "unknown"
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props.get("FragmentPath") or None, props.get("LoadState", "unknown")


def is_project_unit(text: str) -> bool:
    """Whether a unit file's text is one the project wrote.

    >>> is_project_unit("# eagle3-pve: roles/eagle3_train\\n[Unit]\\n"), is_project_unit("[Unit]\\nDescription=Journal\\n")
    (True, False)
    >>> is_project_unit("# Ansible managed\\n[Unit]\\nDescription=EAGLE-3 drafter training (2 workers)\\n")
    True
    """
    lines = text.splitlines()
    return any(line.startswith(UNIT_MARK) for line in lines[:5]) or any(
        line.startswith(LEGACY_DESCRIPTION) for line in lines
    )


def unit_problem(unit: str, systemctl: str = "systemctl", timeout: float = 10.0) -> str | None:
    """Why ``unit`` belongs to something else (installed, and its file is not the project's), or None."""
    path, load_state = unit_file(unit, systemctl, timeout)
    if path is None:
        return None  # not installed (or no systemd): the role writes it, the cleanup has nothing to stop
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError as exc:
        return f"is installed ({path}) but its unit file cannot be read ({exc.strerror})"
    if is_project_unit(text):
        return None
    return (
        f"is a unit eagle3-pve did not write ({path}, {load_state}): the project never writes, starts or stops "
        "another program's unit; name a unit of its own (default eagle3-train.service)"
    )
