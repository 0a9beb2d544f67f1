"""bench/gpu_check.sh's `context` section: the largest max_seq_len the planner allows at context_parallel 1 and at
context_parallel = the GPUs present (one row over all of them), each run for real (two training steps of the
planner's probe step, one process per GPU, NCCL through a file store), measured peak memory against the planner.

Each rank trains its own copy of the drafter (no DDP or FSDP wrapper: the gradients are not reduced), so the
prediction compared is the planner's for that run less DDP's gradient buckets, which no rank has here. A dry run
takes a tiny drafter to 2 CPU processes (gloo). `python bench/gpu_context.py --worker ...` is one rank.
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

import torch  # noqa: E402
from eagle3 import plan as P  # noqa: E402

MAX_LEN = 262144  # the sweep's ceiling: longer steps take minutes each on one GPU
DRY_SHAPE = P.DrafterConfig(128, 4, 32, 320, 1024, 2048)


def context_spec(dry_run: bool, cp: int) -> P.RunSpec:
    """The trainer's CUDA recipe with full activation checkpointing at context_parallel `cp` (a dry run: exact
    attention on CPU, a tiny drafter, loss chunks of 256)."""
    if dry_run:
        spec = P.spec_for(
            DRY_SHAPE,
            cp,
            device="cpu",
            attention="exact",
            loss_chunk_size=256,
            activation_checkpointing="full",
            context_parallel=cp,
        )
        return dataclasses.replace(spec, reserve_gib=0.0)
    spec = P.on_cuda(P.SHAPES["kimi-k2.5"], world_size=cp, activation_checkpointing="full", context_parallel=cp)
    return dataclasses.replace(spec, reserve_gib=1.0)


def predicted_bytes(spec: P.RunSpec, seq_len: int) -> int:
    """The planner's peak for the run, less the DDP buckets no rank of this check holds."""
    return P.predict_peak_bytes(spec, seq_len) - P.static_terms(spec).get("ddp_buckets", 0)


def worker(rank: int, cp: int, seq_len: int, dry_run: bool, store: str, out: str) -> None:
    """One rank: two steps of the probe step on its share of the row; the second's peak and time to out/rank.json."""
    import torch.distributed as dist
    from eagle3.context import make_shard, shard_row
    from eagle3.model import ttt_forward

    device = torch.device("cpu") if dry_run else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = None
    if cp > 1:
        backend = "gloo" if dry_run else "nccl"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=cp)
        shard = make_shard(rank, cp, cp, device.type)
    spec = context_spec(dry_run, cp)
    model, optimizer, batch = P.build_probe_step(spec, seq_len, device)
    if shard is not None:
        batch = shard_row(batch, shard, spec.run.ttt_steps)
    kwargs = {**spec.run.ttt_kwargs(), **({"context": shard} if shard is not None else {})}
    for step in range(2):
        if device.type == "cuda" and step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.monotonic()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.run.autocast):
            loss, _ = ttt_forward(model, batch, **kwargs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.monotonic() - started
        del loss
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "step_s": seconds}))
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(cp: int, seq_len: int, dry_run: bool, timeout_s: float) -> list[dict]:
    """Start cp worker processes, wait for each by PID (killing the rest past the bound), return their figures."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--cp",
            str(cp),
            "--seq-len",
            str(seq_len),
            "--store",
            f"{tmp}/store",
            "--out",
            tmp,
            *(["--dry-run"] if dry_run else []),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(cp)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"context_parallel {cp} at {seq_len}: ranks exited {codes}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cp)]


def section_context(dry_run: bool, budget_s: float = 150.0) -> dict:
    """The largest planned length at cp 1 and cp = GPUs, each measured."""
    gpus = 2 if dry_run else torch.cuda.device_count()
    memory_gb = 1.0 if dry_run else torch.cuda.get_device_properties(0).total_memory / P.GIB
    rows = []
    for cp in sorted({1, gpus}):
        spec = context_spec(dry_run, cp)
        plan = P.make_plan(spec, memory_gb=memory_gb, margin=0.1)
        seq_len = 512 if dry_run else min(plan.max_seq_len, MAX_LEN)
        row = {
            "context_parallel": cp,
            "largest_planned": plan.max_seq_len,
            "max_seq_len": seq_len,
            "predicted_gib": round(predicted_bytes(spec, seq_len) / P.GIB, 2),
        }
        try:
            ranks = run_ranks(cp, seq_len, dry_run, budget_s)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            rows.append(row | {"failed": str(e)})
            continue
        peak = max(r["peak"] for r in ranks)
        row |= {
            "measured_peak_gib": round(peak / P.GIB, 2),
            "step_s": round(ranks[0]["step_s"], 2),
            "tokens_per_s": round(seq_len / ranks[0]["step_s"], 1),
        }
        if peak:
            row["error"] = round(predicted_bytes(spec, seq_len) / peak - 1, 3)
        rows.append(row)
        print(f"  context_parallel {cp}: {row}", flush=True)
    return {"gpus": gpus, "memory_gb": round(memory_gb, 2), "rows": rows, "ok": all("failed" not in r for r in rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--store", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.rank, args.cp, args.seq_len, args.dry_run, args.store, args.out)
    else:
        print(json.dumps(section_context(args.dry_run), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
