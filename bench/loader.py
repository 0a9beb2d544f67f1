"""Data path benchmark: loader tokens/s against the disk's sequential read rate of the same files, and against
what a step consumes.

    .venv-train/bin/python bench/loader.py                    # hidden 896 (the 1/8-Kimi shape), 64k tokens
    .venv-train/bin/python bench/loader.py --hidden 7168      # the Kimi shape's bytes per token

The trainer reads the next step's row on a background thread (eagle3.train.RowPrefetcher) into pinned memory on
CUDA and copies it with non_blocking=True, so a row costs the step only when reading it takes longer than the step.
This bench measures, on the same safetensors shards:

- disk: sequential read of every shard file in 16 MiB reads, each file first dropped from the page cache
  (posix_fadvise DONTNEED), the physical limit of this disk;
- loader: DatasetReader.sample + build_row for packed rows of max_seq_len, the files dropped from the cache first
  (what the prefetch thread does; pin_memory too when CUDA is there);
- the step: tokens/s a Kimi-shaped step consumes on one H200 at a stated MFU (eagle3.flops over the datasheet
  peak), and the share of that step a row's read would take were it not prefetched.

Prints figures; never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import torch  # noqa: E402


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths) -> float:
    """Bytes/s reading every file once, front to back."""
    drop_cache(paths)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--tokens", type=int, default=65536, help="tokens in the synthetic dataset")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument(
        "--mfu", type=float, default=0.4, help="assumed MFU of the GPU step for the consumption rate"
    )
    args = p.parse_args()

    from eagle3 import plan
    from eagle3.data import DatasetReader
    from eagle3.flops import datasheet_peak, step_flops
    from eagle3.packing import build_row, plan_epoch
    from eagle3.synth import SynthConfig, synthesize

    with tempfile.TemporaryDirectory(prefix="eagle3_loader_", dir=os.environ.get("BENCH_DIR")) as tmp:
        cfg = SynthConfig(num_samples=args.tokens // 280 + 1, hidden_size=args.hidden, shard_tokens=1 << 16)
        synthesize(tmp, cfg, log=lambda *a, **k: None)
        shards = sorted(str(q) for q in (Path(tmp) / "shards").glob("*.safetensors"))
        size = sum(os.path.getsize(q) for q in shards)
        disk = max(sequential_read(shards) for _ in range(2))

        reader = DatasetReader(tmp)
        ids = list(range(reader.index.num_samples))
        steps = plan_epoch(
            ids, reader.index.lengths, max_seq_len=args.seq_len, world_size=1, seed=0, epoch=0
        ).steps
        pin = torch.cuda.is_available()

        def load(cold: bool) -> float:
            if cold:
                drop_cache(shards)
            tokens, t0 = 0, time.perf_counter()
            for step in steps:
                samples = [reader.sample(i, args.seq_len) for i in step[0]]
                row = build_row(samples, args.seq_len, reader.index.hidden_size)
                if pin:
                    row = {k: v.pin_memory() for k, v in row.items()}
                tokens += int((row["document_ids"] >= 0).sum())
            return tokens / (time.perf_counter() - t0)

        loader, warm = load(cold=True), load(cold=False)
        per_token = size / max(sum(reader.index.lengths), 1)

    kimi = plan.SHAPES["kimi-k2.5"]
    s_kimi, t_kimi = 32768, 5
    flops = step_flops(
        kimi, s_kimi, t_kimi, loss_chunk_size=4096, activation_checkpointing=True, doc_len=2048
    )
    peak = datasheet_peak("H200", "bf16")
    step_s = flops["total"] / (args.mfu * peak)
    need = s_kimi / step_s
    kimi_bytes = 2 * 4 * kimi.hidden_size + 8 * 2 + 1  # bf16 aux (3H) + last (H), input ids, mask
    print(f"dataset: {len(shards)} shard(s), {size / 2**20:.0f} MiB, hidden {args.hidden}, "
          f"{per_token / 1024:.1f} KiB/token on disk; rows of {args.seq_len}")  # fmt: skip
    print(
        f"disk sequential read (page cache dropped): {disk / 2**20:8.0f} MiB/s = {disk / per_token:10.0f} tokens/s"
    )
    print(f"loader (sample + build_row{' + pin_memory' if pin else ''}):    {loader * per_token / 2**20:8.0f} MiB/s "
          f"= {loader:10.0f} tokens/s ({loader * per_token / disk:.0%} of the disk); page cache warm: "
          f"{warm:.0f} tokens/s")  # fmt: skip
    print(f"Kimi step (S {s_kimi}, {t_kimi} TTT steps, checkpointing): {flops['total'] / 1e12:.0f} TFLOP; on one H200 at "
          f"{args.mfu:.0%} MFU {step_s:.2f} s, consuming {need:.0f} tokens/s = {need * kimi_bytes / 2**20:.0f} MiB/s")  # fmt: skip
    fetch = s_kimi * kimi_bytes / (loader * per_token)
    print(
        f"a Kimi row read at this loader's byte rate: {fetch:.3f} s = {fetch / step_s:.1%} of the step "
        "(hidden by the prefetch thread when under 100 %; the issue's bar: under 5 % even unhidden)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
