"""`eagle3 evaluate` on the tiny real target: speculative decoding gives exactly the target's greedy tokens, and a
drafter trained by the project on generated data accepts more than one that always proposes the most frequent
token."""

import json
import os
import subprocess
import sys
import sysconfig
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
from eagle3.generate import generate
from eagle3.report import write_report
from eagle3.tiny_target import cached
from transformers import AutoModelForCausalLM

TRAINING = Path(__file__).resolve().parents[1]
# The first use builds the tiny target (scripts/test.sh builds it beforehand, beside lint): a pytest run alone may
# spend minutes in that fixture on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny_target():
    return cached(log=lambda *a, **k: None)


def chats(path: Path, files: list[Path]) -> Path:
    with path.open("w") as f:
        for p in files:
            lines = p.read_text(errors="replace").splitlines()
            for start in range(0, min(len(lines), 90), 30):
                head, tail = "\n".join(lines[start : start + 8]), "\n".join(lines[start + 8 : start + 24])
                if head.strip() and tail.strip():
                    f.write(json.dumps({"messages": [{"role": "user", "content": head},
                                                     {"role": "assistant", "content": tail}]}) + "\n")  # fmt: skip
    return path


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


def test_a_trained_drafter_beats_the_most_frequent_token_and_decodes_exactly(tiny_target, tmp_path):
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = chats(tmp_path / "train.jsonl", stdlib[9::10][:16])
    held = chats(tmp_path / "held.jsonl", stdlib[4::10][:2])
    generate(tiny_target, train, tmp_path / "data", max_len=512, draft_vocab=512, shard_samples=16,
             log=lambda *a, **k: None)  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "eagle3", "train", "--data_dir", str(tmp_path / "data"), "--run_dir",
         str(tmp_path / "run"), "--max_seq_len", "1024", "--max_steps", "100", "--warmup_steps", "10", "--lr", "3e-3",
         "--ttt_steps", "3", "--checkpoint_every", "100", "--device", "cpu", "--dtype", "fp32", "--num_threads", "2"],
        cwd=TRAINING, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = evaluate(
        tiny_target, tmp_path / "run", held, k=3, max_new=32, prompts=4, log=lambda *a, **k: None
    )
    assert result["exact"]
    assert result["tau_real"] > result["tau_frequent_token"] + 0.05, result
    assert result["tau_simulated"] is not None and len(result["acceptance_per_position"]) == 3
    assert result["step"] == 100  # the best checkpoint's step: the run validated there
    # the report page plots it beside the simulated curve
    record_evaluation(tmp_path / "run", result)
    info = write_report([str(tmp_path / "run")], tmp_path / "report.png")
    assert info["runs"][0]["tau_real"] == [[100, result["tau_real"], 3]]
