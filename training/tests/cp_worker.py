"""One rank of tests/test_context_parallel.py: `python cp_worker.py RANK WORLD STORE OUT`.

Every case builds the same tiny drafter and packed row(s) on every rank, runs the row's loss and backward once on
one process (the reference, no process group involved) and once split over a context-parallel group (eagle3.context),
then sums the group's losses, statistics and gradients; rank 0 of each group saves both for the test to compare.
Processes meet through a file store (no port); gloo, fp32, exact attention.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from conftest import _model, _row, _tiny_config
from eagle3.context import make_shard, shard_row
from eagle3.model import ttt_forward

TTT = 3
SEQ = 64
ROWS = ([20, 9, 25], [7, 30, 17, 6])  # several documents per row, then padding to SEQ

GQA = dict(num_heads=4, num_kv_heads=2)
MLA = dict(num_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
# (name, world size, cp, drafter overrides, trainer keywords)
CASES = [
    ("gqa-cp2", 2, 2, GQA, {}),
    ("gqa-cp2-full-checkpoint", 2, 2, GQA, {"activation_checkpointing": "full"}),
    ("gqa-cp2-selective-checkpoint", 2, 2, GQA, {"activation_checkpointing": "selective"}),
    ("mqa-cp2", 2, 2, dict(num_heads=4, num_kv_heads=1), {}),
    ("mla-cp2", 2, 2, MLA, {}),
    ("gqa-cp4", 4, 4, GQA, {}),
    ("mha-cp4-chunked-loss", 4, 4, dict(num_heads=4), {"loss_chunk_size": 8}),
    ("gqa-dp2-cp2", 4, 2, GQA, {}),
]


def result(model, loss, stats) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach().clone(), "stats": {k: v.clone() for k, v in stats.items()}, "grads": grads}


def run_case(rank: int, world: int, cp: int, overrides: dict, keywords: dict) -> dict | None:
    cfg = dataclasses.replace(_tiny_config(**overrides))
    dp_rank = rank // cp
    row = _row(cfg, ROWS[dp_rank % len(ROWS)], seq_len=SEQ, seed=dp_rank, mask_prob=0.7)
    kwargs = {"ttt_steps": TTT, "attention": "exact", **keywords}

    reference = _model(cfg)
    loss, stats = ttt_forward(reference, row, **kwargs)
    loss.backward()
    expected = result(reference, loss, stats)

    shard = make_shard(rank, world, cp, "cpu")
    model = _model(cfg)
    loss, stats = ttt_forward(model, shard_row(row, shard, TTT), context=shard, **kwargs)
    loss.backward()
    got = result(model, loss, stats)
    for tensor in [got["loss"], *got["stats"].values(), *got["grads"].values()]:
        dist.all_reduce(tensor, group=shard.group)  # SUM over the group: the row's
    return {"reference": expected, "context_parallel": got} if shard.index == 0 else None


# (name, world size = cp, drafter overrides of the planner's tests' shapes, dtype, activation checkpointing)
MEMORY_CASES = [
    (
        "h96",
        2,
        dict(
            hidden_size=96,
            num_heads=6,
            head_dim=16,
            intermediate_size=256,
            draft_vocab_size=768,
            target_vocab_size=1536,
        ),
        "fp32",
        False,
    ),
    (
        "h128-gqa",
        2,
        dict(
            hidden_size=128,
            num_heads=8,
            head_dim=16,
            num_kv_heads=2,
            intermediate_size=320,
            draft_vocab_size=1024,
            target_vocab_size=2048,
        ),
        "fp32",
        "full",
    ),
    (
        "h128-gqa",
        4,
        dict(
            hidden_size=128,
            num_heads=8,
            head_dim=16,
            num_kv_heads=2,
            intermediate_size=320,
            draft_vocab_size=1024,
            target_vocab_size=2048,
        ),
        "fp32",
        "selective",
    ),
    (
        "h96-mla",
        2,
        dict(
            hidden_size=96,
            num_heads=6,
            head_dim=16,
            intermediate_size=256,
            draft_vocab_size=768,
            target_vocab_size=1536,
            q_lora_rank=48,
            kv_lora_rank=64,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
        ),
        "fp32",
        False,
    ),
    (
        "h64",
        4,
        dict(
            hidden_size=64,
            num_heads=4,
            head_dim=16,
            intermediate_size=192,
            draft_vocab_size=512,
            target_vocab_size=1024,
        ),
        "bf16",
        True,
    ),
]
MEMORY_LEN = 1536


def memory_spec(world: int, overrides: dict, dtype: str, ckpt):
    """The planner's CPU recipe of tests/test_plan.py (exact attention, loss chunks of 256, nothing reserved) at
    context_parallel = world."""
    from eagle3.spec import DrafterConfig, spec_for

    drafter = DrafterConfig(**{"aux_layer_ids": (1, 3, 5), **overrides})
    spec = spec_for(
        drafter,
        world_size=world,
        device="cpu",
        dtype=dtype,
        attention="exact",
        loss_chunk_size=256,
        activation_checkpointing=ckpt,
        ttt_steps=TTT,
        context_parallel=world,
    )
    spec = dataclasses.replace(spec, reserve_gib=0.0, allocator_factor=1.0)
    return spec.with_run(frozen_bf16=True) if dtype == "bf16" else spec


def measure_memory(rank: int, world: int) -> dict:
    from eagle3.memtrack import measure_planned_step

    found = {}
    for name, case_world, overrides, dtype, ckpt in MEMORY_CASES:
        if case_world != world:
            continue
        shard = make_shard(rank, world, world, "cpu")
        step = measure_planned_step(memory_spec(world, overrides, dtype, ckpt), MEMORY_LEN, shard)
        found[f"memory/{name}-cp{world}-{dtype}-{ckpt}/rank{rank}"] = {
            "forward": step.forward,
            "peak": step.peak,
        }
    return found


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for name, case_world, cp, overrides, keywords in CASES:
        if case_world != world:
            continue
        found = run_case(rank, world, cp, overrides, keywords)
        if found is not None:
            results[f"{name}/row{rank // cp}"] = found
    results |= measure_memory(rank, world)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
