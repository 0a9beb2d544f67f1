"""Resume after faults, as a user sees it: corrupt checkpoints are passed over (moved aside, one warning each), a full
disk mid-checkpoint keeps the previous one and says so, status.json tells the truth after a resume, and a
re-planned epoch is named correctly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from eagle3 import checkpoint as ckpt
from eagle3.checkpointer import replan_on_resume
from eagle3.errors import EXIT_CONFIG, EXIT_STORAGE
from pipeline_support import (
    TRAINING_ROOT,
    read_samples,
    read_status,
    reap,
    run_trainer,
    synth_dataset,
    trainer_env,
    write_config,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.getbasetemp())


def _config(tmp_path, data, **values):
    base = dict(
        data_dir=str(data),
        run_dir=str(tmp_path / "run"),
        max_seq_len=512,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        val_every=0,
        val_fraction=0.0,
        checkpoint_every=2,
        max_steps=6,
        keep_checkpoints=3,
        num_threads=1,
        record_samples=True,
    )
    base.update(values)
    return write_config(tmp_path / "train.yaml", **base)


def _state(**values):
    base = dict(step=70, epoch=1, step_in_epoch=30, samples_seen=0, world_size=1, max_seq_len=512, seed=0)
    return ckpt.TrainerState(**{**base, **values})


# ------------------------------------------------------------------------------------------ the re-plan warning
def test_replan_mid_epoch_names_the_epoch_that_continues():
    state = _state()
    note = replan_on_resume(state, ["world_size 1 -> 2"], plan_len=50)
    assert note == (
        "warning: world_size 1 -> 2 since the checkpoint: the rest of epoch 1 is re-planned (from step 30 of 50)"
    )
    assert (state.epoch, state.step_in_epoch) == (1, 30)


def test_replan_past_the_end_of_a_shorter_plan_names_the_skipped_epoch_and_the_next():
    # The old warning said "the rest of epoch 1 is re-planned" and then continued with epoch 2.
    state = _state()
    note = replan_on_resume(state, ["max_seq_len 512 -> 1024"], plan_len=20)
    assert (state.epoch, state.step_in_epoch) == (2, 0)
    assert "epoch 1 now has 20 steps and 30 were done" in note
    assert "the rest of epoch 1 is skipped" in note and "continues with epoch 2 from its start" in note
    assert "re-planned" not in note


def test_no_warning_without_a_change_or_at_an_epoch_start():
    assert replan_on_resume(_state(), [], plan_len=50) is None
    assert replan_on_resume(_state(step_in_epoch=0), ["seed 0 -> 1"], plan_len=50) is None


# ------------------------------------------------------------------------------------------ corrupt checkpoints
@pytest.mark.slow
def test_corrupt_checkpoints_are_passed_over_and_status_tells_the_truth(tmp_path, data):
    cfg = _config(tmp_path, data)
    run = tmp_path / "run"
    root = ckpt.checkpoints_dir(run)
    assert run_trainer(["train", "--config", str(cfg)], tmp_path / "a.txt", timeout=180) == 0
    assert [s for s, _ in ckpt.list_valid(run)] == [2, 4, 6]
    data6 = (root / "step_00000006" / "model.safetensors").read_bytes()
    (root / "step_00000006" / "model.safetensors").write_bytes(data6[: len(data6) // 2])  # truncated
    size4 = (root / "step_00000004" / "model.safetensors").stat().st_size
    (root / "step_00000004" / "model.safetensors").write_bytes(b"\0" * size4)  # zero-filled

    # Restart for two more steps: resumes from step 2, with one warning per skipped checkpoint.
    log = tmp_path / "b.txt"
    assert run_trainer(["train", "--config", str(cfg), "--max-steps", "8"], log, timeout=180) == 0
    text = log.read_text()
    warnings = [line for line in text.splitlines() if line.startswith("warning: checkpoint ")]
    assert len(warnings) == 2, text
    assert str(root / "step_00000006") in warnings[0] and "truncated" in warnings[0]
    assert str(root / "step_00000004") in warnings[1] and "sha256" in warnings[1]
    assert all("moved aside to" in w for w in warnings)
    assert f"resumed from step 2 (checkpoint {root / 'step_00000002'})" in text
    status = read_status(run)
    assert status["phase"] == "done" and status["resumed_from_step"] == 2
    assert status["resumed_from_checkpoint"] == str(root / "step_00000002")
    assert [s["name"] for s in status["skipped_checkpoints"]] == ["step_00000006", "step_00000004"]
    assert status["last_checkpoint_step"] == 8
    assert (root / "step_00000006.corrupt").is_dir() and (root / "step_00000004.corrupt").is_dir()
    steps = [r["step"] for r in read_samples(run)]
    assert steps == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7, 8]  # steps 3-6 ran again, from the same data order

    # A restart of the finished run: nothing to train, and status.json still knows its last checkpoint.
    assert run_trainer(["train", "--config", str(cfg), "--max-steps", "8"], tmp_path / "c.txt", timeout=180) == 0
    status = read_status(run)
    manifest = json.loads((root / "step_00000008" / ckpt.MARKER).read_text())
    assert status["phase"] == "done" and status["step"] == 8 and status["resumed_from_step"] == 8
    assert status["last_checkpoint_step"] == 8 and status["last_checkpoint_time"] == manifest["time"]
    assert status["skipped_checkpoints"] == []

    # Every checkpoint corrupt: a fresh start (decided: the run goes on; the corrupt ones stay aside).
    for _step, path in ckpt.list_valid(run):
        (path / "optimizer.pt").write_bytes(b"\0" * (path / "optimizer.pt").stat().st_size)
    log = tmp_path / "d.txt"
    assert run_trainer(["train", "--config", str(cfg), "--max-steps", "2"], log, timeout=180) == 0
    text = log.read_text()
    assert text.count("warning: checkpoint ") == 3
    assert "none of the 3 checkpoints" in text and "training starts from step 0" in text
    status = read_status(run)
    assert status["resumed_from_step"] is None and status["step"] == 2 and status["last_checkpoint_step"] == 2
    assert len(status["skipped_checkpoints"]) == 3
    assert len([p for p in root.iterdir() if ckpt.CORRUPT_SUFFIX in p.name]) == 5


# ------------------------------------------------------------------------------------------ the packer of a checkpoint
def test_a_checkpoint_from_before_the_packing_key_was_packed_next_fit():
    old = {
        "step": 4,
        "epoch": 0,
        "step_in_epoch": 4,
        "samples_seen": 9,
        "world_size": 1,
        "max_seq_len": 512,
        "seed": 0,
        "best_val_loss": None,
        "best_step": None,
    }
    assert ckpt.TrainerState(**old).packing == "next_fit"


def _planned(data, packing):
    from eagle3.data import DatasetReader
    from eagle3.packing import plan_epoch

    reader = DatasetReader(data)
    ids = list(range(reader.index.num_samples))  # val_fraction 0
    return plan_epoch(ids, reader.index.lengths, max_seq_len=512, world_size=1, seed=0, epoch=0, packing=packing)


@pytest.mark.slow
def test_a_run_resumes_on_its_checkpoints_plan_or_says_it_was_re_planned(tmp_path, data):
    """A run keeps its packer's plan across a restart; a restart with the other packer re-plans the rest of the epoch,
    says so and how to keep the checkpoint's plan (packing: next_fit for checkpoints of earlier versions)."""
    run = tmp_path / "run"
    cfg = _config(tmp_path, data, packing="next_fit", max_steps=4)
    assert run_trainer(["train", "--config", str(cfg)], tmp_path / "a.txt", timeout=180) == 0
    state = json.loads((ckpt.checkpoints_dir(run) / "step_00000004" / "trainer_state.json").read_text())
    assert state["packing"] == "next_fit"

    log = tmp_path / "b.txt"
    assert run_trainer(["train", "--config", str(cfg), "--max-steps", "5"], log, timeout=180) == 0
    assert "packing" not in log.read_text()
    next_fit, first_fit = _planned(data, "next_fit"), _planned(data, "first_fit")
    assert next_fit.steps[:5] != first_fit.steps[:5]  # the test tells the packers apart
    assert [r["ids"] for r in read_samples(run)] == [s[0] for s in next_fit.steps[:5]]

    log = tmp_path / "c.txt"
    cfg = _config(tmp_path, data, max_steps=7)  # the default packer
    assert run_trainer(["train", "--config", str(cfg)], log, timeout=180) == 0
    assert (
        "warning: packing next_fit -> first_fit (packing: next_fit keeps the checkpoint's plan) since the "
        f"checkpoint: the rest of epoch 0 is re-planned (from step 5 of {len(first_fit)})"
    ) in log.read_text()
    assert [r["ids"] for r in read_samples(run)][5:] == [s[0] for s in first_fit.steps[5:7]]
    state = json.loads((ckpt.checkpoints_dir(run) / "step_00000007" / "trainer_state.json").read_text())
    assert state["packing"] == "first_fit"


# ------------------------------------------------------------------------------------------ a full disk
# The trainer in a subprocess, with safetensors' writer failing on its second checkpoint: half the file is
# written, then ENOSPC, as a disk that fills up during the save.
FULL_DISK_DRIVER = """
import errno, os, sys
from eagle3 import checkpoint as ckpt
from eagle3.train import main

real = ckpt.save_file
calls = []
failure = getattr(errno, os.environ.get("FAULT_ERRNO", "ENOSPC"))

def save_file(tensors, filename, *args, **kwargs):
    calls.append(filename)
    if len(calls) == 2:
        with open(filename, "wb") as f:
            f.write(b"\\0" * 1000)
        raise OSError(failure, os.strerror(failure), filename)
    return real(tensors, filename, *args, **kwargs)

ckpt.save_file = save_file
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("errno_name", "kind", "says"),
    [
        ("ENOSPC", "disk_full", "disk full on {root} (ENOSPC: No space left on device"),
        ("EROFS", "read_only", "{root} is read-only (EROFS: Read-only file system)"),
        ("EACCES", "no_permission", "{root} cannot be written by this user (EACCES: Permission denied)"),
    ],
)
def test_a_checkpoint_folder_that_refuses_a_write_keeps_the_previous_one_and_stops(
    tmp_path, data, errno_name, kind, says
):
    cfg = _config(tmp_path, data)
    run = tmp_path / "run"
    root = ckpt.checkpoints_dir(run)
    log = tmp_path / "full.txt"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", FULL_DISK_DRIVER, "--config", str(cfg)],
            cwd=TRAINING_ROOT,
            env={**trainer_env(), "FAULT_ERRNO": errno_name},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout=180)
    finally:
        reap(proc)
    text = log.read_text()
    # Its own exit status, which the unit never restarts: a restart would train to the next save and fail again.
    assert rc == EXIT_STORAGE, text
    line = f"checkpoint at step 4 not written: {says.format(root=root)}"
    assert line in text and "previous checkpoint step 2 kept" in text
    assert "Traceback" not in text  # a clear line, not a stack trace
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # the partial directory is gone
    assert ckpt.verify(root / "step_00000002") is None
    status = read_status(run)
    assert status["phase"] == "failed" and status["error"]["kind"] == kind
    assert status["error"]["errno"] == errno_name and status["error"]["path"] == str(root)
    assert line in status["error"]["message"] and status["last_checkpoint_step"] == 2
    if errno_name != "ENOSPC":
        return
    # Space again: the restart resumes from the kept checkpoint and finishes.
    assert run_trainer(["train", "--config", str(cfg)], tmp_path / "again.txt", timeout=180) == 0
    status = read_status(run)
    assert status["phase"] == "done" and status["resumed_from_step"] == 2 and status["error"] is None


def _can_mount_private_tmpfs(where) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def test_a_real_full_disk_takes_the_same_path(tmp_path, data):
    """The run directory on a 1.6 MB tmpfs (private to the trainer's mount namespace, gone when it exits): the
    first checkpoint (~1 MB) fits, the second runs out of space inside torch.save."""
    small = tmp_path / "small"
    small.mkdir()
    if not _can_mount_private_tmpfs(small):
        pytest.skip("needs root and a private mount namespace (unshare -m) for a small tmpfs")
    cfg = _config(tmp_path, data, run_dir=str(small / "run"), record_samples=False)
    out = tmp_path / "copied"
    log = tmp_path / "log.txt"
    script = (
        f"mount -t tmpfs -o size=1600k tmpfs {small} && {sys.executable} -m eagle3 train --config {cfg} "
        f"> {log} 2>&1; rc=$?; cp -r {small / 'run'} {out}; exit $rc"
    )
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script], cwd=TRAINING_ROOT, env=trainer_env(), start_new_session=True
    )
    try:
        rc = proc.wait(timeout=180)
    finally:
        reap(proc)
    text = log.read_text()
    assert rc == EXIT_STORAGE, text
    root = ckpt.checkpoints_dir(small / "run")
    assert f"checkpoint at step 4 not written: disk full on {root}" in text, text
    assert "previous checkpoint step 2 kept" in text
    assert sorted(p.name for p in ckpt.checkpoints_dir(out).iterdir()) == ["step_00000002"]
    assert ckpt.verify(ckpt.checkpoints_dir(out) / "step_00000002") is None
    error = read_status(out)["error"]
    assert error["kind"] == "disk_full" and "previous checkpoint step 2 kept" in error["message"]


def test_a_read_only_checkpoint_folder_stops_the_run_at_its_first_save(tmp_path, data):
    """checkpoints/ bind-mounted read-only (in the trainer's own mount namespace): the real EROFS, exit 5, the
    folder and the errno in status.json; the run folder itself stays writable."""
    run = tmp_path / "run"
    root = ckpt.checkpoints_dir(run)
    root.mkdir(parents=True)
    if not _can_mount_private_tmpfs(tmp_path):
        pytest.skip("needs root and a private mount namespace (unshare -m)")
    cfg = _config(tmp_path, data)
    log = tmp_path / "log.txt"
    script = (
        f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
        f"exec {sys.executable} -m eagle3 train --config {cfg} > {log} 2>&1"
    )
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script], cwd=TRAINING_ROOT, env=trainer_env(), start_new_session=True
    )
    try:
        rc = proc.wait(timeout=180)
    finally:
        reap(proc)
    text = log.read_text()
    assert rc == EXIT_STORAGE, text
    assert f"checkpoint at step 2 not written: {root} is read-only (EROFS" in text and "no previous checkpoint" in text
    error = read_status(run)["error"]
    assert (error["kind"], error["errno"], error["path"]) == ("read_only", "EROFS", str(root))
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("broken", ["max_seq_len: [", "run_dir: /x\n\tbad: tab", "- a list\n- not a mapping"])
def test_a_config_file_that_cannot_be_parsed_exits_2_and_says_so_where_the_launcher_looks(tmp_path, broken):
    """Even a config whose run_dir cannot be read reports a config error (exit 2, never restarted) in the
    status.json the launcher names, keeping what that file said of the earlier run."""
    status_file = tmp_path / "run" / "status.json"
    status_file.parent.mkdir()
    status_file.write_text(
        json.dumps(
            {"phase": "training", "step": 40, "epoch": 1, "last_checkpoint_step": 25, "updated": 1.0, "error": None}
        )
    )
    cfg = tmp_path / "train.yaml"
    cfg.write_text(broken)
    log = tmp_path / "log.txt"
    env = {**trainer_env(), "EAGLE3_STATUS_FILE": str(status_file)}
    rc = run_trainer(["train", "--config", str(cfg)], log, timeout=60, env=env)
    assert rc == EXIT_CONFIG, log.read_text()
    assert "Traceback" not in log.read_text()
    status = json.loads(status_file.read_text())
    assert status["phase"] == "failed" and status["error"]["kind"] == "config"
    assert str(cfg) in status["error"]["message"]
    # The last real step and checkpoint survive the failure.
    assert (status["step"], status["last_checkpoint_step"]) == (40, 25)
    assert status["previous_run"]["step"] == 40
