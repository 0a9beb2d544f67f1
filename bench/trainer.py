"""Trainer benchmark on CPU: tokens/s and peak memory per max_seq_len, and bytes saved for backward.

    .venv-train/bin/python bench/trainer.py            # S = 2048, 8192, 16384 (tiny shape) + 1/8-Kimi saved bytes
    .venv-train/bin/python bench/trainer.py --quick    # S = 2048 only, fewer steps

Prints figures; never asserts on time. Each max_seq_len runs in its own process, so the peak RSS it reports
(ru_maxrss) belongs to that length alone. Step times are medians over the timed steps (this machine is shared
and noisy). Rows are real packed rows from a synthetic dataset (documents of 48-512 tokens).

Saved bytes: autograd's saved-tensor hooks count the distinct storages kept for backward during one TTT
forward at the 1/8-scaled Kimi-K2.5 drafter shape (hidden 896, 8 heads x 64, MLP 2304, draft vocab 4000,
target vocab 20480, ttt_steps 5), divided by tokens and TTT steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import torch  # noqa: E402


def packed_rows(data_dir: str, seq_len: int, count: int) -> list[dict]:
    from eagle3.data import DatasetReader
    from eagle3.packing import build_row, plan_epoch

    reader = DatasetReader(data_dir)
    ids = list(range(reader.index.num_samples))
    plan = plan_epoch(ids, reader.index.lengths, max_seq_len=seq_len, world_size=1, seed=0, epoch=0)
    rows = []
    for step in plan.steps[:count]:
        rows.append(
            build_row([reader.sample(i, seq_len) for i in step[0]], seq_len, reader.index.hidden_size)
        )
    return rows


def tiny_model(data_dir: str):
    from eagle3.config import TrainConfig
    from eagle3.data import DatasetReader
    from eagle3.model import Eagle3Drafter
    from eagle3.train import drafter_config

    reader = DatasetReader(data_dir)
    model = Eagle3Drafter(drafter_config(TrainConfig(data_dir=data_dir, run_dir="-"), reader.index))
    t2d, d2t = reader.vocab()
    w = reader.target_weights()
    model.load_target_weights(w["embed"], w["final_norm"], w["lm_head"], t2d, d2t)
    return model


def run_options(**keys):
    """The trainer's run options on CPU for config `keys` (exact attention, no autocast), resolved as it does."""
    from eagle3.config import TrainConfig
    from eagle3.options import resolve_options

    return resolve_options(TrainConfig(**keys), "cpu")


def worker_throughput(args) -> dict:
    """One max_seq_len: warm-up step, then timed forward+backward+AdamW steps."""
    from eagle3.model import ttt_forward

    torch.set_num_threads(args.threads)
    model = tiny_model(args.data)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = packed_rows(args.data, args.seq_len, args.steps + 1)
    forward = run_options(ttt_steps=args.ttt_steps).ttt_kwargs()
    times, tokens = [], []
    for i in range(args.steps + 1):
        row = rows[i % len(rows)]
        t0 = time.perf_counter()
        loss, _ = ttt_forward(model, row, **forward)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step allocates optimizer state and warms caches
            times.append(time.perf_counter() - t0)
            tokens.append(int((row["document_ids"] >= 0).sum()))
    step = statistics.median(times)
    return {
        "seq_len": args.seq_len,
        "ttt_steps": args.ttt_steps,
        "step_s": step,
        "tokens_per_s": statistics.median(tokens) / step,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def worker_saved(args) -> dict:
    """Bytes saved for backward per token per TTT step at the 1/8-Kimi shape (random weights and row)."""
    from eagle3.model import DrafterConfig, Eagle3Drafter, ttt_forward

    torch.set_num_threads(args.threads)
    h, vt, vd, s, t = 896, 20480, 4000, args.seq_len, 5
    cfg = DrafterConfig(
        hidden_size=h, num_heads=8, head_dim=64, intermediate_size=2304, draft_vocab_size=vd,
        target_vocab_size=vt, aux_layer_ids=(2, 30, 58),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    model = Eagle3Drafter(cfg)
    chosen = torch.randperm(vt, generator=g)[:vd].sort().values
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[chosen] = True
    model.load_target_weights(
        torch.randn(vt, h, generator=g) * 0.02, torch.ones(h), torch.randn(vt, h, generator=g) * 0.02, t2d,
        chosen - torch.arange(vd),
    )  # fmt: skip
    doc_len = 512
    doc = torch.arange(s) // doc_len
    row = {
        "input_ids": torch.randint(0, vt, (s,), generator=g),
        "aux_hidden": torch.randn(s, 3 * h, generator=g).to(torch.bfloat16),
        "last_hidden": torch.randn(s, h, generator=g).to(torch.bfloat16),
        "loss_mask": torch.ones(s, dtype=torch.bool),
        "document_ids": doc,
        "position_ids": torch.arange(s) % doc_len,
    }
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers() if b.numel()}
    out = {
        "shape": "1/8 Kimi: H 896, 8x64 heads, MLP 2304, V_draft 4000, V_target 20480",
        "seq_len": s,
        "ttt_steps": t,
    }
    for ac in (False, True):
        saved: dict[int, int] = {}

        def pack(x: torch.Tensor, saved=saved):
            st = x.untyped_storage()
            if st.data_ptr() not in params:  # weights are static state, not per-token activations
                saved[st.data_ptr()] = st.nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            forward = run_options(ttt_steps=t, activation_checkpointing=ac).ttt_kwargs()
            loss, _ = ttt_forward(model, row, **forward)
        total = sum(saved.values())
        out["ac" if ac else "no_ac"] = {"saved_bytes": total, "bytes_per_token_per_step": total / (s * t)}
        loss.backward()
        model.zero_grad(set_to_none=True)
    return out


def run_worker(kind: str, extra: list[str], threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {kind} {extra} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("throughput", "saved"))
    p.add_argument("--data")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="2048,8192,16384")
    p.add_argument("--saved-seq-len", type=int, default=1024)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.worker == "throughput":
        print(json.dumps(worker_throughput(args)))
        return 0
    if args.worker == "saved":
        print(json.dumps(worker_saved(args)))
        return 0

    from eagle3.synth import SynthConfig, synthesize

    lengths = [2048] if args.quick else [int(v) for v in args.lengths.split(",")]
    steps = 1 if args.quick else args.steps
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.threads} thread(s) per run")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eagle3_bench_") as tmp:
        # Enough documents for the longest row plus the timed steps.
        need = max(lengths) * (steps + 1)
        synthesize(
            tmp, SynthConfig(num_samples=max(64, need // 240 + 16), max_len=512), log=lambda *a, **k: None
        )
        print(f"\ntiny shape (hidden 64, 4x16 heads, MLP 192, V 512/1024), ttt_steps {args.ttt_steps}, exact attention, "
              f"median of {steps} step(s)")  # fmt: skip
        print(f"{'max_seq_len':>11} {'step s':>8} {'tokens/s':>9} {'peak RSS GiB':>13}")
        for s in lengths:
            r = run_worker("throughput", ["--data", tmp, "--seq-len", str(s), "--steps", str(steps),
                                          "--ttt-steps", str(args.ttt_steps)], args.threads)  # fmt: skip
            print(
                f"{s:>11} {r['step_s']:>8.2f} {r['tokens_per_s']:>9.0f} {r['peak_rss_gb']:>13.2f}", flush=True
            )
    r = run_worker("saved", ["--seq-len", str(args.saved_seq_len)], args.threads)
    print(f"\nbytes saved for backward, {r['shape']}, S={r['seq_len']}, ttt_steps {r['ttt_steps']}:")
    for key, label in (("no_ac", "activation_checkpointing off"), ("ac", "activation_checkpointing on ")):
        v = r[key]
        print(f"  {label}: {v['bytes_per_token_per_step'] / 1024:8.1f} KiB/token/step "
              f"({v['saved_bytes'] / 2**20:.0f} MiB total; hooks do not see what checkpointing keeps in closures)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
