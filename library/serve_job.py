#!/usr/bin/python
"""Ansible module serve_job: where the vLLM server of serve.yml (eagle3-serve.service) stands."""

from __future__ import annotations

DOCUMENTATION = r"""
module: serve_job
short_description: Report the state of the vLLM server (the target with its EAGLE-3 drafter, a systemd unit)
description:
  - Reads the unit (C(systemctl show)) and its journal (C(journalctl -u)); when the unit runs, asks the server on its
    own address for a short completion (O(answer)) and reads the drafter's acceptance from its Prometheus C(/metrics)
    (counters C(vllm:spec_decode_num_drafts), C(vllm:spec_decode_num_accepted_tokens),
    C(vllm:spec_decode_num_accepted_tokens_per_pos); acceptance length = 1 + accepted / drafts).
  - Without O(host) and O(port), the address is read from the unit's C(ExecStart) (C(--host), C(--port)).
  - 'RV(verdict): C(healthy) (it answered a completion), C(waiting) (it runs, but does not answer yet), C(running) (it
    runs; not asked to answer), C(failed) (exited with an error, or waiting to be restarted after one), C(stopped),
    C(absent) (no serve.yml has run here).'
  - With O(drafter), also says whether that folder is an EAGLE-3 export vLLM can serve (RV(drafter_problem)).
  - Changes nothing on the target; a completion it asks for is counted by the server's own counters, so status.yml
    does not ask for one.
version_added: "1.2.0"
author: eagle3-pve
options:
  unit:
    description: The server's systemd unit.
    type: str
    default: eagle3-serve.service
  host:
    description: The address the server listens on; empty to read it from the unit.
    type: str
    default: ""
  port:
    description: The server's port; 0 to read it from the unit.
    type: int
    default: 0
  answer:
    description: Ask the running server for a short completion (the health check of serve.yml's wait).
    type: bool
    default: false
  metrics:
    description: Read the acceptance from C(/metrics) when the unit runs.
    type: bool
    default: true
  request_timeout:
    description: Seconds one HTTP request may take.
    type: float
    default: 30
  drafter:
    description: A folder to check as an EAGLE-3 export (C(config.json) of a drafter and C(model.safetensors)); empty for none.
    type: path
    default: ""
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: It only reads (and, with O(answer), asks the server for a completion).
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux with systemd.
"""

EXAMPLES = r"""
- name: Wait until the server answers a completion (one progress line per poll)
  serve_job:
    answer: true
  register: server
  until: server.verdict != 'waiting'
  retries: 360
  delay: 5

- name: Say where it stands, with the drafter's acceptance length
  ansible.builtin.debug:
    msg: "{{ server.summary }}"
  when: server.verdict != 'absent'
"""

RETURN = r"""
verdict:
  description: healthy, waiting, running, failed, stopped or absent.
  returned: always
  type: str
active:
  description: The unit's ActiveState.
  returned: always
  type: str
status:
  description: The exit status of the server's last run.
  returned: always
  type: int
restarts:
  description: Times systemd restarted the server (NRestarts).
  returned: always
  type: int
url:
  description: Where the server listens (http://HOST:PORT), empty when the unit names no address.
  returned: always
  type: str
answer:
  description: The completion asked for ({ok, model, text, tokens} or {ok, error}); null when not asked.
  returned: always
  type: dict
acceptance:
  description:
    - From C(/metrics), summed over engines - drafts, draft_tokens, accepted, per_position (accepted per draft), tau
      (1 + accepted / drafts; null before the first draft), speculative (the counters exist).
    - Null when not read (the unit does not run, O(metrics) false, or C(/metrics) did not answer).
  returned: always
  type: dict
  sample: {"speculative": true, "drafts": 1658, "draft_tokens": 4974, "accepted": 2190, "per_position": [0.71, 0.43, 0.18], "tau": 2.3209}
tail:
  description: The server's last log lines.
  returned: always
  type: list
  elements: str
progress:
  description: One line for a poll of a waiting task.
  returned: always
  type: str
summary:
  description: One line for a person - the state, the address, what it answered, the acceptance length.
  returned: always
  type: str
  sample: 'eagle3-serve.service: active, answers at http://127.0.0.1:8000 (model /var/lib/eagle3/tiny-target: " the"); acceptance length 2.32 (...)'
drafter_problem:
  description: Why O(drafter) is not an EAGLE-3 export vLLM can serve; null when it is one, or when O(drafter) is empty.
  returned: always
  type: str
"""

import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.serve_status import (
    RUNNING,
    UNIT,
    address_from_execstart,
    ask_completion,
    describe,
    export_problem,
    read_metrics,
    url_host,
)

PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts", "ExecStart")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "default": UNIT},
            "host": {"type": "str", "default": ""},
            "port": {"type": "int", "default": 0},
            "answer": {"type": "bool", "default": False},
            "metrics": {"type": "bool", "default": True},
            "request_timeout": {"type": "float", "default": 30.0},
            "drafter": {"type": "path", "default": ""},
        },
        supports_check_mode=True,
    )
    p = module.params
    argv = ["systemctl", "show", p["unit"]] + [f"--property={name}" for name in PROPERTIES]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    props = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    unit_host, unit_port = address_from_execstart(props.get("ExecStart", ""))
    host, port = p["host"] or unit_host, p["port"] or unit_port
    address = f"{url_host(host)}:{port}" if port else ""
    journal = subprocess.run(
        ["journalctl", f"_SYSTEMD_UNIT={p['unit']}", "-n", "200", "-o", "cat", "--no-pager"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    running = props.get("ActiveState") in RUNNING and props.get("SubState") != "auto-restart"
    base = f"http://{address}"
    answer = ask_completion(base, p["request_timeout"]) if running and address and p["answer"] else None
    acc = read_metrics(base, p["request_timeout"]) if running and address and p["metrics"] else None
    asked = running and bool(address) and p["metrics"]
    result = describe(p["unit"], props, journal.stdout.splitlines(), address, answer, acc, metrics=asked)
    result["drafter_problem"] = export_problem(p["drafter"]) if p["drafter"] else None
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
