"""Native dataset format, synth and the speculators importer; bad data fails with DataError naming the file."""

import json

import pytest
import torch
from eagle3.data import DatasetReader, build_vocab_mapping, import_speculators, read_index
from eagle3.errors import DataError
from eagle3.synth import RandomTarget, SynthConfig, rms_norm, synthesize
from pipeline_support import synth_dataset
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synth_dataset(tmp_path_factory.getbasetemp())


def test_synth_writes_a_consistent_dataset(dataset):
    reader = DatasetReader(dataset)
    reader.validate()
    idx = reader.index
    assert idx.num_samples == 160 and idx.hidden_size == 64
    assert min(idx.lengths) >= 48 and max(idx.lengths) <= 400
    assert len(set(idx.lengths)) > 50  # varied lengths
    sample = reader.sample(3)
    n = idx.lengths[3]
    assert sample["aux_hidden"].shape == (n, 192) and sample["last_hidden"].shape == (n, 64)
    assert not sample["loss_mask"][0]  # every document opens with a prompt
    assert 0.3 < sample["loss_mask"].float().mean() < 0.95  # responses are supervised, prompts are not
    t2d, d2t = reader.vocab()
    assert int(t2d.sum()) == 512 and d2t.numel() == 512
    assert torch.equal(torch.arange(512) + d2t, torch.nonzero(t2d).flatten())


def test_synth_is_deterministic(tmp_path):
    cfg = dict(num_samples=6, max_len=64, min_len=16, seed=5)
    synthesize(tmp_path / "a", SynthConfig(**cfg), log=lambda *a, **k: None)
    synthesize(tmp_path / "b", SynthConfig(**cfg), log=lambda *a, **k: None)
    a, b = DatasetReader(tmp_path / "a"), DatasetReader(tmp_path / "b")
    for i in range(6):
        assert torch.equal(a.sample(i)["input_ids"], b.sample(i)["input_ids"])
        assert torch.equal(a.sample(i)["aux_hidden"], b.sample(i)["aux_hidden"])


def test_synth_responses_follow_the_target_distribution():
    # The stored last hidden state determines the next token's distribution: sampled response tokens
    # should mostly be the target's top choices (temperature 0.7), far above chance.
    cfg = SynthConfig(num_samples=8, min_len=200, max_len=200, seed=1, dtype="float32")
    target = RandomTarget(cfg)
    docs = target.generate([200] * 8, [[(0, 20)]] * 8)
    hits = total = 0
    for doc in docs:
        logits = rms_norm(doc["last_hidden"][:-1], target.final_norm) @ target.lm_head.T  # [L-1, V]
        top5 = logits.topk(5, dim=-1).indices
        nxt = doc["input_ids"][1:]
        resp = doc["loss_mask"][1:]
        hits += int((top5 == nxt[:, None]).any(-1)[resp].sum())
        total += int(resp.sum())
    assert hits / total > 0.5


def test_vocab_mapping_prefers_frequent_ids():
    counts = torch.tensor([0, 10, 3, 10, 7])
    d2t, t2d = build_vocab_mapping(counts, 3)
    assert torch.nonzero(t2d).flatten().tolist() == [1, 3, 4]
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 4]
    with pytest.raises(DataError, match="draft_vocab_size=6 is larger than the target vocab"):
        build_vocab_mapping(counts, 6)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_shard_is_named(dataset, tmp_path):
    bad = _copy(dataset, tmp_path / "d")
    shard = sorted((bad / "shards").iterdir())[0]
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard.name}.*missing"):
        DatasetReader(bad).validate()


def test_truncated_shard_is_corrupt(dataset, tmp_path):
    bad = _copy(dataset, tmp_path / "d")
    shard = sorted((bad / "shards").iterdir())[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="corrupt"):
        DatasetReader(bad).validate()


def test_hidden_size_mismatch_between_index_and_shards(dataset, tmp_path):
    bad = _copy(dataset, tmp_path / "d")
    index = json.loads((bad / "index.json").read_text())
    index["hidden_size"] = 96
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"shape \[\d+, 192\], expected \[\d+, 288\].*hidden_size=96"):
        DatasetReader(bad).validate()


def test_draft_vocab_larger_than_target_vocab(dataset, tmp_path):
    bad = _copy(dataset, tmp_path / "d")
    index = json.loads((bad / "index.json").read_text())
    index["draft_vocab_size"] = 2048
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="draft_vocab_size=2048 is larger than target_vocab_size=1024"):
        read_index(bad)


def test_no_dataset_at_all(tmp_path):
    with pytest.raises(DataError, match=r"index\.json is missing.*eagle3 synth"):
        read_index(tmp_path)


def test_import_from_speculators_layout(dataset, tmp_path):
    # Build a speculators-style directory from the synthetic dataset: hs_{i} with token_ids and [S, 4, H].
    reader = DatasetReader(dataset)
    src = tmp_path / "spec"
    (src / "hidden_states").mkdir(parents=True)
    masks = []
    for i in range(5):
        s = reader.sample(i)
        n = s["input_ids"].numel()
        hs = torch.cat([s["aux_hidden"].view(n, 3, 64), s["last_hidden"].view(n, 1, 64)], dim=1)  # [S, 4, H]
        save_file(
            {"token_ids": s["input_ids"], "hidden_states": hs.contiguous()},
            str(src / "hidden_states" / f"hs_{i}.safetensors"),
        )
        masks.append(
            json.dumps(
                {"index": i, "input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].int().tolist()}
            )
        )
    (src / "loss_masks.jsonl").write_text("\n".join(masks) + "\n")
    target = reader.target_weights()
    save_file(
        {
            "model.embed_tokens.weight": target["embed"],
            "model.norm.weight": target["final_norm"],
            "lm_head.weight": target["lm_head"],
        },
        str(tmp_path / "target.safetensors"),
    )
    out = tmp_path / "native"
    import_speculators(
        src,
        out,
        target_weights=tmp_path / "target.safetensors",
        draft_vocab_size=100,
        aux_layer_ids=(2, 8, 13),
    )
    imported = DatasetReader(out)
    imported.validate()
    assert imported.index.num_samples == 5 and imported.index.draft_vocab_size == 100
    for i in range(5):
        a, b = reader.sample(i), imported.sample(i)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["aux_hidden"], b["aux_hidden"])
        assert torch.equal(a["last_hidden"], b["last_hidden"])


def test_import_rejects_mismatched_hidden_size(dataset, tmp_path):
    src = tmp_path / "spec"
    (src / "hidden_states").mkdir(parents=True)
    save_file(
        {"token_ids": torch.arange(4), "hidden_states": torch.zeros(4, 4, 32), "loss_mask": torch.ones(4)},
        str(src / "hidden_states" / "hs_0.safetensors"),
    )
    target = DatasetReader(dataset).target_weights()
    save_file(target, str(tmp_path / "t.safetensors"))
    with pytest.raises(DataError, match="hidden size 32 does not match the target weights' 64"):
        import_speculators(
            src,
            tmp_path / "o",
            target_weights=tmp_path / "t.safetensors",
            draft_vocab_size=10,
            aux_layer_ids=(1, 2, 3),
        )
