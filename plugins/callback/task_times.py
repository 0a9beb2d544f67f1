# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where a play's time goes: the slowest tasks, and the time of each test case, printed when the play ends."""

from __future__ import annotations

DOCUMENTATION = """
    name: task_times
    type: aggregate
    short_description: the slowest tasks of a run and the time of each test case, at the end of the run
    version_added: "1.1.0"
    description:
      - Times every task (from its start to the next task's start, so waits, retries and loops count) and prints,
        when the playbook ends, the slowest ones with their file and line, and the summed time per task name.
      - A task inside an include or block whose name starts with C(() (the molecule scenarios' test cases, such as
        C((q) datagen.yml ...)) counts towards that case; the cases are printed in the order they ran, with their
        seconds. This is how C(make test) reports each scenario's case times.
      - Inactive unless C(EAGLE3_TASK_TIMES) is set to the number of slowest tasks to print (for example 50).
    requirements:
      - enabled with C(ANSIBLE_CALLBACKS_ENABLED=task_times) (the molecule scenarios set it)
"""

import os
import time

from ansible.plugins.callback import CallbackBase

INCLUDES = {
    "include_tasks",
    "ansible.builtin.include_tasks",
    "include_role",
    "ansible.builtin.include_role",
    "import_tasks",
    "ansible.builtin.import_tasks",
    "block",
}


def case_of(task) -> str | None:
    """The outermost test case (an include or block named "(x) ...") a task runs in, or None.

    >>> class T:  # a stand-in for Ansible's task and block objects
    ...     def __init__(self, name, action, parent=None):
    ...         self.name, self.action, self._parent = name, action, parent
    >>> case = T("(q) datagen.yml survives a kill", "ansible.builtin.include_tasks")
    >>> inner = T("Run ansible-playbook", "ansible.builtin.command", T("", "block", T("Run it", "include_tasks", case)))
    >>> case_of(inner), case_of(T("plain", "command"))
    ('(q) datagen.yml survives a kill', None)
    """
    found, node = None, getattr(task, "_parent", None)
    if (getattr(task, "name", "") or "").startswith("(") and getattr(task, "action", "") in INCLUDES:
        found = task.name
    while node is not None:
        name = getattr(node, "name", "") or ""
        if name.startswith("(") and getattr(node, "action", "block") in INCLUDES:
            found = name
        node = getattr(node, "_parent", None)
    return found


def table(times: dict[str, float], limit: int) -> list[str]:
    """The ``limit`` largest entries as '  12.3 s  NAME' lines, largest first.

    >>> table({"a": 1.0, "b": 12.25, "c": 3.0}, 2)
    ['    12.2 s  b', '     3.0 s  c']
    """
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:limit]
    return [f"  {secs:6.1f} s  {name}" for name, secs in ranked]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        try:
            self._limit = int(os.environ.get("EAGLE3_TASK_TIMES") or 0)
        except ValueError:
            self._limit = 0
        self._current: tuple[str, str | None, float] | None = None  # (label, case, started)
        self._tasks: dict[str, float] = {}
        self._names: dict[str, float] = {}
        self._cases: dict[str, float] = {}  # insertion order = the order the cases ran

    def _close(self) -> None:
        if self._current is None:
            return
        label, case, started = self._current
        secs = time.monotonic() - started
        self._tasks[label] = self._tasks.get(label, 0.0) + secs
        name = label.split("  (", 1)[0]
        self._names[name] = self._names.get(name, 0.0) + secs
        if case:
            self._cases[case] = self._cases.get(case, 0.0) + secs
        self._current = None

    def v2_playbook_on_task_start(self, task, is_conditional=False) -> None:
        if not self._limit:
            return
        self._close()
        where = task.get_path() or "?"
        where = where.split("/roles/", 1)[-1] if "/roles/" in where else os.path.basename(where)
        self._current = (f"{task.get_name()}  ({where})", case_of(task), time.monotonic())

    def v2_playbook_on_handler_task_start(self, task) -> None:  # a handler: Ansible passes no is_conditional
        self.v2_playbook_on_task_start(task)

    def v2_playbook_on_stats(self, stats) -> None:
        if not self._limit:
            return
        self._close()
        total = sum(self._tasks.values())
        self._display.display(f"\ntask times: {len(self._tasks)} tasks, {total:.1f} s; the slowest {self._limit}:")
        for line in table(self._tasks, self._limit):
            self._display.display(line)
        self._display.display("summed by task name (a task run many times, in loops and cases):")
        for line in table(self._names, min(self._limit, 15)):
            self._display.display(line)
        if self._cases:
            self._display.display(f"case times ({sum(self._cases.values()):.1f} s in {len(self._cases)} cases):")
            for case, secs in self._cases.items():
                self._display.display(f"  {secs:6.1f} s  {case}")
