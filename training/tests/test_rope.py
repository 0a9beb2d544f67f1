"""The drafter's rotary embedding equals transformers' for the same config: every supported rope_type, at positions
past the original context, and the scaling is refused by name where it cannot be honoured."""

import pytest
import torch
from eagle3.errors import ConfigError
from eagle3.rope import inv_freq_and_scale, normalize_rope_scaling, rope_cos_sin
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

HEAD_DIM = 64
# (theta, scaling) as verifiers' configs write them: Llama 3.1 (llama3), Qwen/Llama long context (yarn),
# DeepSeek-V3 / Kimi-K2 (yarn with mscale), position interpolation (linear).
CASES = {
    "default": (10000.0, None),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "yarn": (1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-deepseek": (
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "yarn-mscale": (
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    "yarn-untruncated": (
        10000.0,
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False},
    ),
}


def hf_config(theta, scaling, max_positions=131072):
    params = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        rope_parameters=params,
    )


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_equal_transformers(case):
    theta, scaling = CASES[case]
    config = hf_config(theta, scaling)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":  # transformers computes it in the embedding class, not in ROPE_INIT_FUNCTIONS
        embedding = LlamaRotaryEmbedding(config)
        theirs, their_scale = embedding.inv_freq, embedding.attention_scaling
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    ours, our_scale = inv_freq_and_scale(HEAD_DIM, theta, scaling)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale, rel=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_cos_and_sin_equal_llama_rotary_embedding_past_the_original_context(case):
    theta, scaling = CASES[case]
    config = hf_config(theta, scaling)
    positions = torch.tensor([0, 1, 4095, 8191, 40000, 131071])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, len(positions), 1), positions[None])
    ours = rope_cos_sin(positions, HEAD_DIM, theta, scaling)
    # The frequencies agree to 1e-6 (above); at position 131071 an fp32 angle of ~1e5 rad moves by ~1e-3 for a
    # last-bit difference in a frequency, which is the tolerance here. Layout and attention factor are exact.
    torch.testing.assert_close(ours[0], cos[0].float(), rtol=0, atol=1e-3)
    torch.testing.assert_close(ours[1], sin[0].float(), rtol=0, atol=1e-3)
    torch.testing.assert_close(ours[0][:2], cos[0][:2].float(), rtol=0, atol=1e-6)  # small angles: exact


@pytest.mark.parametrize(
    ("scaling", "words"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic NTK"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "not supported"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs original_max_position_embeddings"),
        ({"rope_type": "linear", "factor": -1.0}, "must be positive"),
        ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "not understood"),
        ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, "disagree"),
        ({"factor": 2.0}, "no rope_type"),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "truncate": "no"},
            "true or false",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("yarn", "not a mapping"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(scaling, words):
    with pytest.raises(ConfigError, match=words):
        normalize_rope_scaling(scaling)


def test_transformers_4_spelling_and_an_inline_theta_read_the_same():
    assert normalize_rope_scaling({"type": "linear", "factor": 2, "rope_theta": 5e5}) == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 5e5}) is None
