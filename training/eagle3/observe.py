"""What the trainer shows outside its log: a Prometheus textfile, TensorBoard events, progress, GPU telemetry.

Rank 0 owns one `Observer`. `RunFiles` hands it every status.json update and every metrics.jsonl record; it
keeps the newest of each and rewrites the textfile, adds TensorBoard scalars (when the `tensorboard` package is
importable) and samples the GPUs in a background thread (eagle3.gpu_telemetry) into `telemetry.jsonl`. None of
it may stop training: a failing sink is reported once in the log and then left alone.

The names and units of the textfile are listed in docs/observability.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eagle3.files import atomic_write_text
from eagle3.gpu_telemetry import TELEMETRY_FILE, GpuSampler, gpu_values, now_ms, nvml_reader
from eagle3.metrics import format_duration

PROM_FILE = "eagle3_train.prom"
TENSORBOARD_DIR = "tensorboard"
PHASE_NAMES = {"fetch": "fetch", "fwd": "forward", "bwd": "backward", "opt": "optimizer"}
STATES = ("starting", "training", "validating", "checkpointing", "done", "stopped", "failed")


# ------------------------------------------------------------------------------------ Prometheus
def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


class PromText:
    """Metric families in the Prometheus text exposition format (one HELP and TYPE line per family)."""

    def __init__(self, base_labels: dict[str, str]):
        self.base = base_labels
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, kind: str, help: str, value: float | None, /, **labels: object) -> None:
        if value is None:
            return
        family = self.families.setdefault(name, (kind, help, []))
        merged = {**self.base, **{k: str(v) for k, v in labels.items()}}
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
        family[2].append(f"{name}{{{label_text}}} {_number(value)}")

    def render(self) -> str:
        out = []
        for name, (kind, help, samples) in self.families.items():
            out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(out) + "\n"


def prom_text(
    status: dict, record: dict | None, val: dict | None, gpu: dict | None, tokens_total: float, run: str
) -> str:
    """The textfile from the newest status.json fields, train record, validation and GPU sample."""
    p = PromText({"run": run})
    _status_metrics(p, status, tokens_total)
    if record is not None:
        _step_metrics(p, record)
    if val is not None:
        _validation_metrics(p, val)
    for g in (gpu or {}).get("gpus", []):
        _gpu_metrics(p, g)
    return p.render()


def _status_metrics(p: PromText, status: dict, tokens_total: float) -> None:
    """The run's state, progress and checkpoints, from status.json."""
    phase = status.get("phase")
    for state in STATES:
        p.add(
            "eagle3_train_state",
            "gauge",
            "1 for the run's current state (status.json phase), else 0",
            1 if state == phase else 0,
            state=state,
        )
    p.add("eagle3_train_step", "gauge", "optimizer steps completed", status.get("step"))
    p.add("eagle3_train_max_steps", "gauge", "optimizer steps the run will take", status.get("max_steps"))
    p.add("eagle3_train_max_seq_len_tokens", "gauge", "tokens per packed row", status.get("max_seq_len"))
    p.add("eagle3_train_world_size", "gauge", "ranks (processes) of the run", status.get("world_size"))
    p.add("eagle3_train_tokens_total", "counter", "tokens trained on since this process started", tokens_total)
    p.add(
        "eagle3_train_last_checkpoint_step",
        "gauge",
        "step of the newest valid checkpoint",
        status.get("last_checkpoint_step"),
    )
    p.add(
        "eagle3_train_last_checkpoint_timestamp_seconds",
        "gauge",
        "when the newest checkpoint was completed",
        status.get("last_checkpoint_time"),
    )
    p.add("eagle3_train_eta_seconds", "gauge", "estimated time to the last step", status.get("eta_s"))
    p.add(
        "eagle3_train_status_updated_timestamp_seconds",
        "gauge",
        "when status.json was last written",
        status.get("updated"),
    )


def _step_metrics(p: PromText, record: dict) -> None:
    """Speed, time split, loss and accuracies of the newest log step (a metrics.jsonl train record)."""
    p.add("eagle3_train_tokens_per_second", "gauge", "tokens per second, all ranks", record["tokens_per_s"])
    p.add(
        "eagle3_train_step_seconds",
        "gauge",
        "wall time of one step (mean over the log window)",
        record["step_time_s"],
    )
    for key, phase_name in PHASE_NAMES.items():
        p.add(
            "eagle3_train_step_phase_seconds",
            "gauge",
            "time of one step spent in each phase",
            record["time_split"].get(key),
            phase=phase_name,
        )
    p.add("eagle3_train_loss", "gauge", "training loss, mean over the TTT steps", record.get("loss"))
    p.add("eagle3_train_learning_rate", "gauge", "learning rate", record.get("lr"))
    for k, v in enumerate(record.get("loss_per_step") or []):
        p.add("eagle3_train_ttt_loss", "gauge", "training loss per TTT step", v, ttt_step=k)
    for k, v in enumerate(record.get("full_acc") or []):
        p.add(
            "eagle3_train_full_accuracy_ratio",
            "gauge",
            "top-1 accuracy per TTT step (all positions)",
            v,
            ttt_step=k,
        )
    for k, v in enumerate(record.get("cond_acc") or []):
        p.add(
            "eagle3_train_conditional_accuracy_ratio",
            "gauge",
            "top-1 accuracy per TTT step where every earlier step was right",
            v,
            ttt_step=k,
        )
    kind = record.get("mem_kind", "rss")
    for rank, gb in enumerate(record.get("peak_mem_gb_per_rank") or []):
        p.add(
            "eagle3_train_peak_memory_bytes",
            "gauge",
            "peak memory per rank (cuda: allocated, rss: CPU RSS)",
            gb * 2**30,
            rank=rank,
            kind=kind,
        )


def _validation_metrics(p: PromText, val: dict) -> None:
    """The newest validation: its loss and simulated acceptance length."""
    p.add(
        "eagle3_train_validation_loss",
        "gauge",
        "validation loss, mean over the TTT steps",
        val.get("loss"),
    )
    p.add(
        "eagle3_train_acceptance_length_tokens",
        "gauge",
        "simulated tokens per draft-and-verify round at the last validation",
        val.get("acceptance_length"),
    )
    p.add(
        "eagle3_train_tau_predicted_tokens",
        "gauge",
        "tokens per round a greedy decoder would get over the validation responses (the prediction of tau_real)",
        val.get("tau_predicted"),
    )


def _gpu_metrics(p: PromText, g: dict) -> None:
    """One GPU of the newest telemetry sample."""
    i = g["index"]
    p.add("eagle3_gpu_power_watts", "gauge", "GPU power draw", g.get("power_w"), gpu=i)
    p.add("eagle3_gpu_power_limit_watts", "gauge", "GPU enforced power limit", g.get("power_limit_w"), gpu=i)
    util = g.get("util_pct")
    p.add(
        "eagle3_gpu_utilization_ratio",
        "gauge",
        "GPU utilisation (share of time a kernel ran)",
        None if util is None else util / 100,
        gpu=i,
    )
    clock = g.get("sm_clock_mhz")
    p.add("eagle3_gpu_sm_clock_hertz", "gauge", "SM clock", None if clock is None else clock * 1e6, gpu=i)
    p.add(
        "eagle3_gpu_memory_used_bytes",
        "gauge",
        "GPU memory used (all processes)",
        g.get("memory_used_bytes"),
        gpu=i,
    )
    p.add(
        "eagle3_gpu_starved",
        "gauge",
        "1 when utilisation is high at low power (the GPU waits)",
        1 if g.get("starved") else 0,
        gpu=i,
    )


def write_textfile(path: Path, text: str) -> None:
    """Replace `path` atomically and world-readable, as node_exporter's textfile collector requires: it must never
    read a half-written file, and it runs as its own user. Written every few seconds: no fsync."""
    atomic_write_text(path, text, mode=0o644, fsync=False)


# ------------------------------------------------------------------------------------ progress line
class ProgressLine:
    """A log line with the ETA every `every_s` seconds (the first at the first step): steps per minute over this
    start, so a resumed run's ETA counts only what it does now. `clock` is injectable for tests.

    >>> t = [100.0]
    >>> p = ProgressLine(60, clock=lambda: t[0], start_step=10)
    >>> p.due(11, 110)
    'progress: step 11/110 (10.0%), 1 steps in 0s this start, eta ?'
    >>> t[0] = 130.0; p.due(20, 110) is None
    True
    >>> t[0] = 160.0; p.due(40, 110)
    'progress: step 40/110 (36.4%), 30 steps in 1m00s this start, 30.0 steps/min, eta 2m20s'
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic, start_step: int = 0):
        self.every_s = every_s
        self.clock = clock
        self.start_step = start_step
        self.started = clock()
        self.last: float | None = None

    def due(self, step: int, total: int) -> str | None:
        if self.every_s <= 0:
            return None
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            return None
        self.last = now
        done, elapsed = step - self.start_step, now - self.started
        pct = 100 * step / total if total else 100.0
        rate = ""
        eta = None
        if elapsed > 0 and done > 0:
            per_s = done / elapsed
            rate = f", {per_s * 60:.1f} steps/min"
            eta = (total - step) / per_s
        return (
            f"progress: step {step}/{total} ({pct:.1f}%), {done} steps in {format_duration(elapsed)} this start"
            f"{rate}, eta {format_duration(eta)}"
        )


# ------------------------------------------------------------------------------------ the observer
class Observer:
    """Rank 0's sinks. `RunFiles` calls `on_status` after each status.json write and `on_record` for each
    metrics.jsonl record; `start` begins GPU sampling, `close` ends it and flushes."""

    def __init__(self, cfg, device_type: str, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        self.run_dir = Path(cfg.run_dir)
        self.run = self.run_dir.name or str(self.run_dir)
        prom_dir = Path(cfg.prometheus_textfile_dir) if cfg.prometheus_textfile_dir else self.run_dir
        self.prom_path = prom_dir / PROM_FILE
        self.status: dict = {}
        self.record: dict | None = None
        self.val: dict | None = None
        self.tokens_total = 0.0
        self.broken: set[str] = set()
        self.tb = None  # the SummaryWriter, once training starts
        self.tb_writer = None  # its class until then
        self.tracker = None  # eagle3.trackers: MLflow or W&B, when the config names one
        # status.json's `tracker` (RunFiles reads it at each write): {name, ok, error, at}; None with tracker: none.
        self.tracker_state: dict | None = None
        self.sampler: GpuSampler | None = None
        self._lock = threading.Lock()
        self.device_type = device_type

    def start(self, step: Callable[[], int]) -> Observer:
        self.tb_writer = self._tensorboard()
        if self.cfg.tracker != "none":
            self.tracker_state = {"name": self.cfg.tracker, "ok": True, "error": None, "at": None}
            self._guard("tracker", self._open_tracker, at="start")
        if self.cfg.telemetry_every_s > 0:
            reader, note = nvml_reader() if self.device_type == "cuda" else (None, "no GPU")
            self.sampler = GpuSampler(self.run_dir, self.cfg.telemetry_every_s, step, reader, note, self.on_sample)
            if reader is None:
                self.log(
                    f"gpu telemetry: {note} (device {self.device_type}); power, utilisation and clocks are not recorded"
                )
            else:
                self.log(f"gpu telemetry: every {self.cfg.telemetry_every_s:g} s to {TELEMETRY_FILE}")
            self._guard("telemetry", self.sampler.start)
        else:
            self.log("gpu telemetry: off (telemetry_every_s is 0)")
        self.log(f"prometheus textfile: {self.prom_path}")
        return self

    def _tensorboard(self):
        """torch's SummaryWriter class, or None (and the log says why); the writer itself is opened with the first
        training status (`_open_tensorboard`), when the step this start resumed from is known."""
        if not self.cfg.tensorboard:
            self.log("tensorboard: off (tensorboard: false)")
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.log(
                "tensorboard: off (the tensorboard package is not installed; pip install tensorboard to get "
                f"event files in {self.run_dir / TENSORBOARD_DIR})"
            )
            return None
        return SummaryWriter

    def _open_tensorboard(self, status: dict) -> None:
        """One event folder per run, a new events file per start. A resumed start writes a purge marker at the step
        after its checkpoint: TensorBoard drops what an earlier start logged beyond that checkpoint (the steps this
        start trains again), so each curve continues across restarts without a doubled stretch. A start from
        scratch purges from step 0: a run trained again in the same run_dir replaces its old curves."""
        writer, self.tb_writer = self.tb_writer, None
        resumed = status.get("resumed_from_step")
        folder = self.run_dir / TENSORBOARD_DIR
        self.tb = writer(log_dir=str(folder), purge_step=resumed + 1 if resumed else 0)
        self.log(
            f"tensorboard: event files in {folder}" + (f" (curves continue after step {resumed})" if resumed else "")
        )

    def _open_tracker(self) -> None:
        from eagle3.trackers import open_tracker

        self.tracker = open_tracker(self.cfg, self.run_dir, self.log)

    def _guard(self, sink: str, fn: Callable[[], object], at: str = "log") -> None:
        """Run one sink's write; the first failure is logged, later ones of the same sink are silent. A tracker's
        first failure (at start, at a log call, at its finish) is also kept for status.json (`tracker_state`)."""
        try:
            fn()
        except Exception as e:
            if sink in self.broken:
                return
            self.broken.add(sink)
            detail = f"{type(e).__name__}: {e}"
            if sink == "tracker":
                # A new dict, never changed after: the GPU sampler's thread may fail it while RunFiles reads it.
                self.tracker_state = {"name": self.cfg.tracker, "ok": False, "error": detail[:500], "at": at}
                self.log(
                    f"warning: tracker {self.cfg.tracker} failed at {at} ({detail}); training goes on without "
                    "it (status.json tracker.ok is false)"
                )
            else:
                self.log(f"warning: {sink} not written ({detail}); training goes on")

    def on_status(self, status: dict) -> None:
        self.status = dict(status)
        if self.tb_writer is not None and status.get("phase") == "training":
            self._guard("tensorboard", lambda: self._open_tensorboard(status))
        self._guard("prometheus textfile", self.write_prom)

    def on_record(self, record: dict) -> None:
        kind = record.get("kind")
        if kind == "train":
            self.record = record
            self.tokens_total += record.get("tokens") or 0.0
        elif kind == "val":
            self.val = record
        if self.tb is not None:
            self._guard("tensorboard", lambda: self.tb_scalars(record))
        if self.tracker is not None and "tracker" not in self.broken:
            self._guard("tracker", lambda: self.tracker.log(tb_values(record), record["step"], now_ms()))

    def on_sample(self, sample: dict) -> None:
        if self.tb is not None and sample.get("gpus"):
            self._guard("tensorboard", lambda: self.tb_gpu(sample))
        if self.tracker is not None and sample.get("gpus") and "tracker" not in self.broken:
            self._guard("tracker", lambda: self.tracker.log(gpu_values(sample), sample["step"], now_ms()))
        self._guard("prometheus textfile", self.write_prom)

    def write_prom(self) -> None:
        with self._lock:
            gpu = self.sampler.latest if self.sampler is not None else None
            write_textfile(
                self.prom_path, prom_text(self.status, self.record, self.val, gpu, self.tokens_total, self.run)
            )

    def tb_scalars(self, record: dict) -> None:
        for tag, value in tb_values(record).items():
            self.tb.add_scalar(tag, value, record["step"])
        self.tb.flush()

    def tb_gpu(self, sample: dict) -> None:
        for tag, value in gpu_values(sample).items():
            self.tb.add_scalar(tag, value, sample["step"])

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            if self.sampler.failed:
                self.log(f"warning: {self.sampler.failed}")
        if self.tb is not None:
            with contextlib.suppress(Exception):
                self.tb.close()
        if self.tracker is not None:
            self._guard("tracker", lambda: self.tracker.finish(self.status.get("phase", "")), at="finish")


def tb_values(record: dict) -> dict[str, float]:
    """The scalars of one metrics.jsonl record as TensorBoard tags (`train/...`, `val/...`).

    >>> sorted(tb_values({"kind": "val", "step": 4, "loss": 1.5, "full_acc": [0.5, None],
    ...                   "acceptance_length": 1.7}).items())
    [('val/acceptance_length', 1.7), ('val/full_acc_0', 0.5), ('val/loss', 1.5)]
    """
    kind = record.get("kind", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("kind", "step", "epoch", "max_steps", "world_size", "batches", "batches_total"):
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            out[f"{kind}/{key}"] = float(value)
        elif isinstance(value, dict):
            out.update({f"{kind}/{key}/{k}": float(v) for k, v in value.items() if isinstance(v, int | float)})
        elif isinstance(value, list) and key != "param_checksums":
            out.update({f"{kind}/{key}_{i}": float(v) for i, v in enumerate(value) if isinstance(v, int | float)})
    return out
