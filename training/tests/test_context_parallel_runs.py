"""Context parallelism end to end: `eagle3 train` with context_parallel 2 on two torchrun ranks (FSDP2 over the
(dp 1, cp 2) mesh) follows the single-process run step for step (one row per step in both: the same rows, the same
losses, the same validation); its step checkpoint resumes on one process at cp 1, and the single-process run's
resumes at cp 2 under DDP, each continuing on the reference's trajectory. Refusals come before anything is touched
(exit 2)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3 import checkpoint as ckpt
from pipeline_support import (
    TRAINING_ROOT,
    read_metrics,
    read_status,
    reap,
    rendezvous_port,
    run_trainer,
    synth_dataset,
    trainer_env,
    write_config,
)

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]
STEPS, KEPT = 8, 4  # steps of every run; the checkpoint a resume starts from
RUN_TIMEOUT = 600


def config(tmp: Path, data: Path, run: Path, **values) -> Path:
    base = dict(
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=3,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        val_every=0,
        checkpoint_every=KEPT,
        keep_checkpoints=5,
        num_threads=1,
        max_steps=STEPS,
        num_heads=4,
        num_kv_heads=2,
        attention="exact",
        activation_checkpointing="selective",
    )
    return write_config(tmp / f"{run.name}.yaml", **{**base, **values})


def single(tmp: Path, cfg: Path) -> tuple[int, str]:
    log = tmp / f"{cfg.stem}.log"
    rc = run_trainer(["train", "--config", str(cfg)], log, timeout=RUN_TIMEOUT)
    return rc, log.read_text()


def two_ranks(tmp: Path, cfg: Path) -> tuple[int, str]:
    log_path = tmp / f"{cfg.stem}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{rendezvous_port()}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "-m",
        "eagle3",
        "train",
        "--config",
        str(cfg),
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=TRAINING_ROOT, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        reap(proc)
    return rc, log_path.read_text()


def losses(run: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a resumed run appends its steps again)."""
    return {r["step"]: r["loss"] for r in read_metrics(run)}


def resumable_copy(run: Path, to: Path) -> Path:
    """A copy of `run` whose newest checkpoint is the one of step KEPT (the later ones removed)."""
    shutil.copytree(run, to)
    for path in ckpt.checkpoints_dir(to).glob("step_*"):
        if path.name > ckpt.step_dir_name(KEPT):
            shutil.rmtree(path)
    (to / "metrics.jsonl").unlink()
    return to


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-runs")
    data = synth_dataset(tmp_path_factory.getbasetemp())
    reference = tmp / "reference"
    rc, log = single(tmp, config(tmp, data, reference))
    assert rc == 0, log[-3000:]
    split = tmp / "split"
    rc, log = two_ranks(tmp, config(tmp, data, split, context_parallel=2, fsdp=True))
    assert rc == 0, log[-3000:]
    return tmp, data, reference, split, log


def test_a_row_split_over_two_ranks_trains_as_one_process(runs):
    _, _, reference, split, log = runs
    assert "context parallel: each row split over 2 ranks" in log
    status = read_status(split)
    assert (status["world_size"], status["context_parallel"], status["data_parallel"]) == (2, 2, 1)
    ref, got = losses(reference), losses(split)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(got)], rel=1e-4)
    records = {r["step"]: r for r in read_metrics(split)}
    ref_records = {r["step"]: r for r in read_metrics(reference)}
    # validation at the end: the same rows, the forward a collective of the group
    val, ref_val = read_metrics(split, "val"), read_metrics(reference, "val")
    assert [v["step"] for v in val] == [v["step"] for v in ref_val] == [STEPS]
    assert val[0]["loss"] == pytest.approx(ref_val[0]["loss"], rel=1e-5)
    assert val[0]["full_acc"] == ref_val[0]["full_acc"]
    for step in (1, STEPS):  # the row counted once, its tokens once (each rank counts its own slots)
        assert records[step]["tokens"] == ref_records[step]["tokens"]
        assert records[step]["positions"] == ref_records[step]["positions"]
        assert records[step]["full_acc"] == ref_records[step]["full_acc"]


def test_a_cp_checkpoint_resumes_at_cp_1_and_the_reverse(runs):
    tmp, data, reference, split, _ = runs
    ref = losses(reference)
    to_one = resumable_copy(split, tmp / "to_one")
    rc, log = single(tmp, config(tmp, data, to_one))
    assert rc == 0, log[-3000:]
    assert f"resumed from step {KEPT}" in log and "context_parallel 2 -> 1 since the checkpoint" in log
    got = losses(to_one)
    assert sorted(got) == list(range(KEPT + 1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(got)], rel=1e-4)

    to_two = resumable_copy(reference, tmp / "to_two")
    rc, log = two_ranks(tmp, config(tmp, data, to_two, context_parallel=2))  # DDP this time
    assert rc == 0, log[-3000:]
    assert f"resumed from step {KEPT}" in log and "context_parallel 1 -> 2 since the checkpoint" in log
    got = losses(to_two)
    assert sorted(got) == list(range(KEPT + 1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(got)], rel=1e-4)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"context_parallel": 3}, "context_parallel=3 does not divide the 1 worker of the run (one node)"),
        ({"context_parallel": 0}, "context_parallel"),
    ],
)
def test_a_context_parallel_size_that_cannot_form_exits_2_before_training(runs, values, message):
    tmp, data, *_ = runs
    run = tmp / f"refused{values['context_parallel']}"
    rc, log = single(tmp, config(tmp, data, run, **values))
    assert rc == 2, log[-3000:]
    assert message in log
    assert not ckpt.checkpoints_dir(run).exists()
