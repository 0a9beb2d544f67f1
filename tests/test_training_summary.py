"""The summary train.yml and status.yml print (filter training_summary over train_report's result)."""

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

RUNNING = {
    "phase": "training",
    "step": 40,
    "world_size": 2,
    "max_seq_len": 16384,
    "step_time_s": 4.0,
    "tokens_per_s": 8252.0,
    "tokens_per_s_per_rank": 4126.0,
    "peak_mem_gb": 1.4,
    "mem_kind": "rss",
    "loss": 3.2,
    "full_acc_0": 0.41,
    "eta_s": 3725,
    "last_checkpoint_step": 38,
    "last_checkpoint_time": 900.0,
}


def report(state: str, reason: str = "", detail: str = "", **extra) -> dict:
    return {
        "run": {"state": state, "reason": reason, "detail": detail, "stalled": extra.pop("stalled", False)},
        "unit": extra.pop("unit", {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}),
        "status": extra.pop("status", RUNNING),
        **extra,
    }


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
    lines = summary.training_summary(report("running"), gpus)
    assert "100% util at 250/600 W" in lines[-1] and "STARVED" in lines[-1]


def test_a_failed_run_has_its_reason_and_no_rates_or_eta():
    lines = summary.training_summary(
        report(
            "failed",
            reason="oom: CUDA out of memory",
            detail="unit failed (result exit-code)",
            unit={"ActiveState": "failed", "SubState": "failed", "NRestarts": "0"},
        ),
        [],
        now=1000.0,
    )
    text = "\n".join(lines)
    assert lines[0].startswith("state: failed (unit failed (result exit-code)); eagle3-train.service failed")
    assert "reason: oom: CUDA out of memory" in lines
    assert "tokens/s" not in text and "ETA" not in text and "s/step" not in text
    assert "last checkpoint step 38 (1m40s ago)" in text
    assert lines[-1] == "GPUs: none visible (CPU workers)"


def test_stopped_and_crash_looping_runs_show_no_rates():
    for state in ("stopped", "crash-looping", "finished", "starting"):
        text = "\n".join(summary.training_summary(report(state, reason="signal: killed by SIGKILL"), []))
        assert f"state: {state}" in text and "tokens/s" not in text and "ETA" not in text


def test_a_stalled_run_shows_no_eta():
    lines = summary.training_summary(
        report("running", detail="stalled: no step for 600 s (expected about 4 s)", stalled=True), []
    )
    assert "stalled: no step for 600 s (expected about 4 s)" in lines[0]
    assert not any("ETA" in line for line in lines)
    # The last measured rate is history, not a current rate: it is labelled so, never shown as "N tokens/s" alone.
    rate_lines = [line for line in lines if "tokens/s" in line]
    assert rate_lines and all(line.startswith("no current rate while stalled") for line in rate_lines)


def test_a_running_run_after_a_failure_names_how_the_previous_run_ended():
    text = "\n".join(summary.training_summary(report("running", reason="hang: no step for 45 s"), []))
    assert "state: running" in text and "the previous run ended with hang: no step for 45 s" in text


def test_gpu_holders_outside_the_unit_are_named_with_user_and_command():
    holder = {
        "pid": 4242,
        "name": "python3",
        "user": "alice",
        "paths": ["/dev/nvidia1"],
        "cmdline": "python3 nb.py",
    }
    guard = {
        "pid": 7,
        "name": "nvidia-persistenced",
        "user": "root",
        "paths": ["/dev/nvidia0"],
        "cmdline": "x",
    }
    lines = summary.training_summary(report("running", foreign_holders=[holder], protected_holders=[guard]), [])
    assert "GPU held outside the unit: pid 4242 python3 (user alice): python3 nb.py holds /dev/nvidia1" in lines
    assert any(line.startswith("GPU held by a protected process (never signalled): pid 7") for line in lines)


def test_a_stop_that_had_to_kill_says_so():
    stop = {
        "message": "workers ignored SIGTERM for 60 s: rank 1 (pid 4242) got SIGKILL; 7 step(s) since the last "
        "checkpoint (step 50) are lost"
    }
    lines = summary.training_summary(report("failed", reason="signal: killed by SIGKILL", last_stop=stop), [])
    assert f"last stop: {stop['message']}" in lines


def test_the_last_validation_acceptance_length_is_shown_running_or_not():
    status = {**RUNNING, "acceptance_length": 2.4125, "acceptance_length_step": 500, "val": {"step": 500}}
    for state in ("running", "stopped", "failed"):
        lines = summary.training_summary(report(state, status=status), [], now=1000.0)
        assert "acceptance length 2.41 (val, step 500)" in lines, (state, lines)
    # Before the first validation (or from a trainer that did not write it) there is no such line.
    lines = summary.training_summary(report("running", status={**RUNNING, "val": None}), [], now=1000.0)
    assert not any("acceptance length" in line for line in lines)


def test_the_first_line_says_how_rows_are_split_when_status_json_does():
    status = {**RUNNING, "world_size": 8, "context_parallel": 4, "data_parallel": 2}
    first = summary.training_summary(report("running", status=status), [])[0]
    assert first.endswith("max_seq_len 16384, context_parallel 4, data_parallel 2 (rows per step)"), first
    first = summary.training_summary(report("running"), [])[0]  # a trainer without context parallelism
    assert first.endswith("max_seq_len 16384") and "context_parallel" not in first
