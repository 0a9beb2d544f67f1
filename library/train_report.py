#!/usr/bin/python
# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where the training run stands, as one state with its reason: read-only, for status.yml and train.yml."""

from __future__ import annotations

DOCUMENTATION = r"""
module: train_report
short_description: Report the EAGLE-3 training run as one state with its reason
description:
  - Reads the trainer's C(status.json), the systemd unit, the unit's restart back-off record and the GPU device
    holders, and classifies the run as one of C(running), C(starting), C(stopped), C(finished), C(failed) or
    C(crash-looping), with the failure reason (the trainer's own error kind, else how systemd saw the exit, else
    what the journal says, such as rendezvous, NCCL or a signal).
  - A run that is up but has not reported for several expected step intervals is reported as stalled.
  - Lists processes outside the unit that hold a GPU device (by pid, user and command), protected ones apart.
  - Changes nothing; the same in check mode.
version_added: "0.2.0"
author: eagle3-pve contributors
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: It only reads, the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux with systemd (C(systemctl show), C(journalctl)); GPU holders are read from /proc.
options:
  unit:
    description: The training unit.
    type: str
    default: eagle3-train.service
  run_dir:
    description: The trainer's run directory (C(status.json)).
    type: path
    required: true
  state_dir:
    description:
      - The node's own folder with C(restart-backoff.json) and C(last-stop.json); default O(run_dir). A node of a
        multi-node run has one apart from the shared O(run_dir).
    type: path
  devices:
    description: GPU device globs whose holders are listed.
    type: list
    elements: str
    default: []
  protect:
    description: Process names (globs) that cleanup never signals; their holders are listed as protected.
    type: list
    elements: str
    default: []
  log_every:
    description: The trainer's C(log_every) (status.json is rewritten once per logged step), for the stall bound.
    type: int
    default: 1
"""

EXAMPLES = r"""
- name: Where the run stands
  train_report:
    run_dir: /var/lib/eagle3/run
    devices: [/dev/nvidia0, /dev/nvidia1, /dev/nvidiactl]
    protect: [nvidia-persistenced]
  register: report
"""

RETURN = r"""
hostname:
  description: The target's host name (the trainer's per-node lines in C(status.json) are keyed by it).
  type: str
  returned: always
run:
  description: The run as one state.
  type: dict
  returned: always
  contains:
    state:
      description: C(running), C(starting), C(stopped), C(finished), C(failed) or C(crash-looping).
      type: str
      returned: always
    reason:
      description: "The last failure, such as C(oom: CUDA out of memory); empty when there is none."
      type: str
      returned: always
    detail:
      description: What to look at, in words (a stall, a restart delay, where the run resumed).
      type: str
      returned: always
    stalled:
      description: A running trainer has not reported for several expected step intervals.
      type: bool
      returned: always
    workers:
      description: The run's worker count as the unit starts it (torchrun's --nproc-per-node times --nnodes); null
        when the unit is not installed.
      type: int
      returned: always
status:
  description: The trainer's last status.json ({} when there is none).
  type: dict
  returned: always
unit:
  description: The unit's ActiveState, SubState, Result, NRestarts and ExecMainStatus.
  type: dict
  returned: always
backoff:
  description: The restart record (failures in a row, last exit with reason and message).
  type: dict
  returned: always
last_stop:
  description:
    - The last stop that had to SIGKILL workers (eagle3.launch's C(last-stop.json)), when it came after the
      trainer's last report; {} otherwise. C(message) says which ranks ignored SIGTERM, for how long, and the steps
      lost since the last checkpoint (at least; status.json holds the last logged step).
  type: dict
  returned: always
tensorboard:
  description: The run's TensorBoard folder (C(dir)) and its number of event files (C(event_files), one per start of
    the trainer); {} when the trainer wrote none.
  type: dict
  returned: always
status_age_s:
  description: Seconds since the trainer last rewrote status.json (the target's clock), null without one.
  type: int
  returned: always
foreign_holders:
  description: Processes outside the unit holding a GPU device ({pid, name, user, paths, cmdline, protected}); [] without O(devices).
  type: list
  elements: dict
  returned: always
protected_holders:
  description: Protected processes holding a GPU device (never signalled by cleanup).
  type: list
  elements: dict
  returned: always
"""

import os
import socket
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.procs import holders
from ansible.module_utils.restart_backoff import DEFAULT_UNIT
from ansible.module_utils.restart_backoff import STATE_FILE as BACKOFF_FILE
from ansible.module_utils.restart_backoff import read_state
from ansible.module_utils.train_status import (
    metrics_stand_in,
    read_status,
    run_state,
    status_path,
    unit_state,
    unit_workers,
)

LAST_STOP_FILE = "last-stop.json"  # written by eagle3.launch when a stop had to SIGKILL workers
TENSORBOARD_DIR = "tensorboard"  # eagle3.observe's folder of event files in the run directory


def started_at(unit: dict) -> float:
    mono_us = int(unit.get("ExecMainStartTimestampMonotonic") or 0)
    if not mono_us:
        return 0.0
    return time.time() - (time.monotonic() - mono_us / 1e6)


def tensorboard_events(run_dir: str) -> dict:
    """The run's TensorBoard folder and how many event files it holds ({} when the trainer wrote none)."""
    folder = os.path.join(run_dir, TENSORBOARD_DIR)
    try:
        files = [n for n in os.listdir(folder) if n.startswith("events.out.tfevents.")]
    except OSError:
        return {}
    return {"dir": folder, "event_files": len(files)} if files else {}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str", default=DEFAULT_UNIT),
            run_dir=dict(type="path", required=True),
            state_dir=dict(type="path"),
            devices=dict(type="list", elements="str", default=[]),
            protect=dict(type="list", elements="str", default=[]),
            log_every=dict(type="int", default=1),
        ),
        supports_check_mode=True,
    )
    p = module.params
    unit = unit_state(p["unit"])
    status = read_status(status_path(p["run_dir"]))
    # status.json gone (deleted, its folder replaced) while the unit runs: metrics.jsonl is the evidence of its steps.
    stand_in = metrics_stand_in(p["run_dir"], started_at(unit)) if status is None else None
    status = status or stand_in
    state_dir = p["state_dir"] or p["run_dir"]
    backoff = read_state(os.path.join(state_dir, BACKOFF_FILE))
    run = run_state(
        {**status, "log_every": status.get("log_every", p["log_every"])} if status else None,
        unit,
        backoff,
        started_at(unit),
        time.time(),
        status_file=status_path(p["run_dir"]),
    )
    if stand_in:
        note = (
            f"{status_path(p['run_dir'])} is missing (the trainer rewrites it at its next logged step; was it deleted?): "
            f"step and rates from metrics.jsonl, written {max(time.time() - stand_in['updated'], 0):.0f} s ago"
        )
        run["detail"] = f"{run['detail']}; {note}" if run["detail"] else note
    run["workers"] = unit_workers(unit)  # what the unit starts, not what the last status happened to say
    last_stop = read_status(os.path.join(state_dir, LAST_STOP_FILE))
    if last_stop and status and float(last_stop.get("time") or 0) < float(status.get("updated") or 0):
        last_stop = None  # a stop before the current run's last report: not news any more
    held = (
        holders(p["devices"], exclude_unit=p["unit"], protect=p["protect"], include_protected=True)
        if p["devices"]
        else []
    )
    module.exit_json(
        changed=False,
        hostname=socket.gethostname(),
        tensorboard=tensorboard_events(p["run_dir"]),
        run=run,
        status=status or {},
        unit={k: unit.get(k) for k in ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus")},
        backoff=backoff,
        last_stop=last_stop or {},
        status_age_s=round(time.time() - float(status.get("updated") or 0)) if status else None,
        foreign_holders=[h for h in held if not h["protected"]],
        protected_holders=[h for h in held if h["protected"]],
    )


if __name__ == "__main__":
    main()
