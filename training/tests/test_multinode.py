"""Multi-node training on one machine: two torchrun agents joined by c10d rendezvous on 127.0.0.1 are two nodes
(GROUP_RANK 0 and 1, LOCAL_WORLD_SIZE 2), checked against one agent with 4 ranks on the same data and seed.

    full   2 nodes x 2 ranks take the same steps, loss for loss, as 1 node x 4 ranks (FSDP2 over all 4 ranks)
    hsdp   2 x 2 with shard_layout hsdp (sharded within a node, replicated across nodes) follows them too, saves,
           and resumes on 2 x 2 on the same trajectory
    reshard  a checkpoint of 4 FSDP ranks resumes on 2 ranks (full tensors, re-sharded on load)
    shared   a node that cannot see run_dir (another directory mounted over it) stops every rank with exit 2

The fast tests at the top check the layout rules, the planner's per-GPU memory and the error messages without
starting processes. Every process a test starts is reaped by PID; everything binds 127.0.0.1 only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from eagle3 import distributed as dist_utils
from eagle3 import options
from eagle3 import plan as P
from eagle3.config import TrainConfig
from eagle3.errors import ConfigError
from pipeline_support import (
    TRAINING_ROOT,
    read_metrics,
    read_status,
    reap,
    rendezvous_port,
    synth_dataset,
    trainer_env,
    write_config,
)

RUN_TIMEOUT = 600  # a bound, not an expectation
STEPS = 4
pytestmark = pytest.mark.timeout(1200)


# ----------------------------------------------------------------------------------------------- no processes
def test_hsdp_needs_fsdp_and_equal_nodes():
    assert options.resolve_options(TrainConfig(fsdp=True, shard_layout="hsdp"), "cpu", 8, nodes=2).shard_ranks == 4
    assert options.resolve_options(TrainConfig(fsdp=True), "cpu", 8, nodes=2).shard_ranks == 8
    with pytest.raises(ConfigError, match="shard_layout=hsdp needs fsdp: true"):
        options.resolve_options(TrainConfig(shard_layout="hsdp"), "cpu", 4, nodes=2)
    with pytest.raises(ConfigError, match="not a multiple of this node's LOCAL_WORLD_SIZE"):
        options.resolve_options(TrainConfig(fsdp=True, shard_layout="hsdp"), "cpu", 6, nodes=0)
    run = options.resolve_options(TrainConfig(fsdp=True, shard_layout="hsdp"), "cpu", 4, nodes=1)
    assert not run.hsdp and run.shard_ranks == 4 and any("as full does" in n for n in run.notes)


def test_planner_hsdp_holds_larger_shards_per_gpu(capsys):
    def plan(*flags: str) -> dict:
        assert P.main(["--shape", "kimi-k2.5", "--memory-gb", "96", "--fsdp", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    single = plan("--world-size", "8")  # what the role passes today
    full = plan("--nnodes", "2", "--nproc-per-node", "4")
    hsdp = plan("--nnodes", "2", "--nproc-per-node", "4", "--shard-layout", "hsdp")
    assert single["static_gb"] == full["static_gb"] and full["shard_ranks"] == 8 and full["nnodes"] == 2
    assert hsdp["shard_layout"] == "hsdp" and hsdp["shard_ranks"] == 4 and hsdp["nproc_per_node"] == 4
    # every GPU holds 1/4 instead of 1/8 of the fp32 weights, gradients, AdamW state and frozen weights
    shape = P.SHAPES["kimi-k2.5"]
    by_node = P.static_terms(P.on_cuda(shape, world_size=8, nodes=2, fsdp=True, shard_layout="hsdp"))
    by_all = P.static_terms(P.on_cuda(shape, world_size=8, fsdp=True))
    for term in ("weights_fp32_shard", "grads_fp32_shard", "optimizer_state_shard", "frozen_weights_shard"):
        assert by_node[term] == pytest.approx(2 * by_all[term], abs=1)
    extra = sum(by_node.values()) - sum(by_all.values())
    assert hsdp["static_gb"] - full["static_gb"] == pytest.approx(extra / P.GIB, abs=0.002)
    assert hsdp["max_seq_len"] < full["max_seq_len"]
    assert P.main(["--shape", "tiny", "--memory-gb", "8", "--world-size", "6", "--nnodes", "4"]) == 2
    assert "does not split evenly over --nnodes 4" in capsys.readouterr().err


def test_shared_storage_message_names_run_dir_and_nodes():
    assert dist_utils.shared_storage_verdict("/r", {1: True, 2: True}) is None
    one = dist_utils.shared_storage_verdict("/r", {1: True, 2: False})
    assert one.startswith("run_dir /r is not shared storage: node 2 does not see the marker written by node 0")
    assert "nodes 1, 3 do not see" in dist_utils.shared_storage_verdict("/r", {1: False, 3: False})


# ----------------------------------------------------------------------------------------------- torchrun runs
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.getbasetemp())


def start_run(
    where: Path,
    data: Path,
    run: Path,
    *,
    nodes: int,
    per_node: int,
    private_node: int | None = None,
    private_run: Path | None = None,
    **values,
) -> list[subprocess.Popen]:
    """`nodes` torchrun agents of `per_node` CPU ranks each, one rendezvous on 127.0.0.1; agent k logs to
    where/agent{k}.txt. Agent `private_node` runs in its own mount namespace where `private_run` is mounted
    over `run`: its run_dir is another directory."""
    base = dict(
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=2,
        log_every=1,
        val_every=0,
        checkpoint_every=2,
        num_threads=1,
        fsdp=True,
    )
    cfg = write_config(where / f"train-{uuid.uuid4().hex[:6]}.yaml", **{**base, **values})
    run.mkdir(parents=True, exist_ok=True)
    port, rdzv_id = rendezvous_port(), uuid.uuid4().hex[:8]
    procs = []
    try:
        for node in range(nodes):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--node-rank={node}",
                f"--nproc-per-node={per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
                "--local-addr=127.0.0.1",
                "--max-restarts=0",
                "-m",
                "eagle3",
                "train",
                "--config",
                str(cfg),
            ]
            if node == private_node:  # unshare execs sh, which execs torchrun: one PID throughout
                cmd = [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    'mount --bind "$0" "$1" && shift && exec "$@"',
                    str(private_run),
                    str(run),
                    *cmd,
                ]
            log = (where / f"agent{node}.txt").open("ab")
            proc = subprocess.Popen(
                cmd,
                cwd=TRAINING_ROOT,
                env=trainer_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs.append(proc)
    except BaseException:
        for proc in procs:
            reap(proc)
        raise
    return procs


def finish(procs: list[subprocess.Popen], where: Path) -> tuple[list[int], str]:
    try:
        codes = [proc.wait(timeout=RUN_TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            reap(proc)
    logs = "\n".join(p.read_text() for p in sorted(where.glob("agent*.txt")))
    return codes, logs


def tails(where: Path, chars: int = 2500) -> str:
    """The end of every agent's log, each labelled: a failed run's cause is often in the agent that ended first
    (the one hosting the rendezvous store, say), not in the last log of the joined output."""
    return "\n".join(
        f"--- {p.name}, last {chars} characters:\n{p.read_text(errors='replace')[-chars:]}"
        for p in sorted(where.glob("agent*.txt"))
    )


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run)}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, data):
    """The reference: 1 node x 4 ranks, FSDP2 over all 4, STEPS steps (checkpoints at 2 and 4)."""
    where = tmp_path_factory.mktemp("one_node")
    codes, _ = finish(start_run(where, data, where / "run", nodes=1, per_node=4, max_steps=STEPS), where)
    assert codes == [0], tails(where)
    return where / "run"


@pytest.mark.slow
def test_two_nodes_take_the_same_steps_as_one_node(one_node, data, tmp_path):
    run = tmp_path / "run"
    codes, _ = finish(start_run(tmp_path, data, run, nodes=2, per_node=2, max_steps=STEPS), tmp_path)
    assert codes == [0, 0], tails(tmp_path)
    status = read_status(run)
    assert status["phase"] == "done" and status["world_size"] == 4
    two, one = losses(run), losses(one_node)
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    assert [two[s] for s in sorted(two)] == pytest.approx([one[s] for s in sorted(one)], rel=1e-6)
    assert not (run / dist_utils.SHARED_MARKER).exists()  # the shared-storage check cleans up after itself


@pytest.mark.slow
def test_hsdp_on_two_nodes_follows_full_sharding_across_a_resume(one_node, data, tmp_path):
    run = tmp_path / "run"
    codes, logs = finish(
        start_run(tmp_path, data, run, nodes=2, per_node=2, max_steps=2, shard_layout="hsdp"), tmp_path
    )
    assert codes == [0, 0], tails(tmp_path)
    assert "sharding: hsdp over 2 nodes x 2 ranks" in logs
    codes, logs = finish(
        start_run(tmp_path, data, run, nodes=2, per_node=2, max_steps=STEPS, shard_layout="hsdp"), tmp_path
    )
    assert codes == [0, 0], tails(tmp_path)
    status = read_status(run)
    assert status["resumed_from_step"] == 2 and status["step"] == STEPS and status["phase"] == "done"
    hsdp, one = losses(run), losses(one_node)
    assert sorted(hsdp) == list(range(1, STEPS + 1))
    # the same gradients, summed in another order (within a node, then across nodes)
    assert [hsdp[s] for s in sorted(hsdp)] == pytest.approx([one[s] for s in sorted(hsdp)], rel=1e-4)


@pytest.mark.slow
def test_four_rank_fsdp_checkpoint_resumes_on_two_ranks(one_node, data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_node, run)
    codes, logs = finish(start_run(tmp_path, data, run, nodes=1, per_node=2, max_steps=STEPS + 2), tmp_path)
    assert codes == [0], tails(tmp_path)
    assert "world_size 4 -> 2" in logs
    assert "was written with 4 ranks, fsdp full; its full tensors are re-sharded for 2 ranks, fsdp full" in logs
    status = read_status(run)
    assert status["resumed_from_step"] == STEPS and status["step"] == STEPS + 2 and status["world_size"] == 2
    assert sorted(losses(run))[-2:] == [STEPS + 1, STEPS + 2]


def _private_mounts_work(where: Path) -> bool:
    probe = where / "probe"
    probe.mkdir()
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"mount --bind {where} {probe}"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.slow
def test_a_node_that_does_not_see_run_dir_stops_every_rank_with_exit_2(data, tmp_path):
    if not _private_mounts_work(tmp_path):
        pytest.skip("needs root and unshare --mount (another directory over run_dir on one node)")
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    procs = start_run(tmp_path, data, run, nodes=2, per_node=1, private_node=1, private_run=elsewhere, max_steps=STEPS)
    codes, logs = finish(procs, tmp_path)
    assert codes[0] != 0 and codes[1] != 0, tails(tmp_path)
    message = f"run_dir {run} is not shared storage: node "
    assert f"config error: {message}" in logs, tails(tmp_path)
    assert "does not see the marker written by node" in logs, tails(tmp_path)
    # torchrun's summary of the failed ranks
    assert "exitcode  : 2" in logs or "exitcode: 2" in logs, tails(tmp_path)
    # Either node's unit reads the status.json of its own run_dir: both record the config error (exit 2).
    for view in (run, elsewhere):
        status = read_status(view)
        assert status["phase"] == "failed" and status["error"]["kind"] == "config", status
        assert status["error"]["message"].startswith(message)
        assert not (view / dist_utils.SHARED_MARKER).exists()
        assert not read_metrics(view)  # no step was taken
