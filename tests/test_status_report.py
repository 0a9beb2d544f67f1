"""status.yml -e report=true: the report page is rendered on the training host with the trainer's venv and fetched
to the controller, its path printed; a run directory with a truncated metrics line still gives a report; an invalid
value of `report` fails naming it. The training host is this machine (local connection), every path under tmp_path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.local_inventory import local_training_inventory

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
TRAIN_VENV = ROOT / ".venv-train"


def train_record(step: int) -> dict:
    return {
        "kind": "train",
        "step": step,
        "epoch": 0,
        "max_steps": 10,
        "lr": 1e-4,
        "loss": 2.0 / step,
        "loss_per_step": [2.0 / step, 2.5 / step],
        "full_acc": [0.1 * step, 0.05 * step],
        "cond_acc": [0.1 * step, 0.08 * step],
        "tokens_per_s": 1000.0,
        "tokens_per_s_per_rank": 1000.0,
        "step_time_s": 0.5,
        "time_split": {"fetch": 0.01, "fwd": 0.2, "bwd": 0.25, "opt": 0.04},
        "peak_mem_gb": 1.5,
        "peak_mem_gb_per_rank": [1.5],
        "mem_kind": "rss",
        "world_size": 1,
    }


@pytest.fixture
def target(tmp_path):
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "src").symlink_to(ROOT / "training")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps(train_record(s)) for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:40])  # a run killed mid-write
    (run_dir / "status.json").write_text(
        json.dumps(
            {
                "phase": "failed",
                "step": 3,
                "max_steps": 10,
                "max_seq_len": 512,
                "world_size": 1,
                "updated": 0,
                "error": {"kind": "crash", "message": "test", "max_seq_len": 512},
            }
        )
    )
    return local_training_inventory(
        tmp_path / "local.yml",
        eagle3_train_prefix=str(prefix),
        eagle3_train_run_dir=str(run_dir),
        eagle3_train_venv=str(TRAIN_VENV),
    )


def run_status(inventory: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    args = [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(ROOT / "status.yml")]
    for e in extra:
        args += ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(not (TRAIN_VENV / "bin" / "python").exists(), reason="no training venv (scripts/setup.sh)")
def test_status_report_fetches_a_png_and_prints_its_path(target, tmp_path):
    proc = run_status(target, "report=true", f"report_dir={tmp_path}/reports")
    assert proc.returncode == 0, proc.stdout[-3000:]
    match = re.search(r"report written to (\S+\.png)", proc.stdout)
    assert match, proc.stdout[-3000:]
    png = Path(match.group(1))
    assert png.parent == tmp_path / "reports" and png.name.startswith("ct-local-")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "metrics.jsonl line 4 skipped: truncated or not JSON" in proc.stdout
    sidecar = json.loads((tmp_path / "run" / "report.json").read_text())
    assert sidecar["runs"][0]["phase"] == "failed" and sidecar["runs"][0]["train_records"] == 3


@pytest.mark.slow
def test_status_without_report_renders_nothing(target, tmp_path):
    proc = run_status(target)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "report written" not in proc.stdout and not (tmp_path / "run" / "report.png").exists()


@pytest.mark.slow
def test_status_rejects_a_report_value_that_is_not_a_boolean(target, tmp_path):
    proc = run_status(target, "report=maybe")
    assert proc.returncode != 0
    assert (
        "report=maybe is not a boolean; allowed: true or false (also yes/no, on/off, 1/0, any case)" in proc.stdout
    ), proc.stdout[-3000:]
    assert not (tmp_path / "run" / "report.png").exists()


def test_the_trainers_starvation_rule_is_the_summarys():
    """eagle3/gpu_telemetry.py marks starved samples with a copy of module_utils/nvml.py's thresholds (the trainer
    cannot import module_utils): the report's red crosses and the status summary's flag must agree."""
    import ast

    from module_utils import nvml

    tree = ast.parse((ROOT / "training" / "eagle3" / "gpu_telemetry.py").read_text())
    copies = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "").startswith("STARVED_")
    }
    assert copies == {
        "STARVED_MIN_UTILIZATION_PCT": nvml.STARVED_MIN_UTILIZATION_PCT,
        "STARVED_MAX_POWER_FRACTION": nvml.STARVED_MAX_POWER_FRACTION,
    }
