"""Context parallelism (eagle3.context): a row split over 2 and 4 gloo ranks gives the loss, the statistics and the
gradients of the same row on one process, within 1e-5 in fp32: grouped-query heads split (cp 2) and repeated (cp 4,
MQA), MLA's one latent, several documents per row with padding, TTT 3, both checkpoint modes, a chunked loss, and
two rows at once on a (dp 2, cp 2) mesh. The ranks are processes of tests/cp_worker.py, reaped by PID."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cp_worker import CASES, MEMORY_CASES, MEMORY_LEN, memory_spec
from eagle3 import plan as P
from eagle3.context import ContextShard, shard_row
from eagle3.errors import ConfigError
from eagle3.spec import DrafterConfig

HERE = Path(__file__).resolve().parent
TOL = 1e-5


def run_ranks(world: int, tmp_path: Path) -> dict:
    """Start `world` worker processes, wait for each by PID, and return rank 0's results merged with the others'."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "1"
    store = tmp_path / f"store{world}"
    argv = [sys.executable, str(HERE / "cp_worker.py")]
    procs = [
        subprocess.Popen(
            [*argv, str(r), str(world), str(store), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outputs[r][-4000:]}"
    merged = {}
    for r in range(world):
        merged |= torch.load(tmp_path / f"rank{r}.pt")
    return merged


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cp")
    return run_ranks(2, tmp) | run_ranks(4, tmp)


def _cases():
    for name, world, cp, _, _ in CASES:
        for row in range(world // cp):
            yield f"{name}/row{row}"


@pytest.mark.slow
@pytest.mark.parametrize("key", list(_cases()))
def test_context_parallel_matches_one_rank(results, key):
    found = results[key]
    ref, got = found["reference"], found["context_parallel"]
    torch.testing.assert_close(got["loss"], ref["loss"], atol=TOL, rtol=TOL)
    for name, value in ref["stats"].items():  # counts exact, the float sums (loss, alpha) within fp32 rounding
        tol = TOL if name in ("loss_sum", "alpha_sum") else 0.0
        torch.testing.assert_close(got["stats"][name], value, atol=tol, rtol=tol, msg=name)
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=TOL, rtol=TOL, msg=name)
        assert grad.abs().max() > 0, f"{name}: a zero gradient proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: f"{c[0]}-cp{c[1]}-{c[3]}-{c[4]}")
def test_planner_predicts_each_ranks_bytes_within_15_percent(results, case):
    """eagle3.memtrack on every rank of a context-parallel step (gloo, CPU) against the planner's held bytes at the
    end of the forward and its peak (held + the largest backward phase, the all-to-all buffers included)."""
    name, world, overrides, dtype, ckpt = case
    spec = memory_spec(world, overrides, dtype, ckpt)
    held, peak = P.activation_bytes(spec, MEMORY_LEN), P.dynamic_bytes(spec, MEMORY_LEN)
    for rank in range(world):
        measured = results[f"memory/{name}-cp{world}-{dtype}-{ckpt}/rank{rank}"]
        assert abs(held / measured["forward"] - 1) <= 0.15, (rank, held, measured)
        assert abs(peak / measured["peak"] - 1) <= 0.15, (rank, peak, measured)


@pytest.mark.slow
def test_the_rows_of_a_dp_cp_mesh_differ(results):
    """The (dp 2, cp 2) case trains two different rows: their reference losses differ."""
    a = results["gqa-dp2-cp2/row0"]["reference"]["loss"]
    b = results["gqa-dp2-cp2/row1"]["reference"]["loss"]
    assert not torch.allclose(a, b)


def test_shard_row_holds_own_slots_and_the_halo(make_row, tiny_config):
    row = make_row(tiny_config(), [10, 30, 24], seq_len=64)
    part = shard_row(row, ContextShard(4, 1), halo=3)
    assert torch.equal(part["aux_hidden"], row["aux_hidden"][16:32])
    assert torch.equal(part["last_hidden"], row["last_hidden"][16:35])
    assert torch.equal(part["document_ids"], row["document_ids"])  # the per-slot vectors stay whole
    last = shard_row(row, ContextShard(4, 3), halo=3)
    assert last["last_hidden"].shape[0] == 16  # no slot past the row


@pytest.mark.parametrize(
    ("heads", "kv", "cp", "message"),
    [
        (6, 6, 4, "does not divide num_heads=6"),
        (8, 6, 4, None),  # 6 kv heads do not divide 8 heads: refused by the shape itself first
        (8, 4, 8, None),
    ],
)
def test_heads_that_do_not_split_are_refused(heads, kv, cp, message):
    if message is None and heads % kv:
        with pytest.raises(ConfigError, match="must divide num_heads"):
            DrafterConfig(64, heads, 8, 128, 512, 1024, num_kv_heads=kv).validate()
        return
    cfg = DrafterConfig(64, heads, 8, 128, 512, 1024, num_kv_heads=kv)
    if message is None:
        assert cfg.context_heads(cp) == (heads // cp, 1)
        return
    with pytest.raises(ConfigError, match=message):
        cfg.context_heads(cp)


def test_kv_heads_neither_dividing_nor_multiple_are_refused():
    cfg = DrafterConfig(64, 12, 8, 128, 512, 1024, num_kv_heads=6)
    with pytest.raises(ConfigError, match="num_kv_heads=6 neither divide each other"):
        cfg.context_heads(4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_read_row_reads_a_ranks_share_byte_for_byte(tmp_path, dtype):
    """DatasetReader.read_row(held=...) reads only a rank's hidden-state rows from the files (an 8-bit data set
    dequantized): equal to shard_row of the whole row for every rank, documents crossing the share boundaries, the
    halo, padding at the end."""
    from eagle3.data import DatasetReader, DatasetWriter, build_vocab_mapping

    gen = torch.Generator().manual_seed(0)
    h, lengths = 16, [40, 25, 9, 50]
    writer = DatasetWriter(tmp_path, h, dtype)
    for n in lengths:
        writer.add(
            torch.randint(0, 64, (n,), generator=gen),
            torch.rand(n, generator=gen) < 0.6,
            torch.randn(n, 3 * h, generator=gen),
            torch.randn(n, h, generator=gen),
        )
    d2t, t2d = build_vocab_mapping(torch.ones(64), 32)
    writer.finish(
        target_vocab_size=64,
        draft_vocab_size=32,
        aux_layer_ids=(1, 2, 3),
        t2d=t2d,
        d2t=d2t,
        embed=torch.randn(64, h),
        final_norm=torch.ones(h),
        lm_head=torch.randn(64, h),
    )
    reader = DatasetReader(tmp_path)
    whole = reader.read_row([0, 1, 2, 3], 256)  # 124 tokens, then padding
    for index in range(4):
        shard = ContextShard(4, index)
        part = reader.read_row([0, 1, 2, 3], 256, held=shard.held(256, 3))
        expected = shard_row(whole, shard, 3)
        assert set(part) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(part[name], tensor), (index, name)
