"""Hang watchdog, one per rank: exit with EXIT_HANG (4) when no step finishes within a bound from measured step times.

    before the first step   watchdog_first_step_s (model build, resume, compile and warm-up of the first step)
    each later step         max(watchdog_floor_s, watchdog_factor x median of the last 20 step times)
    a checkpoint            watchdog_checkpoint_s
    validation              the step bound, re-armed after every validation row

When the bound passes, the watchdog thread prints one line, dumps every thread's stack to stderr (the journal)
with faulthandler, records status.json error kind "hang" ("no step for N s (expected about M s)") and ends
the process with os._exit(EXIT_HANG). A restart resumes from the last checkpoint.

A Python thread runs only when the GIL is free; a hang that holds it (a C extension spinning) is caught by
faulthandler's own C-level timer, armed at the same bound + BACKSTOP_GRACE_S: it dumps the stacks and exits
with status 1 (status.json is not written then). NCCL/gloo waits, CUDA syncs, sleeps and I/O release the GIL.

Fault injection (tests only): EAGLE3_FAULT_HANG_AT_STEP=N makes step N (1-based, the N-th optimizer step of
the run's schedule) sleep forever before its forward; EAGLE3_FAULT_HANG_RANK=r limits that to rank r.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from eagle3.errors import EXIT_HANG

HISTORY = 20  # step times kept for the median
BACKSTOP_GRACE_S = 120.0  # the C-level backstop fires this long after the Python watchdog should have
ON_HANG_GRACE_S = 30.0  # the status.json write gets this long before the process exits regardless
FAULT_HANG_ENV = "EAGLE3_FAULT_HANG_AT_STEP"
FAULT_HANG_RANK_ENV = "EAGLE3_FAULT_HANG_RANK"


def step_bound(step_times: list[float], floor_s: float, factor: float) -> float:
    """The bound for the next step: max(floor, factor x median of the recent step times).

    >>> step_bound([0.4, 0.5, 9.0], floor_s=300, factor=10)
    300
    >>> step_bound([40.0, 50.0, 45.0, 2.0], floor_s=300, factor=10)
    425.0
    """
    if not step_times:
        return floor_s
    return max(floor_s, factor * statistics.median(step_times))


def _secs(seconds: float) -> str:
    """Seconds for a message: whole above 10, one decimal below.

    >>> _secs(305.4), _secs(4.26)
    ('305', '4.3')
    """
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def _stream_fd_ok(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


class Watchdog:
    """Armed with a deadline; `step_done` re-arms it with the bound from the measured step times."""

    def __init__(
        self,
        *,
        floor_s: float,
        factor: float,
        first_step_s: float,
        checkpoint_s: float,
        on_hang: Callable[[str], None] | None = None,
        stream=None,
        backstop: bool = True,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self.floor_s = floor_s
        self.factor = factor
        self.first_step_s = first_step_s
        self.checkpoint_s = checkpoint_s
        self.enabled = floor_s > 0
        self.on_hang = on_hang
        self.stream = stream if stream is not None else sys.stderr
        self.backstop = backstop and _stream_fd_ok(self.stream)
        self.exit_fn = exit_fn
        self.step_times: deque[float] = deque(maxlen=HISTORY)
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._armed_at = 0.0
        self._bound = 0.0
        self._what = "step"
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.fired = False

    # ------------------------------------------------------------------------------ bounds
    def bound(self) -> float:
        """The current step bound: first_step_s until a step was measured, then step_bound(...)."""
        if not self.step_times:
            return self.first_step_s
        return step_bound(list(self.step_times), self.floor_s, self.factor)

    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    # ------------------------------------------------------------------------------ arming
    def start(self) -> Watchdog:
        """Start the thread, armed with the first-step bound."""
        if not self.enabled:
            return self
        self._thread = threading.Thread(target=self._run, name="eagle3-watchdog", daemon=True)
        self._thread.start()
        self.arm(self.first_step_s, "first step")
        return self

    def arm(self, bound_s: float, what: str = "step") -> None:
        if not self.enabled:
            return
        with self._cond:
            self._armed_at = time.monotonic()
            self._bound = bound_s
            self._what = what
            self._deadline = self._armed_at + bound_s
            self._cond.notify_all()
        if self.backstop:
            faulthandler.dump_traceback_later(bound_s + BACKSTOP_GRACE_S, exit=True, file=self.stream)

    def step_done(self, seconds: float) -> None:
        """A step finished after `seconds`: remember it and re-arm for the next one."""
        self.step_times.append(seconds)
        self.arm(self.bound(), "step")

    def touch(self, what: str) -> None:
        """Progress inside a longer phase (a validation row): re-arm with the step bound."""
        self.arm(self.bound(), what)

    @contextlib.contextmanager
    def phase(self, what: str, bound_s: float) -> Iterator[None]:
        """A phase with its own bound (a checkpoint); afterwards the step bound applies again."""
        self.arm(bound_s, what)
        try:
            yield
        finally:
            self.arm(self.bound(), "step")

    def stop(self) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._stopped = True
            self._deadline = None
            self._cond.notify_all()
        if self.backstop:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------ firing
    def message(self, waited: float) -> str:
        if self._what == "step":
            median = self.median_step_s()
            expected = f"{_secs(median)} s" if median is not None else f"at most {_secs(self._bound)} s"
            return f"no step for {_secs(waited)} s (expected about {expected}; bound {_secs(self._bound)} s)"
        return f"no step for {_secs(waited)} s: {self._what} did not finish within its bound of {_secs(self._bound)} s"

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(timeout=remaining)
                    continue
                waited = time.monotonic() - self._armed_at
                break
            else:
                return
        self._fire(self.message(waited))

    def _fire(self, message: str) -> None:
        self.fired = True
        out = self.stream
        with contextlib.suppress(Exception):
            print(f"hang: {message}; stacks of all threads follow, then exit {EXIT_HANG}", file=out, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        # Whatever on_hang does (a status.json write on a hung filesystem), the process ends.
        timer = threading.Timer(ON_HANG_GRACE_S, self.exit_fn, (EXIT_HANG,))
        timer.daemon = True
        timer.start()
        if self.on_hang is not None:
            try:
                self.on_hang(message)
            except Exception as e:  # the exit below must happen whatever on_hang raised
                with contextlib.suppress(Exception):
                    print(f"hang: could not record it in status.json: {e}", file=out, flush=True)
        timer.cancel()
        self.exit_fn(EXIT_HANG)


# ---------------------------------------------------------------------------------- fault injection (tests)
def fault_hang_step(rank: int) -> int | None:
    """The step EAGLE3_FAULT_HANG_AT_STEP asks this rank to hang in, or None (the normal case)."""
    raw = os.environ.get(FAULT_HANG_ENV, "").strip()
    if not raw:
        return None
    only = os.environ.get(FAULT_HANG_RANK_ENV, "").strip()
    if only and int(only) != rank:
        return None
    return int(raw)


def injected_hang(step: int) -> None:
    """Sleep forever, as a step stuck in a collective or a driver call would (the GIL is free meanwhile)."""
    print(f"fault injection: {FAULT_HANG_ENV}={step}: step {step} hangs now", flush=True)
    while True:
        time.sleep(3600)
