"""Progress of long commands (synth, import, export): a bar on a terminal, plain lines otherwise.

On a terminal the bar is redrawn in place (carriage return); in a log (systemd, Ansible, a pipe) a line is written
each time another tenth of the work is done, and one at the end with the time taken, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from eagle3.metrics import format_duration

BAR_WIDTH = 30


class Progress:
    """`update(n)` after each piece of work, `close()` at the end. `clock` is injectable for tests."""

    def __init__(
        self, total: int, label: str, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.total = max(0, int(total))
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._decile = 0

    def _eta(self) -> str:
        elapsed = self.clock() - self.started
        if self.done <= 0 or elapsed <= 0:
            return "?"
        return format_duration((self.total - self.done) * elapsed / self.done)

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        pct = 100 * self.done // self.total if self.total else 100
        if self.tty:
            filled = BAR_WIDTH * self.done // self.total if self.total else BAR_WIDTH
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {self.done}/{self.total} eta {self._eta()}  ")
            self.stream.flush()
            return
        decile = pct // 10
        if decile > self._decile and self.done < self.total:
            self._decile = decile
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({pct}%), eta {self._eta()}\n")
            self.stream.flush()

    def close(self) -> None:
        took = format_duration(self.clock() - self.started)
        pct = 100 * self.done // self.total if self.total else 100
        prefix = "\r" if self.tty else ""
        self.stream.write(f"{prefix}{self.label}: {self.done}/{self.total} ({pct}%) in {took}\n")
        self.stream.flush()
