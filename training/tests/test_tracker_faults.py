"""A tracker that fails never stops training, and never fails silently: a stand-in `wandb` package, put first on the
trainer's path, breaks where FAKE_WANDB_FAILS says (on import, at init, at a log call, at its finish). Training goes
on to its last step, rank 0 logs the failure once and status.json's `tracker` carries it. `eagle3 check-tracker`
(which the Ansible role runs in the target's venv before it touches a run) imports the package the same way and
exits 2 naming the tracker, the Python and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pipeline_support import TRAINING_ROOT, read_status, run_trainer, synth_dataset, write_config

FAKE_WANDB = '''"""A stand-in for the wandb package (tests only). FAKE_WANDB_FAILS: import, init, log, finish or empty."""
import json
import os

MODE = os.environ.get("FAKE_WANDB_FAILS", "")
__version__ = "0.0-fake"
if MODE == "import":
    raise ImportError("fake wandb: a broken install")


class Settings:
    def __init__(self, **kwargs):
        pass


class Artifact:
    def __init__(self, name, type):
        pass

    def add_dir(self, path):
        pass

    def add_file(self, path):
        pass


class Run:
    def __init__(self, folder, name):
        self.id, self.name, self.step = "fake-run", name, 0
        self.dir = os.path.join(folder, "wandb", "offline-run-fake", "files")
        os.makedirs(self.dir, exist_ok=True)
        self.logged = os.path.join(folder, "fake-wandb.jsonl")

    def log(self, values, step=None):
        if MODE == "log":
            raise RuntimeError("fake wandb: the service died")
        with open(self.logged, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\\n")
        self.step = step

    def log_artifact(self, artifact):
        pass

    def finish(self, exit_code=0):
        if MODE == "finish":
            raise RuntimeError("fake wandb: cannot close the run")


def init(dir, name, **kwargs):
    if MODE == "init":
        raise RuntimeError("fake wandb: init refused")
    return Run(dir, name)
'''


@pytest.fixture
def fake_wandb(tmp_path):
    """A folder holding the stand-in `wandb` package: put it first on PYTHONPATH."""
    package = tmp_path / "fake" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    return package.parent


def fake_env(fake, mode: str) -> dict[str, str]:
    return {"PYTHONPATH": f"{fake}{os.pathsep}{TRAINING_ROOT}", "FAKE_WANDB_FAILS": mode}


@pytest.mark.parametrize(
    ("mode", "at", "error"),
    [
        ("import", "start", "ImportError: fake wandb: a broken install"),
        ("init", "start", "RuntimeError: fake wandb: init refused"),
        ("log", "log", "RuntimeError: fake wandb: the service died"),
        ("finish", "finish", "RuntimeError: fake wandb: cannot close the run"),
    ],
)
def test_a_failing_tracker_is_in_status_json_and_the_log_once_and_training_goes_on(
    fake_wandb, tmp_path, mode, at, error
):
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=str(synth_dataset(tmp_path)),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=3,
        warmup_steps=1,
        log_every=1,
        val_every=0,
        val_max_batches=1,
        checkpoint_every=1000,
        num_threads=1,
        telemetry_every_s=0,
        tensorboard=False,
        tracker="wandb",
    )
    log = tmp_path / "train.txt"
    code = run_trainer(["train", "--config", str(cfg)], log, env=fake_env(fake_wandb, mode))
    text = log.read_text()
    assert code == 0, text
    status = read_status(run)
    assert status["phase"] == "done" and status["step"] == 3 and status["error"] is None
    assert status["tracker"] == {"name": "wandb", "ok": False, "error": error, "at": at}
    warnings = [line for line in text.splitlines() if line.startswith("warning: tracker wandb failed")]
    assert warnings == [
        f"warning: tracker wandb failed at {at} ({error}); training goes on without it (status.json tracker.ok "
        "is false)"
    ]


def test_a_working_tracker_is_ok_in_status_json(fake_wandb, tmp_path):
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=str(synth_dataset(tmp_path)),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=2,
        warmup_steps=1,
        log_every=1,
        val_every=0,
        val_max_batches=1,
        checkpoint_every=1000,
        num_threads=1,
        telemetry_every_s=0,
        tensorboard=False,
        tracker="wandb",
    )
    log = tmp_path / "train.txt"
    assert run_trainer(["train", "--config", str(cfg)], log, env=fake_env(fake_wandb, "")) == 0, log.read_text()
    assert read_status(run)["tracker"] == {"name": "wandb", "ok": True, "error": None, "at": None}
    assert "warning: tracker" not in log.read_text()
    assert (run / "fake-wandb.jsonl").read_text().count('"train/loss"') == 2


def check_tracker(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m eagle3 check-tracker ARGS`, asserting that it never imports torch."""
    code = (
        "import sys; from eagle3.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'check-tracker imported torch'; sys.exit(code)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "check-tracker", *args],
        cwd=TRAINING_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_tracker_imports_the_configs_tracker_without_torch(fake_wandb, tmp_path):
    config = write_config(tmp_path / "train.yaml", data_dir="/d", run_dir="/r", max_seq_len="auto", tracker="wandb")
    python = os.path.normpath(sys.executable)  # as the child sees itself
    broken = check_tracker(["--config", str(config)], fake_env(fake_wandb, "import"))
    assert broken.returncode == 2, broken.stderr
    assert broken.stderr.strip() == (
        f"check-tracker: tracker='wandb' cannot be used: import wandb fails in {python} (ImportError: fake "
        f"wandb: a broken install); pip install wandb into the training venv ({sys.prefix}), or set tracker: none"
    )
    fine = check_tracker(["--config", str(config)], fake_env(fake_wandb, ""))
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.strip() == f"tracker: wandb (wandb 0.0-fake) imports in {python}"
    none = check_tracker(["--config", str(write_config(tmp_path / "none.yaml", data_dir="/d"))], {})
    assert none.returncode == 0 and none.stdout.strip() == "tracker: none (nothing to import)"
    wrong = check_tracker(["--tracker", "tensorboard"], {})
    assert wrong.returncode == 2 and "tracker='tensorboard' is not one of none, mlflow, wandb" in wrong.stderr
