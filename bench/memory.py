#!/usr/bin/env python3
"""Memory figures for issue 7: measured bytes per token per TTT step at the 1/8-scaled Kimi shape, and the
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
from eagle3.config import TrainConfig  # noqa: E402
from eagle3.memtrack import measure_planned_step  # noqa: E402
from eagle3.options import resolve_options  # noqa: E402

KIB = 1024


def planned(device: str, world_size: int = 1, on_cpu: bool = False, **keys) -> P.Options:
    """The planner's options for trainer config keys on `device`, resolved as the trainer resolves them;
    `on_cpu`: that recipe run here on CPU with the exact attention path."""
    opts = P.Options.from_run(resolve_options(TrainConfig(**keys), device, world_size), reserve_gib=0.0)
    return dataclasses.replace(opts, device="cpu", attention="exact") if on_cpu else opts


def option_sets() -> dict[str, P.Options]:
    return {
        "fp32 (CPU default)": planned("cpu"),
        "bf16 autocast (CUDA recipe)": planned("cuda", on_cpu=True),
        "bf16 + activation checkpointing": planned("cuda", on_cpu=True, activation_checkpointing=True),
        "bf16 + small loss chunks (512)": planned("cuda", on_cpu=True, loss_chunk_size=512),
    }


def measure(shape: P.Shape, opts: P.Options, seq_len: int, ttt_steps: int):
    return measure_planned_step(shape, seq_len, ttt_steps, opts)


def part_a(seq_len: int, ttt_steps: int) -> None:
    shape = P.SHAPES["kimi-k2.5-eighth"]
    per = seq_len * ttt_steps
    print(f"(a) Kimi/8 shape {dataclasses.asdict(shape)}")
    print(f"    S={seq_len}, ttt_steps={ttt_steps}; KiB per token per TTT step (measured | planner)")
    print(f"    {'options':34} {'held/tok/step':>21} {'peak/tok/step':>21} {'marginal step':>21} {'s':>5}")
    for name, opts in option_sets().items():
        started = time.monotonic()
        full = measure(shape, opts, seq_len, ttt_steps)
        fewer = measure(shape, opts, seq_len, ttt_steps - 1)
        held_p = P.activation_bytes(shape, seq_len, ttt_steps, opts)
        peak_p = P.dynamic_bytes(shape, seq_len, ttt_steps, opts)
        marg_p = held_p - P.activation_bytes(shape, seq_len, ttt_steps - 1, opts)
        cells = [
            (full.forward / per, held_p / per),
            (full.peak / per, peak_p / per),
            ((full.forward - fewer.forward) / seq_len, marg_p / seq_len),
        ]
        text = " ".join(f"{m / KIB:9.1f} | {p / KIB:9.1f}" for m, p in cells)
        print(f"    {name:34} {text} {time.monotonic() - started:5.1f}", flush=True)
    for label, o in (
        ("flex, CUDA recipe", planned("cuda")),
        ("flex + checkpointing", planned("cuda", activation_checkpointing=True)),
    ):
        held = P.activation_bytes(shape, seq_len, ttt_steps, o)
        marg = held - P.activation_bytes(shape, seq_len, ttt_steps - 1, o)
        print(
            f"    {label + ' (planner only)':34} held {held / per / KIB:9.1f}   marginal step {marg / seq_len / KIB:9.1f}"
        )
    fsdp = P.static_bytes(shape, planned("cuda", 8, fsdp=True), 8) / P.GIB
    ddp = P.static_bytes(shape, planned("cuda", 8), 8) / P.GIB
    print(
        f"    static per rank, 8 ranks: DDP {ddp:.2f} GiB, FSDP2 {fsdp:.2f} GiB (planner only: needs 8 ranks)"
    )


def part_b() -> None:
    kimi = P.SHAPES["kimi-k2.5"]
    sets = {  # the reserve of a CUDA run (1 GiB) included
        "none (DDP, bf16 autocast)": P.options_from_config(TrainConfig(), "cuda", 8),
        "activation checkpointing": P.options_from_config(
            TrainConfig(activation_checkpointing=True), "cuda", 8
        ),
        "fsdp": P.options_from_config(TrainConfig(fsdp=True), "cuda", 8),
        "checkpointing + fsdp": P.options_from_config(
            TrainConfig(activation_checkpointing=True, fsdp=True), "cuda", 8
        ),
    }
    lengths = (16384, 24576, 32768)
    print(
        "\n(b) Kimi shape, ttt_steps 5, 8 ranks x 96 GiB (budget 86.4 GiB with a 10 % margin): predicted GiB per rank"
    )
    print(
        f"    {'options':30} "
        + " ".join(f"{s:>8}" for s in lengths)
        + f" {'static':>8} {'largest fitting':>16}"
    )
    for name, opts in sets.items():
        peaks = [P.predict_peak_bytes(kimi, s, 5, opts, 8) / P.GIB for s in lengths]
        plan = P.make_plan(kimi, opts, ttt_steps=5, world_size=8, memory_gb=96, margin=0.1, lengths=lengths)
        print(
            f"    {name:30} "
            + " ".join(f"{p:8.1f}" for p in peaks)
            + f" {plan.static_gb:8.1f} {plan.max_seq_len:>16}"
        )
    on = sets["checkpointing + fsdp"]
    print("\n    where the bytes go at 32768, checkpointing + fsdp (GiB):")
    for part, value in P.breakdown(kimi, 32768, 5, on, 8).items():
        print(f"      {part:10} {value}")


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
