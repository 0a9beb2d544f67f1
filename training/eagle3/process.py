"""The trainer process's own conditions: its stop signals, out of memory (recognised, or injected by tests) and
its memory limit."""

from __future__ import annotations

import os
import resource
import signal

import torch

from eagle3.errors import (
    EXIT_CRASH,
)


class StopRequested:
    """SIGTERM/SIGINT: the first asks for a checkpoint at the next step boundary, a second exits at once."""

    def __init__(self, on_second):
        self.requested = False
        self.signal_name = ""
        self._on_second = on_second

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self._on_second(name)
            os._exit(EXIT_CRASH)
        self.requested = True
        self.signal_name = name
        print(
            f"{name} received: checkpoint at the next step boundary, then exit (again to exit at once)",
            flush=True,
        )


def is_oom(exc: BaseException) -> bool:
    """CUDA OOM, CPU allocator failure or a Python MemoryError (RLIMIT_AS on CPU)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


FAULT_OOM_ENV = "EAGLE3_FAULT_OOM_AT_STEP"


def inject_oom(step: int, rank: int, start_step: int = 0) -> None:
    """Tests only: EAGLE3_FAULT_OOM_AT_STEP=N (every rank) or N:rankR (rank R only) raises torch's own
    out-of-memory error in step N (1-based) after its forward, so the real OOM path runs (status.json error
    kind "oom", exit 3, the other ranks stopping) without starving the process of memory. ``+N`` counts from
    the step this run resumed at (``start_step``): +1 is the first step of the run, whatever its checkpoint."""
    raw = os.environ.get(FAULT_OOM_ENV, "")
    if not raw:
        return
    at, _, only = raw.strip().partition(":rank")
    target = start_step + int(at[1:]) if at.startswith("+") else int(at)
    if target == step and (not only or int(only) == rank):
        raise torch.OutOfMemoryError(f"fault injection: {FAULT_OOM_ENV}={raw} (step {step}, rank {rank})")


def apply_memory_limit(limit_gb: float, device: torch.device) -> None:
    """CUDA: per-process memory fraction. CPU: an address-space limit (RLIMIT_AS) so tests can provoke OOM."""
    if limit_gb <= 0:
        return
    limit = int(limit_gb * 2**30)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
