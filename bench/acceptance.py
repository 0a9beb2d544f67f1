"""Real acceptance on the tiny real target: the whole chain, measured (prints figures; asserts nothing).

    .venv-train/bin/python bench/acceptance.py [--steps 300] [--every 100] [--conversations 240]

1. The tiny target (built once, cached: `eagle3 tiny-target`), its held-out loss.
2. `eagle3 generate` of the same conversations (held-out stdlib code, user gives lines, assistant continues) into a
   bfloat16 and a float8 dataset: tokens/s, disk bytes per token.
3. Three drafters trained `--steps` steps: bf16 data with EAGLE-3 norms off, bf16 with the EAGLE 3.1 norms on
   (fc_norm, norm_output, norm_before_residual), fp8 data with norms off. Every `--every` steps: the validation's
   simulated acceptance length and `eagle3 evaluate`'s tau_real on prompts from other files (K = 3).
4. The most-frequent-token drafter's tau_real, the baseline a trained drafter has to beat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle3.evaluate import evaluate, record_evaluation  # noqa: E402
from eagle3.generate import generate  # noqa: E402
from eagle3.tiny_target import INFO_FILE, cached  # noqa: E402


def chats(path: Path, files: list[Path], per_file: int) -> Path:
    with path.open("w") as f:
        for p in files:
            lines = p.read_text(errors="replace").splitlines()
            for start in range(0, min(len(lines), 40 * per_file), 40):
                head, tail = "\n".join(lines[start : start + 8]), "\n".join(lines[start + 8 : start + 32])
                if head.strip() and tail.strip():
                    f.write(
                        json.dumps(
                            {"messages": [{"role": "user", "content": head}, {"role": "assistant", "content": tail}]}
                        )
                        + "\n"
                    )
    return path


def train_argv(data: Path, run: Path, steps: int, every: int, extra: list[str]) -> list[str]:
    """`eagle3 train` on CPU with the bench's recipe: rows of 2,048, TTT 3, a checkpoint and a validation every
    `every` steps, all kept."""
    flags = {
        "data_dir": data,
        "run_dir": run,
        "max_seq_len": 2048,
        "max_steps": steps,
        "warmup_steps": 20,
        "lr": "3e-3",
        "ttt_steps": 3,
        "checkpoint_every": every,
        "val_every": every,
        "val_max_new": 48,  # tau_predicted for a decoder of 48 tokens per prompt, as the benches evaluate
        "keep_checkpoints": 100,
        "device": "cpu",
        "dtype": "fp32",
    }
    return [sys.executable, "-m", "eagle3", "train", *(x for k, v in flags.items() for x in (f"--{k}", str(v))), *extra]


def generate_datasets(target: Path, train: Path, work: Path, quiet: dict) -> dict[str, Path]:
    """The training conversations generated once in bfloat16 and once in 8-bit, with their speed and size."""
    datasets = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        out = work / f"data-{dtype}"
        started = time.monotonic()
        index = generate(target, train, out, max_len=1024, draft_vocab=512, dtype=dtype, shard_samples=64, **quiet)
        seconds = time.monotonic() - started
        meta = json.loads(index.read_text())
        disk = sum(p.stat().st_size for p in (out / "shards").iterdir())
        print(
            f"generate {dtype}: {meta['num_samples']} samples, {meta['num_tokens']} tokens in {seconds:.1f} s "
            f"({meta['num_tokens'] / seconds:,.0f} tokens/s with load and tokenizing), "
            f"{disk / meta['num_tokens']:.0f} bytes/token on disk (hidden 64)"
        )
        datasets[dtype] = out
    return datasets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--work", default="", help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="eagle3-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    quiet = {"log": lambda *a, **k: None}
    target = cached(**quiet)
    info = json.loads((target / INFO_FILE).read_text())
    print(
        f"tiny target: held-out loss {info['held_out_loss']} nats/token (perplexity {info['held_out_perplexity']}),"
        f" built in {info['build_seconds']} s"
    )
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = chats(work / "train.jsonl", [p for i, p in enumerate(stdlib) if i % 10 not in (4, 9)], 3)
    lines = train.read_text().splitlines()[: args.conversations]
    train.write_text("\n".join(lines) + "\n")
    held = chats(work / "held.jsonl", stdlib[4::10], 1)
    datasets = generate_datasets(target, train, work, quiet)
    runs = {
        "bf16, norms off": (datasets["bfloat16"], []),
        "bf16, norms on": (
            datasets["bfloat16"],
            ["--fc_norm", "true", "--norm_output", "true", "--norm_before_residual", "true"],
        ),
        "fp8, norms off": (datasets["float8_e4m3fn"], []),
    }
    rows = []
    baseline = None
    for name, (data, extra) in runs.items():
        run = work / ("run-" + name.replace(", ", "-").replace(" ", "-"))
        started = time.monotonic()
        proc = subprocess.run(
            train_argv(data, run, args.steps, args.every, extra), cwd=ROOT / "training", capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"{name}: training failed\n{proc.stderr[-3000:]}")
            return 1
        train_seconds = time.monotonic() - started
        for step in range(args.every, args.steps + 1, args.every):
            ckpt = run / "checkpoints" / f"step_{step:08d}"
            result = evaluate(
                target,
                run,
                held,
                k=3,
                max_new=args.max_new,
                prompts=args.prompts,
                baseline=baseline is None,
                checkpoint=str(ckpt),
                **quiet,
            )
            record_evaluation(run, result)  # `eagle3 report RUN` shows it
            if baseline is None:
                baseline = result["tau_frequent_token"]
            rows.append((name, step, result.get("tau_simulated"), result))
            print(
                f"  {name} step {step}: tau_sim {result.get('tau_simulated')} tau_real {result['tau_real']:.3f} "
                f"exact {result['exact']}",
                flush=True,
            )
        print(f"{name}: {args.steps} steps in {train_seconds:.0f} s")
    print(f"\nmost-frequent-token drafter: tau_real {baseline:.3f}")
    print(f"{'drafter':<18} {'step':>5} {'tau_sim':>8} {'tau_real':>9} {'accept/pos (K=3)':>24} {'exact':>6}")
    for name, step, sim, r in rows:
        per = " ".join(f"{a:.2f}" if a is not None else "-" for a in r["acceptance_per_position"])
        sim_text = f"{sim:.3f}" if sim is not None else "-"
        print(f"{name:<18} {step:>5} {sim_text:>8} {r['tau_real']:>9.3f} {per:>24} {r['exact']!s:>6}")
    print(f"\nwork folder: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
