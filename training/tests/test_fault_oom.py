"""The test-only hook EAGLE3_FAULT_OOM_AT_STEP: which step and rank raise torch's own out-of-memory error.

The run that goes through it end to end (status.json kind oom, exit 3, the other rank stopping) is
tests/test_torchrun.py::test_out_of_memory_on_one_rank_is_recorded_and_ends_the_run_with_3.
"""

import pytest
import torch
from eagle3.process import FAULT_OOM_ENV, inject_oom, is_oom


@pytest.mark.parametrize(
    ("value", "raises_at"),
    [
        ("", []),
        ("3", [(3, 0), (3, 1)]),
        ("3:rank1", [(3, 1)]),
        (" 1 ", [(1, 0), (1, 1)]),
    ],
)
def test_the_chosen_step_and_rank_raise_a_real_oom(monkeypatch, value, raises_at):
    monkeypatch.setenv(FAULT_OOM_ENV, value)
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            if (step, rank) in raises_at:
                with pytest.raises(torch.OutOfMemoryError) as e:
                    inject_oom(step, rank)
                assert is_oom(e.value) and "fault injection" in str(e.value)
            else:
                inject_oom(step, rank)


def test_unset_does_nothing(monkeypatch):
    monkeypatch.delenv(FAULT_OOM_ENV, raising=False)
    inject_oom(1, 0)


def test_plus_n_counts_from_the_step_the_run_resumed_at(monkeypatch):
    monkeypatch.setenv(FAULT_OOM_ENV, "+2")
    inject_oom(41, 0, start_step=40)
    with pytest.raises(torch.OutOfMemoryError):
        inject_oom(42, 0, start_step=40)
