"""Native dataset format, synth and the speculators importer; bad data fails with DataError naming the file."""

import json

import pytest
import torch
from eagle3.data import DatasetReader, build_vocab_mapping, read_index
from eagle3.errors import DataError
from eagle3.importer import import_speculators
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
            json.dumps({"index": i, "input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].int().tolist()})
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


def test_8bit_storage_round_trips_through_sample_and_read_row_and_is_half_the_bytes(tmp_path):
    """float8 e4m3 with a scale per token and aux layer: read back transparently as bf16, within e4m3's
    precision (3 mantissa bits: 1/16 relative), in half the bytes of bf16 plus 16 bytes of scales per token (ids and mask unchanged)."""
    from eagle3.data import DatasetWriter, dequantize_fp8, quantize_fp8

    gen = torch.Generator().manual_seed(0)
    h, lengths = 32, [40, 25]
    samples = [
        (
            torch.randint(0, 64, (n,), generator=gen),
            torch.ones(n),
            torch.randn(n, 3 * h, generator=gen) * 3,
            torch.randn(n, h, generator=gen),
        )
        for n in lengths
    ]
    sizes = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        root = tmp_path / str(dtype)
        writer = DatasetWriter(root, h, dtype)
        for sample in samples:
            writer.add(*sample)
        d2t, t2d = build_vocab_mapping(torch.ones(64), 32)
        writer.finish(
            target_vocab_size=64,
            draft_vocab_size=32,
            aux_layer_ids=(1, 2, 3),
            t2d=t2d,
            d2t=d2t,
            embed=torch.randn(64, h),
            final_norm=torch.ones(h),
            lm_head=torch.randn(64, h),
        )
        sizes[dtype] = sum(p.stat().st_size for p in (root / "shards").iterdir())
    reader = DatasetReader(tmp_path / str(torch.float8_e4m3fn))
    reader.validate()
    assert reader.index.dtype == "float8_e4m3fn"
    row = reader.read_row([0, 1], 128)
    for i, (ids, _mask, aux, last) in enumerate(samples):
        got = reader.sample(i)
        expected = dequantize_fp8(*quantize_fp8(aux, 3), torch.bfloat16)
        assert got["aux_hidden"].dtype == torch.bfloat16 and torch.equal(got["aux_hidden"], expected)
        assert torch.equal(got["input_ids"], ids)
        start = sum(lengths[:i])
        assert torch.equal(row["aux_hidden"][start : start + lengths[i]], expected)
        assert (got["aux_hidden"].float() - aux).abs().max() <= aux.abs().max() / 16
        assert (got["last_hidden"].float() - last).abs().max() <= last.abs().max() / 16
    tokens = sum(lengths)
    per_token = {k: v / tokens for k, v in sizes.items()}
    # hidden states per token: 4H bf16 values (256 B at H=32) vs 4H fp8 values + 4 float32 scales (144 B); the ids
    # and mask (9 B) and the headers are alike in both. At H=7168 the fp8 share is 0.5 + 16 / 57344 of bf16's.
    assert per_token[torch.float8_e4m3fn] < 0.63 * per_token[torch.bfloat16]


def test_an_8bit_shard_without_its_scales_is_refused_by_name(tmp_path):
    from eagle3.data import DatasetWriter
    from safetensors.torch import load_file, save_file

    writer = DatasetWriter(tmp_path, 8, torch.float8_e4m3fn)
    writer.add(torch.arange(4), torch.ones(4), torch.randn(4, 24), torch.randn(4, 8))
    d2t, t2d = build_vocab_mapping(torch.ones(16), 8)
    writer.finish(
        target_vocab_size=16,
        draft_vocab_size=8,
        aux_layer_ids=(1, 2, 3),
        t2d=t2d,
        d2t=d2t,
        embed=torch.randn(16, 8),
        final_norm=torch.ones(8),
        lm_head=torch.randn(16, 8),
    )
    shard = next((tmp_path / "shards").iterdir())
    tensors = load_file(shard)
    del tensors[next(k for k in tensors if k.endswith("aux_hidden_scale"))]
    save_file(tensors, shard)
    with pytest.raises(DataError, match=r"aux_hidden_scale .* missing or malformed"):
        DatasetReader(tmp_path).sample(0)
