"""Trainer benchmark on CPU: the step speed table, tokens/s per max_seq_len, and bytes held for backward.

    .venv-train/bin/python bench/trainer.py                  # every table (docs/speed.md)
    .venv-train/bin/python bench/trainer.py --only lengths   # tokens/s at S = 1024 .. 16384 (tiny shape)
    .venv-train/bin/python bench/trainer.py --quick          # S = 2048 only, one round

Prints figures; never asserts on time. Each run is its own process, so the peak RSS it reports (ru_maxrss) belongs
to it alone; runs are interleaved over rounds (min and median: this machine is shared and noisy).

Tokens/s per max_seq_len: every length trains on the same documents (the first --timed-tokens tokens of one
shuffled epoch of a synthetic dataset, documents of 48-512 tokens, packed into rows of that length; never the
epoch's partial last row), so a length's figure does not depend on which documents it drew. Tokens are real
tokens, not padding ('fill' is their share of the slots); 'kernel' is the share of the step spent in the kernel
(page faults, mostly); 'vs shorter' compares each length with the previous one round by round; 'ew ns/el' times the
MLP's elementwise work at the row's shape, the memory-bound side of the machine (its cost per element rises as a
row's tensors outgrow the cache).

Saved bytes: the resident set a forward adds and keeps for backward at the 1/8-scaled Kimi-K2.5 drafter shape
(hidden 896, 8 heads x 64, MLP 2304, draft vocab 4000, target vocab 20480, ttt_steps 5), per token and TTT step.
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
from eagle3.distributed import keep_freed_host_memory  # noqa: E402


def packed_rows(data_dir: str, seq_len: int, tokens: int, epoch: int = 0) -> list[dict]:
    """The first rows of the packer's epoch `epoch` (one rank) that hold `tokens` real tokens between them.

    Every length reads the same documents this way (the shuffled order of the epoch, cut into rows of its own
    length), so the rows' cost per token does not depend on which documents a length happened to get: the exact
    attention's cost grows with document length. The epoch's last row, the partial leftover, is never used."""
    from eagle3.data import DatasetReader
    from eagle3.packing import build_row, plan_epoch

    reader = DatasetReader(data_dir)
    ids = list(range(reader.index.num_samples))
    plan = plan_epoch(ids, reader.index.lengths, max_seq_len=seq_len, world_size=1, seed=0, epoch=epoch)
    rows, total = [], 0
    for step in plan.steps[:-1]:
        if total >= tokens:
            return rows
        rows.append(build_row([reader.sample(i, seq_len) for i in step[0]], seq_len, reader.index.hidden_size))
        total += int((rows[-1]["document_ids"] >= 0).sum())
    if total >= tokens:
        return rows
    raise SystemExit(
        f"bench dataset too small: {plan.tokens} tokens pack into {len(plan.steps)} row(s) of {seq_len}; "
        f"{tokens} tokens are needed before the epoch's partial last row"
    )


def tiny_model(data_dir: str):
    from eagle3.config import TrainConfig
    from eagle3.data import DatasetReader
    from eagle3.model import Eagle3Drafter
    from eagle3.spec import drafter_config

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
    """One max_seq_len: a warm-up step (a row of another epoch), then timed forward+backward+AdamW steps over the
    rows that hold the first --timed-tokens tokens of epoch 0; FLOPs counted per row (eagle3.flops)."""
    from eagle3.model import ttt_forward

    torch.set_num_threads(args.threads)
    keep_freed_host_memory("cpu")  # as the trainer does on CPU
    model = tiny_model(args.data)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    warm = packed_rows(args.data, args.seq_len, 1, epoch=1)[0]
    rows = packed_rows(args.data, args.seq_len, args.timed_tokens)
    chunk = {} if args.loss_chunk_size is None else {"loss_chunk_size": args.loss_chunk_size}
    if args.budget_mib:  # the planner's choice for this length and budget (eagle3.plan.memory_options_choice)
        mode, size = planned_memory_options(model.cfg, args.seq_len, args.ttt_steps, args.budget_mib)
        chunk = {"activation_checkpointing": mode, "loss_chunk_size": size}
    forward = run_options(ttt_steps=args.ttt_steps, **chunk).ttt_kwargs()
    times, tokens = [], []
    for i, row in enumerate([warm, *rows]):
        if i == 1:
            sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        t0 = time.perf_counter()
        loss, _ = ttt_forward(model, row, **forward)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step allocates optimizer state and warms caches
            times.append(time.perf_counter() - t0)
            tokens.append(int((row["document_ids"] >= 0).sum()))
    sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0  # page faults, mostly
    ew_ns = elementwise_ns(args.seq_len, model.cfg.intermediate_size)
    from eagle3.flops import step_flops
    from eagle3.spec import SHAPE_KEYS

    shape = {k: getattr(model.cfg, k) for k in (*SHAPE_KEYS, "num_kv_heads")}
    flop = 0
    for row in rows:
        doc = row["document_ids"]
        docs = torch.unique_consecutive(doc[doc >= 0], return_counts=True)[1].tolist()
        flop += step_flops(
            model.cfg,
            args.seq_len,
            args.ttt_steps,
            doc_len=docs,
            activation_checkpointing=forward["activation_checkpointing"],
        )["total"]
    return {
        "shape": shape,
        "loss_chunk_size": forward["loss_chunk_size"],
        "activation_checkpointing": forward["activation_checkpointing"],
        "seq_len": args.seq_len,
        "ttt_steps": args.ttt_steps,
        "steps": len(times),
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "flop_per_s": flop / sum(times),
        "kernel_share": sys_s / sum(times),
        "elementwise_ns": ew_ns,
        "fill": sum(tokens) / (len(tokens) * args.seq_len),  # tokens per slot of the timed rows
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def planned_memory_options(cfg, seq_len: int, ttt_steps: int, budget_mib: float):
    """(activation_checkpointing, loss_chunk_size) the planner picks for a CPU fp32 run of this drafter at
    `seq_len` within `budget_mib` of predicted peak (no reserve: the interpreter and torch are not counted)."""
    import dataclasses

    from eagle3 import plan

    spec = plan.spec_for(cfg, device="cpu", dtype="fp32", attention="exact", ttt_steps=ttt_steps)
    spec = dataclasses.replace(spec, reserve_gib=0.0, allocator_factor=1.0)
    choice = plan.memory_options_choice(spec, seq_len, int(budget_mib * 2**20))
    if choice is None:
        raise SystemExit(f"nothing fits {budget_mib} MiB at max_seq_len {seq_len}")
    return choice


def eighth_model(s: int, doc_len: int = 512):
    """The 1/8-Kimi drafter with random target weights and one random packed row of `s` slots (documents of
    `doc_len`): the issue's shape for the speed and saved-bytes figures."""
    from eagle3.model import Eagle3Drafter
    from eagle3.spec import DrafterConfig

    h, vt, vd = 896, 20480, 4000
    cfg = DrafterConfig(
        hidden_size=h,
        num_heads=8,
        head_dim=64,
        intermediate_size=2304,
        draft_vocab_size=vd,
        target_vocab_size=vt,
        aux_layer_ids=(2, 30, 58),
    )
    g = torch.Generator().manual_seed(0)
    model = Eagle3Drafter(cfg)
    chosen = torch.randperm(vt, generator=g)[:vd].sort().values
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[chosen] = True
    model.load_target_weights(
        torch.randn(vt, h, generator=g) * 0.02,
        torch.ones(h),
        torch.randn(vt, h, generator=g) * 0.02,
        t2d,
        chosen - torch.arange(vd),
    )
    doc = torch.arange(s) // doc_len
    row = {
        "input_ids": torch.randint(0, vt, (s,), generator=g),
        "aux_hidden": torch.randn(s, 3 * h, generator=g).to(torch.bfloat16),
        "last_hidden": torch.randn(s, h, generator=g).to(torch.bfloat16),
        "loss_mask": torch.ones(s, dtype=torch.bool),
        "document_ids": doc,
        "position_ids": torch.arange(s) % doc_len,
    }
    return model, row


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SAVED_MODES = ("none", "selective", "full")


def worker_saved(args) -> dict:
    """Bytes a forward pass holds for backward per token per TTT step at the 1/8-Kimi shape (random weights and
    row), per activation checkpointing mode: the resident memory after the forward minus before it. The worker
    runs with MALLOC_MMAP_THRESHOLD_ fixed low, so every tensor of note is its own mapping and a freed one leaves
    the resident set: what remains after the forward is what autograd keeps (saved-tensor hooks would not see what
    a checkpoint keeps inside itself, the selective mode's matmul outputs)."""
    import gc

    from eagle3.model import ttt_forward

    torch.set_num_threads(args.threads)
    s, t = args.seq_len, 5
    model, row = eighth_model(s)
    out = {
        "shape": "1/8 Kimi: H 896, 8x64 heads, MLP 2304, V_draft 4000, V_target 20480",
        "seq_len": s,
        "ttt_steps": t,
    }
    for rnd in range(2):  # the first round warms the allocator and torch's caches
        for mode in SAVED_MODES:
            gc.collect()
            before = _rss_bytes()
            loss, _ = ttt_forward(
                model, row, ttt_steps=t, activation_checkpointing=mode, loss_chunk_size=0, attention="exact"
            )
            held = _rss_bytes() - before
            loss.backward()
            model.zero_grad(set_to_none=True)
            del loss
            if rnd:
                out[mode] = {"saved_bytes": held, "bytes_per_token_per_step": held / (s * t)}
    return out


# The speed table's variants at the 1/8-Kimi shape: (label, activation_checkpointing, loss_chunk_size); None is
# bench/eager_reference.py. "off": both memory options off; "on": both on (small loss chunks), with the selective or
# the full checkpointing mode.
SPEED_VARIANTS = (
    ("eager reference", None, None),
    ("off (ckpt off, loss_chunk 0)", False, 0),
    ("default (loss_chunk 4096)", False, 4096),
    ("ckpt selective, loss_chunk 0", "selective", 0),
    ("ckpt full, loss_chunk 0", "full", 0),
    ("loss_chunk 256", False, 256),
    ("on (selective, loss_chunk 256)", "selective", 256),
    ("on (full, loss_chunk 256)", "full", 256),
)


def matmul_rate(shapes, dtype=torch.float32, device="cpu", reps: int = 3) -> float:
    """Best FLOP/s of torch.mm over `shapes` [(m, k, n)] in `dtype`: the practical peak at the step's own shapes."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        torch.mm(a, b)
        for _ in range(reps):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device != "cpu":
                torch.cuda.synchronize()
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
    return best


def elementwise_ns(rows: int, cols: int, reps: int = 7) -> float:
    """Best nanoseconds per element of `silu(x) * x` over an fp32 [rows, cols] tensor: the MLP's elementwise work at
    the step's own shape (two reads, two fresh results). Its cost per element rises once the tensors no longer fit
    the cache, which a matmul rate does not show: the memory-bound side of the machine's limit."""
    x = torch.randn(rows, cols)
    best = float("inf")
    for i in range(reps + 1):
        t0 = time.perf_counter()
        y = torch.nn.functional.silu(x) * x
        if i:  # the first allocates the results' pages
            best = min(best, time.perf_counter() - t0)
        del y
    return best / (rows * cols) * 1e9


def step_matmul_shapes(shape, s: int) -> list[tuple[int, int, int]]:
    """The step's largest matmuls (m, k, n): q/k/v from [S, 2H], the MLP up and down, the draft head."""
    h, i = shape.hidden_size, shape.intermediate_size
    return [
        (s, 2 * h, shape.attention_dim + 2 * shape.kv_dim),
        (s, h, i),
        (s, i, h),
        (s, h, shape.draft_vocab_size),
    ]


def worker_speed(args) -> dict:
    """The speed table: forward + backward at the 1/8-Kimi shape, variants interleaved, `runs` rounds; the matmul
    microbenchmark runs in every round too (its best is the practical peak)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from eager_reference import reference_step
    from eagle3 import plan
    from eagle3.flops import step_flops
    from eagle3.model import ttt_forward

    torch.set_num_threads(args.threads)
    keep_freed_host_memory("cpu")  # as the trainer does on CPU
    s, t = args.seq_len, args.ttt_steps
    model, row = eighth_model(s)
    shape = plan.SHAPES["kimi-k2.5-eighth"]

    def run(ckpt, chunk):
        t0 = time.perf_counter()
        if ckpt is None:
            loss, _ = reference_step(model, row, t)
        else:
            kw = {"activation_checkpointing": ckpt, "loss_chunk_size": chunk, "attention": "exact"}
            loss, _ = ttt_forward(model, row, ttt_steps=t, **kw)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _, ckpt, chunk in SPEED_VARIANTS:
        run(ckpt, chunk)  # warm-up
    times: dict[str, list[float]] = {label: [] for label, _, _ in SPEED_VARIANTS}
    peak = 0.0
    for _ in range(args.runs):
        for label, ckpt, chunk in SPEED_VARIANTS:
            times[label].append(run(ckpt, chunk))
        peak = max(peak, matmul_rate(step_matmul_shapes(shape, s)))
    rows = []
    for label, ckpt, chunk in SPEED_VARIANTS:
        f = step_flops(
            shape,
            s,
            t,
            loss_chunk_size=0 if chunk is None else chunk,
            activation_checkpointing=ckpt or False,
            doc_len=512,
        )
        useful = step_flops(shape, s, t, loss_chunk_size=0, doc_len=512)["total"]  # the maths, once
        rows.append(
            {
                "label": label,
                "min_s": min(times[label]),
                "median_s": statistics.median(times[label]),
                "flops": f["total"],
                "useful_flops": useful,
                "recompute_flops": f["recompute"],
            }
        )
    out = {"seq_len": s, "ttt_steps": t, "runs": args.runs, "matmul_peak": peak, "rows": rows}
    if args.profile:
        out["profile"] = {}
        for label, ckpt, chunk in (SPEED_VARIANTS[1], SPEED_VARIANTS[-2], SPEED_VARIANTS[-1]):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(ckpt, chunk)
            top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
            total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
            out["profile"][label] = [
                (e.key, e.self_cpu_time_total / 1e6, e.count, e.self_cpu_time_total / total) for e in top
            ]
    return out


def print_speed(r: dict) -> None:
    peak = r["matmul_peak"]
    by = {row["label"]: row for row in r["rows"]}
    ref, off = by["eager reference"]["min_s"], by["off (ckpt off, loss_chunk 0)"]["min_s"]
    print(
        f"\nstep speed, 1/8-Kimi shape (H 896, 8x64 heads, MLP 2304, V 4000/20480), S={r['seq_len']} (documents of "
        f"512), ttt_steps {r['ttt_steps']}, fp32, forward+backward, {r['runs']} interleaved runs"
    )
    print(f"matmul microbenchmark (same dtype, the step's shapes, same run): practical peak {peak / 1e9:.1f} GFLOP/s")
    print(
        f"{'variant':<30} {'min s':>7} {'median s':>9} {'x off':>6} {'x ref':>6} {'GFLOP':>7} {'recomp':>7} "
        f"{'GFLOP/s':>8} {'of peak':>8}"
    )
    for row in r["rows"]:
        rate = row["useful_flops"] / row["min_s"]
        print(
            f"{row['label']:<30} {row['min_s']:>7.2f} {row['median_s']:>9.2f} {row['min_s'] / off:>6.2f} "
            f"{row['min_s'] / ref:>6.2f} {row['flops'] / 1e9:>7.1f} {row['recompute_flops'] / 1e9:>7.1f} "
            f"{rate / 1e9:>8.1f} {rate / peak:>8.0%}"
        )
    print(
        "  GFLOP: matmul FLOPs the variant executes (eagle3.flops; the reference is credited with the same maths);"
        " recomp: of which recomputed;\n  GFLOP/s and of peak: the maths once (the off variant's FLOPs) over the "
        "min step time, against the matmul peak above"
    )
    for label, top in r.get("profile", {}).items():
        print(f"\nprofile, {label}: top 5 by self CPU time")
        for name, secs, calls, frac in top:
            print(f"  {name:<40} {secs:>7.2f} s {frac:>6.1%} {calls:>6} calls")


def run_worker(kind: str, extra: list[str], threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if kind == "saved":  # large tensors their own mappings, returned when freed: the saved table reads the resident
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # set; not for timed workers (every fresh mapping page-faults)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {kind} {extra} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("throughput", "saved", "speed"))
    p.add_argument("--data")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument(
        "--timed-tokens",
        type=int,
        default=0,
        help="lengths table: tokens every length trains on, timed (0: twice the longest length)",
    )
    p.add_argument("--ttt-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--saved-seq-len", type=int, default=1024)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=5, help="interleaved rounds of the speed table (min and median)")
    p.add_argument("--speed-seq-len", type=int, default=1024)
    p.add_argument("--speed-ttt-steps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="print the profile's top 5 of the off and on steps")
    p.add_argument("--only", choices=("speed", "lengths", "saved"), help="run one table only")
    p.add_argument("--loss-chunk-size", type=int, default=None, help="lengths table: this loss_chunk_size")
    p.add_argument(
        "--budget-mib",
        type=float,
        default=600.0,
        help="lengths table: the memory options the planner picks for this budget (0: config defaults)",
    )
    args = p.parse_args()
    if args.timed_tokens < 0:
        p.error(f"--timed-tokens {args.timed_tokens}: give a number of tokens >= 1, or 0 for twice the longest length")
    if args.worker == "throughput":
        print(json.dumps(worker_throughput(args)))
        return 0
    if args.worker == "saved":
        print(json.dumps(worker_saved(args)))
        return 0
    if args.worker == "speed":
        print(json.dumps(worker_speed(args)))
        return 0

    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.threads} thread(s) per run"
    )
    if args.only in (None, "speed"):
        runs = 2 if args.quick else args.runs
        extra = [
            "--seq-len",
            str(args.speed_seq_len),
            "--ttt-steps",
            str(args.speed_ttt_steps),
            "--runs",
            str(runs),
        ]
        print_speed(run_worker("speed", extra + (["--profile"] if args.profile else []), args.threads))
    if args.only in (None, "lengths"):
        lengths_table(args)
    if args.only in (None, "saved"):
        saved_table(args)
    return 0


def lengths_table(args) -> None:
    """Tokens/s and FLOP/s per max_seq_len at the tiny shape (AdamW included), each length with the memory options
    the planner picks for --budget-mib (0: the config's defaults, or --loss-chunk-size). Every length trains on the
    same documents (the first --timed-tokens tokens of one shuffled epoch, in rows of its own length, after a
    warm-up row); the lengths run interleaved, --runs rounds of one process per length."""
    from eagle3.synth import SynthConfig, synthesize

    lengths = [2048] if args.quick else [int(v) for v in args.lengths.split(",")]
    timed = max(lengths) if args.quick else (args.timed_tokens or 2 * max(lengths))
    runs = 1 if args.quick else args.runs
    with tempfile.TemporaryDirectory(prefix="eagle3_bench_") as tmp:
        # Enough documents for the timed tokens and a warm-up row, none from an epoch's partial last row:
        # synthetic documents average about 205 tokens, sized here at 150 (packed_rows refuses too small a set).
        need = timed + 2 * max(lengths)
        synthesize(tmp, SynthConfig(num_samples=need // 150 + 16, max_len=512), log=lambda *a, **k: None)
        chosen = (
            f"the planner's choice for a {args.budget_mib:g} MiB budget (predicted peak, CPU fp32, no reserve)"
            if args.budget_mib
            else f"loss_chunk_size {'default (4096)' if args.loss_chunk_size is None else args.loss_chunk_size}"
        )
        print(
            f"\ntiny shape (hidden 64, 4x16 heads, MLP 192, V 512/1024), ttt_steps {args.ttt_steps}, exact attention, "
            f"{chosen}, forward+backward+AdamW; every length trains on the same {timed} tokens (one epoch's first "
            f"documents, in rows of its length) after a warm-up row; {runs} interleaved rounds"
        )
        results: dict[int, list[dict]] = {s: [] for s in lengths}
        for _ in range(runs):
            for s in lengths:
                extra = ["--budget-mib", str(args.budget_mib)]  # 0 too: the worker's own default is 600
                if args.loss_chunk_size is not None and not args.budget_mib:
                    extra += ["--loss-chunk-size", str(args.loss_chunk_size)]
                results[s].append(
                    run_worker(
                        "throughput",
                        [
                            "--data",
                            tmp,
                            "--seq-len",
                            str(s),
                            "--timed-tokens",
                            str(timed),
                            "--ttt-steps",
                            str(args.ttt_steps),
                            *extra,
                        ],
                        args.threads,
                    )
                )
        print(
            f"{'max_seq_len':>11} {'ckpt':>9} {'chunk':>5} {'steps':>5} {'fill':>6} {'step s':>7} "
            f"{'tokens/s max':>12} {'tokens/s med':>12} {'vs shorter':>10} {'GFLOP/s max':>11} {'kernel':>6} "
            f"{'ew ns/el':>8} {'peak RSS GiB':>13}"
        )
        for k, s in enumerate(lengths):
            rs = results[s]
            r = rs[0]
            rates = [x["tokens_per_s"] for x in rs]
            # Paired by round (the two processes ran back to back), so the machine's drift over the rounds cancels.
            paired = (
                f"{statistics.median(a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(rs, results[lengths[k - 1]], strict=True)) - 1:>+10.1%}"
                if k
                else f"{'':>10}"
            )
            print(
                f"{s:>11} {r['activation_checkpointing']!s:>9} {r['loss_chunk_size']:>5} {r['steps']:>5} "
                f"{r['fill']:>6.1%} {statistics.median(x['step_s'] for x in rs):>7.3f} {max(rates):>12.0f} "
                f"{statistics.median(rates):>12.0f} {paired} {max(x['flop_per_s'] for x in rs) / 1e9:>11.2f} "
                f"{statistics.median(x['kernel_share'] for x in rs):>6.1%} "
                f"{min(x['elementwise_ns'] for x in rs):>8.2f} "
                f"{max(x['peak_rss_gb'] for x in rs):>13.2f}",
                flush=True,
            )
        print(
            "vs shorter: the median over rounds of this length's tokens/s over the previous length's in the same "
            "round; ew ns/el: silu(x) * x over fp32 [max_seq_len, MLP], best ns per element (memory-bound work: "
            "it rises once a row's tensors outgrow the cache)"
        )


def saved_table(args) -> None:
    r = run_worker("saved", ["--seq-len", str(args.saved_seq_len)], args.threads)
    print(
        f"\nbytes held for backward after the forward (resident set, after - before), {r['shape']}, "
        f"S={r['seq_len']}, ttt_steps {r['ttt_steps']}, loss_chunk_size 0:"
    )
    none, full = r["none"]["saved_bytes"], r["full"]["saved_bytes"]
    for mode in SAVED_MODES:
        v = r[mode]
        kept = (none - v["saved_bytes"]) / (none - full) if none != full else float("nan")
        print(
            f"  activation_checkpointing {mode:<9}: {v['bytes_per_token_per_step'] / 1024:8.1f} KiB/token/step "
            f"({v['saved_bytes'] / 2**20:6.0f} MiB; {kept:5.0%} of full checkpointing's saving)"
        )


if __name__ == "__main__":
    sys.exit(main())
