"""The task_times callback (plugins/callback/task_times.py): a real ansible-playbook run prints its slowest tasks and
the seconds of each test case, in the order the cases ran; without EAGLE3_TASK_TIMES it prints nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = """\
- hosts: localhost
  gather_facts: false
  tasks:
    - name: (b) the slow case
      ansible.builtin.include_tasks: case.yml
      vars: {secs: 2}
    - name: (a) the quick case
      ansible.builtin.include_tasks: case.yml
      vars: {secs: 0}
    - name: Outside every case
      ansible.builtin.command: "true"
      changed_when: true
      notify: A handler
  handlers:
    - name: A handler
      ansible.builtin.debug: {msg: handled}
"""
CASE = """\
- name: Wait in the case
  ansible.builtin.command: sleep {{ secs }}
  changed_when: false
"""


def run(tmp_path: Path, times: str) -> str:
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    (tmp_path / "case.yml").write_text(CASE)
    env = {
        **os.environ,
        "ANSIBLE_CALLBACK_PLUGINS": str(ROOT / "plugins" / "callback"),
        "ANSIBLE_CALLBACKS_ENABLED": "task_times",
        "EAGLE3_TASK_TIMES": times,
        "ANSIBLE_NOCOLOR": "1",
    }
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(tmp_path / "play.yml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Callback dispatch" not in proc.stdout + proc.stderr  # every event, handlers too, reaches the callback
    return proc.stdout


def test_the_slowest_tasks_and_each_case_s_time_are_printed_at_the_end(tmp_path):
    out = run(tmp_path, "5")
    report = out[out.index("task times:") :].splitlines()
    cases = report[report.index(next(line for line in report if line.startswith("case times"))) + 1 :]
    assert [line.split(" s  ", 1)[1] for line in cases] == ["(b) the slow case", "(a) the quick case"]
    slow, quick = (float(line.split()[0]) for line in cases)
    assert slow >= 2.0 and quick >= 0.0  # a lower bound only: a loaded machine adds to every task
    assert "Wait in the case  (case.yml:1)" in report[1]  # the slowest task first, with its file


def test_without_the_variable_it_prints_nothing(tmp_path):
    assert "task times:" not in run(tmp_path, "")
