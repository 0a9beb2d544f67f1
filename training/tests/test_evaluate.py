"""`eagle3 evaluate` on the tiny real target: speculative decoding gives exactly the target's greedy tokens, and a
drafter trained by the project on generated data accepts more than one that always proposes the most frequent
token."""

import shutil
from pathlib import Path

import pytest
import torch
from eagle3.evaluate import (
    FrequentTokenProposer,
    TargetRunner,
    evaluate,
    greedy,
    record_evaluation,
    speculative,
)
from eagle3.report import write_report
from eagle3.tiny_target import cached
from transformers import AutoModelForCausalLM

# The first use builds the tiny target (scripts/test.sh builds it beforehand, beside lint): a pytest run alone may
# spend minutes in that fixture on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny_target():
    return cached(log=lambda *a, **k: None)


def test_speculative_decoding_gives_the_targets_greedy_tokens_whatever_is_proposed(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_target, local_files_only=True, dtype=torch.float32
    ).eval()
    runner = TargetRunner(model, (2, 4, 5))
    prompt = [1, 4, 300, 301, 302, 303, 2, 5]
    plain, _ = greedy(runner, prompt, 20)
    for token in (plain[0], 7, 400):  # a proposer that is sometimes right, and ones that never are
        out, stats = speculative(runner, FrequentTokenProposer(token), prompt, 20, k=3)
        assert out == plain
        assert stats.tokens == 20 and 1 <= stats.tau <= 4


@pytest.mark.slow
def test_a_trained_drafter_beats_the_most_frequent_token_and_decodes_exactly(tiny_drafter, tmp_path):
    run_dir = Path(shutil.copytree(tiny_drafter.run_dir, tmp_path / "run"))  # the shared run stays as it was
    result = evaluate(
        tiny_drafter.target, run_dir, tiny_drafter.held, k=3, max_new=32, prompts=4, log=lambda *a, **k: None
    )
    assert result["exact"]
    assert result["tau_real"] > result["tau_frequent_token"] + 0.05, result
    assert result["tau_simulated"] is not None and len(result["acceptance_per_position"]) == 3
    assert result["step"] == 100  # the best checkpoint's step: the run validated there
    # the report page plots it beside the simulated curve (vLLM's figure, recorded too, is not plotted twice)
    record_evaluation(run_dir, result)
    record_evaluation(run_dir, {**result, "engine": "vllm", "tau_real": 9.9})
    info = write_report([str(run_dir)], tmp_path / "report.png")
    assert info["runs"][0]["tau_real"] == [[100, result["tau_real"], 3]]
