"""A GPU holder that comes back after cleanup killed it: who it is and what starts it (standard library only).

Killing a holder that a loop, a supervisor or a service restarts only frees the GPU for a moment: the next training
start then meets the holder again (or shares the GPU with it), and every later cleanup kills it again. So after a
cleanup that signalled anything, the devices are watched for a short window; a holder that was not there when the
cleanup began, or one of the killed processes' own kind back again, is reported with its parent chain and the
systemd unit its cgroup names, and the cleanup fails instead of calling the GPUs free.
"""

from __future__ import annotations

import re
import time

from . import procs

# /proc/PID/cgroup names the unit (or scope) a process belongs to: ".../cron.service", ".../session-3.scope".
_UNIT = re.compile(r"/([^/\s]+\.(?:service|scope))(?:/|$)")


def unit_of(pid: int, proc: str = procs.PROC) -> str:
    """The systemd unit or scope in a process's cgroup path ('' when none).

    >>> _UNIT.search("0::/system.slice/gpu-hog.service").group(1)
    'gpu-hog.service'
    """
    found = _UNIT.findall(procs.read_cgroup(pid, proc))
    return found[-1] if found else ""


def parent_chain(pid: int, proc: str = procs.PROC) -> list[dict]:
    """The processes above `pid`, nearest first, up to PID 1: [{pid, name, cmdline, unit}]."""
    chain = []
    for parent in procs.ancestors(pid, {}):
        p = procs.read_proc(parent, proc)
        chain.append(
            {
                "pid": parent,
                "name": p.name if p else "?",
                "cmdline": " ".join(procs.read_cmdline(parent, proc))[:160],
                "unit": unit_of(parent, proc),
            }
        )
    return chain


def watch(
    devices: list[str],
    killed: set[tuple[int, int]],
    window: float,
    spare_unit: str | None = None,
    protect: list[str] | None = None,
    self_pid: int | None = None,
    proc: str = procs.PROC,
    poll: float = 0.2,
) -> list[dict]:
    """Holders that appear within `window` seconds that were not among the processes just killed.

    Returns [{pid, name, cmdline, paths, unit, parents}] (empty: nothing came back). A protected holder is left out
    (it is never a target); so is a process in `spare_unit`'s cgroup (the run a foreign-holder cleanup keeps).
    """
    deadline = time.monotonic() + window
    found: dict[int, dict] = {}
    while True:
        for h in procs.holders(devices, exclude_unit=spare_unit, protect=protect, self_pid=self_pid, proc=proc):
            p = procs.read_proc(h["pid"], proc)
            if p is None or p.identity in killed or h["pid"] in found:
                continue
            found[h["pid"]] = {**h, "unit": unit_of(h["pid"], proc), "parents": parent_chain(h["pid"], proc)}
        if found or time.monotonic() >= deadline:
            return sorted(found.values(), key=lambda h: h["pid"])
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def respawner(holder: dict) -> str:
    """What starts a holder again, in words: the nearest parent that is not PID 1, or the unit.

    >>> respawner({"unit": "gpu-hog.service", "parents": [{"pid": 1, "name": "systemd", "cmdline": "", "unit": ""}]})
    'the systemd unit gpu-hog.service (stop or disable it)'
    >>> respawner({"unit": "", "parents": [{"pid": 80, "name": "bash", "cmdline": "bash -c while true; do ...",
    ...            "unit": "session-2.scope"}, {"pid": 1, "name": "systemd", "cmdline": "", "unit": ""}]})
    'its parent pid 80 bash (bash -c while true; do ...; in session-2.scope)'
    """
    parents = [p for p in holder.get("parents") or [] if p["pid"] != 1]
    if parents:
        p = parents[0]
        where = f"; in {p['unit']}" if p.get("unit") else ""
        return f"its parent pid {p['pid']} {p['name']} ({p['cmdline'] or '?'}{where})"
    if holder.get("unit") and holder["unit"].endswith(".service"):
        return f"the systemd unit {holder['unit']} (stop or disable it)"
    return "something outside this container's view (its parent is PID 1)"


def describe(holders: list[dict], window: float) -> str:
    """The failure message for holders that came back."""
    listed = "; ".join(
        f"pid {h['pid']} {h['name']} ({h['cmdline'][:120]}) holds {','.join(h['paths'])}, started by {respawner(h)}"
        for h in holders
    )
    return (
        f"a GPU holder came back within {window:g} s of the cleanup: {listed}. Killing it again would not help: "
        "stop what starts it (or, if it is meant to stay, add its name to gpu_cleanup_protect); the GPUs were not "
        "called free"
    )
