#!/usr/bin/env python3
"""Find and stop the processes of a GPU job by reading /proc directly (standard library only).

Used by the ``gpu_cleanup`` Ansible module on the target and, unchanged, as a pre-start guard for the
training unit.  Why /proc and not ``ps``/``fuser``/psutil: psmisc may be missing from CT templates,
``psutil.open_files()`` never lists character devices, and the target must run with the standard library.

Process identity is ``(pid, start_time)`` (field 22 of /proc/PID/stat, clock ticks since boot): a PID
that was reused by another process after our scan is never signalled.

The file reads top to bottom in the order a cleanup runs (each section opens with its main function):

1. Selection: which processes belong to the job, hold GPU devices or are protected.
   ``select_targets`` (``Selectors``, ``untouchable``, ``name_matches``, ``device_paths``, ``descendants``).
2. Verification: what holds a device.  ``holders`` (also the CLI).
   Stopping the processes (the unit, TERM, wait, KILL, the survivors, the sweep) is module_utils/proc_stop.py.
3. Reading /proc, shared by the stages: ``scan``, ``read_proc``, ``read_cmdline``, ``fd_paths``, ...
4. The pre-start guard CLI: ``main``.

Pre-start guard CLI (stable; the training role deploys this file and runs it as ExecStartPre)::

    python3 procs.py holders --devices GLOB [GLOB ...] [--exclude-cgroup-of-unit UNIT] [--protect NAME ...]

Exit status: 0 when no process outside UNIT's cgroup (and not named like a ``--protect`` pattern, and not
this guard or its ancestors) holds a path matching a GLOB open as a file descriptor or memory map;
1 when some do (one line per holder on stdout: ``pid=N name=COMM paths=P1,P2 cmdline=...``);
2 on a usage error.  Example::

    $ python3 procs.py holders --devices '/dev/nvidia[0-9]*' /dev/nvidiactl \\
          --exclude-cgroup-of-unit eagle3-train.service --protect nvidia-persistenced
    pid=4242 name=pt_data_worker paths=/dev/nvidia0 cmdline=python3 -m eagle3 train
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field

PROC = "/proc"
# comm (the kernel's process name) is cut to TASK_COMM_LEN - 1 characters.
COMM_LEN = 15
# States that no longer run user code: zombie (exited, not reaped), dead.
EXITED_STATES = ("Z", "X", "x")
# Uninterruptible sleep: SIGKILL is queued but only acts when the kernel call returns.
UNINTERRUPTIBLE_STATES = ("D",)
# systemd ActiveState values of a unit that still has (or is about to have) processes to stop.
ACTIVE_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")
# A GPU job's device nodes (globs): a process holding one open or mapped holds a GPU. The one declaration: the
# gpu_cleanup module's default devices, the gpu_cleanup role's default (plugins/filter/target_constants.py reads
# it on the controller) and bench/gpu_check.py read it (tests/test_contracts.py holds them to it).
DEVICE_GLOBS = ["/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


@dataclass(frozen=True)
class Proc:
    """One process as seen in one scan of /proc."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    name: str
    state: str
    start_time: int

    @property
    def identity(self) -> tuple[int, int]:
        return (self.pid, self.start_time)


# =========================================================================== 1. selection


@dataclass
class Selectors:
    """What makes a process part of the job.  ``devices`` are globs; ``match_cmdline`` compiled regexes."""

    unit: str | None = None
    marker: str | None = None
    devices: list[str] = field(default_factory=list)
    match_cmdline: list[re.Pattern] = field(default_factory=list)
    protect: list[str] = field(default_factory=list)
    # Keep the unit's run: its cgroup's processes are never selected (a cleanup of foreign holders only).
    spare_unit: bool = False


@dataclass
class Target:
    proc: Proc
    cmdline: list[str]
    reasons: list[str]

    def as_dict(self) -> dict:
        return {
            "pid": self.proc.pid,
            "ppid": self.proc.ppid,
            "name": self.proc.name,
            "cmdline": " ".join(self.cmdline),
            "reasons": self.reasons,
            "start_time": self.proc.start_time,
        }


def select_targets(
    sel: Selectors, self_pid: int | None = None, proc: str = PROC
) -> tuple[list[Target], list[dict], list[dict]]:
    """Processes of the job, and those that matched but are protected (never signalled).

    Returns (targets, protected, zombies): protected is [{pid, name, reasons, why}]; zombies are exited
    descendants of the job ([{pid, ppid, name}]), not targets: no signal reaches them, their parent reaps.
    """
    procs = scan(proc)
    never = untouchable(procs, self_pid)
    marker = None
    if sel.marker:
        name, value = parse_marker(sel.marker)
        marker = f"{name}={value}"
    reasons: dict[int, list[str]] = {}
    for p in procs.values():
        if is_kernel_thread(p) or p.state in EXITED_STATES:
            continue
        why = []
        in_unit = bool(sel.unit) and in_unit_cgroup(read_cgroup(p.pid, proc), sel.unit)
        if in_unit and sel.spare_unit:
            continue
        if in_unit:
            why.append(f"unit:{sel.unit}")
        if marker and marker in read_environ(p.pid, proc):
            why.append(f"marker:{marker}")
        why.extend(f"device:{path}" for path in device_paths(p.pid, sel.devices, proc))
        if sel.match_cmdline:
            line = " ".join(read_cmdline(p.pid, proc))
            why.extend(f"cmdline:{rx.pattern}" for rx in sel.match_cmdline if rx.search(line))
        if why:
            reasons[p.pid] = why
    # Only processes we may signal pass the job on to their children: the children of a protected
    # sshd or of this module's own ancestors are not part of the job.
    roots = {
        pid for pid in reasons if pid not in never and not name_matches(procs[pid].name, _argv0(pid, proc), sel.protect)
    }
    zombies = []
    for pid in descendants(roots, procs):
        p = procs[pid]
        if p.state in EXITED_STATES:
            zombies.append({"pid": pid, "ppid": p.ppid, "name": p.name})
        elif not is_kernel_thread(p):
            # Recorded even when the process matched on its own: it tells which tree it belongs to.
            reasons.setdefault(pid, []).append(f"descendant-of:{_root_of(pid, roots, procs)}")
    targets, protected = [], []
    for pid in sorted(reasons):
        p = procs[pid]
        cmdline = read_cmdline(pid, proc)
        if pid in never:
            protected.append({"pid": pid, "name": p.name, "reasons": reasons[pid], "why": never[pid]})
        elif name_matches(p.name, cmdline[0] if cmdline else "", sel.protect):
            # Named as protection saw it: argv[0] when the process renamed itself (comm may say python3).
            shown = p.name if name_matches(p.name, "", sel.protect) else os.path.basename(cmdline[0])
            protected.append({"pid": pid, "name": shown, "reasons": reasons[pid], "why": "protected name"})
        else:
            targets.append(Target(p, cmdline, reasons[pid]))
    return targets, protected, zombies


# --------------------------------------------------------------------------- the selectors' options


def parse_marker(marker: str) -> tuple[str, str]:
    """Split an environment marker ``NAME=VALUE``; raise ValueError with a fix for anything else.

    >>> parse_marker("EAGLE3_JOB=eagle3-train")
    ('EAGLE3_JOB', 'eagle3-train')
    >>> parse_marker("EAGLE3_JOB")
    Traceback (most recent call last):
    ...
    ValueError: marker 'EAGLE3_JOB' is not NAME=VALUE (for example EAGLE3_JOB=eagle3-train)
    """
    name, sep, value = marker.partition("=")
    if not sep or not value or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"marker {marker!r} is not NAME=VALUE (for example EAGLE3_JOB=eagle3-train)")
    return name, value


def compile_patterns(patterns: list[str]) -> list[re.Pattern]:
    """Compile ``match_cmdline`` regexes; ValueError names the bad one.

    >>> compile_patterns(["eagle3 train("])
    Traceback (most recent call last):
    ...
    ValueError: match_cmdline regex 'eagle3 train(' is invalid: missing ), unterminated subpattern at position 12
    """
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"match_cmdline regex {pattern!r} is invalid: {e}") from None
    return compiled


# --------------------------------------------------------------------------- belonging to the job


def in_unit_cgroup(cgroup_text: str, unit: str) -> bool:
    """Whether a /proc/PID/cgroup content places the process in ``unit`` (or a cgroup below it).

    Only systemd's own hierarchies count: the cgroup v2 line (``0::``) and the v1 ``name=systemd`` one.

    >>> in_unit_cgroup("0::/system.slice/eagle3-train.service\\n", "eagle3-train.service")
    True
    >>> in_unit_cgroup("1:name=systemd:/system.slice/eagle3-train.service/payload\\n0::/\\n", "eagle3-train.service")
    True
    >>> in_unit_cgroup("4:memory:/system.slice/eagle3-train.service\\n0::/user.slice\\n", "eagle3-train.service")
    False
    """
    for line in cgroup_text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        systemd_hierarchy = hierarchy == "0" or "name=systemd" in controllers.split(",")
        if systemd_hierarchy and unit in path.split("/"):
            return True
    return False


def device_paths(pid: int, globs: list[str], proc: str = PROC) -> list[str]:
    """Paths matching ``globs`` that ``pid`` holds as an fd or a memory map (not as its cwd)."""
    if not globs:
        return []
    return match_globs(held_paths(pid, proc), globs)


def match_globs(paths: set[str], globs: list[str]) -> list[str]:
    """Sorted paths that match any glob (``*`` also crosses ``/``, as in fnmatch).

    >>> match_globs({"/dev/nvidia0", "/dev/nvidia-uvm", "/dev/null"}, ["/dev/nvidia[0-9]*", "/dev/nvidia-uvm"])
    ['/dev/nvidia-uvm', '/dev/nvidia0']
    """
    return sorted(p for p in paths if any(fnmatch.fnmatchcase(p, g) for g in globs))


def descendants(roots: set[int], procs: dict[int, Proc]) -> set[int]:
    """PIDs below ``roots`` in the parent tree (roots excluded).

    >>> tree = {p: Proc(p, pp, p, p, "x", "S", 0) for p, pp in [(10, 1), (11, 10), (12, 11), (20, 1)]}
    >>> sorted(descendants({10}, tree))
    [11, 12]
    """
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child not in roots:
                found.add(child)
                stack.append(child)
    return found


def _root_of(pid: int, roots: set[int], procs: dict[int, Proc]) -> int:
    """Nearest ancestor of ``pid`` that matched a selector directly."""
    p = procs.get(pid)
    while p is not None and p.ppid in procs:
        if p.ppid in roots:
            return p.ppid
        p = procs[p.ppid]
    return -1


def is_kernel_thread(p: Proc) -> bool:
    # kthreadd is PID 2 in the root namespace; kernel threads have it as parent and no argv.
    return p.pid == 2 or p.ppid == 2


# --------------------------------------------------------------------------- protected: never signalled


def untouchable(procs: dict[int, Proc], self_pid: int | None = None) -> dict[int, str]:
    """PIDs that are never signalled whatever the options, with the reason.

    PID <= 1, this process, its ancestors (ansible, the connection, the shell) and its process group.
    """
    self_pid = os.getpid() if self_pid is None else self_pid
    me = procs.get(self_pid) or read_proc(self_pid)
    pgid = me.pgid if me else os.getpgid(self_pid)
    never = {pid: "pid <= 1" for pid in procs if pid <= 1}
    for pid in (p.pid for p in procs.values() if p.pgid == pgid):
        never[pid] = "in this module's process group"
    for pid in ancestors(self_pid, procs):
        never[pid] = "ancestor of this module"
    never[self_pid] = "this module"
    return never


def ancestors(pid: int, procs: dict[int, Proc]) -> list[int]:
    """The parent chain of ``pid`` up to PID 1 (or the top of this PID namespace).

    >>> tree = {p: Proc(p, pp, p, p, "x", "S", 0) for p, pp in [(1, 0), (10, 1), (11, 10)]}
    >>> ancestors(11, tree)
    [10, 1]
    """
    chain = []
    seen = {pid}
    p = procs.get(pid) or read_proc(pid)
    while p is not None and p.ppid > 0 and p.ppid not in seen:
        chain.append(p.ppid)
        seen.add(p.ppid)
        p = procs.get(p.ppid) or read_proc(p.ppid)
    return chain


def name_matches(name: str, argv0: str, patterns: list[str]) -> bool:
    """Whether a process named ``name`` (its comm) or started as ``argv0`` matches a protect pattern.

    comm is cut to 15 characters, so a full-length name is also compared against the cut pattern.

    >>> name_matches("nvidia-persiste", "", ["nvidia-persistenced"])
    True
    >>> name_matches("systemd-journal", "/lib/systemd/systemd-journald", ["systemd*"])
    True
    >>> name_matches("python3", "/usr/bin/python3", ["sshd", "dcgm*"])
    False
    """
    candidates = [name, os.path.basename(argv0)] if argv0 else [name]
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates if c):
            return True
        if len(name) == COMM_LEN and fnmatch.fnmatchcase(name, pattern[:COMM_LEN] + "*"):
            return True
    return False


def _argv0(pid: int, proc: str = PROC) -> str:
    argv = read_cmdline(pid, proc)
    return argv[0] if argv else ""


# =========================================================================== 2. verification


def holders(
    devices: list[str],
    exclude_unit: str | None = None,
    protect: list[str] | None = None,
    self_pid: int | None = None,
    proc: str = PROC,
    include_protected: bool = False,
) -> list[dict]:
    """Processes holding a device matching ``devices``, outside ``exclude_unit`` and ``protect``.

    This process and its ancestors are left out (they are the caller); zombies hold nothing.
    Returns [{pid, name, user, paths, cmdline, protected}] sorted by pid; with ``include_protected``, holders
    whose name matches ``protect`` are listed too, with protected=True (they still hold the device).
    """
    procs = scan(proc)
    self_pid = os.getpid() if self_pid is None else self_pid
    skip = {self_pid, *ancestors(self_pid, procs)}
    found = []
    for p in procs.values():
        if p.pid in skip or is_kernel_thread(p) or p.state in EXITED_STATES:
            continue
        paths = device_paths(p.pid, devices, proc)
        if not paths:
            continue
        if exclude_unit and in_unit_cgroup(read_cgroup(p.pid, proc), exclude_unit):
            continue
        cmdline = read_cmdline(p.pid, proc)
        is_protected = name_matches(p.name, cmdline[0] if cmdline else "", protect or [])
        if is_protected and not include_protected:
            continue
        found.append(
            {
                "pid": p.pid,
                # The name that protection matched on: argv[0] when the process renamed itself (exec -a).
                "name": os.path.basename(cmdline[0]) if is_protected and cmdline else p.name,
                "user": owner_name(p.pid, proc),
                "paths": paths,
                "cmdline": " ".join(cmdline),
                "protected": is_protected,
            }
        )
    return found


def owner_name(pid: int, proc: str = PROC) -> str:
    """The user name owning a process (its uid when the name is unknown), '?' when it is gone."""
    try:
        uid = os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return "?"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


# =========================================================================== 3. reading /proc


def scan(proc: str = PROC) -> dict[int, Proc]:
    """All processes now visible, by pid (processes that exit during the scan are skipped)."""
    found = {}
    for pid in list_pids(proc):
        p = read_proc(pid, proc)
        if p is not None:
            found[pid] = p
    return found


def list_pids(proc: str = PROC) -> list[int]:
    return sorted(int(d) for d in os.listdir(proc) if d.isdigit())


def read_proc(pid: int, proc: str = PROC) -> Proc | None:
    """The process now at ``pid``, or None when there is none."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def parse_stat(text: str) -> Proc:
    """Parse the content of /proc/PID/stat.

    The name sits in parentheses and may itself contain spaces and ')', so split at the last ')'.

    >>> p = parse_stat("42 (pt worker) S 7 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 98765 0 0")
    >>> (p.pid, p.name, p.state, p.ppid, p.pgid, p.sid, p.start_time)
    (42, 'pt worker', 'S', 7, 42, 42, 98765)
    """
    head, _, tail = text.rpartition(")")
    pid_text, _, name = head.partition(" (")
    fields = tail.split()
    # fields[0] is field 3 (state); field N of proc(5) is fields[N - 3].
    return Proc(
        pid=int(pid_text),
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        name=name,
        state=fields[0],
        start_time=int(fields[19]),
    )


def read_cmdline(pid: int, proc: str = PROC) -> list[str]:
    """argv of ``pid`` ([] for kernel threads, zombies and vanished processes)."""
    raw = _read_bytes(f"{proc}/{pid}/cmdline")
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] if raw else []


def read_environ(pid: int, proc: str = PROC) -> list[str]:
    """The environment ``pid`` was started with, as NAME=VALUE strings (later setenv calls do not show)."""
    raw = _read_bytes(f"{proc}/{pid}/environ")
    return [e.decode(errors="replace") for e in raw.split(b"\0") if e]


def read_cgroup(pid: int, proc: str = PROC) -> str:
    return _read_bytes(f"{proc}/{pid}/cgroup").decode(errors="replace")


def read_wchan(pid: int, proc: str = PROC) -> str:
    """Kernel function a sleeping process waits in ('' when unknown or running)."""
    w = _read_bytes(f"{proc}/{pid}/wchan").decode(errors="replace").strip()
    return "" if w == "0" else w


def held_paths(pid: int, proc: str = PROC) -> set[str]:
    """Paths ``pid`` holds as an open fd or a memory map.

    DataLoader workers forked after CUDA init inherit the device fds; a mapping alone also pins a device.
    """
    return fd_paths(pid, proc) | parse_maps_paths(_read_bytes(f"{proc}/{pid}/maps").decode(errors="replace"))


def open_paths(pid: int, proc: str = PROC) -> set[str]:
    """Every path ``pid`` holds: open fds, memory maps and its working directory."""
    paths = held_paths(pid, proc)
    try:
        paths.add(os.readlink(f"{proc}/{pid}/cwd"))
    except OSError:
        pass
    return paths


def fd_paths(pid: int, proc: str = PROC) -> set[str]:
    """Targets of the open file descriptors of ``pid`` that are filesystem paths."""
    paths = set()
    fd_dir = f"{proc}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return paths
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("/"):
            paths.add(target[: -len(" (deleted)")] if target.endswith(" (deleted)") else target)
    return paths


def parse_maps_paths(text: str) -> set[str]:
    """Paths mapped in a /proc/PID/maps content (anonymous and pseudo mappings left out).

    >>> sorted(parse_maps_paths(
    ...     "7f00-7f10 rw-s 00000000 00:05 12 /dev/nvidia0\\n"
    ...     "7f10-7f20 rw-p 00000000 00:00 0 \\n"
    ...     "7f20-7f30 rw-s 00000000 00:05 13 /dev/shm/nccl-x (deleted)\\n"
    ...     "7ffc-7ffd rw-p 00000000 00:00 0 [stack]\\n"))
    ['/dev/nvidia0', '/dev/shm/nccl-x']
    """
    paths = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5]
            if path.endswith(" (deleted)"):
                path = path[: -len(" (deleted)")]
            paths.add(path)
    return paths


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


# =========================================================================== 4. CLI (pre-start guard)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="procs.py", description="Refuse to start a GPU job while foreign processes hold the GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("holders", help="exit 1 and list holders of matching devices, exit 0 when none")
    h.add_argument("--devices", nargs="+", required=True, metavar="GLOB")
    h.add_argument("--exclude-cgroup-of-unit", metavar="UNIT")
    h.add_argument("--protect", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    found = holders(args.devices, args.exclude_cgroup_of_unit, args.protect)
    for f in found:
        print(f"pid={f['pid']} name={f['name']} paths={','.join(f['paths'])} cmdline={f['cmdline']}")
    if found:
        print(
            f"{len(found)} process(es) outside {args.exclude_cgroup_of_unit or 'the job'} hold GPU devices;"
            " run cleanup.yml (or gpu_cleanup) before starting the job",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(errno.EPIPE)
