"""Packing benchmark: how full the rows come out, per packer, and what it does to the shuffle order.

    .venv-train/bin/python bench/packing.py                 # 20000 samples per distribution (seconds)
    .venv-train/bin/python bench/packing.py --samples 5000  # quicker

A padded slot costs a step as much as a real token, so the fill (real tokens per slot, eagle3.packing.EpochPlan.fill)
multiplies the trainer's tokens/s directly. Two length distributions, drawn with a fixed seed:

- uniform 48-512 tokens: the synthetic dataset of the tests, the demo and bench/trainer.py;
- lognormal (median 600 tokens, sigma 0.9, cut at 16384): a stand-in for chat data, whose lengths have a long tail
  (a few samples of several thousand tokens, many of a few hundred). It is an assumption, not a measured corpus.

Per max_seq_len and world size, both packers (first_fit, next_fit): the fill, the steps of one epoch, how far the
shuffle order moves (the most steps any sample is placed after one that came later in the shuffle; next_fit at
one rank keeps the order exactly), and the time to plan the epoch. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from eagle3.packing import PACKINGS, plan_epoch, shuffled


def distributions(n: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    return {
        "uniform 48-512": [rng.randint(48, 512) for _ in range(n)],
        "lognormal, median 600": [max(16, min(16384, round(rng.lognormvariate(6.4, 0.9)))) for _ in range(n)],
    }


def most_steps_late(plan, ids: list[int], seed: int) -> int:
    """The most steps a sample is placed after one that came later in the shuffle (0: the order is kept)."""
    step_of = {sid: k for k, step in enumerate(plan.steps) for row in step for sid in row}
    later_min, worst = len(plan), 0
    for sid in reversed(shuffled(ids, seed, plan.epoch)):
        worst = max(worst, step_of[sid] - later_min)
        later_min = min(later_min, step_of[sid])
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000, help="samples per distribution")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--world-sizes", default="1,8")
    args = ap.parse_args()
    if args.samples < 1:
        ap.error("--samples must be at least 1")
    lengths = [int(v) for v in args.lengths.split(",")]
    worlds = [int(v) for v in args.world_sizes.split(",")]
    print(
        f"{'distribution':<22} {'ranks':>5} {'max_seq_len':>11} "
        + " ".join(f"{p + ' fill':>14} {'steps':>6} {'late':>5} {'plan s':>6}" for p in PACKINGS)
    )
    for name, lens in distributions(args.samples).items():
        ids = list(range(len(lens)))
        mean = sum(lens) / len(lens)
        print(f"{name} ({len(lens)} samples, {mean:.0f} tokens on average)")
        for world in worlds:
            for s in lengths:
                cells = []
                for packing in PACKINGS:
                    t0 = time.perf_counter()
                    plan = plan_epoch(ids, lens, max_seq_len=s, world_size=world, seed=1, epoch=0, packing=packing)
                    took = time.perf_counter() - t0
                    cells.append(f"{plan.fill:>14.1%} {len(plan):>6} {most_steps_late(plan, ids, 1):>5} {took:>6.2f}")
                print(f"{'':<22} {world:>5} {s:>11} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
