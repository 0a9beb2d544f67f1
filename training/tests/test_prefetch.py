"""The data path: DatasetReader.read_row / sample read with preadv give the same bytes as the safetensors slices
packed by build_row, and RowPrefetcher hands out those rows (reused buffers, misses, filler rows)."""

import random
import shutil

import pytest
import torch
from eagle3.data import SAMPLE_KEYS, DatasetReader, DatasetWriter, sample_key
from eagle3.errors import DataError
from eagle3.feed import RowPrefetcher
from eagle3.packing import build_row
from pipeline_support import synth_dataset
from safetensors import safe_open


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # small shards: rows span several files
    return synth_dataset(tmp_path_factory.getbasetemp(), "synth_prefetch", num_samples=60, shard_tokens=3000)


def reference_sample(reader, i, max_len=None):
    """The former DatasetReader.sample: safetensors slices of the kept rows."""
    n = reader.index.shard_of[i]
    keep = reader.index.lengths[i] if max_len is None else min(reader.index.lengths[i], max_len)
    with safe_open(str(reader.index.root / reader.index.shard_files[n]), framework="pt") as f:
        out = {k: f.get_slice(sample_key(i, k))[:keep] for k in SAMPLE_KEYS}
    out["loss_mask"] = out["loss_mask"].to(torch.bool)
    return out


def reference_row(reader, ids, seq_len):
    return build_row([reference_sample(reader, i, seq_len) for i in ids], seq_len, reader.index.hidden_size)


def assert_same_bytes(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        x, y = a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)
        assert torch.equal(x, y), k


def test_sample_matches_safetensors(dataset):
    reader = DatasetReader(dataset)
    for i in (0, 7, 31, 59):
        for max_len in (None, 1, 50, 10_000):
            assert_same_bytes(reader.sample(i, max_len), reference_sample(reader, i, max_len))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_read_row_matches_build_row(tmp_path_factory, dtype):
    root = synth_dataset(
        tmp_path_factory.getbasetemp(), f"synth_rows_{dtype}", num_samples=40, shard_tokens=2000, dtype=dtype
    )
    reader = DatasetReader(root)
    rng = random.Random(0)
    for _ in range(40):
        ids = rng.sample(range(40), rng.randint(1, 6))
        seq_len = rng.choice([16, 100, 700, 2048])  # truncated documents, overflowing and padded rows
        assert_same_bytes(reader.read_row(ids, seq_len), reference_row(reader, ids, seq_len))


def test_read_row_exactly_full_and_single_token(dataset):
    reader = DatasetReader(dataset)
    ids = [3, 4]
    full = sum(reader.index.lengths[i] for i in ids)
    for seq_len in (full, full - 1, 1):
        assert_same_bytes(reader.read_row(ids, seq_len), reference_row(reader, ids, seq_len))


def test_read_row_reuses_a_buffer_and_overwrites_it_in_full(dataset):
    reader = DatasetReader(dataset)
    long_row = reader.read_row([10, 11, 12, 13, 14, 15], 1024)  # little padding
    kept = {k: v.data_ptr() for k, v in long_row.items()}
    short = reader.read_row([5], 1024, out=long_row)  # mostly padding now
    assert {k: v.data_ptr() for k, v in short.items()} == kept
    assert_same_bytes(short, reference_row(reader, [5], 1024))
    other = reader.read_row([5], 512, out=short)  # another shape: a new row
    assert other["aux_hidden"].data_ptr() != kept["aux_hidden"]
    assert_same_bytes(other, reference_row(reader, [5], 512))


def test_loss_mask_bytes_and_other_dtypes_convert_like_build_row(tmp_path):
    h = 8
    writer = DatasetWriter(tmp_path, h, torch.bfloat16)
    for n in (5, 3):
        writer.add(torch.arange(n), torch.ones(n), torch.randn(n, 3 * h), torch.randn(n, h))
    writer.finish(
        target_vocab_size=16,
        draft_vocab_size=8,
        aux_layer_ids=(0, 1, 2),
        t2d=torch.ones(16),
        d2t=torch.zeros(8),
        embed=torch.zeros(16, h),
        final_norm=torch.ones(h),
        lm_head=torch.zeros(16, h),
    )
    # Rewrite the shard by hand: a loss_mask byte of 2 (true, but not 1) and input_ids stored as int32.
    shard = tmp_path / "shards" / "shard_00000.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["0.loss_mask"] = torch.tensor([0, 2, 1, 0, 255], dtype=torch.uint8)
    tensors["1.input_ids"] = tensors["1.input_ids"].to(torch.int32)
    from safetensors.torch import save_file

    save_file(tensors, str(shard))
    reader = DatasetReader(tmp_path)
    row = reader.read_row([0, 1], 10)
    assert row["loss_mask"].view(torch.uint8).tolist() == [0, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    assert_same_bytes(row, reference_row(reader, [0, 1], 10))
    assert_same_bytes(reader.sample(1), reference_sample(reader, 1))


def test_truncated_shard_fails_with_data_error(dataset, tmp_path):
    bad = tmp_path / "d"
    shutil.copytree(dataset, bad)
    shard = sorted((bad / "shards").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    reader = DatasetReader(bad)
    with pytest.raises(DataError, match="corrupt"):
        reader.sample(0)
    with pytest.raises(DataError, match="corrupt"):
        reader.read_row([0], 64)


def test_shape_mismatch_with_the_index_fails_with_data_error(dataset, tmp_path):
    import json

    bad = tmp_path / "d"
    shutil.copytree(dataset, bad)
    index = json.loads((bad / "index.json").read_text())
    index["hidden_size"] = 32
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="does not match the index"):
        DatasetReader(bad).read_row([0], 64)


def test_prefetcher_serves_prefetched_and_missed_rows(dataset):
    reader = DatasetReader(dataset)
    steps = [[0, 1], [2], [3, 4, 5], [6], [7, 8], [9]]
    prefetch = RowPrefetcher(str(dataset), 512, pin_memory=False)
    try:
        held = []
        for k, ids in enumerate(steps):
            row, real = prefetch.get((0, k), ids, 0)  # step 0 (and any miss) reads inline
            assert real
            assert_same_bytes(row, reference_row(reader, ids, 512))
            if held:  # the previous step's row is intact while this step runs and the next one is read
                prev_k, prev = held[-1]
                assert_same_bytes(prev, reference_row(reader, steps[prev_k], 512))
            held.append((k, row))
            if k + 1 < len(steps) and k != 2:  # no prefetch after step 2: step 3 is a miss
                prefetch.schedule((0, k + 1), steps[k + 1], 0)
                prefetch.pending[-1][1].result()  # let the read finish before the checks above run again
        # a stale prefetch (another key) is dropped, the asked-for row read
        prefetch.schedule((1, 0), [10], 0)
        row, _ = prefetch.get((1, 5), [11], 0)
        assert_same_bytes(row, reference_row(reader, [11], 512))
    finally:
        prefetch.close()


def test_prefetcher_filler_row_is_not_real(dataset):
    reader = DatasetReader(dataset)
    prefetch = RowPrefetcher(str(dataset), 256, pin_memory=False)
    try:
        row, real = prefetch.get((0, 0), [], 4)
        assert not real
        assert_same_bytes(row, reference_row(reader, [4], 256))
    finally:
        prefetch.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_prefetcher_pins_rows(dataset):
    prefetch = RowPrefetcher(str(dataset), 256, pin_memory=True)
    try:
        row, _ = prefetch.get((0, 0), [1, 2], 0)
        assert all(v.is_pinned() for v in row.values())
    finally:
        prefetch.close()


def test_deeper_prefetch_queues_rows_in_order(dataset):
    reader = DatasetReader(dataset)
    steps = [[k] for k in range(12)]
    with pytest.raises(ValueError, match="at least 1"):
        RowPrefetcher(str(dataset), 128, pin_memory=False, depth=0)
    prefetch = RowPrefetcher(str(dataset), 128, pin_memory=False, depth=3)
    try:
        prev = None
        for k, ids in enumerate(steps):
            row, _ = prefetch.get((0, k), ids, 0)
            if k == 0:  # fill the queue: steps 1, 2, 3
                for ahead in range(1, 4):
                    prefetch.schedule((0, ahead), steps[ahead], 0)
            elif k + 3 < len(steps):
                prefetch.schedule((0, k + 3), steps[k + 3], 0)
            assert len(prefetch.pending) == min(3, len(steps) - 1 - k)
            for _, future in list(prefetch.pending):
                future.result()  # every queued read done: none may touch the rows held
            assert_same_bytes(row, reference_row(reader, ids, 128))
            if prev is not None:
                assert_same_bytes(prev[1], reference_row(reader, steps[prev[0]], 128))
            prev = (k, row)
        assert len(prefetch.buffers) == 5
    finally:
        prefetch.close()


def test_the_trainer_queues_the_next_depth_steps_across_epochs_and_stops_at_the_end():
    from types import SimpleNamespace

    from eagle3.checkpoint import TrainerState
    from eagle3.loop import Trainer

    plans = {0: [None] * 3, 1: [None] * 2, 2: [None] * 3}  # epochs of 3, 2 and 3 steps: 8 steps in all
    trainer = SimpleNamespace(total_steps=8, plan=lambda epoch: plans[epoch])

    def upcoming(step, epoch, index, n):
        state = TrainerState(step, epoch, index, 0, 1, 512, 0)
        return Trainer.upcoming_positions(trainer, state, n)

    assert upcoming(0, 0, 0, 2) == [(0, 1), (0, 2)]
    assert upcoming(1, 0, 1, 2) == [(0, 2), (1, 0)]  # into the next epoch
    assert upcoming(2, 0, 2, 3) == [(1, 0), (1, 1), (2, 0)]
    assert upcoming(6, 2, 1, 2) == [(2, 2)]  # step 7 of 8: only the last one is left
    assert upcoming(7, 2, 2, 2) == []
