#!/usr/bin/env python3
"""Context parallelism figures: the planner's table for the Kimi-K2.5-shaped drafter on 8 x 96 GiB, and measured CPU
peaks of context-parallel ranks (gloo) against the planner.

    .venv-train/bin/python bench/context_parallel.py [--seq-len 4096] [--shape kimi-k2.5-eighth] [--skip-measure]

(a) Planner, Kimi-K2.5 shapes (Llama-style and MLA), ttt_steps 5, activation checkpointing + FSDP2, flex attention
    (CUDA): predicted peak per GPU for context_parallel 1/2/4/8 at 32768..524288 tokens, the largest length that
    fits 96 GiB less 10 %, and the flex BlockMasks of the 5 TTT steps (counted in the peak).
(b) Measured: one forward+backward of the planner's probe step (eagle3.memtrack, the bytes the real step allocates;
    gradients and weights excluded) on each rank of a context-parallel group of cp = 1, 2, 4 processes on this CPU
    (exact attention, fp32, full activation checkpointing, loss chunks of 512), next to the planner's prediction for
    that rank, and the step's wall time on rank 0 (2 cores shared by all ranks: a cost figure, not a speed-up).

Prints figures; asserts nothing. The ranks are processes this script starts and waits for by PID.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))

from eagle3 import plan as P  # noqa: E402

GIB = P.GIB
LENGTHS = (32768, 65536, 131072, 262144, 524288)


def part_a() -> None:
    print("(a) planner: Kimi-K2.5 shapes, ttt_steps 5, 8 x 96 GiB, activation checkpointing + fsdp, flex (CUDA)")
    budget = P.budget_bytes(96, 0.1)
    header = "".join(f"{s:>9}" for s in LENGTHS)
    for name in ("kimi-k2.5", "kimi-k2.5-mla"):
        print(f"    {name}: predicted GiB per GPU at max_seq_len, and the largest that fits {budget / GIB:.1f} GiB")
        print(f"    {'cp':>4}{header}{'largest':>10}")
        for cp in (1, 2, 4, 8):
            spec = P.on_cuda(P.SHAPES[name], 8, activation_checkpointing=True, fsdp=True, context_parallel=cp)
            peaks = "".join(f"{P.predict_peak_bytes(spec, s) / GIB:9.1f}" for s in LENGTHS)
            largest = P.make_plan(spec, memory_gb=96, margin=0.1).max_seq_len
            print(f"    {cp:>4}{peaks}{largest:>10}")
    masks = ", ".join(f"{s}: {P.block_mask_bytes(s, 5) / 2**20:.1f} MiB" for s in (32768, 131072, 262144))
    print(f"    flex BlockMasks of 5 TTT steps (any cp: each rank attends over the whole row): {masks}")


def measure_spec(shape: str, cp: int) -> P.RunSpec:
    spec = P.spec_for(
        P.SHAPES[shape],
        world_size=cp,
        device="cpu",
        attention="exact",
        loss_chunk_size=512,
        activation_checkpointing="full",
        ttt_steps=5,
        context_parallel=cp,
    )
    return dataclasses.replace(spec, reserve_gib=0.0, allocator_factor=1.0)


def worker(rank: int, cp: int, shape: str, seq_len: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from eagle3.context import make_shard
    from eagle3.memtrack import measure_planned_step

    torch.set_num_threads(1)
    shard = None
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
        shard = make_shard(rank, cp, cp, "cpu")
    started = time.perf_counter()
    step = measure_planned_step(measure_spec(shape, cp), seq_len, shard)
    seconds = time.perf_counter() - started  # the warm-up step and the measured one
    Path(out, f"rank{rank}.json").write_text(json.dumps({"forward": step.forward, "peak": step.peak, "s": seconds}))
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def part_b(shape: str, seq_len: int) -> None:
    print(f"\n(b) measured on this CPU: {shape}, max_seq_len {seq_len}, ttt_steps 5, fp32, exact, full checkpointing")
    print(f"    {'cp':>3} {'rank':>4} {'held MiB':>9} {'planned':>8} {'peak MiB':>9} {'planned':>8} {'peak err':>9}")
    for cp in (1, 2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--worker", "--cp", str(cp), "--shape", shape, "--seq-len", str(seq_len)]
            cmd += ["--store", f"{tmp}/store", "--out", tmp]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(cp)]
            for p in procs:
                p.wait()
            if any(p.returncode for p in procs):
                print(f"    cp {cp}: a rank failed ({[p.returncode for p in procs]})")
                continue
            spec = measure_spec(shape, cp)
            held, peak = P.activation_bytes(spec, seq_len), P.dynamic_bytes(spec, seq_len)
            for r in range(cp):
                m = json.loads(Path(tmp, f"rank{r}.json").read_text())
                print(
                    f"    {cp:>3} {r:>4} {m['forward'] / 2**20:9.1f} {held / 2**20:8.1f} {m['peak'] / 2**20:9.1f} "
                    f"{peak / 2**20:8.1f} {peak / m['peak'] - 1:+9.1%}" + (f"   {m['s']:.1f} s" if r == 0 else "")
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--shape", default="kimi-k2.5-eighth", choices=sorted(P.SHAPES))
    p.add_argument("--skip-measure", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--cp"):
        p.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.rank, args.cp, args.shape, args.seq_len, args.store, args.out)
        return 0
    part_a()
    if not args.skip_measure:
        part_b(args.shape, args.seq_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
