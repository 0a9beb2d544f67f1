"""How well the validation predicts the real acceptance length: for each finished run of bench/recipe.py, the
trainer's validation of the evaluated checkpoint replayed (the same split, rows and statistics as
eagle3.loop.Trainer.validate), its two figures beside evaluate's tau_real (prints figures; asserts nothing).

    .venv-train/bin/python bench/prediction.py --work /var/tmp/recipe [--max-new 48]

- acceptance_length: the stationary estimate, every validation slot counted as the start of a round;
- tau_predicted: the rounds a greedy decoder would run over the validation responses, round by round from the
  frontier (eagle3.acceptance.round_walk), exact where the responses are the target's own greedy output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from eagle3.data import DatasetReader  # noqa: E402
from eagle3.metrics import StatAccumulator, summarize, val_record  # noqa: E402
from eagle3.model import ttt_forward  # noqa: E402
from eagle3.packing import plan_epoch, split_train_val  # noqa: E402
from eagle3.trained import load_trained  # noqa: E402


def validation(run: Path, which: str = "best", max_new: int = 0) -> dict:
    """The validation record of the run's `which` checkpoint, as the trainer would have written it with
    `val_max_new: max_new`."""
    model, _, cfg = load_trained(str(run), which, warn=lambda *a: None)
    reader = DatasetReader(cfg.data_dir)
    _, val_ids = split_train_val(reader.index.num_samples, cfg.val_fraction)
    plan = plan_epoch(
        val_ids,
        reader.index.lengths,
        max_seq_len=cfg.max_seq_len,
        world_size=1,
        seed=cfg.seed,
        epoch=0,
        shuffle=False,
        packing=cfg.packing,
    )
    acc = StatAccumulator(cfg.ttt_steps)
    with torch.no_grad():
        for assignment in plan.steps:
            row = reader.read_row(assignment[0], cfg.max_seq_len)
            kwargs = {"ttt_steps": cfg.ttt_steps, "gamma": cfg.ttt_gamma, "lk_weight": cfg.lk_weight}
            _, stats = ttt_forward(model, row, walk_max_new=max_new, **kwargs)
            acc.add_stats(stats)
    return val_record(0, summarize(acc.stats), batches=len(plan.steps), batches_total=len(plan.steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="bench/recipe.py's work folder (its finished runs)")
    ap.add_argument("--max-new", type=int, default=48, help="val_max_new: evaluate's --max-new of the runs (0: all)")
    args = ap.parse_args()
    rows = []
    for run in sorted(Path(args.work).glob("run-*")):
        result = run / "recipe-evaluation.json"
        if not result.is_file():
            continue
        real = json.loads(result.read_text())
        val = validation(run, max_new=args.max_new)
        rows.append((run.name, real["tau_real"], val["acceptance_length"], val["tau_predicted"]))
    print(f"{'run':<36} {'tau_real':>8} {'stationary':>10} {'vs real':>8} {'predicted':>9} {'vs real':>8}")
    for name, real, stationary, predicted in rows:
        print(
            f"{name:<36} {real:>8.3f} {stationary:>10.3f} {stationary / real - 1:>+8.1%} {predicted:>9.3f} "
            f"{predicted / real - 1:>+8.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
