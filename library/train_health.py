#!/usr/bin/python
# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Wait until the trainer is provably healthy, or fail saying exactly why not."""

from __future__ import annotations

DOCUMENTATION = r"""
module: train_health
short_description: Wait until EAGLE-3 training is provably healthy, or fail with the reason
description:
  - Polls the trainer's C(status.json) and the systemd unit until the current run has completed
    C(min_steps) steps (healthy), or a failure is seen.
  - Fails fast and specifically, in this order, on an out-of-memory (with the length that failed), a rejected
    configuration (the trainer's message), a crash (the last C(log_lines) journal lines), or the timeout
    (with what it saw last).
  - A C(status.json) older than the unit's current start is ignored, so a previous run's success or failure
    is never reported as this run's.
  - A run that was already going when the wait began must be seen to complete a step during the wait,
    because steps done long ago do not prove that a stuck run is healthy.
version_added: "0.1.0"
author: eagle3-pve contributors
options:
  unit:
    description: The training unit.
    type: str
    default: eagle3-train.service
  run_dir:
    description: The trainer's run directory (holds C(status.json)).
    type: path
    required: true
  state_dir:
    description:
      - The node's own folder with C(restart-backoff.json); default O(run_dir). A node of a multi-node run has one
        apart from the shared O(run_dir).
    type: path
  min_steps:
    description: Steps the current run must complete to count as healthy.
    type: int
    default: 3
  timeout:
    description: Seconds to wait in all.
    type: int
    default: 600
  poll_interval:
    description: Seconds between polls.
    type: float
    default: 1.0
  poll_for:
    description:
      - Return after polling this many seconds with C(verdict=waiting) and a C(progress) line, so that the task can
        be retried with C(until) and the person watching sees one line per poll. The wait as a whole still ends
        after C(timeout) seconds counted from C(wait_started).
      - Unset, the module waits in one call until a verdict or the timeout.
    type: float
  wait_started:
    description:
      - When the wait as a whole began (seconds since the epoch, the target's clock), from the first call's
        C(wait_started). Default, now.
    type: float
  baseline_step:
    description:
      - The step the trainer had reported when the wait began (the first call's C(baseline_step)). A run that was
        going before the wait is healthy only once it passes this step.
    type: int
  log_lines:
    description: Journal lines returned (and shown) on a crash or timeout.
    type: int
    default: 30
  max_seq_len:
    description: The max_seq_len this run was started with, for the messages.
    type: int
  lock_path:
    description:
      - The run lock (M(target_lock)) this run holds; with O(lock_owner), its lease is renewed at each poll (about
        every 5 s), so that a long wait never lets it go stale. Fails with C(verdict=lock_lost) when the lock is no
        longer this run's. Nothing is renewed in check mode.
    type: path
  lock_owner:
    description: This run's token for O(lock_path) (the C(run_lock) role's C(run_lock_lease.owner)).
    type: str
  lock_ttl:
    description: The lease renewed at each poll, in seconds; default, the lease's own ttl.
    type: int
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: It only reads, and waits as in a real run; the run lock's lease is not renewed in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux with systemd (C(systemctl show), C(journalctl)).
"""

EXAMPLES = r"""
- name: Wait for 3 healthy steps
  train_health:
    run_dir: /var/lib/eagle3/run
    min_steps: 3
    timeout: 900

# One progress line per 5 s poll: a first call fixes the start, then the task is retried until a verdict.
- name: First look
  train_health:
    run_dir: /var/lib/eagle3/run
    poll_for: 0
    timeout: 900
  register: first
- name: Wait, one line per poll
  train_health:
    run_dir: /var/lib/eagle3/run
    timeout: 900
    poll_for: 5
    wait_started: "{{ first.wait_started }}"
    baseline_step: "{{ first.baseline_step }}"
  register: health
  until: health.verdict != 'waiting'
  retries: 200
  delay: 0
  when: first.verdict == 'waiting'
"""

RETURN = r"""
verdict:
  description:
    - C(healthy), C(done), C(oom), C(config), C(hang), C(disk_full), C(read_only), C(no_permission), C(crash) (a
      crash loop included), C(stopped) or C(timeout); C(waiting) when O(poll_for) ran out first.
    - C(lock_lost) when O(lock_path) could not be renewed because the lock is no longer this run's.
    - Every verdict but C(healthy), C(done) and C(waiting) fails the task.
  type: str
  returned: always
msg:
  description: The verdict in words (for a failure, with what to do).
  type: str
  returned: always
status:
  description: The trainer's last status.json (step, tokens/s, peak memory, ...); {} when there is none.
  type: dict
  returned: always
unit:
  description: The unit's ActiveState, SubState, Result, ExecMainStatus, NRestarts ({} with C(lock_lost)).
  type: dict
  returned: always
log:
  description: The last O(log_lines) journal lines of the unit's current invocation.
  type: list
  elements: str
  returned: when the task fails, except with C(lock_lost)
elapsed:
  description: Seconds waited since RV(wait_started) (0 with C(lock_lost)).
  type: float
  returned: always
progress:
  description: One line for the person watching, e.g. C(step 12 (3/3 steps this run), 5,207 tok/s, phase training).
  type: str
  returned: always
wait_started:
  description: When the wait began (seconds since the epoch, the target's clock); pass it to the next call.
  type: float
  returned: always
baseline_step:
  description: The step reported when the wait began, null before the trainer reported one; pass it to the next call.
  type: int
  returned: always
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.restart_backoff import DEFAULT_UNIT
from ansible.module_utils.restart_backoff import STATE_FILE as BACKOFF_FILE
from ansible.module_utils.restart_backoff import read_state as read_backoff
from ansible.module_utils.run_lock import LockError, renew
from ansible.module_utils.train_status import (
    completed_steps,
    is_fresh,
    last_log_lines,
    read_status,
    run_state,
    status_path,
    unit_state,
    verdict,
)


def unit_started_at(unit: dict) -> float:
    """Wall-clock start of the unit's current main process, from systemd's monotonic timestamp."""
    mono_us = int(unit.get("ExecMainStartTimestampMonotonic") or 0)
    if not mono_us:
        return time.time()
    return time.time() - (time.monotonic() - mono_us / 1e6)


def progress_line(message: str, status: dict | None, min_steps: int, fresh: bool = True) -> str:
    """What the person watching wants to see at each poll.

    >>> progress_line("phase training, step 4", {"phase": "training", "step": 4, "resumed_from_step": 2,
    ...               "tokens_per_s": 5207.3}, 3)
    'step 4 (2/3 steps this run), 5,207 tok/s, phase training'
    >>> progress_line("no status from this run yet", None, 3)
    'no status from this run yet'
    >>> progress_line("no status from this run yet", {"step": 15, "phase": "stopped"}, 3, fresh=False)
    'no status from this run yet (the previous run reported step 15, phase stopped)'
    """
    if not status or status.get("step") is None:
        return message
    if not fresh:
        return f"{message} (the previous run reported step {status['step']}, phase {status.get('phase', '?')})"
    done = completed_steps(status)
    parts = [f"step {status['step']} ({max(done, 0)}/{min_steps} steps this run)"]
    if status.get("tokens_per_s"):
        parts.append(f"{float(status['tokens_per_s']):,.0f} tok/s")
    parts.append(f"phase {status.get('phase', '?')}")
    return ", ".join(parts)


ARGUMENT_SPEC = dict(
    unit=dict(type="str", default=DEFAULT_UNIT),
    run_dir=dict(type="path", required=True),
    state_dir=dict(type="path"),
    min_steps=dict(type="int", default=3),
    timeout=dict(type="int", default=600),
    poll_interval=dict(type="float", default=1.0),
    poll_for=dict(type="float"),
    wait_started=dict(type="float"),
    baseline_step=dict(type="int"),
    log_lines=dict(type="int", default=30),
    max_seq_len=dict(type="int"),
    lock_path=dict(type="path"),
    lock_owner=dict(type="str"),
    lock_ttl=dict(type="int"),
)


def check_params(module: AnsibleModule, p: dict) -> None:
    for key in ("min_steps", "timeout", "poll_interval"):
        if p[key] <= 0:
            module.fail_json(msg=f"{key} must be positive, got {p[key]}")
    if p["poll_for"] is not None and p["poll_for"] < 0:
        module.fail_json(msg=f"poll_for must be 0 or more, got {p['poll_for']}")


def renew_or_fail(module: AnsibleModule, p: dict, wall_start: float, first_step) -> None:
    """Renew the run lock's lease; a lost lock fails the task (verdict lock_lost)."""
    try:
        renew(p["lock_path"], p["lock_owner"], p["lock_ttl"])
    except LockError as exc:
        module.fail_json(
            msg=str(exc),
            verdict="lock_lost",
            status={},
            unit={},
            elapsed=0.0,
            progress=str(exc),
            wait_started=wall_start,
            baseline_step=first_step,
        )


def observe(p: dict, wall_start: float, first_step) -> dict:
    """One look at the unit and status.json: {kind, message, status, unit, started_at, first_step}."""
    unit = unit_state(p["unit"])
    status = read_status(status_path(p["run_dir"]))
    # 1 s of slack: the trainer may write its first status within the second systemd stamps the start.
    started_at = unit_started_at(unit)
    kind, message = verdict(
        status,
        unit,
        min_steps=p["min_steps"],
        started_at=started_at - 1.0,
        max_seq_len=p["max_seq_len"],
    )
    # Restarting after a failure: the run's state (train_status.run_state, which status.yml shows too) is
    # crash-looping, said now with the last exit's reason, not after the whole timeout.
    if kind == "waiting" and unit.get("ActiveState") == "activating":
        record = read_backoff(os.path.join(p["state_dir"] or p["run_dir"], BACKOFF_FILE))
        run = run_state(status, unit, record, started_at, time.time())
        if run["state"] == "crash-looping":
            kind = "crash"
            message = (
                f"crash loop: {record['failures']} failed run(s) in a row, systemd restarts it with a growing "
                f"delay; last exit: {run['reason'] or '?'}"
            )
    # A run that was already going before this wait (train.yml found nothing to change) is healthy only once
    # it is seen to advance now: steps completed an hour ago say nothing about a run stuck since.
    step = (status or {}).get("step")
    if first_step is None and step is not None:
        first_step = step
    if kind == "healthy" and started_at < wall_start - 5 and step == first_step:
        kind, message = "waiting", f"running since before this check; waiting to see it pass step {step}"
    return {
        "kind": kind,
        "message": message,
        "status": status,
        "unit": unit,
        "started_at": started_at,
        "first_step": first_step,
    }


def wait(module: AnsibleModule, p: dict, wall_start: float) -> dict:
    """Poll until a verdict other than waiting, the timeout, or this call's poll_for; the last observation."""
    deadline = wall_start + p["timeout"]
    call_deadline = time.time() + p["poll_for"] if p["poll_for"] is not None else deadline
    renew_lock = bool(p["lock_path"]) and not module.check_mode
    renewed_at = None
    seen = {"first_step": p["baseline_step"]}
    while True:
        # The run lock's lease, renewed while this run waits here (at most every 5 s; each call renews once).
        if renew_lock and (renewed_at is None or time.monotonic() - renewed_at >= 5):
            renew_or_fail(module, p, wall_start, seen["first_step"])
            renewed_at = time.monotonic()
        seen = observe(p, wall_start, seen["first_step"])
        now = time.time()
        if seen["kind"] != "waiting" or now >= deadline or now >= call_deadline:
            return seen
        time.sleep(min(p["poll_interval"], max(call_deadline - now, 0.05)))


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC, required_together=[("lock_path", "lock_owner")], supports_check_mode=True
    )
    p = module.params
    check_params(module, p)
    wall_start = p["wait_started"] if p["wait_started"] is not None else time.time()
    deadline = wall_start + p["timeout"]
    seen = wait(module, p, wall_start)
    kind, message, status, unit = seen["kind"], seen["message"], seen["status"], seen["unit"]
    result = {
        "changed": False,
        "verdict": kind,
        "status": status or {},
        "unit": {k: unit.get(k) for k in ("ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts")},
        "elapsed": round(time.time() - wall_start, 1),
        "progress": message,
        "wait_started": wall_start,
        "baseline_step": seen["first_step"],
    }
    if kind == "waiting" and time.time() < deadline:
        result["progress"] = progress_line(
            message, status, p["min_steps"], is_fresh(status or {}, seen["started_at"] - 1.0)
        )
        module.exit_json(msg=message, **result)
    if kind in ("healthy", "done"):
        module.exit_json(msg=message, **result)
    result["log"] = last_log_lines(p["unit"], p["log_lines"], unit.get("InvocationID", ""))
    if kind == "waiting":
        result["verdict"] = "timeout"
        message = f"not healthy after {p['timeout']}s: {message}"
    elif kind == "oom":
        message += ". Choose a smaller max_seq_len (or max_seq_len=auto), or enable activation_checkpointing/fsdp."
    module.fail_json(msg=message, **result)


if __name__ == "__main__":
    main()
