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

from eagle3.acceptance import acceptance_length
from eagle3.files import atomic_write_json
from eagle3.step_stats import STAT_KEYS  # the sum/count pairs ttt_forward returns: one definition

TIMER_KEYS = ("fetch", "fwd", "bwd", "opt")
# Extra scalars reduced with the stats: summed across ranks, except peak memory (max).
SCALAR_SUM_KEYS = ("tokens", "rows", "steps", *TIMER_KEYS)


class StatAccumulator:
    """Sums of the TTT statistics and step scalars since the last log step."""

    def __init__(self, ttt_steps: int):
        self.ttt_steps = ttt_steps
        self.reset()

    def reset(self) -> None:
        self.stats = torch.zeros(len(STAT_KEYS), self.ttt_steps, dtype=torch.float64)  # [len(STAT_KEYS), T]
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
    """Rates per TTT step from summed statistics [len(STAT_KEYS), T].

    >>> t = torch.zeros(len(STAT_KEYS), 2, dtype=torch.float64)
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
        # sum_v min(p_target, p_draft): how often speculative *sampling* (temperature 1) would accept the draft's
        # token at each step, over all positions (not given the steps before; eagle3.loss)
        "expected_acc": rate(s["alpha_sum"], s["count"]),
        "count": [float(v) for v in s["count"].tolist()],
        # the rounds a greedy decoder would run over the rows (validation; eagle3.acceptance.round_walk)
        "round_tokens": float(s["round_tokens_sum"][0]),
        "rounds": float(s["rounds_sum"][0]),
    }


def mean_loss(summary: dict) -> float | None:
    """Mean over TTT steps of the per-step loss (the validation criterion for the best checkpoint)."""
    values = [v for v in summary["loss"] if v is not None]
    return sum(values) / len(values) if values else None


def peak_memory_gb(device: torch.device) -> tuple[float, str]:
    """Peak CUDA memory allocated by this process, or its peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda"
    return peak_rss_kib() / 2**20, "rss"


def peak_rss_kib() -> int:
    """This process's peak resident set in KiB: VmHWM of its address space. ru_maxrss is not used where VmHWM can
    be read: Linux keeps it across execve, so a trainer started by a large parent (a test runner that has
    imported transformers, say) would report the parent's footprint as its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


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


# ------------------------------------------------------------------------------------- the records
# status.json fields a train record updates at each log step (besides the watchdog's bound)
STATUS_FROM_TRAIN = (
    "step",
    "epoch",
    "loss",
    "full_acc_0",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "step_time_s",
    "time_split",
    "peak_mem_gb",
    "mem_kind",
    "eta_s",
)


def rate_fields(summary: dict) -> dict:
    """The mean loss and the per-TTT-step rates of a `summarize` result, as both records carry them."""
    return {
        "loss": mean_loss(summary),
        "loss_per_step": summary["loss"],
        "full_acc": summary["full_acc"],
        "cond_acc": summary["cond_acc"],
        "full_acc_true": summary["full_acc_true"],
        "cond_acc_true": summary["cond_acc_true"],
        "expected_acc": summary["expected_acc"],
    }


def train_record(
    summary: dict,
    scalars: dict[str, float],
    memory_gb: list[float],
    checksums: list[float] | None,
    *,
    step: int,
    epoch: int,
    max_steps: int,
    lr: float,
    wall_s: float,
    world_size: int,
    mem_kind: str,
) -> dict:
    """One `kind: train` line of metrics.jsonl from a log window: `summary` of the summed statistics, `scalars`
    summed over the ranks (SCALAR_SUM_KEYS), each rank's peak memory and parameter checksum (None under FSDP
    or with one rank), `wall_s` since the window began.

    >>> s = summarize(torch.ones(len(STAT_KEYS), 2, dtype=torch.float64))
    >>> scalars = {"tokens": 800.0, "rows": 4.0, "steps": 4.0, "fetch": 0.4, "fwd": 2.0, "bwd": 1.2, "opt": 0.4}
    >>> r = train_record(s, scalars, [1.5, 2.0], None, step=10, epoch=0, max_steps=30, lr=1e-4, wall_s=2.0,
    ...                  world_size=2, mem_kind="rss")
    >>> r["tokens_per_s"], r["tokens_per_s_per_rank"], r["step_time_s"], r["eta_s"], r["peak_mem_gb"]
    (400.0, 200.0, 1.0, 20.0, 2.0)
    >>> r["time_split"]["fwd"], r["full_acc_1"]
    (0.5, 1.0)
    """
    steps = max(1.0, scalars["steps"] / world_size)  # steps in the window (each rank counted its own)
    step_time = wall_s / steps
    record = {
        "kind": "train",
        "step": step,
        "epoch": epoch,
        "max_steps": max_steps,
        "lr": lr,
        **rate_fields(summary),
        "positions": summary["count"],
        "tokens": scalars["tokens"],
        "tokens_per_s": scalars["tokens"] / wall_s,
        "tokens_per_s_per_rank": scalars["tokens"] / wall_s / world_size,
        "step_time_s": step_time,
        "time_split": {k: scalars[k] / world_size / steps for k in TIMER_KEYS},
        "peak_mem_gb": max(memory_gb),
        "peak_mem_gb_per_rank": memory_gb,
        "mem_kind": mem_kind,
        "param_checksums": checksums,
        "eta_s": (max_steps - step) * step_time,
        "world_size": world_size,
    }
    for k, v in enumerate(summary["full_acc"]):
        record[f"full_acc_{k}"] = v
        record[f"cond_acc_{k}"] = summary["cond_acc"][k]
    return record


def status_fields(record: dict) -> dict:
    """The status.json fields of a train record."""
    return {key: record[key] for key in STATUS_FROM_TRAIN}


def val_record(step: int, summary: dict, batches: int | None = None, batches_total: int | None = None) -> dict:
    """One validation result (status.json `val`, and metrics.jsonl with `kind: val`).

    `acceptance_length` is the simulated tokens per draft-and-verify round of chain drafting over the
    `ttt_steps` steps, from `cond_acc_true` (eagle3.acceptance), every slot counted as a round's start;
    `acceptance_length_draft_vocab` the same from `cond_acc` (an upper bound); `tau_predicted` the tokens per
    round of the rounds a greedy decoder would run over the validation responses, round by round from the
    frontier (eagle3.acceptance.round_walk: the prediction of evaluate's tau_real; None under context parallelism).
    `batches` rows per rank were run out of `batches_total` (val_max_batches).

    >>> t = torch.zeros(len(STAT_KEYS), 2, dtype=torch.float64)
    >>> for key, v in {"count": [10., 8.], "loss_sum": [5., 8.], "cond_acc_sum": [8., 4.], "cond_acc_count": [10., 8.],
    ...                "cond_acc_true_sum": [5., 2.], "cond_acc_true_count": [10., 5.]}.items():
    ...     t[STAT_KEYS.index(key)] = torch.tensor(v)
    >>> r = val_record(40, summarize(t), batches=2, batches_total=5)
    >>> r["acceptance_length"], r["acceptance_length_draft_vocab"], r["batches"], r["positions"]
    (1.7, 2.2, 2, 10.0)
    """
    return {
        "step": step,
        **rate_fields(summary),
        "acceptance_length": acceptance_length(summary["cond_acc_true"]),
        "acceptance_length_draft_vocab": acceptance_length(summary["cond_acc"]),
        "tau_predicted": round(summary["round_tokens"] / summary["rounds"], 4) if summary.get("rounds") else None,
        "positions": summary["count"][0],
        "batches": batches,
        "batches_total": batches_total,
    }


def val_line(val: dict) -> str:
    """The log line of a validation result.

    >>> val_line({"step": 40, "loss": 1.25, "full_acc": [0.5, 0.25, None], "full_acc_true": [0.4], "positions": 96.0,
    ...           "acceptance_length": 1.3, "acceptance_length_draft_vocab": 1.625, "batches": 3, "batches_total": 9})
    'val step 40: loss 1.2500 full_acc 0.500 0.250 (true 0.400) acceptance length 1.30 (draft vocab 1.62) over 96 positions (3 of 9 rows)'
    """
    acc = ""
    if val.get("acceptance_length") is not None:
        acc = f" acceptance length {val['acceptance_length']:.2f}"
        if val.get("acceptance_length_draft_vocab") is not None:
            acc += f" (draft vocab {val['acceptance_length_draft_vocab']:.2f})"
    rows = ""
    if val.get("batches") is not None and val.get("batches_total") not in (None, val["batches"]):
        rows = f" ({val['batches']} of {val['batches_total']} rows)"
    return (
        f"val step {val['step']}: loss {val['loss']:.4f} full_acc "
        + " ".join(f"{v:.3f}" for v in val["full_acc"] if v is not None)
        + f" (true {val['full_acc_true'][0]:.3f}){acc} over {int(val['positions'])} positions{rows}"
    )


class RunFiles:
    """`status.json` (atomically replaced) and `metrics.jsonl` (appended) of one run; rank 0 writes them."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.observer = None  # rank 0's eagle3.observe.Observer, once training is set up
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
            "acceptance_length": None,  # the last validation's simulated acceptance length (eagle3.acceptance)
            "acceptance_length_step": None,  # the step of that validation
            "error": None,
            "tracker": None,  # eagle3.observe.Observer.tracker_state: {name, ok, error, at}; null with tracker: none
            "pid": os.getpid(),
            "updated": time.time(),
        }

    def update_status(self, **fields) -> None:
        self.status.update(fields)
        self.status["updated"] = time.time()
        if self.observer is not None:  # whether the experiment tracker works (set once it fails, and kept)
            self.status["tracker"] = self.observer.tracker_state
        if self.enabled:
            atomic_write_json(self.run_dir / "status.json", self.status)
            if self.observer is not None:  # eagle3.observe: the Prometheus textfile follows status.json
                self.observer.on_status(self.status)

    def append_metrics(self, record: dict) -> None:
        if not self.enabled:
            return
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.observer is not None:  # eagle3.observe: TensorBoard, the textfile's rates
            self.observer.on_record(record)
