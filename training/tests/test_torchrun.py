"""Two CPU ranks under torchrun (gloo), started as the systemd unit starts them where it matters
(`python -m eagle3.launch --status ... -- python -m torch.distributed.run ...`): loss falls, parameters stay
identical, metrics cover both ranks; a signal to one rank stops both at the same step; FSDP follows DDP's
trajectory across a stop and a resume; out of memory on one rank ends the run with exit 3; a SIGTERM to the
launcher ends it with exit 0, one line and no traceback.

Every wait is for an event (a metrics line, a process exit) with a generous bound; nothing asserts speed.
"""

from __future__ import annotations

import doctest
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3 import checkpoint as ckpt
from eagle3 import launch
from eagle3.data import DatasetReader
from pipeline_support import (
    TRAINING_ROOT,
    read_metrics,
    read_samples,
    read_status,
    reap,
    rendezvous_port,
    synth_dataset,
    trainer_env,
    wait_for,
    write_config,
)

RUN_TIMEOUT = 600  # bounds, not expectations: a run takes seconds on an idle machine
STOP_TIMEOUT = 300
# Over pyproject's 300 s per test: a test here may start two torchrun runs on a loaded machine.
pytestmark = pytest.mark.timeout(1200)
STEPS = 12  # the DDP reference run and the FSDP run it is compared with


def start_torchrun(
    tmp_path: Path, data: Path, *, via_launch: bool = False, env: dict | None = None, **values
) -> tuple[subprocess.Popen, Path]:
    """Start 2 CPU ranks on `data`; the run directory is tmp_path/run, the output tmp_path/log.txt."""
    run = tmp_path / "run"
    base = dict(
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=3,
        log_every=1,
        val_every=0,
        checkpoint_every=1000,
        num_threads=1,
        record_samples=True,
    )
    cfg = write_config(tmp_path / "train.yaml", **{**base, **values})
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
    if via_launch:
        cmd = [sys.executable, "-m", "eagle3.launch", "--status", str(run / "status.json"), "--", *cmd]
    log = (tmp_path / "log.txt").open("ab")
    proc = subprocess.Popen(
        cmd,
        cwd=TRAINING_ROOT,
        env=trainer_env(**(env or {})),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, run


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        reap(proc)
    return rc, (tmp_path / "log.txt").read_text()


def worker_pids(agent_pid: int) -> list[int]:
    """The torchrun agent's direct children (the workers we started through it)."""
    return launch.children(agent_pid)


def worker_rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK="))[5:])


def reached_step(run: Path, step: int):
    return lambda: any(r["step"] >= step for r in read_metrics(run))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, data):
    """One finished DDP run of STEPS steps through eagle3.launch, shared by the tests that read it."""
    tmp = tmp_path_factory.mktemp("ddp")
    proc, run = start_torchrun(tmp, data, via_launch=True, max_steps=STEPS)
    rc, log = finish(proc, tmp)
    return rc, log, run


def test_launch_doctests():
    assert doctest.testmod(launch).failed == 0


def test_a_rank_ends_through_exit_process_with_its_code_its_atexit_handlers_and_its_output():
    """A rank that joined a process group ends with os._exit (the interpreter's finalization can abort it, see
    eagle3.distributed.exit_process): the exit code, the atexit handlers and buffered output must survive that."""
    script = (
        "import atexit, sys\n"
        "from eagle3 import distributed\n"
        "atexit.register(lambda: print('atexit handler ran'))\n"
        "print('buffered line', end='')\n"
        "sys.stderr.write('buffered error')\n"
        "distributed.exit_process(7)\n"
        "print('not reached')\n"
    )
    env = trainer_env()
    env.pop("PYTHONUNBUFFERED", None)  # a pipe: stdout is block-buffered, as under torchrun's redirection
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=TRAINING_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered lineatexit handler ran\n" and done.stderr.endswith("buffered error")


@pytest.mark.slow
def test_two_ranks_stay_in_sync_and_reduce_metrics(ddp_run, data):
    rc, log, run = ddp_run
    assert rc == 0, log[-3000:]
    assert "eagle3.launch: torchrun exited 0; unit exit status 0" in log
    assert read_status(run)["world_size"] == 2 and read_status(run)["phase"] == "done"

    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first * 0.8, [r["loss"] for r in records]  # loss falls
    for r in records:  # DDP keeps both ranks' parameters identical
        a, b = r["param_checksums"]
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)
    # Tokens and supervised positions in the metrics are the sums over both ranks' rows.
    reader = DatasetReader(data)
    rank_records = [read_samples(run, 0), read_samples(run, 1)]
    ids0 = {s for r in rank_records[0] for s in r["ids"]}
    ids1 = {s for r in rank_records[1] for s in r["ids"]}
    assert ids0 and ids1 and not ids0 & ids1  # each rank packs its own samples
    for record in records[:2]:
        window = [r for r in rank_records[0] + rank_records[1] if r["step"] == record["step"]]
        assert record["tokens"] == sum(reader.index.lengths[s] for r in window for s in r["ids"])
    assert len(records[0]["peak_mem_gb_per_rank"]) == 2 and min(records[0]["peak_mem_gb_per_rank"]) > 0


@pytest.mark.slow
def test_fsdp_stops_with_one_signalled_rank_and_resumes_on_the_ddp_trajectory(ddp_run, data, tmp_path):
    """Only rank 1 gets SIGTERM; the stop-flag collective makes rank 0 checkpoint and stop with it. The FSDP2
    checkpoint (fp32 on CPU) then resumes, and every step's loss equals the DDP run's."""
    proc, run = start_torchrun(tmp_path, data, max_steps=STEPS, fsdp=True)
    try:
        assert wait_for(reached_step(run, 2), timeout=STOP_TIMEOUT), (tmp_path / "log.txt").read_text()[-3000:]
        rank1 = next(p for p in worker_pids(proc.pid) if worker_rank(p) == 1)
        os.kill(rank1, signal.SIGTERM)
        rc, log = finish(proc, tmp_path, STOP_TIMEOUT)
    finally:
        reap(proc)
    assert rc == 0, log[-3000:]
    status = read_status(run)
    assert status["phase"] == "stopped", "the run finished before the signal: raise STEPS"
    stopped_at = status["step"]
    assert ckpt.newest_valid(run).name == ckpt.step_dir_name(stopped_at)
    assert (ckpt.newest_valid(run) / "rng_rank1.pt").is_file()
    assert (
        [r["step"] for r in read_samples(run, 0)]
        == [r["step"] for r in read_samples(run, 1)]
        == list(range(1, stopped_at + 1))
    )

    proc, run = start_torchrun(tmp_path, data, max_steps=STEPS, fsdp=True)
    rc, log = finish(proc, tmp_path)
    assert rc == 0, log[-3000:]
    status = read_status(run)
    assert status["resumed_from_step"] == stopped_at and status["step"] == STEPS and status["phase"] == "done"
    fsdp = {r["step"]: r["loss"] for r in read_metrics(run)}
    ddp = {r["step"]: r["loss"] for r in read_metrics(ddp_run[2])}
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    assert [fsdp[s] for s in sorted(fsdp)] == pytest.approx([ddp[s] for s in sorted(fsdp)], rel=1e-4)


@pytest.mark.slow
def test_out_of_memory_on_one_rank_is_recorded_and_ends_the_run_with_3(data, tmp_path):
    """EAGLE3_FAULT_OOM_AT_STEP raises torch's OutOfMemoryError in rank 1's step 3: the real OOM path runs
    (status.json kind oom with max_seq_len, rank exit 3), rank 0 stops too, and eagle3.launch exits 3."""
    proc, run = start_torchrun(tmp_path, data, via_launch=True, env={"EAGLE3_FAULT_OOM_AT_STEP": "3:rank1"}, epochs=1)
    rc, log = finish(proc, tmp_path)
    assert rc == 3, log[-3000:]
    # Which rank torchrun names as the root cause is a race (rank 0's broken collective may end first); the
    # unit's exit status comes from status.json and does not depend on it.
    assert "OOM: out of memory at max_seq_len=512" in log and "unit exit status 3 (trainer error: oom)" in log
    status = read_status(run)
    assert status["phase"] == "failed" and status["error"]["kind"] == "oom", status
    assert status["error"]["max_seq_len"] == 512
    assert "max_seq_len=512" in status["error"]["message"] and "fault injection" in status["error"]["message"]
    assert [r["step"] for r in read_samples(run, 0)] == [1, 2]  # rank 0 did not train on alone


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_cleanly_without_a_traceback(data, tmp_path):
    """systemd's stop: SIGTERM to eagle3.launch only. The workers checkpoint and exit 0, torchrun exits 0,
    the unit exits 0, and the journal gets one line about it and no Python traceback."""
    proc, run = start_torchrun(tmp_path, data, via_launch=True, epochs=1)
    try:
        assert wait_for(reached_step(run, 2), timeout=STOP_TIMEOUT), (tmp_path / "log.txt").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as KillMode=mixed does
        rc, log = finish(proc, tmp_path, STOP_TIMEOUT)
    finally:
        reap(proc)
    assert rc == 0, log[-3000:]
    status = read_status(run)
    assert status["phase"] == "stopped", "the run finished before the signal"
    assert f"eagle3.launch: stopped on SIGTERM; trainer checkpointed at step {status['step']}" in log, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    assert ckpt.newest_valid(run).name == ckpt.step_dir_name(status["step"])


@pytest.mark.slow
def test_init_from_under_fsdp_gives_the_unsharded_runs_first_step(ddp_run, data, tmp_path):
    """init_from loads the export into the full model on every rank before FSDP2 shards it: the first step's loss
    (the forward before any update, i.e. the exported drafter's logits) is the same sharded and unsharded, and it
    is not the loss of a run started from random weights."""
    exported = tmp_path / "export"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3",
            "export",
            str(ddp_run[2]),
            str(exported),
            "--checkpoint",
            "latest",
            "--verifier",
            "test/verifier",
            "--verifier-arch",
            "LlamaForCausalLM",
        ],
        cwd=TRAINING_ROOT,
        env=trainer_env(),
        check=True,
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    first = {}
    for fsdp in (False, True):
        where = tmp_path / ("fsdp" if fsdp else "ddp")
        where.mkdir()
        proc, run = start_torchrun(where, data, max_steps=1, fsdp=fsdp, init_from=str(exported))
        rc, log = finish(proc, where)
        assert rc == 0, log[-3000:]
        first[fsdp] = next(r["loss"] for r in read_metrics(run) if r["step"] == 1)
    from_scratch = next(r["loss"] for r in read_metrics(ddp_run[2]) if r["step"] == 1)
    assert first[True] == pytest.approx(first[False], rel=1e-4)
    assert abs(first[False] - from_scratch) > 1e-3 * abs(from_scratch), (first, from_scratch)
