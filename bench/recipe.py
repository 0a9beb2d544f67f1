"""The recipe, measured: real acceptance length of drafters trained on the tiny real target with the knobs the drafter
trainers people use differ on, at equal data and steps (prints a table; asserts nothing).

    .venv-train/bin/python bench/recipe.py [--steps 300] [--seeds 0,1] [--variants default,lk,...] [--work DIR]

1. The tiny target (built once, cached: `eagle3 tiny-target`); conversations from the standard library's sources
   (the user gives 8 lines of a module, the assistant continues 24), a held-out set from other modules.
2. `eagle3 generate` once into a bfloat16 dataset (the data every variant trains on), and once more with
   --regenerate (the assistant turns replaced by the target's own greedy continuation) for the `regenerated` variant.
3. Every variant trained `--steps` steps per seed (the seed changes the drafter's init and the data order), then
   `eagle3 evaluate` on the held-out prompts (exact greedy speculative decoding, K = 3): tau_real per seed with its
   95 % bootstrap interval over the prompts, and over all seeds' prompts pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from acceptance import chats, train_argv  # noqa: E402  (the conversations and the recipe of bench/acceptance.py)
from eagle3.acceptance import bootstrap_ci, tau_of  # noqa: E402
from eagle3.evaluate import evaluate  # noqa: E402
from eagle3.generate import generate  # noqa: E402
from eagle3.tiny_target import cached  # noqa: E402

# name -> (trainer flags, dataset). The trainer's defaults are the baseline; each other row changes one knob, but
# "speculators optimizer", which takes speculators' AdamW settings together (weight decay 0.01, clip 1.0, betas
# torch's defaults) as they ship them.
VARIANTS = {
    "default": ([], "responses"),
    "lk": (["--lk_weight", "1"], "responses"),
    "kl+lk": (["--lk_weight", "0.5"], "responses"),
    "gamma 0.8": (["--ttt_gamma", "0.8"], "responses"),
    "lm head trained": (["--train_lm_head", "true"], "responses"),
    "drop oov targets": (["--drop_oov_targets", "true"], "responses"),
    "speculators optimizer": (
        ["--weight_decay", "0.01", "--grad_clip", "1.0", "--adam_beta2", "0.999"],
        "responses",
    ),
    "regenerated": ([], "regenerated"),
}


def datasets(work: Path, target: Path, conversations: int, quiet: dict) -> tuple[dict, Path]:
    import sysconfig

    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = chats(work / "train.jsonl", [p for i, p in enumerate(stdlib) if i % 10 not in (4, 9)], 3)
    lines = train.read_text().splitlines()[:conversations]
    train.write_text("\n".join(lines) + "\n")
    held = chats(work / "held.jsonl", stdlib[4::10], 1)
    out = {}
    for name, regen in (("responses", False), ("regenerated", True)):
        folder = work / f"data-{name}"
        if not (folder / "index.json").exists():
            started = time.monotonic()
            generate(
                target,
                train,
                folder,
                max_len=1024,
                draft_vocab=512,
                dtype="bfloat16",
                shard_samples=64,
                regenerate_responses=regen,
                regenerate_max_new=192,
                **quiet,
            )
            print(f"data {name}: generated in {time.monotonic() - started:.0f} s", flush=True)
        out[name] = folder
    return out, held


def train(run: Path, data: Path, steps: int, seed: int, flags: list[str]) -> float:
    started = time.monotonic()
    argv = train_argv(data, run, steps, steps, ["--seed", str(seed), *flags])  # bench/acceptance.py's recipe
    proc = subprocess.run(argv, cwd=ROOT / "training", capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run.name}: training failed\n{proc.stderr[-3000:]}")
    return time.monotonic() - started


def measure(name: str, seeds: list[int], work: Path, target: Path, data: dict, held: Path, args) -> tuple:
    """One variant over the seeds (a finished run's evaluation is read back, not made again): (name, tau_real per
    seed, pooled tau_real, its 95 % interval, the validation's simulated tau per seed)."""
    flags, dataset = VARIANTS[name]
    pooled, taus, sims = [], [], []
    for seed in seeds:
        run = work / f"run-{name.replace(' ', '-').replace('+', '-')}-seed{seed}"
        result_file = run / "recipe-evaluation.json"
        if result_file.exists():
            result = json.loads(result_file.read_text())
        else:
            seconds = train(run, data[dataset], args.steps, seed, flags)
            quiet = {"log": lambda *a, **k: None}
            result = evaluate(
                target,
                run,
                held,
                k=3,
                max_new=args.max_new,
                prompts=args.prompts,
                baseline=False,
                checkpoint="latest",
                **quiet,
            )
            result["train_seconds"] = seconds
            result_file.write_text(json.dumps(result))
        pooled += [(p["tokens"] - 1, p["rounds"]) for p in result["per_prompt"]]
        taus.append(result["tau_real"])
        sims.append(result.get("tau_simulated"))
        ci = result.get("tau_real_ci95") or [float("nan")] * 2
        sim = "-" if result.get("tau_simulated") is None else f"{result['tau_simulated']:.3f}"
        print(
            f"{name} seed {seed}: tau_real {result['tau_real']:.3f} (95 % CI {ci[0]:.3f}-{ci[1]:.3f}), simulated {sim}, "
            f"exact {result['exact']}, trained in {result['train_seconds']:.0f} s",
            flush=True,
        )
    tokens, rounds = sum(t for t, _ in pooled), sum(r for _, r in pooled)
    return name, taus, tau_of(tokens, 0, rounds), bootstrap_ci(pooled), sims


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of the table's rows")
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--work", default="", help="work folder, reused: data and finished runs are kept")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="eagle3-recipe-"))
    work.mkdir(parents=True, exist_ok=True)
    quiet = {"log": lambda *a, **k: None}
    target = cached(**quiet)
    data, held = datasets(work, target, args.conversations, quiet)
    rows = [measure(name, seeds, work, target, data, held, args) for name in names]
    print(
        f"\nrecipe on the tiny target: {args.steps} steps, seeds {args.seeds}, {args.prompts} held-out prompts x "
        f"{args.max_new} tokens, K = 3 (exact greedy speculative decoding)"
    )
    print(
        f"{'variant':<22} {'tau_real per seed':<22} {'pooled':>7} {'95 % CI (pooled)':>17} {'simulated':>10} {'sim/real':>8}"
    )
    for name, taus, tau, ci, sims in rows:
        per_seed = " / ".join(f"{t:.3f}" for t in taus)
        sim = sum(sims) / len(sims) if all(v is not None for v in sims) else None
        sim_text = f"{sim:>10.3f} {sim / (sum(taus) / len(taus)) - 1:>+8.1%}" if sim else f"{'-':>10} {'-':>8}"
        print(f"{name:<22} {per_seed:<22} {tau:>7.3f} {ci[0]:>8.3f}-{ci[1]:.3f} {sim_text}")
    print(f"\nwork folder: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
