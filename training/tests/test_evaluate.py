"""`eagle3 evaluate` on the tiny real target: speculative decoding gives exactly the target's greedy tokens, and a
drafter trained by the project on generated data accepts more than one that always proposes the most frequent
token."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from eagle3.cli import main
from eagle3.evaluate import (
    BOOTSTRAP_RESAMPLES,
    FrequentTokenProposer,
    TargetRunner,
    bootstrap_ci,
    evaluate,
    greedy,
    record_evaluation,
    speculative,
    summary_line,
)
from eagle3.report import write_report
from eagle3.tiny_target import cached
from eagle3.tokenizer import TOKENIZER_FILES
from transformers import AutoModelForCausalLM

# The first use builds the tiny target (scripts/test.sh builds it beforehand, beside lint): a pytest run alone may
# spend minutes in that fixture on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny_target():
    return cached(log=lambda *a, **k: None)


def test_speculative_decoding_gives_the_targets_greedy_tokens_whatever_is_proposed(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, local_files_only=True, dtype=torch.float32).eval()
    runner = TargetRunner(model, (2, 4, 5))
    prompt = [1, 4, 300, 301, 302, 303, 2, 5]
    plain, _ = greedy(runner, prompt, 20)
    for token in (plain[0], 7, 400):  # a proposer that is sometimes right, and ones that never are
        out, stats = speculative(runner, FrequentTokenProposer(token), prompt, 20, k=3)
        assert out == plain
        assert stats.tokens == 20 and 1 <= stats.tau <= 4
        # tau_real leaves out the prefill forward and its token: the rounds' 19 tokens over the rounds
        assert stats.prefills == 1 and stats.rounds == stats.target_forwards - 1 == stats.reached[0]
        assert stats.tau == round(19 / stats.rounds, 4)


@pytest.mark.slow
def test_a_trained_drafter_beats_the_most_frequent_token_and_decodes_exactly(tiny_drafter, tmp_path):
    run_dir = Path(shutil.copytree(tiny_drafter.run_dir, tmp_path / "run"))  # the shared run stays as it was
    lines = []
    result = evaluate(
        tiny_drafter.target,
        run_dir,
        tiny_drafter.held,
        k=3,
        max_new=32,
        prompts=4,
        log=lambda line, **kw: lines.append((line, kw.get("file"))),
    )
    assert result["exact"]
    # a line per prompt on stderr as it goes, then the result line on stdout (the role prints it)
    assert [f is sys.stderr for _, f in lines] == [True] * 4 + [False]
    assert lines[-1][0] == summary_line(result) and lines[-1][0].startswith("evaluate: tau_real ")
    assert lines[0][0].startswith("evaluate: prompt 1/4: ") and " rounds, tau " in lines[0][0]
    assert lines[3][0].endswith(f"running tau_real {result['tau_real']:.3f}")
    # per prompt: its tokens, rounds, accepted drafts and tau; they add up to the totals, the prefills left out
    per = result["per_prompt"]
    assert len(per) == 4 and sum(p["tokens"] for p in per) == result["tokens"]
    assert sum(p["rounds"] for p in per) == result["drafting_rounds"] == result["target_forwards"] - 4
    assert sum(p["accepted"] for p in per) == result["accepted_tokens"]
    assert all(p["tau"] == round((p["tokens"] - 1) / p["rounds"], 4) for p in per)
    assert result["tau_real"] == round((result["tokens"] - 4) / result["drafting_rounds"], 4)
    assert result["tau_real"] <= result["acceptance_length"]  # equal but for rounds cut at --max-new
    assert result["tokens_per_target_forward"] < result["tau_real"]  # the former figure, prefills counted
    low, high = result["tau_real_ci95"]
    assert low <= result["tau_real"] <= high and result["bootstrap_resamples"] == BOOTSTRAP_RESAMPLES
    assert f"(95 % CI {low:.3f}-{high:.3f} over the 4 prompts, bootstrap)" in lines[-1][0]
    assert result["tau_real"] > result["tau_frequent_token"] + 0.05, result
    assert result["tau_simulated"] is not None and len(result["acceptance_per_position"]) == 3
    assert result["step"] == 100  # the best checkpoint's step: the run validated there
    # the report page plots it beside the simulated curve (vLLM's figure, recorded too, is not plotted twice)
    record_evaluation(run_dir, result)
    record_evaluation(run_dir, {**result, "engine": "vllm", "tau_real": 9.9})
    info = write_report([str(run_dir)], tmp_path / "report.png")
    assert info["runs"][0]["tau_real"] == [[100, result["tau_real"], 3]]


def test_the_bootstrap_interval_resamples_prompts_and_weighs_them_by_their_rounds():
    prompts = [(30, 15), (45, 15), (60, 20), (20, 16), (70, 25), (33, 14)]  # (round tokens, rounds)
    low, high = bootstrap_ci(prompts)
    assert low < 258 / 105 < high  # tau_real: a ratio of sums, not the mean of the prompts' taus
    assert bootstrap_ci(prompts) == [low, high]  # a fixed seed: the same prompts give the same interval
    assert bootstrap_ci(prompts, seed=1) != [low, high]
    assert bootstrap_ci(prompts * 4)[1] - bootstrap_ci(prompts * 4)[0] < high - low  # more prompts, narrower
    assert bootstrap_ci([(40, 20)] * 8) == [2.0, 2.0]  # prompts that agree leave nothing to resample
    assert bootstrap_ci([(40, 20), (0, 0)]) == [
        2.0,
        2.0,
    ]  # a prompt without a round (eos first) weighs nothing
    assert bootstrap_ci([(0, 0)]) is None


def test_a_target_folder_without_a_tokenizer_is_refused_in_one_line_naming_it(tiny_target, tmp_path, capsys):
    target = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    removed = [p.name for p in target.iterdir() if p.name in TOKENIZER_FILES]
    assert "tokenizer.json" in removed
    for name in removed:
        (target / name).unlink()
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"text": "import os"}) + "\n")
    # before the drafter is read: no drafter is needed to find out
    assert main(["evaluate", str(tmp_path / "drafter"), "--target", str(target), "--data", str(held)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"evaluate: {target} has no tokenizer (none of tokenizer.json, "), err
    (target / "tokenizer.json").write_text("not JSON")  # one that is there but does not load
    assert main(["evaluate", str(tmp_path / "drafter"), "--target", str(target), "--data", str(held)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"evaluate: the tokenizer in {target} (tokenizer.json) does not load: "), err
    assert err.count("\n") == 1, err
    assert main(["evaluate", str(tmp_path / "drafter"), "--target", str(tmp_path), "--data", str(held)]) == 2
    assert capsys.readouterr().err == (
        f"evaluate: {tmp_path} is not a model folder (no config.json); give the target's local folder\n"
    )
