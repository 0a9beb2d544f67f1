#!/usr/bin/python
"""Ansible module gpu_cleanup: stop a GPU job and verify that its GPUs are free."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_cleanup
short_description: Stop a GPU training job, kill its leftovers and verify that the GPUs are released
description:
  - Stops the job's systemd I(unit) gracefully (when systemd runs and the unit exists), bounded by I(stop_timeout).
  - Finds the job's processes by the unit's cgroup, by an inherited environment I(marker), by the I(devices)
    they hold open or mapped (read from C(/proc/PID/fd) and C(/proc/PID/maps)), by explicit I(match_cmdline)
    regexes, and as descendants of those.
  - Sends SIGTERM, polls until they exit or I(term_timeout) passes, then SIGCONT and SIGKILL; re-scans for
    respawned and late-forked processes until none is left or the total I(timeout) is spent.
  - Removes stale job files matching I(sweep) that no live process references.
  - Verifies that no process holds a matching device and, when NVML or nvidia-smi is available, that every
    GPU's used memory is within I(gpu_memory_tolerance_mib). An unverifiable check is reported as
    C(unverified), never as success.
  - Never signals PID <= 1, itself, its ancestors, its process group, or a process named like a I(protect)
    pattern. A process is identified by (pid, start time), so a reused PID is never signalled.
  - GPU process lists from NVML are never used to choose processes (inside a container they hold host PIDs).
version_added: "1.0.0"
author: eagle3-pve
options:
  unit:
    description:
      - systemd unit of the job; stopped first, and members of its cgroup are targets.
      - An installed unit whose file eagle3-pve did not write (no C(# eagle3-pve:) line) fails the task before
        anything is stopped.
    type: str
  stop_timeout:
    description: Seconds to wait for C(systemctl stop) (the trainer saves a checkpoint on SIGTERM).
    type: float
    default: 120
  stop_report:
    description:
      - A JSON file the job's own launcher writes when stopping it had to SIGKILL workers that ignored SIGTERM
        (C({message, time, killed, steps_lost}); eagle3.launch writes C(last-stop.json) beside the trainer's status).
      - When it was written during this cleanup, it is returned as C(unit.escalation) and named in RV(msg).
    type: str
  marker:
    description: Environment marker C(NAME=VALUE) that every process of the job inherits.
    type: str
  devices:
    description: Globs of device paths; processes holding a match as an fd or memory map are targets.
    type: list
    elements: str
    default: ["/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
  match_cmdline:
    description: Extra, explicit opt-in regexes searched in the command line. Never a default.
    type: list
    elements: str
    default: []
  protect:
    description: Process name globs that are never signalled (compared with comm and argv[0]).
    type: list
    elements: str
    default: ["nvidia-persistenced", "nv-hostengine", "dcgm*", "sshd", "systemd*"]
  term_timeout:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 30
  kill_timeout:
    description: Seconds to wait for processes to disappear after SIGKILL, per round.
    type: float
    default: 10
  timeout:
    description:
      - Total budget in seconds for the whole run.
      - Default I(stop_timeout) + I(term_timeout) + 4 * I(kill_timeout).
    type: float
  sweep:
    description:
      - Globs of stale job files, removed only when no live process references them.
      - Each glob lies directly in C(/dev/shm), C(/tmp) or C(/var/tmp) and its name starts with at least 3 literal
        characters (C(/dev/shm/nccl-*), never C(/dev/shm/*) or C(/srv/data/*)); any other glob fails the task
        before anything is touched.
      - A matching directory is removed only when it is torchrun's log folder (C(torchelastic_<id>)) without a
        mount point in it; any other directory tree is kept and listed in RV(sweep_kept).
    type: list
    elements: str
    default: ["/dev/shm/nccl-*", "/dev/shm/torch_*", "/tmp/torchelastic_*"]
  gpu_memory_tolerance_mib:
    description: A GPU counts as released when its used memory is at most this many MiB.
    type: int
    default: 1024
  spare_unit:
    description:
      - Keep the unit's run going and clean up only what holds a GPU outside it (a foreign holder next to a healthy
        run). The unit is not stopped and no process of its cgroup is selected. Needs O(unit).
    type: bool
    default: false
  respawn_window:
    description:
      - Seconds to watch the devices after anything was signalled. A holder that appears in that time (a loop, a
        supervisor or a service starting it again) fails the task, named with its parent chain and its systemd
        unit; it is not killed again. 0 turns the watch off.
    type: float
    default: 5
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - Lists the unit's state, the targets and the files it would remove, and touches nothing; C(changed) says
        whether a real run would stop, signal or remove anything. GPU memory is read once and reported as
        C(unverified).
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux only; reads /proc itself (psmisc and psutil are not needed).
"""

EXAMPLES = r"""
- name: Stop the training job and release the GPUs
  gpu_cleanup:
    unit: eagle3-train.service
    marker: EAGLE3_JOB=eagle3-train
    term_timeout: 30
  register: cleanup

- name: Only show what would be stopped
  gpu_cleanup:
    marker: EAGLE3_JOB=eagle3-train
  check_mode: true
"""

RETURN = r"""
msg:
  description: One line saying what happened (or, in check mode, what would), counts first; on failure the reason
    comes first, then this summary.
  returned: always
  type: str
  sample: "unit eagle3-train.service: stopped; 3 target(s): 3 terminated, 0 killed, 0 survived; 2 file(s) swept;
    verification: devices free, GPU memory ok, GPU memory 40754 -> 3 MiB; 31.20 s"
targets:
  description:
    - Processes selected (in check mode, those that would be), with why (C(unit:), C(marker:), C(device:),
      C(cmdline:), C(descendant-of:)) and their start time (clock ticks since boot, the identity used with the pid).
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 4242, "ppid": 1, "name": "pt_data_worker", "cmdline": "python3 -m eagle3 train",
            "reasons": ["marker:EAGLE3_JOB=eagle3-train", "device:/dev/nvidia0"], "start_time": 981234}]
protected:
  description: Processes that matched a selector but are never signalled ({pid, name, reasons, why}).
  returned: always
  type: list
  elements: dict
terminated:
  description: PIDs that exited after SIGTERM ([] in check mode).
  returned: always
  type: list
  elements: int
killed:
  description: PIDs that needed SIGKILL ([] in check mode).
  returned: always
  type: list
  elements: int
unkillable:
  description: Processes still running after SIGKILL ({pid, name, state, wchan}); the task fails when not empty.
  returned: always
  type: list
  elements: dict
zombies:
  description: Targets that exited but wait for their parent to reap them ({pid, ppid, name}); they hold no files.
  returned: always
  type: list
  elements: dict
rounds:
  description: Rounds of signalling and re-scanning for respawned or late-forked processes (0 when nothing was signalled).
  returned: always
  type: int
respawned:
  description:
    - Holders that came back within O(respawn_window) after the cleanup ({pid, name, user, paths, cmdline, unit,
      parents}, parents nearest first as {pid, name, cmdline, unit}); [] when nothing came back.
  returned: always
  type: list
  elements: dict
holders_after:
  description:
    - Unprotected processes still holding a matching device at the end ({pid, name, user, paths, cmdline,
      protected}); [] on success, and in check mode (not looked at).
  returned: always
  type: list
  elements: dict
protected_holders_after:
  description:
    - Protected processes (O(protect)) that still hold a matching device at the end, as in RV(holders_after).
      They were never signalled and do not fail the task, but the device is not free. [] in check mode.
  returned: always
  type: list
  elements: dict
removed:
  description: Swept paths that were removed (would be removed in check mode).
  returned: always
  type: list
  elements: str
sweep_in_use:
  description: Paths matching O(sweep) that were kept because a live process references them.
  returned: always
  type: list
  elements: str
sweep_kept:
  description: Paths matching O(sweep) that were kept because they are not the job's (a directory tree other than
    torchrun's log folder, or one with a mount point in it), each with the reason.
  returned: always
  type: list
  elements: str
sweep_errors:
  description: Swept paths that could not be removed, each with the error.
  returned: always
  type: list
  elements: str
unit:
  description: The unit step.
  returned: always
  type: dict
  contains:
    name:
      description: O(unit), null without one.
      returned: always
      type: str
    state:
      description:
        - The unit's ActiveState before the stop; C(none) without O(unit); C(no-systemd) or C(not-found) when the
          step was skipped.
      returned: always
      type: str
    stopped:
      description: C(systemctl stop) ran and finished (always false in check mode).
      returned: always
      type: bool
    message:
      description: What the step did, or why it did nothing.
      returned: always
      type: str
    escalation:
      description:
        - The job launcher's O(stop_report) when this stop had to SIGKILL workers ({message, time, killed,
          steps_lost}), else null.
      returned: when O(unit) is given, except in check mode
      type: dict
gpu_memory:
  description: GPU memory before and after, and whether the GPUs count as released.
  returned: always
  type: dict
  contains:
    before:
      description: Used memory per GPU before the run ([{index, used_mib}]), null when not measurable.
      returned: always
      type: list
      elements: dict
    after:
      description: Used memory per GPU at the end, as RV(gpu_memory.before); null in check mode.
      returned: always
      type: list
      elements: dict
    tolerance_mib:
      description: O(gpu_memory_tolerance_mib).
      returned: always
      type: int
    source:
      description: C(nvml), C(nvidia-smi), or null without either.
      returned: always
      type: str
    status:
      description: C(ok), C(failed) (the task fails) or C(unverified) (no tool, no answer, or check mode).
      returned: always
      type: str
    message:
      description: Why, in words.
      returned: always
      type: str
elapsed:
  description: Seconds the run took.
  returned: always
  type: float
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils import job_files, nvml, owned, proc_stop, procs, respawn

D_STATE_HINT = (
    "state D means the process waits inside the kernel (often the NVIDIA driver after an Xid error): "
    "no signal from inside the container helps; check dmesg on the Proxmox node, then reset the GPU "
    "(nvidia-smi -r) or reboot the node"
)


STRINGS = {"type": "list", "elements": "str"}
PROTECT = ["nvidia-persistenced", "nv-hostengine", "dcgm*", "sshd", "systemd*"]


def argument_spec() -> dict:
    return {
        "unit": {"type": "str"},
        "stop_timeout": {"type": "float", "default": 120},
        "marker": {"type": "str"},
        # module_utils/procs.py declares it; DOCUMENTATION states it for ansible-doc (tests/test_contracts.py)
        "devices": {**STRINGS, "default": procs.DEVICE_GLOBS},
        "match_cmdline": {**STRINGS, "default": []},
        "protect": {**STRINGS, "default": PROTECT},
        "term_timeout": {"type": "float", "default": 30},
        "kill_timeout": {"type": "float", "default": 10},
        "timeout": {"type": "float"},
        "sweep": {**STRINGS, "default": ["/dev/shm/nccl-*", "/dev/shm/torch_*", "/tmp/torchelastic_*"]},
        "gpu_memory_tolerance_mib": {"type": "int", "default": 1024},
        "stop_report": {"type": "str"},
        "spare_unit": {"type": "bool", "default": False},
        "respawn_window": {"type": "float", "default": 5.0},
    }


def validate(p: dict) -> tuple[procs.Selectors, proc_stop.Budget]:
    """Turn options into selectors and a budget; ValueError (naming the value) before anything is touched."""
    proc_stop.check_timeouts({k: p[k] for k in ("stop_timeout", "term_timeout", "kill_timeout", "timeout")})
    if p["marker"] is not None:
        procs.parse_marker(p["marker"])
    if p["gpu_memory_tolerance_mib"] < 0:
        raise ValueError(f"gpu_memory_tolerance_mib={p['gpu_memory_tolerance_mib']} must be >= 0 (for example 1024)")
    for glob in p["devices"]:
        if not glob.startswith("/"):
            raise ValueError(f"path glob {glob!r} must be absolute (for example /dev/nvidia[0-9]*)")
    for glob in p["sweep"]:
        if problem := job_files.glob_problem(glob):
            raise ValueError(f"sweep glob {glob} {problem}; nothing was touched")
    if p["unit"] is not None and not p["unit"].strip():
        raise ValueError("unit='' is empty; give a unit name such as eagle3-train.service or leave it out")
    if p["spare_unit"] and not p["unit"]:
        raise ValueError("spare_unit=true needs the unit whose run it keeps (unit=eagle3-train.service)")
    if p["respawn_window"] < 0:
        raise ValueError(f"respawn_window={p['respawn_window']} must be >= 0 seconds (for example 5)")
    selectors = procs.Selectors(
        unit=p["unit"],
        marker=p["marker"],
        devices=p["devices"],
        match_cmdline=procs.compile_patterns(p["match_cmdline"]),
        protect=p["protect"],
        spare_unit=p["spare_unit"],
    )
    total = p["timeout"] or p["stop_timeout"] + p["term_timeout"] + 4 * p["kill_timeout"]
    return selectors, proc_stop.Budget(
        term=p["term_timeout"], kill=p["kill_timeout"], stop=p["stop_timeout"], total=total
    )


def run(p: dict, check_mode: bool, self_pid: int | None = None) -> tuple[dict, str | None]:
    """The whole cleanup; returns (result, failure message or None)."""
    started = time.monotonic()
    selectors, budget = validate(p)
    deadline = started + budget.total
    # nvidia-smi can hang: each call gets a tenth of the budget, between 1 and 10 s.
    call_timeout = min(10.0, max(1.0, budget.total / 10))
    before, before_query = nvml.measure(call_timeout)
    unit = unit_step(selectors, budget, p["stop_report"], check_mode, deadline)

    remaining = max(deadline - time.monotonic(), 0.1)
    outcome = proc_stop.terminate(
        selectors,
        proc_stop.Budget(term=budget.term, kill=budget.kill, stop=budget.stop, total=remaining),
        check_mode=check_mode,
        self_pid=self_pid,
    )

    # A holder that comes back (a loop, a supervisor, a service restarting it) is named with what starts it.
    came_back = []
    if outcome["targets"] and not check_mode and p["respawn_window"] > 0:
        killed = {(t["pid"], t["start_time"]) for t in outcome["targets"]}
        window = min(p["respawn_window"], max(deadline - time.monotonic(), 0.0))
        came_back = respawn.watch(
            selectors.devices,
            killed,
            window,
            spare_unit=selectors.unit if selectors.spare_unit else None,
            protect=selectors.protect,
            self_pid=self_pid,
        )

    held = proc_stop.referenced_paths(procs.scan())
    unreferenced, in_use, kept = job_files.candidates(p["sweep"], held)
    removed, sweep_errors = [], []
    for path in unreferenced:
        error = None if check_mode else job_files.remove(path)
        (sweep_errors if error else removed).append(error or path)

    holders_after, protected_holders = holders_step(selectors, check_mode, self_pid)
    if check_mode:
        gpu = {
            "source": before_query["source"],
            "tolerance_mib": p["gpu_memory_tolerance_mib"],
            "after": None,
        }
        gpu.update(status="unverified", message="check mode: nothing was stopped")
    else:
        # The driver frees memory within seconds of the last holder's exit: poll for at most kill_timeout
        # (inside the budget), but always take at least one reading.
        now = time.monotonic()
        window = min(deadline, now + budget.kill) if outcome["targets"] else now
        gpu = nvml.verify_memory(before_query, p["gpu_memory_tolerance_mib"], max(window, now + 1.0), call_timeout)
    gpu["before"] = before

    signalled = bool(outcome["targets"]) and not check_mode
    would = bool(outcome["targets"] or unreferenced or unit.get("state") in procs.ACTIVE_STATES)
    result = {
        "changed": would if check_mode else bool(unit["stopped"] or signalled or removed),
        **outcome,
        "holders_after": holders_after,
        "respawned": came_back,
        "respawn_window": p["respawn_window"],
        "protected_holders_after": protected_holders,
        "removed": removed,
        "sweep_in_use": in_use,
        "sweep_kept": kept,
        "sweep_errors": sweep_errors,
        "unit": unit,
        "gpu_memory": gpu,
        "elapsed": round(time.monotonic() - started, 3),
    }
    result["msg"] = summary(result, check_mode)
    return result, failure(result)


def unit_step(selectors, budget, stop_report: str | None, check_mode: bool, deadline: float) -> dict:
    """Stop the job's unit (or only read its state: spared, check mode); the unit part of the result."""
    if selectors.unit and selectors.spare_unit:
        unit = proc_stop.unit_state(selectors.unit)
        unit.update(
            stopped=False,
            spared=True,
            message=f"{unit.get('message', '')} (kept running: foreign holders only)",
        )
    elif selectors.unit and not check_mode:
        stop_bound = min(budget.stop, max(deadline - time.monotonic() - budget.kill, 1.0))
        stop_began = time.time()
        unit = proc_stop.stop_unit(selectors.unit, stop_bound)
        unit["escalation"] = stop_escalation(stop_report, stop_began)
    elif selectors.unit:
        unit = proc_stop.unit_state(selectors.unit)
    else:
        unit = {"state": "none", "stopped": False, "message": "no unit given"}
    unit["name"] = selectors.unit
    return unit


def holders_step(selectors, check_mode: bool, self_pid: int | None) -> tuple[list[dict], list[dict]]:
    """(unprotected, protected) processes still holding a device at the end; nothing looked at in check mode.

    Protected holders (nvidia-persistenced, ...) are never signalled and do not fail the cleanup, but they still
    hold a device: they are reported apart, so "held afterwards" never reads 0 while one holds /dev/nvidia1.
    """
    if check_mode:
        return [], []
    after = procs.holders(
        selectors.devices,
        exclude_unit=selectors.unit if selectors.spare_unit else None,
        protect=selectors.protect,
        self_pid=self_pid,
        include_protected=True,
    )
    return [h for h in after if not h["protected"]], [h for h in after if h["protected"]]


def stop_escalation(path: str | None, since: float) -> dict | None:
    """The job launcher's account of a stop that had to SIGKILL, when it was written at or after ``since``.

    >>> import json, tempfile, time
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> json.dump({"message": "workers ignored SIGTERM for 60 s: rank 1 (pid 42) got SIGKILL", "time": 100.0}, f)
    >>> f.close()
    >>> stop_escalation(f.name, since=99.0)["message"]
    'workers ignored SIGTERM for 60 s: rank 1 (pid 42) got SIGKILL'
    >>> stop_escalation(f.name, since=101.0) is None  # an earlier stop's report
    True
    >>> stop_escalation("/nonexistent/last-stop.json", since=0) is None
    True
    """
    if not path:
        return None
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or float(report.get("time") or 0) < since:
        return None
    return report


def summary(r: dict, check_mode: bool) -> str:
    """One readable line: what happened, counts first."""
    if check_mode:
        return (
            f"check mode: would signal {len(r['targets'])} process(es) and remove {len(r['removed'])} file(s); "
            f"unit {r['unit']['name'] or '-'}: {r['unit']['state']}"
        )
    g = r["gpu_memory"]
    total = lambda rows: f"{sum(x['used_mib'] or 0 for x in rows):.0f}" if rows is not None else "?"  # noqa: E731
    measured = g["before"] is not None or g["after"] is not None
    mem = f", GPU memory {total(g['before'])} -> {total(g['after'])} MiB" if measured else ""
    escalated = (r["unit"].get("escalation") or {}).get("message")
    return (
        f"unit {r['unit']['name'] or '-'}: {'stopped' if r['unit']['stopped'] else r['unit']['state']}"
        f"{f' (the stop escalated: {escalated})' if escalated else ''}; "
        f"{len(r['targets'])} target(s): {len(r['terminated'])} terminated, {len(r['killed'])} killed, "
        f"{len(r['unkillable'])} survived; {len(r['removed'])} file(s) swept; "
        f"verification: devices {'busy' if r['holders_after'] else 'free'}"
        f"{protected_note(r['protected_holders_after'])}, GPU memory {g['status']}{mem}; "
        f"{r['elapsed']:.2f} s"
    )


def protected_note(held: list[dict]) -> str:
    """' (still held by protected: pid 7 nvidia-persistenced /dev/nvidia1)', or '' when none.

    >>> protected_note([{"pid": 7, "name": "nvidia-persistenced", "paths": ["/dev/nvidia1"]}])
    ' (still held by protected: pid 7 nvidia-persistenced /dev/nvidia1)'
    """
    if not held:
        return ""
    listed = ", ".join(f"pid {h['pid']} {h['name']} {','.join(h['paths'])}" for h in held)
    return f" (still held by protected: {listed})"


def failure(r: dict) -> str | None:
    """The failure message, or None when the GPUs are verified free (or unverifiable but free of holders)."""
    problems = []
    if r.get("respawned"):
        problems.append(respawn.describe(r["respawned"], r["respawn_window"]))
    if r["unkillable"]:
        listed = "; ".join(
            f"pid={u['pid']} name={u['name']} state={u['state']} wchan={u['wchan'] or '-'}" for u in r["unkillable"]
        )
        hint = (
            D_STATE_HINT
            if any(u["state"] in procs.UNINTERRUPTIBLE_STATES for u in r["unkillable"])
            else ("they ignored SIGKILL within the budget; raise timeout/kill_timeout or inspect them")
        )
        problems.append(f"{len(r['unkillable'])} process(es) survived SIGKILL: {listed} ({hint})")
    back = {h["pid"] for h in r.get("respawned") or []}
    if [h for h in r["holders_after"] if h["pid"] not in back]:
        listed = "; ".join(
            f"pid={h['pid']} name={h['name']} paths={','.join(h['paths'])}"
            for h in r["holders_after"]
            if h["pid"] not in back
        )
        problems.append(
            f"GPU devices still held: {listed} (not selected or started during the run; add them with "
            "marker/match_cmdline, or add their names to protect if they are meant to stay)"
        )
    if r["gpu_memory"]["status"] == "failed":
        problems.append(r["gpu_memory"]["message"])
    return " | ".join(problems) or None


def main() -> None:
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    try:
        validate(module.params)  # bad input fails here, before any signal
    except ValueError as e:
        module.fail_json(msg=str(e))
    foreign = module.params["unit"] and owned.unit_problem(module.params["unit"])
    if foreign:
        module.fail_json(msg=f"unit {module.params['unit']} {foreign}; nothing was stopped")
    result, failed = run(module.params, module.check_mode, self_pid=os.getpid())
    if failed:
        module.fail_json(msg=f"{failed}. Summary: {result.pop('msg')}", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
