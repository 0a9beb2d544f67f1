"""Packing: full rows, per-document positions, every sample exactly once, deterministic, balanced."""

import pytest
import torch
from eagle3.packing import PACKING_WINDOW, PACKINGS, build_row, plan_epoch, shuffled, split_train_val


def _lengths(n, seed=0, lo=20, hi=900):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


@pytest.mark.parametrize("packing", PACKINGS)
def test_every_sample_once_and_rows_fit(packing):
    lengths = _lengths(300)
    plan = plan_epoch(list(range(300)), lengths, max_seq_len=1024, world_size=4, seed=1, epoch=0, packing=packing)
    seen = [sid for step in plan.steps for rank in step for sid in rank]
    assert sorted(seen) == list(range(300))
    for step in plan.steps:
        assert len(step) == 4
        for rank in step:
            assert sum(lengths[s] for s in rank) <= 1024
    assert plan.fill > 0.8  # rows are mostly full


@pytest.mark.parametrize("packing", PACKINGS)
def test_deterministic_per_seed_and_epoch(packing):
    lengths = _lengths(100)
    ids = list(range(100))
    a = plan_epoch(ids, lengths, max_seq_len=1024, world_size=2, seed=3, epoch=1, packing=packing)
    b = plan_epoch(ids, lengths, max_seq_len=1024, world_size=2, seed=3, epoch=1, packing=packing)
    c = plan_epoch(ids, lengths, max_seq_len=1024, world_size=2, seed=3, epoch=2, packing=packing)
    assert a.steps == b.steps
    assert a.steps != c.steps


@pytest.mark.parametrize("packing", PACKINGS)
def test_ranks_get_balanced_tokens(packing):
    lengths = _lengths(400, lo=50, hi=600)
    plan = plan_epoch(list(range(400)), lengths, max_seq_len=2048, world_size=4, seed=0, epoch=0, packing=packing)
    spreads = []
    for step in plan.steps[:-1]:  # the last step takes what is left
        loads = [sum(lengths[s] for s in rank) for rank in step]
        spreads.append(max(loads) - min(loads))
    # Balanced to within one typical sample, far below a row.
    assert sorted(spreads)[len(spreads) // 2] < 600


@pytest.mark.parametrize("world_size", [1, 4])
def test_first_fit_fills_rows_that_next_fit_leaves_part_empty(world_size):
    lengths = _lengths(2000, lo=48, hi=512)
    ids = list(range(2000))
    kw = dict(max_seq_len=1024, world_size=world_size, seed=1, epoch=0)
    first, then = plan_epoch(ids, lengths, **kw), plan_epoch(ids, lengths, packing="next_fit", **kw)
    assert first.fill > 0.97 and first.fill > then.fill + 0.015, (first.fill, then.fill)
    assert len(first) < len(then)


def _first_fit_by_definition(order, lengths, max_seq_len, world_size):
    """first_fit as its docstring states it, scanning every row for every sample."""
    queue, steps = list(order), []
    while queue:
        loads, rows, passed, rest = [0] * world_size, [[] for _ in range(world_size)], [], []
        for k, sid in enumerate(queue):
            if len(passed) == PACKING_WINDOW or sum(loads) == world_size * max_seq_len:
                rest = queue[k:]
                break
            n = min(lengths[sid], max_seq_len)
            fits = [r for r in range(world_size) if loads[r] + n <= max_seq_len]
            if not fits:
                passed.append(sid)
                continue
            best = max(fits, key=lambda r: (loads[r], -r))  # the fullest; ties to the lower rank
            rows[best].append(sid)
            loads[best] += n
        queue = passed + rest
        steps.append(rows)
    return steps


@pytest.mark.parametrize(("world_size", "max_seq_len"), [(1, 1024), (3, 1024), (8, 512), (16, 4096)])
def test_first_fit_is_its_definition(world_size, max_seq_len):
    lengths = _lengths(600, seed=world_size, lo=10, hi=1500)
    ids = list(range(600))
    plan = plan_epoch(ids, lengths, max_seq_len=max_seq_len, world_size=world_size, seed=2, epoch=1)
    assert plan.steps == _first_fit_by_definition(shuffled(ids, 2, 1), lengths, max_seq_len, world_size)


@pytest.mark.parametrize("world_size", [1, 4])
def test_first_fit_keeps_the_shuffle_order_to_within_its_window(world_size):
    """A sample is never placed more than PACKING_WINDOW steps after one that came later in the shuffle, even when
    half the samples are longer than half a row and queue up one per row."""
    lengths = _lengths(2000, lo=20, hi=1000)
    ids = list(range(2000))
    plan = plan_epoch(ids, lengths, max_seq_len=1024, world_size=world_size, seed=1, epoch=0)
    step_of = {sid: k for k, step in enumerate(plan.steps) for row in step for sid in row}
    placed = [step_of[sid] for sid in shuffled(ids, 1, 0)]
    later_min, delays = len(plan), []
    for k in reversed(placed):
        delays.append(k - later_min)
        later_min = min(later_min, k)
    assert 0 < max(delays) <= PACKING_WINDOW


# plan_epoch's output for the inputs below before first_fit existed (commit 23e64f0).
EARLIER_NEXT_FIT = [[[5, 7], [3, 4, 1]], [[9, 10, 8], [6, 11]], [[2], [0]]]


def test_next_fit_keeps_earlier_versions_plans():
    """next_fit is what checkpoints from before the packing key were planned with: its plans must not change."""
    plan = plan_epoch(
        list(range(12)),
        _lengths(12, lo=100, hi=700),
        max_seq_len=1024,
        world_size=2,
        seed=5,
        epoch=3,
        packing="next_fit",
    )
    assert plan.steps == EARLIER_NEXT_FIT


def test_overlong_samples_are_truncated_and_counted():
    lengths = [100, 5000, 300, 2000]
    plan = plan_epoch([0, 1, 2, 3], lengths, max_seq_len=1024, world_size=1, seed=0, epoch=0)
    assert plan.truncated == 2
    assert plan.tokens == 100 + 1024 + 300 + 1024


def test_last_step_may_leave_a_rank_empty():
    plan = plan_epoch([0], [50], max_seq_len=128, world_size=2, seed=0, epoch=0)
    assert plan.steps == [[[0], []]]


def test_row_layout_padding_and_truncation():
    def sample(n, start):
        return {
            "input_ids": torch.arange(start, start + n),
            "loss_mask": torch.ones(n, dtype=torch.bool),
            "aux_hidden": torch.ones(n, 6),
            "last_hidden": torch.ones(n, 2),
        }

    row = build_row([sample(3, 10), sample(7, 20)], 8, 2)
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21, 22, 23, 24]  # second document cut at the row end
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    short = build_row([sample(2, 0)], 4, 2)
    assert short["document_ids"].tolist() == [0, 0, -1, -1]
    assert short["loss_mask"].tolist() == [True, True, False, False]
    assert short["aux_hidden"][2:].abs().sum() == 0
    assert row["aux_hidden"].shape == (8, 6)


def test_validation_split_is_the_tail():
    train, val = split_train_val(100, 0.1)
    assert val == list(range(90, 100))
    assert train == list(range(90))


def test_the_config_offers_every_packer_and_defaults_to_first_fit():
    import dataclasses

    from eagle3.config import TrainConfig

    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["packing"]
    assert field.metadata["choices"] == PACKINGS and field.default == "first_fit"
