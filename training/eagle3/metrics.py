"""Step metrics: TTT statistics as sum/count pairs, one dense console line, JSONL, and `status.json`.

`ttt_forward` returns float64 [ttt_steps] tensors as sums and counts; they are accumulated between log
steps and all-reduced with one collective (a single flat vector), then turned into rates here.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from eagle3.config import atomic_write_json
from eagle3.model import STAT_KEYS  # the sum/count pairs ttt_forward returns: one definition

TIMER_KEYS = ("fetch", "fwd", "bwd", "opt")
# Extra scalars reduced with the stats: summed across ranks, except peak memory (max).
SCALAR_SUM_KEYS = ("tokens", "rows", "steps", *TIMER_KEYS)
PHASES = ("starting", "training", "validating", "checkpointing", "done", "stopped", "failed")


class StatAccumulator:
    """Sums of the TTT statistics and step scalars since the last log step."""

    def __init__(self, ttt_steps: int):
        self.ttt_steps = ttt_steps
        self.reset()

    def reset(self) -> None:
        self.stats = torch.zeros(len(STAT_KEYS), self.ttt_steps, dtype=torch.float64)  # [8, T]
        self.scalars = torch.zeros(len(SCALAR_SUM_KEYS), dtype=torch.float64)  # [6]
        self.peak_mem = 0.0

    def add_stats(self, stats: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for i, key in enumerate(STAT_KEYS):
            self.stats[i] += stats[key].detach().to("cpu", torch.float64) * weight

    def add_scalars(self, **values: float) -> None:
        for key, value in values.items():
            self.scalars[SCALAR_SUM_KEYS.index(key)] += value

    def flat(self) -> torch.Tensor:
        """One vector for one all_reduce(SUM): stats, scalars. Peak memory is reduced separately (MAX)."""
        return torch.cat([self.stats.flatten(), self.scalars])

    def unflatten(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.stats.numel()
        return flat[:n].view(len(STAT_KEYS), self.ttt_steps), flat[n:]


def summarize(stats: torch.Tensor) -> dict[str, list[float | None]]:
    """Rates per TTT step from summed statistics [8, T].

    >>> t = torch.zeros(8, 2, dtype=torch.float64)
    >>> t[STAT_KEYS.index("count")] = torch.tensor([10., 8.])
    >>> t[STAT_KEYS.index("loss_sum")] = torch.tensor([5., 8.])
    >>> t[STAT_KEYS.index("full_acc_sum")] = torch.tensor([6., 2.])
    >>> summarize(t)["loss"], summarize(t)["full_acc"]
    ([0.5, 1.0], [0.6, 0.25])
    """
    s = {key: stats[i] for i, key in enumerate(STAT_KEYS)}

    def rate(num: torch.Tensor, den: torch.Tensor) -> list[float | None]:
        return [float(n / d) if d > 0 else None for n, d in zip(num.tolist(), den.tolist(), strict=True)]

    return {
        "loss": rate(s["loss_sum"], s["count"]),
        "full_acc": rate(s["full_acc_sum"], s["count"]),
        "cond_acc": rate(s["cond_acc_sum"], s["cond_acc_count"]),
        "full_acc_true": rate(s["full_acc_true_sum"], s["count"]),
        "cond_acc_true": rate(s["cond_acc_true_sum"], s["cond_acc_true_count"]),
        "count": [float(v) for v in s["count"].tolist()],
    }


def mean_loss(summary: dict) -> float | None:
    """Mean over TTT steps of the per-step loss (the validation criterion for the best checkpoint)."""
    values = [v for v in summary["loss"] if v is not None]
    return sum(values) / len(values) if values else None


def peak_memory_gb(device: torch.device) -> tuple[float, str]:
    """Peak CUDA memory allocated by this process, or its peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda"
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


def format_duration(seconds: float | None) -> str:
    """Short human duration for the ETA.

    >>> format_duration(3725)
    '1h02m'
    >>> format_duration(95)
    '1m35s'
    >>> format_duration(None)
    '?'
    """
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _fmt(values: list[float | None], spec: str) -> str:
    return " ".join("-" if v is None else format(v, spec) for v in values)


def console_line(record: dict) -> str:
    """One dense line per log step, for the person watching `journalctl -f`."""
    split = record["time_split"]
    total = sum(split.values()) or 1.0
    pct = " ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items())
    return (
        f"step {record['step']}/{record['max_steps']} ep {record['epoch']} | "
        f"loss {_fmt(record['loss_per_step'], '.3f')} | "
        f"acc {_fmt(record['full_acc'], '.3f')} (true {_fmt(record['full_acc_true'], '.3f')}) | "
        f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_rank']:,.0f}/rank) | "
        f"{record['step_time_s'] * 1000:.0f} ms/step [{pct}] | "
        f"mem {record['peak_mem_gb']:.2f} GB {record['mem_kind']} | eta {format_duration(record['eta_s'])}"
    )


class RunFiles:
    """`status.json` (atomically replaced) and `metrics.jsonl` (appended) of one run; rank 0 writes them."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.status: dict = {
            "phase": "starting",
            "step": 0,
            "epoch": 0,
            "steps_per_epoch": 0,
            "max_steps": 0,
            "max_seq_len": 0,
            "world_size": 1,
            "loss": None,
            "full_acc_0": None,
            "tokens_per_s": 0.0,
            "tokens_per_s_per_rank": 0.0,
            "step_time_s": 0.0,
            "time_split": dict.fromkeys(TIMER_KEYS, 0.0),
            "peak_mem_gb": 0.0,
            "mem_kind": "rss",
            "eta_s": None,
            "resumed_from_step": None,  # the step of the checkpoint this start resumed from
            "resumed_from_checkpoint": None,  # its path
            "skipped_checkpoints": [],  # corrupt ones passed over at this start: {name, reason, moved_to}
            "last_checkpoint_step": None,  # the newest valid checkpoint (also right after a resume)
            "last_checkpoint_time": None,  # when it was completed (unix seconds)
            "watchdog_bound_s": None,  # the hang watchdog's current bound for one step (log steps)
            "val": None,
            "error": None,
            "pid": os.getpid(),
            "updated": time.time(),
        }

    def update_status(self, **fields) -> None:
        self.status.update(fields)
        self.status["updated"] = time.time()
        if self.enabled:
            atomic_write_json(self.run_dir / "status.json", self.status)

    def append_metrics(self, record: dict) -> None:
        if not self.enabled:
            return
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
