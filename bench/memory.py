#!/usr/bin/env python3
"""Memory figures: measured bytes per token per TTT step at the 1/8-scaled Kimi shape, and the
planner's predictions for the full Kimi shape on 8 x 96 GiB.

    .venv-train/bin/python bench/memory.py [--seq-len 1024] [--ttt-steps 3] [--skip-measure]

(a) Kimi/8 shape (hidden 896, 8 heads x 64, MLP 2304, draft vocab 4000, target vocab 20480), on CPU with
    eagle3.memtrack (bytes of the tensors the real forward+backward allocates; gradients excluded). For each
    option set: held at the end of the forward and peak, each divided by S * ttt_steps, and the marginal bytes
    of one more TTT step (held(T) - held(T-1)) / S. Next to each, the planner's prediction for the same run.
    The CUDA recipe (bf16 autocast, frozen weights in bf16) runs here on CPU with the exact attention path;
    flex_attention (CUDA) saves the concatenated K/V of each step instead: the planner's flex column shows it.
    FSDP needs several ranks: predicted only.
(b) Kimi shape (hidden 7168, 64 x 64, MLP 18432, vocab 32000/163840), ttt_steps 5, 8 ranks of 96 GiB:
    predicted peak per rank at 16384, 24576 and 32768 with and without each option.

Prints figures; asserts nothing. CPU only, about a minute on 2 busy cores with the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "training"))

import torch  # noqa: E402
from eagle3 import plan as P  # noqa: E402
from eagle3.memtrack import measure_planned_step  # noqa: E402

KIB = 1024


def planned(shape, device: str, world_size: int = 1, on_cpu: bool = False, **keys) -> P.RunSpec:
    """The spec of trainer config keys for `shape` on `device`, resolved as the trainer resolves it, nothing
    reserved; `on_cpu`: that recipe run here on CPU with the exact attention path."""
    spec = P.spec_for(shape, world_size, device=device, **keys)
    spec = dataclasses.replace(spec, reserve_gib=0.0, allocator_factor=1.0)
    return spec.with_run(device="cpu", attention="exact") if on_cpu else spec


def option_sets(shape, ttt_steps: int) -> dict[str, P.RunSpec]:
    t = {"ttt_steps": ttt_steps}
    return {
        "fp32 (CPU default)": planned(shape, "cpu", **t),
        "bf16 autocast (CUDA recipe)": planned(shape, "cuda", on_cpu=True, **t),
        "bf16 + activation checkpointing": planned(shape, "cuda", on_cpu=True, activation_checkpointing=True, **t),
        "bf16 + small loss chunks (512)": planned(shape, "cuda", on_cpu=True, loss_chunk_size=512, **t),
    }


def part_a(seq_len: int, ttt_steps: int) -> None:
    shape = P.SHAPES["kimi-k2.5-eighth"]
    per = seq_len * ttt_steps
    print(f"(a) Kimi/8 shape {shape.to_dict()}")
    print(f"    S={seq_len}, ttt_steps={ttt_steps}; KiB per token per TTT step (measured | planner)")
    print(f"    {'options':34} {'held/tok/step':>21} {'peak/tok/step':>21} {'marginal step':>21} {'s':>5}")
    for name, spec in option_sets(shape, ttt_steps).items():
        started = time.monotonic()
        fewer_spec = spec.with_run(ttt_steps=ttt_steps - 1)
        full = measure_planned_step(spec, seq_len)
        fewer = measure_planned_step(fewer_spec, seq_len)
        held_p = P.activation_bytes(spec, seq_len)
        peak_p = P.dynamic_bytes(spec, seq_len)
        marg_p = held_p - P.activation_bytes(fewer_spec, seq_len)
        cells = [
            (full.forward / per, held_p / per),
            (full.peak / per, peak_p / per),
            ((full.forward - fewer.forward) / seq_len, marg_p / seq_len),
        ]
        text = " ".join(f"{m / KIB:9.1f} | {p / KIB:9.1f}" for m, p in cells)
        print(f"    {name:34} {text} {time.monotonic() - started:5.1f}", flush=True)
    for label, o in (
        ("flex, CUDA recipe", planned(shape, "cuda", ttt_steps=ttt_steps)),
        ("flex + checkpointing", planned(shape, "cuda", activation_checkpointing=True, ttt_steps=ttt_steps)),
    ):
        held = P.activation_bytes(o, seq_len)
        marg = held - P.activation_bytes(o.with_run(ttt_steps=ttt_steps - 1), seq_len)
        print(
            f"    {label + ' (planner only)':34} held {held / per / KIB:9.1f}   marginal step {marg / seq_len / KIB:9.1f}"
        )
    fsdp = P.static_bytes(planned(shape, "cuda", 8, fsdp=True)) / P.GIB
    ddp = P.static_bytes(planned(shape, "cuda", 8)) / P.GIB
    print(f"    static per rank, 8 ranks: DDP {ddp:.2f} GiB, FSDP2 {fsdp:.2f} GiB (planner only: needs 8 ranks)")


def part_b() -> None:
    kimi = P.SHAPES["kimi-k2.5"]
    sets = {  # the reserve of a CUDA run (1 GiB) included
        "none (DDP, bf16 autocast)": P.on_cuda(kimi, 8),
        "activation checkpointing": P.on_cuda(kimi, 8, activation_checkpointing=True),
        "fsdp": P.on_cuda(kimi, 8, fsdp=True),
        "checkpointing + fsdp": P.on_cuda(kimi, 8, activation_checkpointing=True, fsdp=True),
    }
    lengths = (16384, 24576, 32768)
    print(
        "\n(b) Kimi shape, ttt_steps 5, 8 ranks x 96 GiB (budget 86.4 GiB with a 10 % margin): predicted GiB per rank"
    )
    print(f"    {'options':30} " + " ".join(f"{s:>8}" for s in lengths) + f" {'static':>8} {'largest fitting':>16}")
    for name, opts in sets.items():
        peaks = [P.predict_peak_bytes(opts, s) / P.GIB for s in lengths]
        plan = P.make_plan(opts, memory_gb=96, margin=0.1, lengths=lengths)
        print(
            f"    {name:30} " + " ".join(f"{p:8.1f}" for p in peaks) + f" {plan.static_gb:8.1f} {plan.max_seq_len:>16}"
        )
    on = sets["checkpointing + fsdp"]
    print("\n    where the bytes go at 32768, checkpointing + fsdp (GiB):")
    for part, value in P.breakdown(on, 32768).items():
        print(f"      {part:10} {value}")


def part_c() -> None:
    """The Kimi drafter with Llama-style attention against the same drafter with DeepSeek-V3's MLA (eagle3.mla):
    planned bytes per token, per TTT step, and the largest planned max_seq_len on 8 GPUs."""
    print("\n(c) Kimi shape, Llama-style (kimi-k2.5) vs MLA (kimi-k2.5-mla), 8 ranks, ttt_steps 5 (planner)")
    print(
        f"    {'options':22} {'shape':15} {'held KiB/token':>15} {'per TTT step':>13} {'largest @96':>12} {'@141':>8}"
    )
    sets = {
        "none": {},
        "checkpointing": {"activation_checkpointing": True},
        "fsdp": {"fsdp": True},
        "checkpointing + fsdp": {"activation_checkpointing": True, "fsdp": True},
    }
    for label, keys in sets.items():
        for name in ("kimi-k2.5", "kimi-k2.5-mla"):
            spec = P.on_cuda(P.SHAPES[name], 8, **keys)
            fewer = spec.with_run(ttt_steps=spec.run.ttt_steps - 1)
            per_token = P.activation_bytes(spec, 2) - P.activation_bytes(spec, 1)
            per_step = per_token - (P.activation_bytes(fewer, 2) - P.activation_bytes(fewer, 1))
            lengths = [P.make_plan(spec, memory_gb=gb, margin=0.1).max_seq_len for gb in (96, 141)]
            print(
                f"    {label:22} {name:15} {per_token / KIB:15.1f} {per_step / KIB:13.1f} {lengths[0]:12} {lengths[1]:8}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--skip-measure", action="store_true", help="only the planner's tables (no CPU runs)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    if not args.skip_measure:
        part_a(args.seq_len, args.ttt_steps)
    part_b()
    part_c()
    return 0


if __name__ == "__main__":
    sys.exit(main())
