"""vLLM with and without a drafter: tokens/s of both, and the acceptance vLLM counts beside the project's decoder's
(prints figures; asserts nothing).

    .venv-train/bin/python bench/vllm_speedup.py --target DIR --drafter RUN_OR_EXPORT --data HELD.jsonl
        [--k 3] [--max-new 64] [--prompts 16] [--repeats 5] [--vllm-args JSON]

One engine pair (with the drafter, without) is started once; the held-out prompts are decoded `--repeats` times by
each (one request at a time, greedy), and the median tokens/s of each is reported with the median of the per-repeat
ratios (this machine is shared and noisy: the two are measured back to back in each repeat). The acceptance comes
from vLLM's counters; the project's exact decoder (`eagle3 evaluate`, no KV cache) decodes the same prompts once for
its figure. Without arguments it measures the tiny target with a drafter trained on it for 100 steps (about a
minute to build: training/tests/pipeline_support.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle3.engine_vllm import open_pair, parse_engine_args, vllm_version  # noqa: E402
from eagle3.evaluate import evaluate, evaluate_vllm, load_drafter  # noqa: E402


def tiny_drafter(work: Path):
    sys.path.insert(0, str(ROOT / "training" / "tests"))
    from pipeline_support import train_tiny_drafter

    return train_tiny_drafter(work)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="")
    ap.add_argument("--drafter", default="", help="a run folder (its best checkpoint) or an export folder")
    ap.add_argument("--data", default="", help="held-out samples: the prompts")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vllm-args", default="{}", metavar="JSON")
    args = ap.parse_args()
    if not (args.target and args.drafter and args.data):
        built = tiny_drafter(Path(tempfile.mkdtemp(prefix="eagle3-vllm-speedup-")))
        args.target, args.drafter, args.data = str(built.target), str(built.export_dir), str(built.held)
    options = dict(k=args.k, max_new=args.max_new, prompts=args.prompts, log=lambda *a, **k: None)
    ours = evaluate(args.target, args.drafter, args.data, baseline=False, **options)

    export = Path(args.drafter)
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-speedup-export-") as tmp:
        drafter, run_cfg = load_drafter(export)
        if run_cfg is not None:  # a run folder: serve its best checkpoint, as evaluate --engine vllm does
            from eagle3.engine_vllm import exported

            export = exported(drafter, run_cfg, export, args.target, Path(tmp))
        spec, plain = open_pair(args.target, export, args.k, parse_engine_args(args.vllm_args))
        try:
            runs = [
                evaluate_vllm(args.target, args.drafter, args.data, engines=(spec, plain), **options)
                for _ in range(args.repeats)
            ]
        finally:
            spec.close()
            plain.close()
    with_rate = statistics.median(r["tokens_per_second"] for r in runs)
    alone_rate = statistics.median(r["greedy_tokens_per_second"] for r in runs)
    ratio = statistics.median(r["speedup"] for r in runs)
    last = runs[-1]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; vLLM {vllm_version()}")
    print(f"K={args.k}, {last['prompts']} prompts x up to {args.max_new} tokens, {args.repeats} repeats")
    print(f"engine start: {spec.start_seconds:.1f} s with the drafter, {plain.start_seconds:.1f} s without")
    print(
        f"tokens/s (median): {with_rate:.1f} with the drafter, {alone_rate:.1f} without; ratio {ratio:.3f} "
        f"(per repeat: {[r['speedup'] for r in runs]})"
    )
    print(f"outputs equal in every repeat: {all(r['exact'] for r in runs)}")
    print("acceptance length (1 + accepted / drafting rounds):")
    print(
        f"  vLLM counters      {last['acceptance_length']}  ({last['accepted_tokens']} accepted in "
        f"{last['drafting_rounds']} rounds), per position {last['acceptance_per_position']}"
    )
    print(
        f"  project's decoder  {ours['acceptance_length']}  ({ours['accepted_tokens']} accepted in "
        f"{ours['drafting_rounds']} rounds), per position {ours['acceptance_per_position']}"
    )
    print(
        f"tau_real (tokens of the drafting rounds per round): vLLM {last['tau_real']}, project's decoder {ours['tau_real']}"
    )
    print(json.dumps({"vllm": runs, "eagle3": ours}))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from running this again
    sys.exit(main())
