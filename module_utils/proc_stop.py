"""Stopping a GPU job's processes (standard library only): the systemd unit first, then TERM, a bounded wait and
SIGCONT+KILL by identity, re-scanning for processes that were respawned or forked meanwhile; the survivors, and the
files the sweep must keep (the sweep itself is module_utils/job_files.py).

Which processes belong to the job, and everything read from /proc, is module_utils/procs.py (the unit's pre-start
guard is that file alone). Identity is ``(pid, start_time)``: a PID reused by another process is never signalled;
pidfd_send_signal closes the last race where the kernel has it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from .procs import (
    ACTIVE_STATES,
    EXITED_STATES,
    PROC,
    Proc,
    Selectors,
    open_paths,
    read_proc,
    read_wchan,
    select_targets,
)


@dataclass
class Budget:
    """Timeouts in seconds; ``total`` bounds the whole run (stop, signals, re-scans)."""

    term: float = 30.0
    kill: float = 10.0
    stop: float = 120.0
    total: float = 300.0


def check_timeouts(values: dict[str, float | None]) -> None:
    """Raise ValueError naming the first timeout that is not a positive number of seconds.

    >>> check_timeouts({"term_timeout": 30, "kill_timeout": 0})
    Traceback (most recent call last):
    ...
    ValueError: kill_timeout=0 must be a positive number of seconds (for example 10)
    """
    examples = {"term_timeout": 30, "kill_timeout": 10, "stop_timeout": 120, "timeout": 300}
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(
                f"{name}={value:g} must be a positive number of seconds (for example {examples.get(name, 30)})"
            )


# --------------------------------------------------------------------------- first: the systemd unit


def stop_unit(unit: str, timeout: float, systemctl: str = "systemctl", run_dir: str = "/run/systemd/system") -> dict:
    """Stop ``unit`` through systemd, waiting at most ``timeout`` s (its ExecStop/KillMode do the graceful part).

    Returns {state, stopped, message}: state is the ActiveState seen before ('no-systemd', 'not-found'
    when there is nothing to stop).  A stop that overruns ``timeout`` is left to systemd and reported;
    the caller's TERM/KILL of the unit's cgroup members takes over.
    """
    seen = unit_state(unit, systemctl, run_dir, min(timeout, 10.0))
    state = seen["state"]
    if state not in ACTIVE_STATES and state != "unknown":
        return seen
    try:
        run = subprocess.run([systemctl, "stop", unit], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {
            "state": state,
            "stopped": False,
            "message": f"systemctl stop {unit} did not finish within {timeout:g} s; signalling its processes",
        }
    if run.returncode != 0:
        return {
            "state": state,
            "stopped": False,
            "message": f"systemctl stop {unit} failed (rc={run.returncode}): {run.stderr.strip()}",
        }
    return {"state": state, "stopped": True, "message": f"stopped {unit} (was {state})"}


def unit_state(
    unit: str, systemctl: str = "systemctl", run_dir: str = "/run/systemd/system", timeout: float = 10.0
) -> dict:
    """{state, stopped: False, message} of ``unit`` without changing it (check mode)."""
    if not systemd_booted(run_dir) or shutil.which(systemctl) is None:
        return {"state": "no-systemd", "stopped": False, "message": "systemd is not running here"}
    props = unit_properties(unit, systemctl, timeout)
    if props.get("LoadState") in (None, "not-found"):
        return {"state": "not-found", "stopped": False, "message": f"unit {unit} is not installed"}
    state = props.get("ActiveState", "unknown")
    return {"state": state, "stopped": False, "message": f"unit {unit} is {state}"}


def unit_properties(unit: str, systemctl: str = "systemctl", timeout: float = 10.0) -> dict[str, str]:
    """``LoadState`` and ``ActiveState`` of ``unit`` ({} when systemctl fails or hangs)."""
    try:
        out = subprocess.run(
            [systemctl, "show", "--property=LoadState,ActiveState", unit],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def systemd_booted(run_dir: str = "/run/systemd/system") -> bool:
    """sd_booted(3): systemd is PID 1 of this (container's) namespace."""
    return os.path.isdir(run_dir)


# --------------------------------------------------------------------------- then: TERM, wait, KILL


def terminate(
    sel: Selectors, budget: Budget, check_mode: bool = False, self_pid: int | None = None, proc: str = PROC
) -> dict:
    """Scan -> TERM -> poll until exited or term timeout -> SIGCONT+KILL -> re-scan until empty or budget spent.

    Returns {targets, protected, terminated, killed, unkillable, zombies, rounds}.  In check mode it
    only scans.  Re-scans catch workers that a live agent respawned and children forked during the
    TERM handling; those already had the job's grace period, so they get KILL directly.
    """
    deadline = time.monotonic() + budget.total
    targets, protected, zombies = select_targets(sel, self_pid=self_pid, proc=proc)
    result = {
        "targets": [t.as_dict() for t in targets],
        "protected": protected,
        "terminated": [],
        "killed": [],
        "unkillable": [],
        "zombies": [],
        "rounds": 0,
    }
    if check_mode or not targets:
        result["zombies"] = zombies
        return result
    ids = [t.proc.identity for t in targets]
    seen = set(ids)
    for ident in ids:
        send_signal(ident, signal.SIGTERM, proc)
    # Keep part of the budget for KILL: the grace period never eats the whole run.
    reserve = min(budget.kill, budget.total / 2)
    alive = wait_exited(ids, min(time.monotonic() + budget.term, deadline - reserve), proc)
    result["terminated"] = [i[0] for i in ids if i not in alive]
    killed: list[tuple[int, int]] = []
    rounds, stuck_rounds, backoff = 1, 0, 0.1
    while True:
        if alive:
            still = kill_and_wait(alive, budget.kill, deadline, proc)
            killed.extend(i for i in alive if i not in still)
            alive = still
        if time.monotonic() >= deadline:
            break
        fresh, more_protected, more_zombies = select_targets(sel, self_pid=self_pid, proc=proc)
        zombies += more_zombies
        known = {p["pid"] for p in result["protected"]}
        result["protected"].extend(p for p in more_protected if p["pid"] not in known)
        new = [t for t in fresh if t.proc.identity not in seen]
        for t in new:
            seen.add(t.proc.identity)
            result["targets"].append(t.as_dict())
        if new:
            # Respawned or late-forked: the job already had its grace period, so KILL at once.
            alive += [t.proc.identity for t in new]
            rounds += 1
            continue
        if not alive:
            break
        # Only survivors of SIGKILL are left (D state): retry with back-off as Slurm does, then give up.
        stuck_rounds += 1
        if stuck_rounds >= 3:
            break
        time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff *= 4
        rounds += 1
    result["killed"] = [i[0] for i in killed]
    result["rounds"] = rounds
    result["unkillable"] = unkillable(alive, proc)
    # Exited job processes still waiting for their parent (the parent may be a survivor).
    result["zombies"] = unreaped([z["pid"] for z in zombies] + [i[0] for i in seen], proc)
    return result


def kill_and_wait(
    identities: list[tuple[int, int]], timeout: float, deadline: float, proc: str = PROC
) -> list[tuple[int, int]]:
    """SIGCONT then SIGKILL each identity; poll for ``timeout`` s, never past ``deadline`` (time.monotonic).

    Returns the identities still running.
    """
    for ident in identities:
        send_signal(ident, signal.SIGCONT, proc)
        send_signal(ident, signal.SIGKILL, proc)
    return wait_exited(identities, min(deadline, time.monotonic() + timeout), proc)


# --------------------------------------------------------------------------- signalling by identity


def send_signal(identity: tuple[int, int], sig: int, proc: str = PROC) -> str:
    """Signal exactly the process ``identity`` names.  Returns 'sent', 'gone' or 'reused'.

    With a pidfd (Linux >= 5.3) the race is closed: the fd pins the process we checked.  Without one,
    the start time is re-read right before kill(), which leaves a window of microseconds.
    """
    pid, start = identity
    if pid <= 1:
        raise ValueError(f"refusing to signal pid {pid}")
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pidfd = None  # ENOSYS (old kernel) or seccomp: fall back to the start-time check
    try:
        p = read_proc(pid, proc)
        if p is None:
            return "gone"
        if p.start_time != start:
            return "reused"
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "gone"
        return "sent"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def wait_exited(identities: list[tuple[int, int]], deadline: float, proc: str = PROC) -> list[tuple[int, int]]:
    """Poll (not sleep) until every identity has exited or ``deadline`` (time.monotonic) passes.

    Returns the identities still running.  The poll interval grows from 10 ms to 200 ms.
    """
    pending = [i for i in identities if is_running(i, proc)]
    interval = 0.01
    while pending and time.monotonic() < deadline:
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 1.5, 0.2)
        pending = [i for i in pending if is_running(i, proc)]
    return pending


def is_running(identity: tuple[int, int], proc: str = PROC) -> bool:
    """Still there and not exited (a zombie has exited: it only waits for its parent)."""
    p = current(identity, proc)
    return p is not None and p.state not in EXITED_STATES


def current(identity: tuple[int, int], proc: str = PROC) -> Proc | None:
    """The process with this identity if it still exists (zombies included), else None."""
    p = read_proc(identity[0], proc)
    return p if p is not None and p.start_time == identity[1] else None


# --------------------------------------------------------------------------- survivors of the signals


def unkillable(identities: list[tuple[int, int]], proc: str = PROC) -> list[dict]:
    """Those of ``identities`` still running after SIGKILL, described for the failure report."""
    return [describe(i, proc) for i in identities if is_running(i, proc)]


def describe(identity: tuple[int, int], proc: str = PROC) -> dict:
    """{pid, name, state, wchan} of a survivor, for the failure report."""
    p = current(identity, proc)
    return {
        "pid": identity[0],
        "name": p.name if p else "",
        "state": p.state if p else "gone",
        "wchan": read_wchan(identity[0], proc) if p else "",
    }


def unreaped(pids: list[int], proc: str = PROC) -> list[dict]:
    """Those of ``pids`` that are now zombies, once each in order: [{pid, ppid, name}]."""
    found = []
    reported = set()
    for pid in pids:
        p = read_proc(pid, proc)
        if p is not None and p.state in EXITED_STATES and p.pid not in reported:
            reported.add(p.pid)
            found.append({"pid": p.pid, "ppid": p.ppid, "name": p.name})
    return found


# --------------------------------------------------------------------------- what the sweep must keep


def referenced_paths(procs: dict[int, Proc], proc: str = PROC) -> set[str]:
    """Every path any live process holds (fd, map or cwd)."""
    held: set[str] = set()
    for p in procs.values():
        if p.state not in EXITED_STATES:
            held |= open_paths(p.pid, proc)
    return held
