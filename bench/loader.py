"""Data path benchmark: the loader against the disk's sequential read rate of the same files and against what a
Kimi-shaped step consumes, and the real RowPrefetcher's fetch share of a simulated Kimi step.

    .venv-train/bin/python bench/loader.py                  # both shapes, 5 interleaved repeats (2-5 min, by load)
    .venv-train/bin/python bench/loader.py --repeats 3 --kimi-tokens 16384 --row-tokens 2048   # quicker

The trainer reads the next step's row on a background thread (eagle3.feed.RowPrefetcher) straight into its
final tensors (DatasetReader.read_row: one preadv per field of a sample, into pinned memory on CUDA), and the
step copies it with non_blocking=True; a row costs the step only when reading it takes longer than the step.

Two datasets of random bf16 hidden states in the native format (eagle3.data.DatasetWriter, documents of
--doc-len tokens on average, shards of --shard-tokens): hidden 896 (the 1/8-Kimi shape) and hidden 7168
(the Kimi shape: aux_hidden [L, 3H] + last_hidden [L, H] in bf16, input_ids int64, loss_mask uint8 per token).
Per shape, interleaved, --repeats times (the machine is shared: min/median, not one figure):

- disk: sequential read of every shard file in 16 MiB reads, each file first dropped from the page cache
  (posix_fadvise DONTNEED), the physical limit of this disk as the guest sees it;
- loader: packed rows of --seq-len, cold (files dropped first) and warm (in the page cache), both the new
  path (DatasetReader.read_row) and the old one (DatasetReader.sample per document + packing.build_row);
- the step: tokens/s a Kimi-shaped step consumes on one H200 at --mfu (eagle3.flops over the datasheet peak).

Then the real RowPrefetcher feeds a consumer that sleeps a step per row, on the Kimi dataset, page cache dropped
before each run. A Kimi row (32768 tokens x 56 KiB = 1.8 GiB) does not fit this bench's budget, so rows are
--row-tokens long and the step time is scaled by row-tokens / 32768: the same tokens/s and bytes/s per rank.
The fetch share is the trainer's: time_split.fetch / step_time_s of metrics.jsonl, fetch being the time from
asking for the row to the row being on the device (here the wait in RowPrefetcher.get; with CUDA also the
copy). A first pass over three rows allocates the prefetcher's row buffers (as a run's first steps do), then
the page cache is dropped and the measured pass runs; its first step is not prefetched (as in the trainer) and is
left out of the share. The consumer runs at the Kimi rate and at 80 % of the disk's median cold rate measured above
(a rate this disk supports, whether or not it supports the Kimi rate), with prefetch depth 1 (what the trainer
schedules) and 2 (--depths), interleaved.

All files live in a temporary directory (BENCH_DIR to choose where) removed at the end. Prints figures; never
asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import torch  # noqa: E402

KIMI_ROW = 32768  # tokens per rank per step of the Kimi shape (the plan's max_seq_len)
KIMI_TTT = 5


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths) -> float:
    """Bytes/s reading every file once, front to back, page cache dropped first."""
    buf = memoryview(bytearray(16 << 20))  # one buffer, touched before timing: no page faults in the loop
    drop_cache(paths)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                total += got
    return total / (time.perf_counter() - t0)


def write_dataset(root: Path, hidden: int, tokens: int, doc_len: int, shard_tokens: int, seed: int) -> None:
    """A native dataset of random documents (lengths uniform in [doc_len/2, 3 doc_len/2]) with bf16 states."""
    from eagle3.data import DatasetWriter

    g = torch.Generator().manual_seed(seed)
    longest = doc_len * 3 // 2
    pool = torch.randn(longest * 4 * hidden + 4096, generator=g).to(torch.bfloat16)  # reused, offset per doc
    writer = DatasetWriter(root, hidden, torch.bfloat16, shard_tokens=shard_tokens)
    written = 0
    while written < tokens:
        n = int(torch.randint(doc_len // 2, longest + 1, (1,), generator=g))
        off = int(torch.randint(0, 4096, (1,), generator=g))
        states = pool[off : off + n * 4 * hidden].view(n, 4 * hidden)
        mask = torch.arange(n) >= n // 4  # a prompt, then a supervised response
        writer.add(torch.randint(0, 256, (n,), generator=g), mask, states[:, : 3 * hidden], states[:, 3 * hidden :])
        written += n
    d2t = torch.zeros(128, dtype=torch.long)
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[:128] = True
    writer.finish(
        target_vocab_size=256,
        draft_vocab_size=128,
        aux_layer_ids=(2, 8, 13),
        t2d=t2d,
        d2t=d2t,
        embed=torch.zeros(256, hidden, dtype=torch.bfloat16),
        final_norm=torch.ones(hidden, dtype=torch.bfloat16),
        lm_head=torch.zeros(256, hidden, dtype=torch.bfloat16),
    )


def rows_of(reader, seq_len: int) -> list[list[int]]:
    from eagle3.packing import plan_epoch

    ids = list(range(reader.index.num_samples))
    plan = plan_epoch(ids, reader.index.lengths, max_seq_len=seq_len, world_size=1, seed=0, epoch=0)
    return [step[0] for step in plan.steps]


def load_rate(reader, rows, seq_len: int, shards, buffers, *, cold: bool, new: bool, pin: bool) -> float:
    """Tokens/s of reading every row (page cache dropped first when cold); the new path reads into `buffers`,
    3 rows kept across calls and rotated like RowPrefetcher's over a training run."""
    from eagle3.packing import build_row

    if new and buffers[0] is None:  # allocated once, as by a run's first steps
        for k, ids in enumerate(rows[:3]):
            buffers[k] = reader.read_row(ids, seq_len, pin_memory=pin)
    if cold:
        drop_cache(shards)
    tokens, t0 = 0, time.perf_counter()
    for k, ids in enumerate(rows):
        if new:
            row = buffers[k % 3] = reader.read_row(ids, seq_len, pin_memory=pin, out=buffers[k % 3])
        else:
            row = build_row([reader.sample(i, seq_len) for i in ids], seq_len, reader.index.hidden_size)
            if pin:
                row = {k: v.pin_memory() for k, v in row.items()}
        tokens += int((row["document_ids"] >= 0).sum())
        del row
    return tokens / (time.perf_counter() - t0)


def prefetch_share(
    data_dir: str, rows, row_tokens: int, step_s: float, shards, device, depth: int
) -> tuple[float, float]:
    """(fetch share of the step, worst single fetch / step) over one run of the real RowPrefetcher (`depth`
    rows queued ahead, as Trainer.next_row would schedule them) feeding a consumer that sleeps `step_s` per row,
    page cache dropped first. Step 1 (never prefetched) is left out."""
    from eagle3.feed import RowPrefetcher

    prefetch = RowPrefetcher(data_dir, row_tokens, pin_memory=device.type == "cuda", depth=depth)
    for k, ids in enumerate(rows[: len(prefetch.buffers)]):  # a run's first steps allocate the row buffers
        prefetch.get((-1, k), ids, rows[0][0])
    drop_cache(shards)
    fetch, worst, wall_start = 0.0, 0.0, None
    try:
        for k, ids in enumerate(rows):
            t0 = time.perf_counter()
            if k == 1:
                wall_start = t0
            row, _real = prefetch.get((0, k), ids, rows[0][0])
            for ahead in range(k + 1, min(k + depth, len(rows) - 1) + 1):
                if not prefetch.scheduled((0, ahead)):
                    prefetch.schedule((0, ahead), rows[ahead], rows[0][0])
            if device.type == "cuda":  # Trainer.to_device + sync
                row = {key: v.to(device, non_blocking=True) for key, v in row.items()}
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            if k >= 1:
                fetch += t1 - t0
                worst = max(worst, t1 - t0)
            del row
            time.sleep(step_s)  # the step's forward, backward and optimizer
        wall = time.perf_counter() - wall_start
    finally:
        prefetch.close()
    steps = len(rows) - 1
    return fetch / wall, worst / (wall / steps)


def mm(values, fmt="{:.0f}") -> str:
    """'median (min .. max)' of repeated measurements."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the hidden-896 dataset")
    p.add_argument("--kimi-tokens", type=int, default=32768, help="tokens of the hidden-7168 dataset")
    p.add_argument("--seq-len", type=int, default=8192, help="row length of the loader measurements")
    p.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    p.add_argument("--shard-tokens", type=int, default=1 << 14)
    p.add_argument("--row-tokens", type=int, default=4096, help="row length of the prefetch simulation")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2], help="prefetch depths to compare")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed MFU of the GPU step")
    p.add_argument(
        "--h2d-gbs",
        type=float,
        nargs="+",
        default=[25.0, 50.0],
        help="assumed pinned host-to-GPU copy GB/s without a GPU (PCIe Gen4 / Gen5 x16 in practice)",
    )
    return p.parse_args()


def make_sets(tmp: str, args, hiddens) -> dict:
    """hidden -> (root, reader, shard paths, bytes per token, packed rows of --seq-len), one dataset per shape."""
    from eagle3.data import DatasetReader

    sets = {}
    for hidden, tokens in hiddens:
        root = Path(tmp) / f"h{hidden}"
        write_dataset(root, hidden, tokens, args.doc_len, args.shard_tokens, seed=hidden)
        reader = DatasetReader(root)
        shards = sorted(str(q) for q in (root / "shards").glob("*.safetensors"))
        size = sum(os.path.getsize(q) for q in shards)
        per_token = size / sum(reader.index.lengths)
        sets[hidden] = (root, reader, shards, per_token, rows_of(reader, args.seq_len))
    return sets


def measure_loaders(sets: dict, args, pin: bool) -> dict:
    """hidden -> measurement -> tokens/s of each repeat: disk, old and new loader, cold and warm, interleaved."""
    runs = {h: {k: [] for k in ("disk", "old_cold", "new_cold", "old_warm", "new_warm")} for h in sets}
    buffers = {h: [None] * 3 for h in sets}
    for rep in range(args.repeats):
        for hidden, (_root, reader, shards, per_token, rows) in sets.items():
            r = runs[hidden]
            kw = {"seq_len": args.seq_len, "shards": shards, "pin": pin, "buffers": buffers[hidden]}
            cold = {
                "disk": lambda shards=shards, per_token=per_token: sequential_read(shards) / per_token,
                "old_cold": lambda kw=kw, reader=reader, rows=rows: load_rate(reader, rows, cold=True, new=False, **kw),
                "new_cold": lambda kw=kw, reader=reader, rows=rows: load_rate(reader, rows, cold=True, new=True, **kw),
            }
            # The order rotates per repeat: a cache below the guest's (the host's, under a virtual disk)
            # favours whichever cold read follows another one; rotating spreads that over all three.
            names = list(cold)
            for name in names[rep % 3 :] + names[: rep % 3]:
                r[name].append(cold[name]())
            r["old_warm"].append(load_rate(reader, rows, cold=False, new=False, **kw))
            r["new_warm"].append(load_rate(reader, rows, cold=False, new=True, **kw))
    return runs


def simulate_prefetch(kimi_set, sims, args, device) -> tuple[list, dict, dict]:
    """The prefetch simulation on the Kimi dataset, rows of --row-tokens with the step scaled to keep the rate:
    (its rows, fetch shares and worst fetches per (rate name, tokens/s, depth), one entry per repeat)."""
    root, reader, shards, _per_token, _rows = kimi_set
    sim_rows = rows_of(reader, args.row_tokens)
    shares = {sim: [] for sim in sims}
    worst = {sim: [] for sim in sims}
    for _ in range(args.repeats):
        for sim in sims:
            _name, tps, depth = sim
            share, w = prefetch_share(
                str(root), sim_rows, args.row_tokens, args.row_tokens / tps, shards, device, depth
            )
            shares[sim].append(share)
            worst[sim].append(w)
    return sim_rows, shares, worst


def print_loader_table(table, args, pin: bool) -> None:
    print(
        f"datasets: random bf16 states, documents of {args.doc_len} tokens on average, shards of "
        f"{args.shard_tokens} tokens; loader rows of {args.seq_len}; {args.repeats} interleaved repeats, "
        f"median (min..max); page cache dropped with posix_fadvise (the guest's cache: a host cache under a "
        f"virtual disk may still serve 'cold' reads)"
    )
    print(f"{'hidden':>6} {'KiB/token':>9}  {'measurement':<44} {'tokens/s':>28} {'MiB/s':>22}")
    labels = {
        "disk": "disk sequential read, cold (physical limit)",
        "new_cold": "loader read_row (3 reused rows), cold",
        "new_warm": "loader read_row (3 reused rows), warm",
        "old_cold": "old loader sample+build_row, cold",
        "old_warm": "old loader sample+build_row, warm",
    }
    for hidden, per_token, r in table:
        for key, label in labels.items():
            mib = [v * per_token / 2**20 for v in r[key]]
            print(
                f"{hidden:>6} {per_token / 1024:>9.1f}  {label + (' + pin' if pin and 'loader' in label else ''):<44} "
                f"{mm(r[key]):>28} {mm(mib):>22}"
            )
        med = statistics.median(r["new_cold"]) / statistics.median(r["disk"])
        best = max(r["new_cold"]) / max(r["disk"])
        old = statistics.median(r["old_cold"]) / statistics.median(r["disk"])
        print(
            f"{'':>6} {'':>9}  read_row cold / disk: {med:.0%} of medians, {best:.0%} of bests (the old loader "
            f"{old:.0%} of medians); read_row warm / cold: {statistics.median(r['new_warm']) / statistics.median(r['new_cold']):.1f} x"
        )


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)

    from eagle3 import plan
    from eagle3.flops import datasheet_peak, step_flops

    kimi = plan.SHAPES["kimi-k2.5"]
    flops = step_flops(kimi, KIMI_ROW, KIMI_TTT, loss_chunk_size=4096, activation_checkpointing=True, doc_len=2048)
    peak = datasheet_peak("H200", "bf16")
    step_s = flops["total"] / (args.mfu * peak)
    need_tps = KIMI_ROW / step_s
    pin = torch.cuda.is_available()
    device = torch.device("cuda" if pin else "cpu")

    with tempfile.TemporaryDirectory(prefix="eagle3_loader_", dir=os.environ.get("BENCH_DIR")) as tmp:
        sets = make_sets(tmp, args, ((896, args.tokens), (kimi.hidden_size, args.kimi_tokens)))
        runs = measure_loaders(sets, args, pin)
        disk_tps = statistics.median(runs[kimi.hidden_size]["disk"])
        rates = [("the Kimi rate (one H200)", need_tps), ("80% of the disk's median", 0.8 * disk_tps)]
        sims = [(name, tps, depth) for name, tps in rates for depth in args.depths]
        sim_rows, shares, worst = simulate_prefetch(sets[kimi.hidden_size], sims, args, device)
        for h in sets:
            sets[h][1].close()
        table = [(h, sets[h][3], runs[h]) for h in sets]

    print_loader_table(table, args, pin)
    kimi_per_token = table[-1][1]
    print(
        f"Kimi step (S {KIMI_ROW}, {KIMI_TTT} TTT steps, activation checkpointing, documents of 2048): "
        f"{flops['total'] / 1e12:.0f} TFLOP; on one H200 ({peak / 1e12:.0f} TFLOP/s bf16 datasheet) at "
        f"{args.mfu:.0%} MFU {step_s:.2f} s per step, consuming {need_tps:.0f} tokens/s = "
        f"{need_tps * kimi_per_token / 2**20:.0f} MiB/s per GPU ({8 * need_tps * kimi_per_token / 1e9:.1f} GB/s "
        f"for 8 GPUs on a node)"
    )
    kimi_disk = statistics.median(table[-1][2]["disk"])
    print(
        f"this disk, cold: {kimi_disk * kimi_per_token / 2**20:.0f} MiB/s = {kimi_disk / need_tps:.1f} x one GPU's need"
    )
    print(
        f"RowPrefetcher feeding a simulated step on the hidden-{kimi.hidden_size} files, cold: rows of "
        f"{args.row_tokens} tokens ({len(sim_rows)} per run, step 1 left out), step time scaled by "
        f"{args.row_tokens}/{KIMI_ROW}; fetch share = time_split.fetch / step_time_s, {args.repeats} runs"
    )
    for sim in sims:
        name, tps, depth = sim
        step = args.row_tokens / tps
        s = shares[sim]
        print(
            f"  consumer at {name:<26} {tps:6.0f} tokens/s = {tps * kimi_per_token / 2**20:5.0f} MiB/s, step "
            f"{step:.3f} s, depth {depth}: fetch share min {min(s):.2%} median {statistics.median(s):.2%}; "
            f"worst single fetch {statistics.median(worst[sim]):.0%} of a step (median of runs)"
        )
    if not pin:
        h2d = ", ".join(f"{need_tps * kimi_per_token / (g * 1e9):.1%} at {g:.0f} GB/s" for g in args.h2d_gbs)
        print(
            f"  no GPU here: the step's pinned copy to the GPU (part of the trainer's fetch time: to_device + "
            f"sync) would add, at the Kimi rate, {h2d} host-to-device (assumed; --h2d-gbs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
