"""The summary train.yml and status.yml print (filter training_summary)."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "training_summary", ROOT / "roles" / "eagle3_train" / "filter_plugins" / "training_summary.py"
)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def test_doctests():
    assert doctest.testmod(summary).failed == 0


def test_starved_gpu_is_called_out():
    gpus = [
        {
            "index": 0,
            "name": "RTX PRO 6000",
            "utilization_pct": 100,
            "power_draw_w": 250,
            "power_limit_w": 600,
            "memory_used_mib": 40000,
            "memory_total_mib": 97887,
            "starved": True,
        }
    ]
    lines = summary.training_summary({}, {}, gpus)
    assert "100% util at 250/600 W" in lines[-1] and "STARVED" in lines[-1]


def test_no_status_yet_and_an_oom_are_readable():
    lines = summary.training_summary(
        {"phase": "failed", "error": {"kind": "oom", "message": "CUDA out of memory", "max_seq_len": 32768}},
        {"ActiveState": "failed", "SubState": "failed", "NRestarts": "0"},
        [],
    )
    assert lines[0].startswith("eagle3-train.service: failed (failed), restarts 0")
    assert "last error (oom, max_seq_len 32768): CUDA out of memory" in lines
    assert lines[-1] == "GPUs: none visible (CPU workers)"
