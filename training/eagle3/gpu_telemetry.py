"""GPU telemetry for the trainer's observer: NVML read in a background thread (power, utilisation, SM clock,
memory per GPU), one record per sample in `telemetry.jsonl` beside `metrics.jsonl`, and the "starved" flag of a GPU
that shows high utilisation at low power (it waits on communication or data instead of computing).

Never a reason to stop training: without NVML (no GPU, no pynvml) the sampler says why once and writes nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

TELEMETRY_FILE = "telemetry.jsonl"
# The same rule as module_utils/nvml.py `is_starved` (the status summary's flag): high utilisation at low power.
STARVED_MIN_UTILIZATION_PCT = 90.0
STARVED_MAX_POWER_FRACTION = 0.5


def is_starved(util_pct: float | None, power_w: float | None, limit_w: float | None) -> bool:
    """High utilisation at low power: the GPU waits (communication, data), it does not compute.

    >>> is_starved(100, 250, 600), is_starved(100, 476, 600), is_starved(20, 90, 600), is_starved(100, None, 600)
    (True, False, False, False)
    """
    if util_pct is None or power_w is None or not limit_w:
        return False
    return util_pct >= STARVED_MIN_UTILIZATION_PCT and power_w < STARVED_MAX_POWER_FRACTION * limit_w


def nvml_reader() -> tuple[Callable[[], list[dict]] | None, str]:
    """A function returning one dict per GPU (NVML through nvidia-ml-py, the module torch.cuda's power and
    utilisation calls use), or None and why not."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None, "no GPU"
    except ImportError:  # pragma: no cover - the trainer always has torch
        return None, "no GPU"
    try:
        import pynvml
    except ImportError:
        return None, "no NVML: nvidia-ml-py is not installed (torch.cuda.power_draw needs it too)"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        return None, f"no NVML: {e}"

    def value(fn, *args):
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None

    def read() -> list[dict]:
        gpus = []
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            power = value(pynvml.nvmlDeviceGetPowerUsage, h)  # mW
            limit = value(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)  # mW
            util = value(pynvml.nvmlDeviceGetUtilizationRates, h)
            clock = value(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)  # MHz
            mem = value(pynvml.nvmlDeviceGetMemoryInfo, h)
            gpus.append(
                gpu_sample(
                    i,
                    power_w=None if power is None else power / 1000,
                    power_limit_w=None if limit is None else limit / 1000,
                    util_pct=None if util is None else float(util.gpu),
                    sm_clock_mhz=None if clock is None else float(clock),
                    memory_used_bytes=None if mem is None else float(mem.used),
                    memory_total_bytes=None if mem is None else float(mem.total),
                )
            )
        return gpus

    return read, "nvml"


def gpu_sample(index: int, **values: float | None) -> dict:
    """One GPU's sample with its starvation flag.

    >>> gpu_sample(0, power_w=200.0, power_limit_w=600.0, util_pct=99.0)["starved"]
    True
    """
    sample = {"index": index, **values}
    sample["starved"] = is_starved(values.get("util_pct"), values.get("power_w"), values.get("power_limit_w"))
    return sample


class GpuSampler:
    """Samples the GPUs every `interval_s` in a daemon thread, appending `telemetry.jsonl` records
    {"kind": "gpu", "time", "step", "gpus": [...]}. Without a GPU it writes one record with `"gpus": []` and a
    `note` ("no GPU"), and samples nothing: no value is ever made up."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        interval_s: float,
        step: Callable[[], int],
        reader: Callable[[], list[dict]] | None,
        note: str,
        on_sample: Callable[[dict], None] | None = None,
    ):
        self.path = Path(run_dir) / TELEMETRY_FILE
        self.interval_s = interval_s
        self.step = step
        self.reader = reader
        self.note = note
        self.on_sample = on_sample
        self.latest: dict | None = None
        self.failed: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> dict:
        record = {"kind": "gpu", "time": time.time(), "step": self.step()}
        if self.reader is None:
            record.update(gpus=[], note=self.note)
        else:
            try:
                record["gpus"] = self.reader()
            except Exception as e:  # a driver hiccup must not stop training; say so in the record
                record.update(gpus=[], note=f"sample failed: {type(e).__name__}: {e}")
        self.latest = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.on_sample is not None:
            self.on_sample(record)
        return record

    def start(self) -> GpuSampler:
        self.sample_once()
        if self.reader is not None and self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="eagle3-telemetry", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except OSError as e:
                self.failed = f"{TELEMETRY_FILE} not written ({e.strerror or e}); telemetry stopped"
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def now_ms() -> int:
    return int(time.time() * 1000)


def gpu_values(sample: dict) -> dict[str, float]:
    """One telemetry sample's scalars, per GPU (`gpu0/power_w`, ..., `gpu0/starved` as 0 or 1).

    >>> gpu_values({"step": 3, "gpus": [{"index": 0, "power_w": 250.0, "util_pct": None, "starved": False}]})
    {'gpu0/power_w': 250.0, 'gpu0/starved': 0.0}
    """
    out: dict[str, float] = {}
    for g in sample["gpus"]:
        for key in ("power_w", "util_pct", "sm_clock_mhz", "memory_used_bytes"):
            if g.get(key) is not None:
                out[f"gpu{g['index']}/{key}"] = float(g[key])
        out[f"gpu{g['index']}/starved"] = float(g["starved"])
    return out
