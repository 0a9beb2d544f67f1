# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible's default output, with a progress line for every poll of a task that waits."""

from __future__ import annotations

DOCUMENTATION = """
    name: eagle3
    type: stdout
    short_description: default output, plus one progress line per poll of a waiting task
    version_added: "0.2.0"
    description:
      - Ansible's default stdout callback, unchanged except for tasks that retry (C(until)/C(retries)).
      - A task that waits by polling (the training health check, the root file system build) prints one line per
        poll instead of C(FAILED - RETRYING), because waiting is not failing. The line holds the task's own
        C(progress) text when the module returns one (step, tokens/s, phase), otherwise the seconds waited.
      - A failure with a message (a refused input, a module's own verdict) is printed once, in the C(fatal) line;
        ansible-core would print it a second time as an C([ERROR]) block. C(-vvv) shows that block too.
      - A failure that repeats the previous failure's message on the same host (a C(rescue) that fails the play
        again with C(ansible_failed_result.msg), perhaps adding to it) prints C(the error above) in place of the
        repeated words, and what it adds.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout_callback in ansible.cfg (the project's ansible.cfg does)
"""

import time

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback


def unrepeated(message, previous):
    """A failure message without the previous failure's words when it repeats them.

    >>> unrepeated("max_seq_len=32768 does not fit (this node was stopped)", "max_seq_len=32768 does not fit")
    'the error above (this node was stopped)'
    >>> unrepeated("another error", "max_seq_len=32768 does not fit")
    'another error'
    """
    if isinstance(message, str) and previous and message.startswith(previous):
        return "the error above" + message[len(previous) :]
    return message


def progress_line(host: str, task: str, result: dict, waited: float) -> str:
    """One line for one poll.

    >>> progress_line("ct129", "Wait until healthy", {"progress": "step 4, 812 tok/s, phase training"}, 12.4)
    '[ct129] waiting (12 s): step 4, 812 tok/s, phase training'
    >>> progress_line("localhost", "Wait for mmdebstrap", {"retries": 10, "attempts": 2}, 10.0)
    '[localhost] waiting (10 s): Wait for mmdebstrap'
    """
    what = result.get("progress") or task
    return f"[{host}] waiting ({waited:.0f} s): {what}"


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "eagle3"

    def __init__(self):
        super().__init__()
        self._started: dict[tuple[str, str], float] = {}
        self._last_failure: dict[str, str] = {}  # host -> the message of its last failure shown
        self._shown_msg: str | None = None  # the message the failure being printed shows instead of its own

    def v2_runner_on_start(self, host, task) -> None:
        self._started[(host.get_name(), str(task._uuid))] = time.monotonic()
        super().v2_runner_on_start(host, task)

    def _handle_exception(self, result, use_stderr: bool = False) -> None:
        # The fatal line that follows holds the message; the [ERROR] block would repeat it word for word.
        if result.get("msg") and self._display.verbosity < 3:
            result.pop("exception", None)
            return
        super()._handle_exception(result, use_stderr=use_stderr)

    def v2_runner_on_failed(self, result, ignore_errors=False) -> None:
        host, message = result.host.get_name(), result.result.get("msg")
        shown = unrepeated(message, self._last_failure.get(host))
        if isinstance(message, str) and message:
            self._last_failure[host] = message
        # Only this callback's output changes (the result other callbacks get keeps the whole message).
        self._shown_msg = shown if shown != message and self._display.verbosity < 3 else None
        try:
            super().v2_runner_on_failed(result, ignore_errors=ignore_errors)
        finally:
            self._shown_msg = None

    def _dump_results(self, result, *args, **kwargs):
        if getattr(self, "_shown_msg", None) is not None and isinstance(result, dict) and "msg" in result:
            result = {**result, "msg": self._shown_msg}
        return super()._dump_results(result, *args, **kwargs)

    def v2_runner_retry(self, result) -> None:
        started = self._started.get((result.host.get_name(), str(result.task._uuid)), time.monotonic())
        line = progress_line(
            self.host_label(result),
            result.task.name or result.task_name,
            result.result,
            time.monotonic() - started,
        )
        if self._run_is_verbose(result, verbosity=2):
            line += f" Result was: {self._dump_results(result.result)}"
        self._display.display(line, color=C.COLOR_DEBUG)
