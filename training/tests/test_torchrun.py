"""Two CPU ranks under torchrun (gloo): loss falls, parameters stay identical, metrics cover both ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3 import checkpoint as ckpt
from eagle3.data import DatasetReader
from pipeline_support import (
    TRAINING_ROOT,
    read_metrics,
    read_samples,
    read_status,
    reap,
    synth_dataset,
    trainer_env,
    wait_for,
    write_config,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_torchrun(tmp_path: Path, **values) -> tuple[subprocess.Popen, Path]:
    data = values.pop("data_dir")
    run = tmp_path / "run"
    base = dict(
        data_dir=str(data), run_dir=str(run), max_seq_len=512, ttt_steps=2, lr=3e-3, warmup_steps=3,
        log_every=4, val_every=12, checkpoint_every=12, num_threads=1, record_samples=True,
    )  # fmt: skip
    cfg = write_config(tmp_path / "train.yaml", **{**base, **values})
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--master-addr", "127.0.0.1",
        "--log-dir", str(tmp_path / "torchrun_logs"), "-m", "eagle3", "train", "--config", str(cfg),
    ]  # fmt: skip
    log = (tmp_path / "log.txt").open("wb")
    proc = subprocess.Popen(
        cmd,
        cwd=TRAINING_ROOT,
        env=trainer_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, run


def worker_pids(agent_pid: int) -> list[int]:
    """The torchrun agent's direct children (the workers we started through it)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    return [int(p) for p in children]


def worker_rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK="))[5:])


@pytest.mark.slow
def test_two_ranks_stay_in_sync_and_reduce_metrics(tmp_path_factory, tmp_path):
    data = synth_dataset(tmp_path_factory.getbasetemp())
    proc, run = start_torchrun(tmp_path, data_dir=data, max_steps=24)
    try:
        rc = proc.wait(timeout=240)
    finally:
        reap(proc)
    assert rc == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert read_status(run)["world_size"] == 2 and read_status(run)["phase"] == "done"

    records = read_metrics(run)
    assert records[-1]["loss"] < records[0]["loss"] * 0.8  # loss falls
    for r in records:  # DDP keeps both ranks' parameters identical
        a, b = r["param_checksums"]
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)
    # Tokens and supervised positions in the metrics are the sums over both ranks' rows.
    reader = DatasetReader(data)
    rank_records = [read_samples(run, 0), read_samples(run, 1)]
    ids0 = {s for r in rank_records[0] for s in r["ids"]}
    ids1 = {s for r in rank_records[1] for s in r["ids"]}
    assert ids0 and ids1 and not ids0 & ids1  # each rank packs its own samples
    window = [r for r in (rank_records[0] + rank_records[1]) if r["step"] <= records[0]["step"]]
    tokens = sum(reader.index.lengths[s] for r in window for s in r["ids"])
    assert records[0]["tokens"] == tokens
    assert len(records[0]["peak_mem_gb_per_rank"]) == 2 and min(records[0]["peak_mem_gb_per_rank"]) > 0


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path_factory, tmp_path):
    """Only rank 1 gets the signal; the stop-flag collective makes rank 0 checkpoint and stop with it."""
    data = synth_dataset(tmp_path_factory.getbasetemp())
    proc, run = start_torchrun(
        tmp_path, data_dir=data, epochs=1, log_every=1, val_every=0, checkpoint_every=1000
    )
    try:
        assert wait_for(lambda: any(r["step"] >= 3 for r in read_metrics(run)), timeout=120)
        rank1 = next(p for p in worker_pids(proc.pid) if worker_rank(p) == 1)
        os.kill(rank1, signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        reap(proc)
    assert rc == 0, (tmp_path / "log.txt").read_text()[-3000:]
    status = read_status(run)
    assert status["phase"] == "stopped"
    stopped_at = status["step"]
    assert ckpt.newest_valid(run).name == ckpt.step_dir_name(stopped_at)
    assert (ckpt.newest_valid(run) / "rng_rank1.pt").is_file()
    assert (
        [r["step"] for r in read_samples(run, 0)]
        == [r["step"] for r in read_samples(run, 1)]
        == list(range(1, stopped_at + 1))
    )


@pytest.mark.slow
def test_fsdp_matches_ddp_and_resumes(tmp_path_factory, tmp_path):
    """FSDP2 (fp32 on CPU) follows the same trajectory as DDP; its checkpoints resume like DDP's."""
    data = synth_dataset(tmp_path_factory.getbasetemp())
    losses = {}
    for mode in ("ddp", "fsdp"):
        (tmp_path / mode).mkdir()
        proc, run = start_torchrun(
            tmp_path / mode, data_dir=data, max_steps=8, val_every=0, checkpoint_every=4, fsdp=mode == "fsdp"
        )
        try:
            assert proc.wait(timeout=240) == 0, (tmp_path / mode / "log.txt").read_text()[-3000:]
        finally:
            reap(proc)
        losses[mode] = [r["loss"] for r in read_metrics(run)]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-4)
    # Resume the FSDP run from its step-8 checkpoint for 4 more steps.
    proc, run = start_torchrun(
        tmp_path / "fsdp", data_dir=data, max_steps=12, val_every=0, checkpoint_every=4, fsdp=True
    )
    try:
        assert proc.wait(timeout=240) == 0, (tmp_path / "fsdp" / "log.txt").read_text()[-3000:]
    finally:
        reap(proc)
    status = read_status(run)
    assert status["resumed_from_step"] == 8 and status["step"] == 12 and status["phase"] == "done"


@pytest.mark.slow
def test_out_of_memory_under_torchrun_is_recorded_as_oom(tmp_path_factory, tmp_path):
    """Both ranks hit their 1 GB address-space limit at 16384 tokens; status.json says oom, ranks exit 3."""
    data = synth_dataset(tmp_path_factory.getbasetemp())
    proc, run = start_torchrun(
        tmp_path,
        data_dir=data,
        max_seq_len=16384,
        ttt_steps=5,
        max_steps=2,
        memory_limit_gb=1.0,
        val_fraction=0.0,
    )
    try:
        rc = proc.wait(timeout=240)
    finally:
        reap(proc)
    log = (tmp_path / "log.txt").read_text()
    assert rc != 0  # torchrun reports a failed worker; eagle3.launch maps status.json to exit 3
    assert "exitcode  : 3" in log, log[-3000:]
    status = read_status(run)
    assert status["phase"] == "failed" and status["error"]["kind"] == "oom", status
    assert status["error"]["max_seq_len"] == 16384 and "16384" in status["error"]["message"]
