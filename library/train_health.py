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
  log_lines:
    description: Journal lines returned (and shown) on a crash or timeout.
    type: int
    default: 30
  max_seq_len:
    description: The max_seq_len this run was started with, for the messages.
    type: int
"""

EXAMPLES = r"""
- name: Wait for 3 healthy steps
  train_health:
    run_dir: /var/lib/eagle3/run
    min_steps: 3
    timeout: 900
"""

RETURN = r"""
verdict:
  description: healthy, done, oom, config, crash, stopped or timeout.
  type: str
  returned: always
status:
  description: The trainer's last status.json (step, tokens/s, peak memory, ...).
  type: dict
  returned: always
unit:
  description: The unit's ActiveState, SubState, Result, ExecMainStatus, NRestarts.
  type: dict
  returned: always
log:
  description: The unit's last journal lines (on failure).
  type: list
  elements: str
  returned: on failure
elapsed:
  description: Seconds waited.
  type: float
  returned: always
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.train_status import last_log_lines, read_status, status_path, unit_state, verdict


def unit_started_at(unit: dict) -> float:
    """Wall-clock start of the unit's current main process, from systemd's monotonic timestamp."""
    mono_us = int(unit.get("ExecMainStartTimestampMonotonic") or 0)
    if not mono_us:
        return time.time()
    return time.time() - (time.monotonic() - mono_us / 1e6)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", default="eagle3-train.service"),
            run_dir=dict(type="path", required=True),
            min_steps=dict(type="int", default=3),
            timeout=dict(type="int", default=600),
            poll_interval=dict(type="float", default=1.0),
            log_lines=dict(type="int", default=30),
            max_seq_len=dict(type="int"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    for key in ("min_steps", "timeout", "poll_interval"):
        if p[key] <= 0:
            module.fail_json(msg=f"{key} must be positive, got {p[key]}")
    start = time.monotonic()
    deadline = start + p["timeout"]
    path = status_path(p["run_dir"])
    kind, message, status, unit = "waiting", "", None, {}
    wall_start, first_step = time.time(), None
    while True:
        unit = unit_state(p["unit"])
        status = read_status(path)
        # 1 s of slack: the trainer may write its first status within the second systemd stamps the start.
        started_at = unit_started_at(unit)
        kind, message = verdict(
            status,
            unit,
            min_steps=p["min_steps"],
            started_at=started_at - 1.0,
            max_seq_len=p["max_seq_len"],
        )
        # A run that was already going before this wait (train.yml found nothing to change) is healthy only once
        # it is seen to advance now: steps completed an hour ago say nothing about a run stuck since.
        step = (status or {}).get("step")
        if first_step is None and step is not None:
            first_step = step
        if kind == "healthy" and started_at < wall_start - 5 and step == first_step:
            kind, message = "waiting", f"running since before this check; waiting to see it pass step {step}"
        if kind != "waiting" or time.monotonic() >= deadline:
            break
        time.sleep(p["poll_interval"])

    result = {
        "changed": False,
        "verdict": kind if kind != "waiting" else "timeout",
        "status": status or {},
        "unit": {
            k: unit.get(k) for k in ("ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts")
        },
        "elapsed": round(time.monotonic() - start, 1),
    }
    if kind in ("healthy", "done"):
        module.exit_json(msg=message, **result)
    result["log"] = last_log_lines(p["unit"], p["log_lines"], unit.get("InvocationID", ""))
    if kind == "waiting":
        message = f"not healthy after {p['timeout']}s: {message}"
    elif kind == "oom":
        message += (
            ". Choose a smaller max_seq_len (or max_seq_len=auto), or enable activation_checkpointing/fsdp."
        )
    module.fail_json(msg=message, **result)


if __name__ == "__main__":
    main()
