#!/usr/bin/python
"""Ansible module datagen_job: where the eagle3-datagen job (eagle3 generate under systemd) stands."""

from __future__ import annotations

DOCUMENTATION = r"""
module: datagen_job
short_description: Report the state of the data generation job (eagle3 generate as a systemd unit)
description:
  - Reads the unit (C(systemctl show)), its journal (C(journalctl -u)) and the dataset folder, and says where the job
    stands in one line. Only reads; the same in check mode.
  - The dataset is C(finished) when its C(index.json) exists (eagle3 generate writes it last).
  - Without O(out), the dataset folder is the first argument after C(generate) in the unit's C(ExecStart).
  - 'A job stopped by its output folder (exit status 5, C(EXIT_STORAGE) of the trainer''s C(eagle3.errors), when
    the folder is full, read-only or not writable) is C(failed), and RV(fault) names the folder, the errno and the
    error kind, read from the job''s last line, for example "eagle3 generate: the output folder /d is full (ENOSPC,
    disk_full): free space there, ...". systemd does not restart it; the complete shards are kept and the next
    datagen.yml resumes after them.'
version_added: "1.0.0"
author: eagle3-pve
options:
  unit:
    description: The job's systemd unit.
    type: str
    default: eagle3-datagen.service
  out:
    description: The dataset folder the job writes; empty to read it from the unit.
    type: path
    default: ""
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: It only reads.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux with systemd.
"""

EXAMPLES = r"""
- name: Wait until the dataset is complete (one progress line per poll)
  datagen_job:
    out: /var/lib/eagle3/data
  register: job
  until: job.finished or job.active == 'failed'
  retries: 720
  delay: 5

- name: Say where it stands
  ansible.builtin.debug:
    msg: "{{ job.summary }}"
  when: job.exists
"""

RETURN = r"""
exists:
  description: The unit is known to systemd (datagen.yml has written it).
  returned: always
  type: bool
out:
  description: The dataset folder (O(out), or read from the unit), empty when neither names one.
  returned: always
  type: str
finished:
  description: The dataset is complete (its index.json exists).
  returned: always
  type: bool
samples:
  description: Samples in the finished dataset (its index.json), null before.
  returned: always
  type: int
active:
  description: The unit's ActiveState (active, activating, inactive, failed, ...).
  returned: always
  type: str
status:
  description: The exit status of the job's last run.
  returned: always
  type: int
result:
  description: How the job's last run ended, as systemd says it (Result - success, exit-code, signal, ...).
  returned: always
  type: str
restarts:
  description: Times systemd restarted the job (NRestarts).
  returned: always
  type: int
line:
  description: The job's newest progress line (samples, tokens/s, ETA), empty before the first.
  returned: always
  type: str
tail:
  description: The job's last log lines.
  returned: always
  type: list
  elements: str
progress:
  description: One line for a poll of a waiting task.
  returned: always
  type: str
summary:
  description: One line for a person - the state, the progress or the result, the restarts.
  returned: always
  type: str
  sample: "eagle3-datagen.service: active, generate: 128/400 samples, 14026 tokens/s, ETA 42 s; 1 restart(s)"
fault:
  description:
    - The output folder that stopped the job (exit status 5, never restarted), null otherwise.
    - C(kind) is C(disk_full) (ENOSPC, EDQUOT), C(read_only) (EROFS) or C(no_permission) (EACCES, EPERM), as in the
      trainer's status.json; C(kind) and C(errno) are null when the job's last line is no longer in the journal.
  returned: always
  type: dict
  sample: {"kind": "disk_full", "errno": "ENOSPC", "path": "/var/lib/eagle3/data"}
"""

import json
import re
import subprocess
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.train_status import EXIT_STORAGE, STORAGE_ERROR_KINDS

PROPERTIES = ("LoadState", "ActiveState", "Result", "ExecMainStatus", "NRestarts", "ExecStart")
PROGRESS_PREFIXES = ("generate:", "tiny-target:")
# The line eagle3 generate ends with when its output folder refuses a write (training/eagle3/storage.py,
# storage_line; the format is a contract in docs/contracts.md). Paths hold no spaces (the inputs' grammar).
FAULT_LINE = re.compile(
    r"^eagle3 generate: the output folder (?P<path>\S+) [^(]*\((?P<errno>E[A-Z]+), (?P<kind>[a-z_]+)\)"
)


def out_from_execstart(execstart: str) -> str:
    """The folder eagle3 generate writes, from systemd's rendering of ExecStart ("" when it names none).

    >>> out_from_execstart("{ path=/v/bin/python ; argv[]=/v/bin/python -m eagle3 generate /data/out --target /m ; "
    ...                    "ignore_errors=no ; start_time=[n/a] }")
    '/data/out'
    >>> out_from_execstart("{ path=/bin/true ; argv[]=/bin/true ; ignore_errors=no }")
    ''
    >>> out_from_execstart("")
    ''
    """
    argv = re.search(r"argv\[\]=([^;]*)", execstart)
    words = argv.group(1).split() if argv else []
    return words[words.index("generate") + 1] if "generate" in words[:-1] else ""


def storage_fault(status: int, out: str, log: list[str]) -> dict | None:
    """The output folder that stopped the job ({kind, errno, path}), when it exited with EXIT_STORAGE; else None.
    The newest such line of the journal is this run's (an older run's line never counts: the status decides).

    >>> storage_fault(5, "/d", ["generate: 4/8 samples", "eagle3 generate: the output folder /d is full (ENOSPC, "
    ...               "disk_full): free space there, then run datagen.yml (or this command) again; the 2 complete "
    ...               "shards are kept"])
    {'kind': 'disk_full', 'errno': 'ENOSPC', 'path': '/d'}
    >>> storage_fault(5, "/d", []), storage_fault(1, "/d", ["eagle3 generate: the output folder /d is read-only "
    ...                                                      "(EROFS, read_only): ..."])
    ({'kind': None, 'errno': None, 'path': '/d'}, None)
    """
    if status != EXIT_STORAGE:
        return None
    for line in reversed(log):
        match = FAULT_LINE.match(line)
        if match and match.group("kind") in STORAGE_ERROR_KINDS:
            return {"kind": match.group("kind"), "errno": match.group("errno"), "path": match.group("path")}
    return {"kind": None, "errno": None, "path": out}


def describe(unit: str, props: dict, out: str, log: list[str], samples: int | None) -> dict:
    """The module's result from what was read: the unit's properties, the dataset folder, the journal, index.json.

    >>> r = describe("d.service", {"LoadState": "loaded", "ActiveState": "active", "NRestarts": "1"}, "/o",
    ...              ["generate: resuming: 2 of 4 shards", "generate: 6/8 samples, 900 tokens/s, ETA 2 s"], None)
    >>> r["summary"]
    'd.service: active, generate: 6/8 samples, 900 tokens/s, ETA 2 s; 1 restart(s)'
    >>> r["progress"]
    'generate: 6/8 samples, 900 tokens/s, ETA 2 s'
    >>> describe("d.service", {"LoadState": "loaded", "ActiveState": "inactive"}, "/o", [], 8)["summary"]
    'd.service: finished, dataset complete in /o (8 samples)'
    >>> r = describe("d.service", {"LoadState": "loaded", "ActiveState": "failed", "Result": "exit-code",
    ...              "ExecMainStatus": "2"}, "/o", ["eagle3.generate: error: --data /x does not exist"], None)
    >>> r["summary"]
    'd.service: failed (exit-code, exit status 2): eagle3.generate: error: --data /x does not exist'
    >>> describe("d.service", {"LoadState": "not-found", "ActiveState": "inactive"}, "", [], None)["summary"]
    'd.service: not set up (no datagen.yml has run here)'
    >>> r = describe("d.service", {"LoadState": "loaded", "ActiveState": "failed", "Result": "exit-code",
    ...              "ExecMainStatus": "5"}, "/o", ["eagle3 generate: the output folder /o is read-only (EROFS, "
    ...              "read_only): remount it read-write, ..."], None)
    >>> r["summary"]
    'd.service: failed, stopped by its output folder, not restarted (exit status 5): eagle3 generate: the output folder /o is read-only (EROFS, read_only): remount it read-write, ...'
    >>> r["fault"]
    {'kind': 'read_only', 'errno': 'EROFS', 'path': '/o'}
    """
    active = props.get("ActiveState", "")
    status = int(props.get("ExecMainStatus") or 0)
    restarts = int(props.get("NRestarts") or 0)
    progress = [line for line in log if line.startswith(PROGRESS_PREFIXES)]
    line = progress[-1] if progress else ""
    exists = props.get("LoadState", "not-found") != "not-found"
    again = f"; {restarts} restart(s)" if restarts else ""
    fault = storage_fault(status, out, log) if exists and samples is None else None
    if not exists:
        summary = f"{unit}: not set up (no datagen.yml has run here)"
    elif samples is not None:
        summary = f"{unit}: finished, dataset complete in {out} ({samples} samples){again}"
    elif active in ("active", "activating", "reloading"):
        summary = f"{unit}: {active}, {line or 'no progress line yet'}{again}"
    elif fault is not None:
        said = next((x for x in reversed(log) if FAULT_LINE.match(x)), None) or (
            f"the output folder {out} refused a write (full, read-only or not writable; the job's line is no longer "
            "in the journal)"
        )
        summary = f"{unit}: failed, stopped by its output folder, not restarted (exit status {status}{again}): {said}"
    elif active == "failed" or status != 0:
        last = log[-1] if log else "no log lines"
        summary = f"{unit}: failed ({props.get('Result') or 'exit'}, exit status {status}{again}): {last}"
    else:
        summary = f"{unit}: {active or 'unknown'}, not finished ({line or 'no progress line'}); datagen.yml resumes it"
    return {
        "exists": exists,
        "out": out,
        "finished": samples is not None,
        "samples": samples,
        "active": active,
        "status": status,
        "result": props.get("Result", ""),
        "restarts": restarts,
        "line": line,
        "tail": log[-12:],
        "progress": line or f"{unit} {active}",
        "summary": summary,
        "fault": fault,
    }


def read_samples(out: str) -> int | None:
    """num_samples of OUT/index.json, None while the dataset is not complete."""
    index = Path(out) / "index.json" if out else None
    if index is None or not index.is_file():
        return None
    try:
        return int(json.loads(index.read_text()).get("num_samples", 0))
    except (OSError, ValueError, AttributeError):
        return 0  # complete (generate writes it last) but unreadable: say so through the count


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "default": "eagle3-datagen.service"},
            "out": {"type": "path", "default": ""},
        },
        supports_check_mode=True,
    )
    unit = module.params["unit"]
    argv = ["systemctl", "show", unit] + [f"--property={p}" for p in PROPERTIES]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    props = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    out = module.params["out"] or out_from_execstart(props.get("ExecStart", ""))
    journal = subprocess.run(
        ["journalctl", f"_SYSTEMD_UNIT={unit}", "-n", "200", "-o", "cat", "--no-pager"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    module.exit_json(changed=False, **describe(unit, props, out, journal.stdout.splitlines(), read_samples(out)))


if __name__ == "__main__":
    main()
