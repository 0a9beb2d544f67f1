"""The MLA block (eagle3.mla) against transformers' DeepseekV3Attention with the same weights, with YaRN scaling at
positions past the original context, and its latent-space TTT steps against the expanded per-head form."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3.attention import TTTAttention
from eagle3.mla import MLAAttention, MLAShape, rotate, softmax_scale
from eagle3.model import RMSNorm
from eagle3.rope import normalize_rope_scaling, rope_cos_sin
from reference_attention import reference_ttt_attention
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

HIDDEN, THETA = 64, 10000.0
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def shapes():
    # q through a low rank and directly; value heads wider than the no-position key part, as in DeepSeek-V3
    return [MLAShape(4, 24, 16, 8, 8, 12), MLAShape(4, 0, 16, 8, 8, 12)]


def hf_attention(shape: MLAShape, interleave: bool):
    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        q_lora_rank=shape.q_lora_rank or None,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        rope_parameters={**YARN, "rope_theta": THETA},
        rope_interleave=interleave,
        attention_bias=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=32 * 4,
    )
    config._attn_implementation = "eager"
    return (
        DeepseekV3Attention(config, layer_idx=0).double().float(),
        DeepseekV3RotaryEmbedding(config),
        config,
    )


def ours_with_the_weights_of(hf, shape: MLAShape, interleave: bool) -> MLAAttention:
    torch.manual_seed(0)
    for p in hf.parameters():  # random weights, norms included (ones would hide a wrong norm)
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    ours = MLAAttention(HIDDEN, HIDDEN, shape, RMSNorm, 1e-6, interleave)
    ours.load_state_dict(hf.state_dict())  # the same names and shapes: vLLM's deepseek_eagle3 loads these
    return ours


@pytest.mark.parametrize("shape", shapes())
@pytest.mark.parametrize("interleave", [True, False])
def test_the_block_is_transformers_deepseek_v3_attention_with_yarn_past_the_original_context(shape, interleave):
    hf, rotary, _ = hf_attention(shape, interleave)
    ours = ours_with_the_weights_of(hf, shape, interleave)
    seq = 96
    positions = torch.arange(seq) + 40  # up to 135: past the original 32 and past 32 x factor 4
    x = torch.randn(1, seq, HIDDEN)
    cos, sin = rotary(x, positions[None])
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    expected, _ = hf(x, (cos, sin), causal)

    scaling = normalize_rope_scaling(YARN)
    our_cos, our_sin = rope_cos_sin(positions, shape.qk_rope_head_dim, THETA, scaling)
    assert torch.allclose(our_cos, cos[0], atol=1e-6) and torch.allclose(our_sin, sin[0], atol=1e-6)
    attention = TTTAttention(torch.zeros(seq, dtype=torch.long), "exact")
    out, latent = ours(x[0], our_cos, our_sin, [], attention, softmax_scale(shape, scaling))
    assert latent.shape == (1, seq, shape.kv_lora_rank + shape.qk_rope_head_dim)
    assert torch.allclose(out, expected[0], atol=1e-5, rtol=0), (out - expected[0]).abs().max()


def expanded_step(ours: MLAAttention, x, cos, sin, past_kv, document_ids, scale):
    """The same TTT step the expanded way: per-head keys and values, the dense reference attention."""
    s = ours.shape
    q_nope, q_rot = ours.queries(x).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
    latent = ours.latent(x, cos, sin)[0]  # [S, r + rope]
    c, k_rot = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
    kv = ours.kv_b_proj(c).view(-1, s.num_heads, s.qk_nope_head_dim + s.v_head_dim).transpose(0, 1)
    k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rot[None].expand(s.num_heads, -1, -1)], dim=-1)  # [heads, S, qk]
    keys, values = [*[p[0] for p in past_kv], k], [*[p[1] for p in past_kv], v]
    q = torch.cat([q_nope, rotate(q_rot, cos, sin, ours.interleave)], dim=-1) * (scale * s.qk_head_dim**0.5)
    out = reference_ttt_attention(q, keys, values, document_ids)  # [heads, S, v]
    return ours.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1)), (k, v)


@pytest.mark.parametrize("kind", ["exact", "flex"])
def test_ttt_steps_in_the_latent_equal_the_expanded_per_head_form(kind):
    shape = MLAShape(4, 24, 16, 8, 8, 12)
    hf, _, _ = hf_attention(shape, True)
    ours = ours_with_the_weights_of(hf, shape, True).double()
    document_ids = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)  # three documents: the mask matters
    seq = document_ids.shape[0]
    scaling = normalize_rope_scaling(YARN)
    scale = softmax_scale(shape, scaling)
    attention = TTTAttention(document_ids, kind)
    latents, expanded = [], []
    hidden = torch.randn(seq, HIDDEN, dtype=torch.float64)
    # flex_attention has no backward on CPU: its forward is what is compared here (CUDA trains with it)
    with torch.set_grad_enabled(kind == "exact"):
        run_steps(ours, hidden, document_ids, attention, scaling, scale, latents, expanded)


def run_steps(ours, hidden, document_ids, attention, scaling, scale, latents, expanded):
    shape, seq = ours.shape, hidden.shape[0]
    for step in range(3):
        cos, sin = rope_cos_sin(torch.arange(seq) + 1 + step, shape.qk_rope_head_dim, THETA, scaling)
        cos, sin = cos.double(), sin.double()
        out, latent = ours(hidden, cos, sin, latents, attention, scale)
        reference, kv = expanded_step(ours, hidden, cos, sin, expanded, document_ids, scale)
        assert torch.allclose(out, reference, atol=1e-10), (step, (out - reference).abs().max())
        latents.append(latent)
        expanded.append(kv)
        hidden = hidden + out  # the next step reads something new, as a TTT step does


def test_gradients_reach_every_weight_through_the_latent_steps():
    shape = MLAShape(4, 24, 16, 8, 8, 12)
    ours = MLAAttention(HIDDEN, HIDDEN, shape, RMSNorm, 1e-6, True)
    document_ids = torch.zeros(32, dtype=torch.long)
    attention = TTTAttention(document_ids, "exact")
    scale = softmax_scale(shape, None)
    hidden, latents = torch.randn(32, HIDDEN), []
    for step in range(2):
        cos, sin = rope_cos_sin(torch.arange(32) + 1 + step, shape.qk_rope_head_dim, THETA)
        out, latent = ours(hidden, cos, sin, latents, attention, scale)
        latents.append(latent)
        hidden = hidden + out
    hidden.square().mean().backward()
    missing = [name for name, p in ours.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


# ------------------------------------------------------------------------------------- the drafter with MLA
MLA_KEYS = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)


def test_an_mla_drafter_has_the_weights_vllms_deepseek_eagle3_loads(tiny_config, make_model):
    model = make_model(tiny_config(**MLA_KEYS))
    names = {n for n, _ in model.named_parameters()}
    attention = {n.split("self_attn.")[1] for n in names if "self_attn." in n}
    assert attention == {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == model.cfg.trainable_params()  # the planner's count
    assert model.layers[0].self_attn.kv_a_proj_with_mqa.in_features == 2 * 64  # embedding and hidden halves


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_mla_under_activation_checkpointing_gives_the_same_loss_and_gradients(tiny_config, make_model, make_row, mode):
    from eagle3.model import ttt_forward

    cfg = tiny_config(**MLA_KEYS, rope_scaling=YARN)
    row = make_row(cfg, [40, 60, 28])
    grads = []
    for checkpointing in ("none", mode):
        model = make_model(cfg)
        loss, _ = ttt_forward(model, row, ttt_steps=3, activation_checkpointing=checkpointing, attention="exact")
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = grads
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys()
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6), name


def test_mla_flex_and_exact_attention_agree_over_the_ttt_steps(tiny_config, make_model, make_row):
    from eagle3.model import ttt_forward

    cfg = tiny_config(**MLA_KEYS)
    model, row = make_model(cfg), make_row(cfg, [50, 30, 48])
    with torch.no_grad():  # flex_attention has no backward on CPU
        exact, _ = ttt_forward(model, row, ttt_steps=3, attention="exact")
        flex, _ = ttt_forward(model, row, ttt_steps=3, attention="flex")
    assert torch.allclose(exact, flex, atol=1e-5), (exact, flex)


def test_mla_keys_without_kv_lora_rank_are_refused_by_name(tiny_config):
    from eagle3.errors import ConfigError

    with pytest.raises(ConfigError, match="which kv_lora_rank > 0 selects: set kv_lora_rank too"):
        tiny_config(qk_rope_head_dim=8).validate()
    with pytest.raises(ConfigError, match="qk_rope_head_dim=7 must be even"):
        tiny_config(**{**MLA_KEYS, "qk_rope_head_dim": 7}).validate()


# ------------------------------------------------------------------------------------- an MLA run
def mla_config(tmp_path, data, **values):
    from pipeline_support import write_config

    base = dict(
        data_dir=str(data),
        run_dir=str(tmp_path / "run"),
        max_seq_len=1024,
        ttt_steps=2,
        lr=5e-3,
        warmup_steps=5,
        log_every=5,
        val_every=20,
        checkpoint_every=20,
        num_threads=1,
        rope_scaling=YARN,
        **MLA_KEYS,
    )
    return write_config(tmp_path / "train.yaml", **{**base, **values})


@pytest.mark.slow
def test_an_mla_drafter_learns_resumes_and_exports_in_vllms_deepseek_layout(tmp_path_factory, tmp_path):
    from pipeline_support import read_metrics, read_status, run_trainer, synth_dataset

    data = synth_dataset(tmp_path_factory.getbasetemp(), "synth_learn", num_samples=400, max_len=512)
    run = tmp_path / "run"
    for steps in (20, 40):  # the second start resumes from the first one's checkpoint
        config = mla_config(tmp_path, data, max_steps=steps)
        assert run_trainer(["train", "--config", str(config)], tmp_path / "log.txt", timeout=240) == 0, (
            tmp_path / "log.txt"
        ).read_text()[-3000:]
    status = read_status(run)
    assert status["phase"] == "done" and status["step"] == 40 and status["resumed_from_step"] == 20
    train, val = read_metrics(run), read_metrics(run, "val")
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], [r["loss"] for r in train]
    assert [v["step"] for v in val] == [20, 40] and val[1]["loss"] < val[0]["loss"]
    out = tmp_path / "export"
    verifier = ["--verifier", "org/target", "--verifier-arch", "DeepseekV3ForCausalLM"]
    assert run_trainer(["export", str(run), str(out), *verifier], tmp_path / "export.txt", timeout=120) == 0, (
        tmp_path / "export.txt"
    ).read_text()[-2000:]
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["kv_lora_rank"] == 16


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_mla_drafter_under_two_rank_fsdp2_takes_the_ddp_runs_steps(tmp_path_factory, tmp_path):
    from pipeline_support import read_metrics, synth_dataset
    from test_torchrun import finish, start_torchrun

    data = synth_dataset(tmp_path_factory.getbasetemp())
    losses = []
    for name, fsdp in (("ddp", False), ("fsdp", True)):
        where = tmp_path / name
        where.mkdir()
        proc, run = start_torchrun(where, data, max_steps=4, fsdp=fsdp, **MLA_KEYS)
        rc, log = finish(proc, where)
        assert rc == 0, log[-3000:]
        losses.append([r["loss"] for r in read_metrics(run)])
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-4)


# ------------------------------------------------------------------------------------- export and import
MLA_VERIFIER = {
    "verifier_name_or_path": "moonshotai/Kimi-K2-Instruct",
    "verifier_architectures": ["DeepseekV3ForCausalLM"],
}


@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_an_mla_drafter_round_trips_through_vllms_deepseek_layout_with_identical_logits(
    tmp_path, tiny_config, make_model, make_row, q_lora_rank
):
    import json

    from eagle3.export import export_speculators, init_from_export, load_exported
    from eagle3.model import ttt_logits

    cfg = tiny_config(**{**MLA_KEYS, "q_lora_rank": q_lora_rank}, rope_scaling=YARN, fc_norm=True, norm_output=True)
    model, batch = make_model(cfg), make_row(cfg, [40, 30])
    export_speculators(model, tmp_path / "out", dtype=torch.float32, speculative_tokens=3, **MLA_VERIFIER)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["num_hidden_layers"]) == (16, 8, 1)
    assert config["q_lora_rank"] == (q_lora_rank or None)  # DeepseekV3Config: null means queries without low rank
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(cfg.aux_layer_ids)
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_interleave"] is True
    loaded = load_exported(tmp_path / "out")
    assert loaded.cfg == model.cfg
    torch.testing.assert_close(ttt_logits(loaded, batch, 3), ttt_logits(model, batch, 3), rtol=0, atol=0)
    fresh = make_model(cfg)  # the same target weights, other trainable ones
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    assert not torch.equal(ttt_logits(fresh, batch, 3), ttt_logits(model, batch, 3))
    assert init_from_export(fresh, tmp_path / "out")
    torch.testing.assert_close(ttt_logits(fresh, batch, 3), ttt_logits(model, batch, 3), rtol=0, atol=0)


def test_what_the_deepseek_layout_cannot_hold_is_refused_by_name(tmp_path, tiny_config, make_model):
    import json

    from eagle3.errors import ConfigError
    from eagle3.export import export_speculators, load_exported

    with pytest.raises(ConfigError, match="rope_interleave=false"):
        export_speculators(make_model(tiny_config(**MLA_KEYS, rope_interleave=False)), tmp_path, **MLA_VERIFIER)
    with pytest.raises(ConfigError, match="norm_before_fc=true"):
        export_speculators(make_model(tiny_config(**MLA_KEYS, norm_before_fc=True)), tmp_path, **MLA_VERIFIER)
    export_speculators(make_model(tiny_config(**MLA_KEYS)), tmp_path, **MLA_VERIFIER)
    path = tmp_path / "config.json"
    good = json.loads(path.read_text())
    for change, words in (
        ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"index_topk": 2048}, r"unknown field\(s\) \['index_topk'\]"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=words):
            load_exported(tmp_path)


def test_max_seq_len_auto_plans_an_mla_run_from_its_trainer_config(tmp_path_factory, tmp_path, capsys):
    """The role's max_seq_len=auto: the planner reads the trainer config (MLA keys included) and the data set."""
    from eagle3 import plan as P
    from pipeline_support import synth_dataset

    data = synth_dataset(tmp_path_factory.getbasetemp())
    config = mla_config(tmp_path, data, max_seq_len="auto", device="cpu", memory_limit_gb=2)
    assert P.main(["--config", str(config), "--json", "--lengths", "1024,2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["kv_lora_rank"] == 16 and out["shape"]["head_dim"] == 16
    assert out["max_seq_len"] % 128 == 0 and out["max_seq_len"] >= 1024
