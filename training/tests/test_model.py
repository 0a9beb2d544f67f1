"""Drafter config, parameter names, frozen parts and target weights."""

from __future__ import annotations

import doctest

import eagle3.model as model_module
import pytest
import torch
from eagle3.errors import ConfigError, DataError
from eagle3.model import Eagle3Drafter, ttt_forward
from eagle3.spec import DrafterConfig

SPECULATORS_NAMES = {
    "embed_tokens.weight",
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "verifier_norm.weight",
    "verifier_lm_head.weight",
    "d2t",
    "t2d",
}


def test_docstring_examples_hold():
    assert doctest.testmod(model_module).failed == 0


def test_state_dict_uses_speculators_names_and_shapes(tiny_config):
    cfg = tiny_config(hidden_size=64, num_heads=2, head_dim=24)  # heads * head_dim != hidden, as for Kimi
    state = Eagle3Drafter(cfg).state_dict()
    assert set(state) == SPECULATORS_NAMES
    assert state["fc.weight"].shape == (64, 192)
    assert state["layers.0.self_attn.q_proj.weight"].shape == (48, 128)  # 2H input
    assert state["layers.0.self_attn.o_proj.weight"].shape == (64, 48)
    assert state["lm_head.weight"].shape == (512, 64)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool and state["t2d"].shape == (1024,)
    assert "input_norm.weight" in Eagle3Drafter(tiny_config(norm_before_fc=True)).state_dict()


def test_only_the_drafter_body_trains_and_frozen_parts_get_no_gradient(make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = make_model(cfg)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {
        "embed_tokens.weight",
        "verifier_norm.weight",
        "verifier_lm_head.weight",
        "lm_head.weight",
    }
    loss, _ = ttt_forward(model, make_row(cfg, [30]), ttt_steps=2)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n not in frozen)
    trainable = make_model(tiny_config(train_lm_head=True))
    assert trainable.lm_head.weight.requires_grad


def test_target_weights_land_where_the_teacher_reads_them(make_model, random_target, tiny_config):
    cfg = tiny_config()
    target = random_target(cfg, seed=7)
    model = Eagle3Drafter(cfg)
    model.load_target_weights(**target)
    assert torch.equal(model.verifier_lm_head.weight, target["lm_head"][target["t2d"]])
    assert torch.equal(model.lm_head.weight, model.verifier_lm_head.weight)  # starts at the target's rows
    assert torch.equal(model.embed_tokens.weight, target["embed"])
    ids = torch.arange(cfg.draft_vocab_size)
    assert torch.equal(ids + model.d2t[ids], torch.nonzero(model.t2d).flatten())
    # The true target argmax (whole vocab) from the kept rows equals a plain argmax over the full head.
    y = torch.randn(50, cfg.hidden_size)
    _, true_ids, _ = model.target_chunk(y)
    assert torch.equal(true_ids, (model.verifier_norm(y) @ target["lm_head"].T).argmax(-1))


def test_target_weights_of_another_shape_are_refused(random_target, tiny_config):
    cfg = tiny_config()
    target = random_target(tiny_config(hidden_size=96))
    with pytest.raises(DataError, match=r"target weight embed has shape \[1024, 96\], expected \[1024, 64\]"):
        Eagle3Drafter(cfg).load_target_weights(**target)
    target = random_target(cfg)
    target["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    with pytest.raises(DataError, match="vocab mapping mismatch"):
        Eagle3Drafter(cfg).load_target_weights(**target)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"draft_vocab_size": 2048},
            "draft_vocab_size=2048 is larger than target_vocab_size=1024; .* use at most 1024",
        ),
        ({"hidden_size": 0}, "hidden_size=0 must be a positive integer"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"aux_layer_ids": (1, 1, 2)}, r"aux_layer_ids=\(1, 1, 2\) must be 3 distinct"),
        ({"aux_layer_ids": (1, 2)}, "aux_layer_ids=.* must be 3 distinct"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be positive"),
        ({"num_kv_heads": 3}, r"num_kv_heads=3 must divide num_heads=4 .*\[1, 2, 4\]"),
        ({"num_kv_heads": 0}, "num_kv_heads=0 must be a positive integer"),
    ],
)
def test_bad_config_names_key_value_and_expectation(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides).validate()
    with pytest.raises(ConfigError, match=message):
        Eagle3Drafter(tiny_config(**overrides))


def test_config_round_trips_through_a_dict_and_refuses_unknown_keys(tiny_config):
    cfg = tiny_config(norm_before_fc=True, rope_theta=500000.0)
    data = cfg.to_dict()
    assert data["aux_layer_ids"] == [1, 3, 5]
    assert DrafterConfig.from_dict(data) == cfg
    with pytest.raises(ConfigError, match=r"unknown drafter config key\(s\) \['num_layers'\]"):
        DrafterConfig.from_dict({**data, "num_layers": 2})
    with pytest.raises(ConfigError, match=r"missing \['hidden_size'\]"):
        DrafterConfig.from_dict({k: v for k, v in data.items() if k != "hidden_size"})


def test_bf16_frozen_weights_stay_close_to_fp32(make_model, make_row, tiny_config):
    # Frozen embedding and target heads in bf16 halve their bytes; loss and gradient barely move
    # (measured: loss 2e-6 relative, gradient cosine 0.99999).
    cfg = tiny_config()
    batch = make_row(cfg, [100, 60], seq_len=160, mask_prob=0.8)
    grads = []
    losses = []
    for model in (make_model(cfg), make_model(cfg).frozen_to(torch.bfloat16)):
        loss, _ = ttt_forward(model, batch, ttt_steps=3)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.fc.weight.dtype == torch.float32
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-4
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.9999


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("attention", ["exact", "flex"])
def test_grouped_query_drafter_equals_multi_head_drafter_with_repeated_kv_heads(
    make_model, make_row, tiny_config, kv_heads, attention
):
    """A GQA drafter (4 query heads, kv_heads key/value heads) has the logits of the multi-head drafter whose
    k/v projections repeat each key/value head's rows for its group of query heads (HF repeat_kv)."""
    from eagle3.model import ttt_logits

    gqa = make_model(tiny_config(num_kv_heads=kv_heads))
    attn = gqa.layers[0].self_attn
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (kv_heads * 16, 128)
    reference = make_model(tiny_config())
    state = gqa.state_dict()
    for name in ("k_proj", "v_proj"):
        w = state[f"layers.0.self_attn.{name}.weight"].view(kv_heads, 16, 128)
        state[f"layers.0.self_attn.{name}.weight"] = w.repeat_interleave(4 // kv_heads, 0).reshape(64, 128)
    reference.load_state_dict(state)
    batch = make_row(tiny_config(), [40, 30], seq_len=80)
    torch.testing.assert_close(
        ttt_logits(gqa, batch, 3, attention), ttt_logits(reference, batch, 3, attention), rtol=1e-5, atol=1e-5
    )


def _logits(model, batch, steps=3):
    from eagle3.model import ttt_logits

    return ttt_logits(model, batch, steps, "exact")


def test_fc_norm_normalises_each_aux_state_before_fc(make_model, make_row, tiny_config):
    """fc_norm (EAGLE 3.1): RMSNorm of each of the three [S, H] aux states, weights fc_norm.{0,1,2}."""
    plain, normed = make_model(tiny_config()), make_model(tiny_config(fc_norm=True))
    assert [n for n, _ in normed.named_parameters() if n.startswith("fc_norm")] == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    scales = torch.tensor([0.5, 2.0, 3.0])
    with torch.no_grad():
        for i, norm in enumerate(normed.fc_norm):
            norm.weight.fill_(float(scales[i]))
    batch = make_row(tiny_config(), [30, 20], seq_len=56)
    by_hand = dict(batch)
    parts = batch["aux_hidden"].chunk(3, dim=-1)
    by_hand["aux_hidden"] = torch.cat(
        [scales[i] * p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) for i, p in enumerate(parts)], -1
    )
    torch.testing.assert_close(_logits(normed, batch), _logits(plain, by_hand), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="norm_before_fc and fc_norm are mutually exclusive"):
        tiny_config(fc_norm=True, norm_before_fc=True).validate()


def test_norm_output_feeds_the_post_norm_hidden_state_to_later_steps(make_model, make_row, tiny_config):
    """norm_output: step 0 is unchanged; step k >= 1 reads norm(h_{k-1}) where the plain drafter reads h_{k-1}."""
    plain, fed_normed = make_model(tiny_config()), make_model(tiny_config(norm_output=True))
    batch = make_row(tiny_config(), [30, 20], seq_len=56)
    a, b = _logits(plain, batch), _logits(fed_normed, batch)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert not torch.allclose(a[1], b[1])
    # by hand: run plain's steps, normalising the carried hidden state between them
    steps = fed_normed.ttt_hidden_states(batch, 2, "exact")
    first, second = next(steps), next(steps)
    with torch.no_grad():
        ref_first = next(plain.ttt_hidden_states(batch, 1, "exact"))
    torch.testing.assert_close(first, ref_first, rtol=0, atol=0)
    assert second.shape == first.shape


def test_norm_before_residual_adds_the_normed_hidden_half(make_model, make_row, tiny_config):
    """norm_before_residual (vLLM llama_eagle3): residual = hidden_norm(hidden) instead of hidden. With a
    zero o_proj and zero down_proj the layer output is its residual, so the difference is visible directly."""
    plain, before = make_model(tiny_config()), make_model(tiny_config(norm_before_residual=True))
    batch = make_row(tiny_config(), [30], seq_len=32)
    with torch.no_grad():
        for m in (plain, before):
            m.layers[0].self_attn.o_proj.weight.zero_()
            m.layers[0].mlp.down_proj.weight.zero_()
        fc_out = plain.fc(batch["aux_hidden"])
        h_plain = next(plain.ttt_hidden_states(batch, 1, "exact"))
        h_before = next(before.ttt_hidden_states(batch, 1, "exact"))
    torch.testing.assert_close(h_plain, fc_out, rtol=0, atol=0)
    torch.testing.assert_close(h_before, before.layers[0].hidden_norm(fc_out), rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"norm_output": True, "fc_norm": True, "num_kv_heads": 2}])
def test_selective_checkpointing_gives_the_loss_and_gradients_of_none_and_full(
    make_model, make_row, tiny_config, options
):
    """activation_checkpointing selective (matmul outputs kept, the rest recomputed) and full give the loss and
    gradients of no checkpointing, in fp64 to a tight tolerance; true means full."""
    from eagle3.model import ttt_forward

    cfg = tiny_config(**options)
    row = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in row.items()}
    results = {}
    for mode in (False, "selective", "full", True):
        model = make_model(cfg, dtype=torch.float64)
        loss, stats = ttt_forward(
            model, batch, ttt_steps=4, activation_checkpointing=mode, loss_chunk_size=40, attention="exact"
        )
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results[mode] = (loss.detach(), stats, grads)
    loss0, stats0, grads0 = results[False]
    assert "fc.weight" in grads0 and "layers.0.mlp.down_proj.weight" in grads0
    for mode in ("selective", "full", True):
        loss, stats, grads = results[mode]
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-12, msg=str(mode))
        for key in stats0:
            torch.testing.assert_close(stats[key], stats0[key], rtol=0, atol=0, msg=key)
        assert grads.keys() == grads0.keys()
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-10, atol=1e-12, msg=f"{mode} {name}")


def test_selective_checkpointing_recomputes_no_matmul(make_model, make_row, tiny_config):
    """Backward under selective checkpointing runs the matmuls of the gradients only: as many aten.mm calls as
    without checkpointing (the kept outputs are not made again), where full checkpointing runs the step's forward
    matmuls again: 6 of its 7 linear layers per TTT step (down_proj's output is read by no backward, and the
    non-reentrant checkpoint stops recomputing once it has what backward needs)."""
    from eagle3.model import ttt_forward
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.mm += 1
            return func(*args, **(kwargs or {}))

    cfg = tiny_config()
    row = make_row(cfg, [50, 30, 20], seq_len=128)
    counts = {}
    for mode in (False, "selective", "full"):
        model = make_model(cfg)
        loss, _ = ttt_forward(model, row, ttt_steps=3, activation_checkpointing=mode, attention="exact")
        with CountMM() as counter:
            loss.backward()
        counts[mode] = counter.mm
    assert counts["selective"] == counts[False]
    assert counts["full"] == counts[False] + 3 * 6


def test_activation_checkpointing_values_are_validated_before_anything_runs():
    from eagle3.config import TrainConfig
    from eagle3.errors import ConfigError
    from eagle3.options import checkpoint_mode, resolve_options

    assert [checkpoint_mode(v) for v in (False, True, "selective", "full")] == [
        "none",
        "full",
        "selective",
        "full",
    ]
    for value in ("full", "selective", True, False):
        assert resolve_options(
            TrainConfig(activation_checkpointing=value), "cpu"
        ).activation_checkpointing == checkpoint_mode(value)
    with pytest.raises(ConfigError, match=r"activation_checkpointing='sometimes' is not one of false, selective, full"):
        resolve_options(TrainConfig(activation_checkpointing="sometimes"), "cpu")


def test_selective_checkpointing_runs_under_bf16_autocast(make_model, make_row, tiny_config):
    """Under autocast (the CUDA default) selective checkpointing recomputes the same ops as its forward (autocast's
    weight-cast cache would otherwise change them) and gives full checkpointing's loss and gradients."""
    from eagle3.model import ttt_forward

    cfg = tiny_config()
    row = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    results = {}
    for mode in ("selective", "full"):
        model = make_model(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = ttt_forward(model, row, ttt_steps=3, activation_checkpointing=mode, attention="exact")
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(results["selective"][0], results["full"][0], rtol=1e-3, atol=1e-3)
    for name, grad in results["full"][1].items():
        torch.testing.assert_close(results["selective"][1][name], grad, rtol=2e-2, atol=2e-3, msg=name)


def test_train_lm_head_is_a_config_key_that_reaches_the_drafter():
    """`train_lm_head: true` (the trainer config) makes the drafter's head trainable; the default keeps it frozen."""
    import types

    from eagle3.config import TrainConfig
    from eagle3.spec import drafter_config

    index = types.SimpleNamespace(
        hidden_size=64, draft_vocab_size=512, target_vocab_size=1024, aux_layer_ids=(2, 4, 5), meta={}
    )
    for value in (False, True):
        shape = drafter_config(TrainConfig(data_dir="-", run_dir="-", train_lm_head=value), index)
        with torch.device("meta"):
            model = Eagle3Drafter(shape)
        assert model.lm_head.weight.requires_grad is value
