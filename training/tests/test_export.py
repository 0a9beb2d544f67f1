"""Export to the speculators format and back: same logits, the fields vLLM reads, clear refusals."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3.errors import ConfigError, DataError
from eagle3.export import export_speculators, load_exported
from eagle3.model import ttt_logits
from safetensors import safe_open

VERIFIER = {"verifier_name_or_path": "org/target", "verifier_architectures": ["LlamaForCausalLM"]}


def _trained_a_little(make_model, make_row, cfg):
    """A drafter whose trainable weights moved away from their initial values."""
    model = make_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_round_trip_gives_the_same_logits(tmp_path, make_model, make_row, tiny_config):
    cfg = tiny_config(norm_before_fc=True)
    model = _trained_a_little(make_model, make_row, cfg)
    export_speculators(model, tmp_path / "out", dtype=torch.float32, speculative_tokens=3, **VERIFIER)
    loaded = load_exported(tmp_path / "out")
    batch = make_row(cfg, [40, 23], seq_len=64)
    torch.testing.assert_close(ttt_logits(loaded, batch, 3), ttt_logits(model, batch, 3), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)


def test_bf16_export_is_close_and_keeps_the_vocab_maps_exact(tmp_path, make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = _trained_a_little(make_model, make_row, cfg)
    export_speculators(model, tmp_path / "out", **VERIFIER)  # bfloat16 by default, as vLLM serves it
    batch = make_row(cfg, [64])
    expected = ttt_logits(model, batch, 2)
    got = ttt_logits(load_exported(tmp_path / "out"), batch, 2)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.long and f.get_tensor("t2d").dtype == torch.bool


def test_config_carries_what_vllm_reads(tmp_path, make_model, tiny_config):
    cfg = tiny_config(aux_layer_ids=(2, 16, 29))
    export_speculators(
        make_model(cfg),
        tmp_path,
        speculative_tokens=5,
        verifier_name_or_path="moonshotai/Kimi-K2.5",
        verifier_architectures=["DeepseekV3ForCausalLM"],
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 5,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert spec["verifier"] == {
        "name_or_path": "moonshotai/Kimi-K2.5",
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    assert config["norm_before_residual"] is False  # vLLM assumes True when the key is absent
    assert config["draft_vocab_size"] == 512 and config["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["head_dim"]) == (64, 4, 16)
    assert layer["vocab_size"] == 1024 and layer["intermediate_size"] == 128
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("verifier") for n in names)  # the teacher is not part of the drafter
    assert {
        "fc.weight",
        "layers.0.hidden_norm.weight",
        "lm_head.weight",
        "embed_tokens.weight",
        "d2t",
    } <= names


def test_embedding_can_be_left_to_vllm(tmp_path, make_model):
    export_speculators(make_model(), tmp_path, include_embed_tokens=False, **VERIFIER)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in set(f.keys())
    assert load_exported(tmp_path).fc.weight.shape == (64, 192)


def test_trainer_checkpoint_state_without_lm_head_is_refused_with_the_fix(tmp_path, make_model, tiny_config):
    model = make_model()
    trainable = {n: p for n, p in model.state_dict().items() if n not in ("lm_head.weight", "embed_tokens.weight")}
    with pytest.raises(DataError, match=r"lack \['lm_head.weight'\].*load_target_weights"):
        export_speculators(trainable, tmp_path, cfg=tiny_config(), **VERIFIER)
    with pytest.raises(ConfigError, match="without cfg"):
        export_speculators(trainable, tmp_path, **VERIFIER)


def test_loading_refuses_what_this_drafter_cannot_run(tmp_path, make_model):
    export_speculators(make_model(), tmp_path, **VERIFIER)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="norm_before_residual=absent"):
        load_exported(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_exported(tmp_path / "nowhere")


def test_grouped_query_drafter_round_trips_with_its_kv_heads(tmp_path, make_model, make_row, tiny_config):
    cfg = tiny_config(num_kv_heads=2)
    model = _trained_a_little(make_model, make_row, cfg)
    export_speculators(model, tmp_path / "out", dtype=torch.float32, speculative_tokens=3, **VERIFIER)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.self_attn.k_proj.weight").shape == (2 * 16, 2 * 64)
    loaded = load_exported(tmp_path / "out")
    assert loaded.cfg.num_kv_heads == 2
    batch = make_row(cfg, [40, 23], seq_len=64)
    torch.testing.assert_close(ttt_logits(loaded, batch, 3), ttt_logits(model, batch, 3), rtol=0, atol=0)
    layer["num_key_value_heads"] = 3  # not a divisor of 4 query heads
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json: num_kv_heads=3 must divide num_heads=4"):
        load_exported(tmp_path / "out")


@pytest.mark.parametrize(
    "norms",
    [
        {"fc_norm": True},
        {"norm_output": True},
        {"norm_before_residual": True},
        {"fc_norm": True, "norm_output": True, "norm_before_residual": True, "num_kv_heads": 1},
    ],
)
def test_each_norm_option_round_trips_with_identical_logits(tmp_path, make_model, make_row, tiny_config, norms):
    cfg = tiny_config(**norms)
    model = _trained_a_little(make_model, make_row, cfg)
    export_speculators(model, tmp_path / "out", dtype=torch.float32, speculative_tokens=3, **VERIFIER)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("fc_norm", "norm_output", "norm_before_residual"):
        assert config[key] is norms.get(key, False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ({f"fc_norm.{i}.weight" for i in range(3)} <= names) == norms.get("fc_norm", False)
    loaded = load_exported(tmp_path / "out")
    assert all(getattr(loaded.cfg, key) == value for key, value in norms.items())
    batch = make_row(cfg, [40, 23], seq_len=64)
    torch.testing.assert_close(ttt_logits(loaded, batch, 3), ttt_logits(model, batch, 3), rtol=0, atol=0)


def _exported_config(tmp_path, make_model, **overrides):
    export_speculators(make_model(), tmp_path, **VERIFIER)
    return json.loads((tmp_path / "config.json").read_text())


def _load_with(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_exported(tmp_path)


def test_export_writes_a_complete_config_and_refuses_an_unknown_verifier(tmp_path, make_model):
    config = _exported_config(tmp_path, make_model)
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "org/target",
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["torch_dtype"] == "bfloat16" and config["transformer_layer_config"]["torch_dtype"] == "bfloat16"
    assert config["draft_vocab_size"] == 512 and config["transformer_layer_config"]["vocab_size"] == 1024
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size"):
        assert key in config
    with pytest.raises(ConfigError, match="export needs the verifier: verifier_name_or_path=None"):
        export_speculators(make_model(), tmp_path / "other")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(medusa_heads=4), r"unknown field\(s\) \['medusa_heads'\] in the top level"),
        (
            lambda c: c["transformer_layer_config"].update(sliding_window=4096),
            r"unknown field\(s\) \['sliding_window'\] in transformer_layer_config",
        ),
        (
            lambda c: c["speculators_config"].update(tree_width=2),
            r"unknown field\(s\) \['tree_width'\] in speculators_config",
        ),
        (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids is missing"),
        (lambda c: c.pop("norm_before_residual"), "norm_before_residual=absent"),
        (
            lambda c: c["transformer_layer_config"].update(model_type="qwen3"),
            "transformer_layer_config.model_type='qwen3'; this drafter implements only 'llama'",
        ),
        (
            lambda c: c["transformer_layer_config"].update(num_hidden_layers=2),
            "transformer_layer_config.num_hidden_layers=2",
        ),
        (
            lambda c: c["transformer_layer_config"].update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "transformer_layer_config.rope_scaling: rope_type 'llama3' needs low_freq_factor",
        ),
        (
            lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            "rope_parameters: rope_type 'yarn' needs factor",
        ),
        (
            lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_theta": 5e5}),
            "rope_theta disagrees",
        ),
        (
            lambda c: [c["transformer_layer_config"].pop(k) for k in ("rope_theta", "rope_parameters")],
            "no rope_theta",
        ),
        (
            lambda c: c["transformer_layer_config"].update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_scaling.rope_type='dynamic' is not supported",
        ),
        (
            lambda c: c["transformer_layer_config"].update(
                rope_scaling={"rope_type": "linear", "factor": 2.0},
                rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
            ),
            "rotary scaling disagrees",
        ),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (lambda c: c.update(target_hidden_size=128), "target_hidden_size=128"),
        (lambda c: c.update(fc_norm="yes"), "fc_norm='yes' must be true or false"),
        (
            lambda c: c["transformer_layer_config"].pop("rms_norm_eps"),
            "transformer_layer_config.rms_norm_eps is missing",
        ),
    ],
)
def test_import_refuses_unknown_and_unsupported_fields_by_name(tmp_path, make_model, change, message):
    config = _exported_config(tmp_path, make_model)
    change(config)
    with pytest.raises(ConfigError, match=message):
        _load_with(tmp_path, config)


def test_import_reads_rope_theta_in_either_layout(tmp_path, make_model):
    config = _exported_config(tmp_path, make_model)
    layer = config["transformer_layer_config"]
    del layer["rope_parameters"]  # transformers 4 layout
    layer["rope_theta"] = 500000.0
    assert _load_with(tmp_path, config).cfg.rope_theta == 500000.0
    del layer["rope_theta"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0}  # transformers 5 layout
    assert _load_with(tmp_path, config).cfg.rope_theta == 250000.0
    layer["rope_theta"] = 250000.0  # both, agreeing
    layer["rope_scaling"] = None
    assert _load_with(tmp_path, config).cfg.rope_theta == 250000.0
    # what speculators and HF also write, none of which changes the drafter's logits
    config.update(embed_requires_grad=False, transformers_version="4.56.0", speculators_version="0.3.0")
    layer.update(use_cache=True, initializer_range=0.02, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    assert _load_with(tmp_path, config).cfg.hidden_size == 64


def test_init_from_an_export_gives_its_logits_before_the_first_step(tmp_path, make_model, make_row, tiny_config):
    from eagle3.export import init_from_export

    cfg = tiny_config(num_kv_heads=2, fc_norm=True)
    trained = _trained_a_little(make_model, make_row, cfg)
    export_speculators(trained, tmp_path / "out", dtype=torch.float32, **VERIFIER)
    fresh = make_model(cfg, seed=0)  # same dataset target (seed 0), but fresh trainable weights
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.normal_()
    batch = make_row(cfg, [40, 23], seq_len=64)
    assert not torch.allclose(ttt_logits(fresh, batch, 3), ttt_logits(trained, batch, 3))
    copied = init_from_export(fresh, tmp_path / "out")
    assert "fc_norm.0.weight" in copied and "embed_tokens.weight" not in copied
    torch.testing.assert_close(ttt_logits(fresh, batch, 3), ttt_logits(trained, batch, 3), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="the export is another drafter: num_kv_heads=2 there, 4 in this run"):
        init_from_export(make_model(tiny_config(fc_norm=True)), tmp_path / "out")
    with pytest.raises(DataError, match="d2t differs from this run's dataset vocab mapping"):
        init_from_export(make_model(cfg, seed=1), tmp_path / "out")
    with pytest.raises(ConfigError, match="does not exist"):
        init_from_export(fresh, tmp_path / "nowhere")
