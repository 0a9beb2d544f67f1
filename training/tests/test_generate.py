"""`eagle3 generate` on the tiny real target (built once from the Python stdlib's sources and cached): the loss
mask covers the assistant turns, the hidden states are the target's own, the target config reaches the drafter,
and a generation killed with SIGKILL resumes with no sample lost or doubled."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from eagle3.cli import main
from eagle3.config import TrainConfig
from eagle3.data import DatasetReader, read_index
from eagle3.errors import ConfigError, DataError
from eagle3.generate import FAULT_KILL_ENV, default_aux_layers, generate
from eagle3.samples import read_records, tokenize
from eagle3.spec import drafter_config
from eagle3.tiny_target import cached
from eagle3.tokenizer import TOKENIZER_FILES
from transformers import AutoModelForCausalLM, AutoTokenizer

TRAINING = Path(__file__).resolve().parents[1]
# The first use builds the tiny target (scripts/test.sh builds it beforehand, beside lint): a pytest run alone may
# spend minutes in that fixture on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny Llama target (about 80 s to build the first time on 2 cores; then read from the cache)."""
    return cached(log=lambda *a, **k: None)


def conversations(path: Path, count: int = 12) -> Path:
    """Chat samples made of held-out stdlib code: the user gives ten lines, the assistant continues."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[9::10]
    with path.open("w") as f:
        for p in files[:count]:
            lines = p.read_text(errors="replace").splitlines()
            head, tail = "\n".join(lines[:10]), "\n".join(lines[10:22])
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "system", "content": "You write Python."},
                            {"role": "user", "content": "Continue:\n" + head},
                            {"role": "assistant", "content": tail},
                        ]
                    }
                )
                + "\n"
            )
    return path


def test_the_loss_mask_covers_exactly_the_assistant_turns(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target, local_files_only=True)
    record = {
        "messages": [
            {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": "    return x + 1"},
            {"role": "user", "content": "and g?"},
            {"role": "assistant", "content": "def g(y):\n    return y"},
        ]
    }
    sample = tokenize(record, tokenizer, 4096)
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert tokenizer.decode(supervised) == "    return x + 1<|end|>def g(y):\n    return y<|end|>"
    text = tokenize({"text": "import os"}, tokenizer, 4096)
    assert all(text.loss_mask) and tokenizer.decode(text.input_ids) == "import os"
    assert len(tokenize(record, tokenizer, 5).input_ids) == 5


def test_the_default_aux_layers_are_three_distinct_ascending_layers_of_any_target_of_3_layers_or_more():
    for n in range(3, 81):
        layers = default_aux_layers(n)
        assert len(set(layers)) == 3 and list(layers) == sorted(layers), (n, layers)
        assert all(0 <= i < n for i in layers), (n, layers)
        reference = (2, n // 2, n - 3)  # EAGLE-3's, vLLM's and speculators' (2, n/2, n-3)
        if len(set(reference)) == 3 and list(reference) == sorted(reference) and reference[-1] < n:
            assert layers == reference, n  # what existing datasets and exports name stays as it was
        else:
            assert n < 7 and layers[1] == n // 2, (n, layers)
    for n in (0, 1, 2):
        with pytest.raises(ConfigError, match=f"the target has {n} decoder layers?: .* at least 3"):
            default_aux_layers(n)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("not json", "not JSON"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role system/user/assistant"),
        ('{"prompt": "x"}', "no messages, conversations or text"),
    ],
)
def test_bad_input_lines_are_refused_with_their_line_number(tmp_path, line, words):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"data.jsonl:2: .*{words}"):
        read_records(path)


def test_a_target_folder_without_a_tokenizer_is_refused_in_one_line_naming_it(tiny_target, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for p in Path(tiny_target).iterdir():
        if p.name not in TOKENIZER_FILES:
            (target / p.name).symlink_to(p)
    data = conversations(tmp_path / "chats.jsonl", 2)
    assert main(["generate", str(tmp_path / "out"), "--target", str(target), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"generate: {target} has no tokenizer (none of tokenizer.json, ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_sharegpt_and_plain_text_read_as_conversations_and_text(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    assert read_records(path) == [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    text = tmp_path / "notes.txt"
    text.write_text("first paragraph\n\nsecond\n")
    assert read_records(text) == [{"text": "first paragraph"}, {"text": "second"}]


def test_hidden_states_are_the_targets_and_its_config_reaches_the_drafter(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=3)
    index_path = generate(
        tiny_target,
        data,
        tmp_path / "ds",
        max_len=256,
        draft_vocab=256,
        dtype="float32",
        shard_samples=2,
        log=lambda *a, **k: None,
    )
    index = read_index(index_path.parent)
    assert index.num_samples == 3 and index.aux_layer_ids == (2, 4, 5) and index.draft_vocab_size == 256
    target = index.meta["target_config"]
    assert target["rms_norm_eps"] == 1e-5 and target["rope_scaling"] is None and target["hidden_size"] == 64
    cfg = drafter_config(TrainConfig(data_dir=str(index.root), run_dir=str(tmp_path)), index)
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (1e-5, target["rope_theta"])
    # The stored states are what transformers reports: the inputs of layers 2, 4, 5 are hidden_states[2], [4], [5],
    # and the last one before the final norm gives the target's logits through norm and head.
    model = AutoModelForCausalLM.from_pretrained(tiny_target, local_files_only=True, dtype=torch.float32).eval()
    reader = DatasetReader(index.root)
    sample = reader.sample(1)
    with torch.no_grad():
        out = model(input_ids=sample["input_ids"][None], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(sample["aux_hidden"], expected, rtol=1e-5, atol=1e-5)
    logits = model.lm_head(model.model.norm(sample["last_hidden"]))
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)


def _run(args, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "eagle3", "generate", *args],
        cwd=TRAINING,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_generation_killed_with_sigkill_resumes_with_no_sample_lost_or_doubled(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=7)
    args = ["--target", str(tiny_target), "--data", str(data), "--max-len", "256", "--shard-samples", "2"]
    whole = _run([str(tmp_path / "whole"), *args])
    assert whole.returncode == 0, whole.stderr
    killed = _run([str(tmp_path / "resumed"), *args], {FAULT_KILL_ENV: "1"})
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "resumed" / "index.json").exists()  # an unfinished dataset has no index
    resumed = _run([str(tmp_path / "resumed"), *args])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 2 of 4 shards are complete" in resumed.stdout
    a, b = DatasetReader(tmp_path / "whole"), DatasetReader(tmp_path / "resumed")
    assert a.index.num_samples == b.index.num_samples == 7
    assert [s["lengths"] for s in a.index.meta["shards"]] == [s["lengths"] for s in b.index.meta["shards"]]
    for i in range(7):
        x, y = a.sample(i), b.sample(i)
        for key in x:
            assert torch.equal(x[key], y[key]), (i, key)
    # the same folder with other settings is not mixed into it
    again = _run([str(tmp_path / "resumed"), *args[:-1], "3"])
    assert again.returncode == 2 and "already holds a finished dataset" in again.stderr


def test_ranks_write_their_own_shards_and_rank_0_indexes_them(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=5)
    quiet = {"log": lambda *a, **k: None, "max_len": 256, "shard_samples": 2}
    assert generate(tiny_target, data, tmp_path / "ds", rank=1, world_size=2, **quiet) is None
    assert sorted(p.name for p in (tmp_path / "ds" / "shards").iterdir()) == ["shard_00001.safetensors"]
    index = read_index(generate(tiny_target, data, tmp_path / "ds", rank=0, world_size=2, **quiet).parent)
    assert index.num_samples == 5 and len(index.meta["shards"]) == 3


def test_a_folder_of_another_generation_is_refused(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=2)
    quiet = {"log": lambda *a, **k: None, "shard_samples": 1}
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "generate_plan.json").write_text(json.dumps({"digest": "other", "settings": {"max_len": 9}}))
    with pytest.raises(ConfigError, match="holds shards of another generation"):
        generate(tiny_target, data, tmp_path / "ds", max_len=256, **quiet)


@pytest.mark.slow
def test_regenerate_replaces_the_responses_by_the_targets_own_and_resumes(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=3)
    quiet = {"log": lambda *a, **k: None, "max_len": 512, "shard_samples": 2, "regenerate_max_new": 16}
    index = read_index(generate(tiny_target, data, tmp_path / "ds", regenerate_responses=True, **quiet).parent)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target, local_files_only=True)
    reader = DatasetReader(index.root)
    regenerated = [json.loads(line) for line in (tmp_path / "ds" / "regenerated.jsonl").read_text().splitlines()]
    for i, record in enumerate(read_records(data)):
        prompt = tokenizer.apply_chat_template(record["messages"][:2], add_generation_prompt=True, return_dict=True)
        ids = torch.tensor([list(prompt["input_ids"])])
        greedy = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        said = tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
        assert regenerated[i]["messages"][2]["content"] == said
        assert regenerated[i]["messages"][:2] == record["messages"][:2]  # the prompts are kept
        sample = reader.sample(i)
        supervised = sample["input_ids"][sample["loss_mask"]].tolist()
        assert tokenizer.decode(supervised) == said + "<|end|>"
    # a restart after a kill mid-way reads the complete lines back and regenerates the rest, the same way
    path = tmp_path / "again" / "regenerated.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(regenerated[0]) + "\n" + '{"messages": [{"role": "us')  # a torn second line
    generate(tiny_target, data, tmp_path / "again", regenerate_responses=True, **quiet)
    assert path.read_text() == (tmp_path / "ds" / "regenerated.jsonl").read_text()


def test_8bit_generation_reads_back_as_the_bf16_one_within_e4m3_precision(tiny_target, tmp_path):
    data = conversations(tmp_path / "chat.jsonl", count=3)
    quiet = {"log": lambda *a, **k: None, "max_len": 256, "shard_samples": 2}
    bf16 = DatasetReader(generate(tiny_target, data, tmp_path / "bf16", dtype="float32", **quiet).parent)
    fp8 = DatasetReader(generate(tiny_target, data, tmp_path / "fp8", dtype="float8_e4m3fn", **quiet).parent)
    fp8.validate()
    for i in range(3):
        exact, small = bf16.sample(i), fp8.sample(i)
        assert torch.equal(exact["input_ids"], small["input_ids"])
        for key in ("aux_hidden", "last_hidden"):
            err = (small[key].float() - exact[key]).abs().amax(dim=-1)
            assert (err <= exact[key].abs().amax(dim=-1) / 16 + 1e-6).all(), key
    row = fp8.read_row([0, 1, 2], 1024)
    assert row["aux_hidden"].dtype == torch.bfloat16
