"""Simulated acceptance length (eagle3.acceptance) and the validation cap (val_max_batches)."""

from __future__ import annotations

import doctest

import pytest
import torch
from eagle3 import acceptance
from eagle3.acceptance import acceptance_length
from eagle3.data import DatasetReader
from eagle3.metrics import summarize, val_record
from eagle3.model import STAT_KEYS
from eagle3.packing import plan_epoch, split_train_val
from pipeline_support import read_metrics, read_status, run_trainer, synth_dataset, write_config


def test_docstring_examples():
    result = doctest.testmod(acceptance)
    assert result.attempted > 0 and result.failed == 0


def test_hand_made_case():
    # By hand: p = 0.9, 0.9*0.8 = 0.72, 0.72*0.5 = 0.36, 0.36*0.25 = 0.09 -> 1 + 2.07 = 3.07.
    assert acceptance_length([0.9, 0.8, 0.5, 0.25]) == pytest.approx(3.07)
    assert acceptance_length([0.9, 0.8, 0.5, 0.25], depth=1) == pytest.approx(1.9)
    # Never right: only the verifier's own token. Always right over 4 steps: 4 drafted + 1.
    assert acceptance_length([0.0, 0.0, 0.0, 0.0]) == 1.0
    assert acceptance_length([1.0] * 4) == 5.0
    # A step with no supervised position ends the sum (a lower bound); after a step at 0 nothing counts.
    assert acceptance_length([0.5, None, 0.9]) == pytest.approx(1.5)
    assert acceptance_length([0.5, 0.0, None, None]) == pytest.approx(1.5)
    assert acceptance_length([]) is None and acceptance_length([None, 0.5]) is None


def test_it_is_one_plus_the_sum_of_full_accuracies_when_every_step_sees_the_same_positions():
    # 10 positions over 3 steps: right at step 0 for 6, then 3 of those, then 1 of those.
    right = torch.tensor([[1] * 6 + [0] * 4, [1] * 3 + [0] * 7, [1] * 1 + [0] * 9], dtype=torch.bool)
    stats = torch.zeros(len(STAT_KEYS), 3, dtype=torch.float64)
    before = torch.ones(10, dtype=torch.bool)
    for k in range(3):
        now = before & right[k]
        for key, value in {
            "count": 10,
            "loss_sum": 1.0,
            "full_acc_sum": now.sum(),
            "cond_acc_sum": now.sum(),
            "cond_acc_count": before.sum(),
            "full_acc_true_sum": now.sum(),
            "cond_acc_true_sum": now.sum(),
            "cond_acc_true_count": before.sum(),
        }.items():
            stats[STAT_KEYS.index(key), k] = float(value)
        before = now
    record = val_record(7, summarize(stats))
    # full_acc = 0.6, 0.3, 0.1: tau = 1 + 0.6 + 0.3 + 0.1 = 2.0 (cond_acc = 0.6, 0.5, 1/3).
    assert record["acceptance_length"] == pytest.approx(2.0)
    assert record["acceptance_length"] == pytest.approx(1 + sum(record["full_acc_true"]))
    assert record["acceptance_length_draft_vocab"] == pytest.approx(2.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.getbasetemp())


def test_val_max_batches_is_honoured_and_acceptance_reaches_status(tmp_path, data):
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=str(data),
        run_dir=str(tmp_path / "run"),
        max_seq_len=512,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        val_every=1,
        val_max_batches=1,
        max_steps=2,
        checkpoint_every=1000,
        num_threads=1,
    )
    log = tmp_path / "log.txt"
    assert run_trainer(["train", "--config", str(cfg)], log) == 0, log.read_text()
    reader = DatasetReader(data)
    _, val_ids = split_train_val(reader.index.num_samples, 0.1)
    plan = plan_epoch(val_ids, reader.index.lengths, max_seq_len=512, world_size=1, seed=0, epoch=0, shuffle=False)
    assert len(plan.steps) > 1  # otherwise the cap would cut nothing

    def step0_positions(ids):
        """Supervised slots of TTT step 0: each document's loss mask after its first token."""
        return sum(float(reader.sample(i)["loss_mask"][1:].sum()) for i in ids)

    vals = read_metrics(tmp_path / "run", "val")
    assert [v["step"] for v in vals] == [1, 2]
    for v in vals:
        assert (v["batches"], v["batches_total"]) == (1, len(plan.steps))
        assert v["positions"] == step0_positions(plan.steps[0][0])
        assert v["positions"] < step0_positions(val_ids)
        assert 1.0 <= v["acceptance_length"] <= 3.0
        assert v["acceptance_length"] == pytest.approx(acceptance_length(v["cond_acc_true"]))
    status = read_status(tmp_path / "run")
    assert status["acceptance_length"] == vals[-1]["acceptance_length"]
    assert status["acceptance_length_step"] == 2 and status["val"]["batches"] == 1
    assert "(1 of " in log.read_text()
