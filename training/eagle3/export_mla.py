"""The export layout of an MLA drafter: the config.json vLLM's EAGLE-3 DeepSeek drafter (deepseek_eagle3,
`Eagle3DeepseekV2ForCausalLM`) reads, a DeepseekV2Config of one decoder layer, and reading it back.

speculators' format has no MLA layer, so an MLA drafter is written the way vLLM's own loader and the published
MLA drafters for Kimi and DeepSeek targets describe it: the target's attention fields (q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_theta, rope_scaling), one hidden layer with a dense SiLU MLP,
`draft_vocab_size`, `target_hidden_size`, the norm options, and the target layers the drafter reads
(`eagle_aux_hidden_state_layer_ids`, also under `eagle_config` where vLLM counts them). The weights keep the
names the Llama-style export uses (`layers.0.self_attn.kv_a_proj_with_mqa.weight`, ...), which vLLM's loader
prefixes with `model.`; `d2t` maps the draft vocabulary, `t2d` is written for the round trip (vLLM skips it).

Reading is strict: a field this drafter cannot honour (more than one layer, biases, another activation, a MoE
layer, the NeoX rotary layout) is refused by name, never silently dropped.
"""

from __future__ import annotations

import torch

from eagle3 import __version__
from eagle3.errors import ConfigError
from eagle3.rope import normalize_rope_scaling
from eagle3.spec import MLA_KEYS, DrafterConfig

# Written: the first. vLLM (0.32) maps both to its one EAGLE-3 DeepSeek class, but rewrites any draft config of
# model_type deepseek_v3 into its MTP model ("Eagle3DeepSeekMTPModel ... not supported"), so the export is a
# deepseek_v2 config (the same attention fields); an older export's V3 name still reads back.
ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
ATTENTION_WEIGHTS = (
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
# What DeepseekV3Config (and save_pretrained) writes that cannot change a one-layer dense drafter's logits: the
# MoE routing of the target's other layers, training and generation settings. Read by name and ignored.
IGNORED = {
    "first_k_dense_replace",
    "moe_intermediate_size",
    "moe_layer_freq",
    "n_group",
    "n_routed_experts",
    "n_shared_experts",
    "norm_topk_prob",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "scoring_func",
    "seq_aux",
    "topk_group",
    "topk_method",
    "aux_loss_alpha",
    "ep_size",
    "num_nextn_predict_layers",
    "initializer_range",
    "attention_dropout",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "pretraining_tp",
    "torchscript",
    "use_bfloat16",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "max_position_embeddings",
    "eagle3_pve",
    "speculative_tokens",
    "verifier",
}
READ = {
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_interleave",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "norm_before_residual",
    "fc_norm",
    "norm_output",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    *MLA_KEYS,
}
# Fields whose value this drafter fixes; another value is refused with the field's name.
FIXED = {
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "rope_interleave": True,
}
EAGLE_CONFIG_FIELDS = {
    "eagle_aux_hidden_state_layer_ids",
    "use_aux_hidden_state",
    "use_input_layernorm_in_first_layer",
    "use_last_layernorm",
    "use_mtp_layernorm",
}


def is_mla_export(config: dict) -> bool:
    return bool(set(config.get("architectures") or ()) & set(ARCHITECTURES))


def attention_names(cfg: DrafterConfig) -> list[str]:
    """The MLA layer's weight names in the export (q_proj in place of q_a/q_b when q_lora_rank is 0)."""
    names = ATTENTION_WEIGHTS if cfg.q_lora_rank else ("q_proj", *ATTENTION_WEIGHTS[3:])
    return [f"layers.0.self_attn.{n}.weight" for n in names]


def check_exportable(cfg: DrafterConfig) -> None:
    """What vLLM's deepseek_eagle3 layer cannot express, refused by name."""
    if cfg.norm_before_fc:
        raise ConfigError(
            "norm_before_fc=true: vLLM's EAGLE-3 DeepSeek drafter has no RMSNorm over the 3H concat; "
            "train with fc_norm (one RMSNorm per aux state) instead"
        )
    if not cfg.rope_interleave:
        raise ConfigError(
            "rope_interleave=false: vLLM's DeepSeek MLA layer rotates adjacent pairs (DeepSeek's layout); "
            "train with rope_interleave: true"
        )


def deepseek_eagle3_config(
    cfg: DrafterConfig,
    *,
    speculative_tokens: int,
    verifier: dict,
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """The config.json dictionary of an MLA drafter (a DeepseekV2Config of one layer, with EAGLE-3's fields)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    return {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "deepseek_v2",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "num_hidden_layers": 1,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.rope_interleave,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "norm_before_residual": cfg.norm_before_residual,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "speculative_tokens": speculative_tokens,
        "verifier": verifier,
        "eagle3_pve": {"version": __version__, "drafter_config": cfg.to_dict()},
    }


def _refuse(config: dict, source: str) -> None:
    unknown = sorted(set(config) - READ - IGNORED)
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {unknown}; this reader knows {sorted(READ | IGNORED)} and refuses what it "
            "cannot honour (docs/drafter-format.md)"
        )
    for key, value in FIXED.items():
        if config.get(key, value) != value:
            raise ConfigError(f"{source}: {key}={config[key]!r}; this drafter implements only {value!r}")
    eagle = config.get("eagle_config") or {}
    if not isinstance(eagle, dict) or set(eagle) - EAGLE_CONFIG_FIELDS:
        raise ConfigError(f"{source}: eagle_config={eagle!r}: only {sorted(EAGLE_CONFIG_FIELDS)} are known")
    if config.get("num_key_value_heads", config.get("num_attention_heads")) != config.get("num_attention_heads"):
        raise ConfigError(f"{source}: num_key_value_heads must equal num_attention_heads in an MLA layer")
    for key in ("norm_before_residual", "fc_norm", "norm_output"):
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{source}: {key}={config[key]!r} must be true or false")


def config_from_deepseek_eagle3(config: dict, source: str) -> DrafterConfig:
    """DrafterConfig of an MLA export; ConfigError naming the field that is missing, unknown or unsupported."""
    _refuse(config, source)
    missing = [
        k
        for k in (
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
            "draft_vocab_size",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "rope_theta",
            "norm_before_residual",
        )
        if config.get(k) is None
    ]
    layers = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if missing or not layers:
        raise ConfigError(f"{source}: {missing or ['eagle_aux_hidden_state_layer_ids']} missing; re-export the drafter")
    if config.get("target_hidden_size") not in (None, config["hidden_size"]):
        raise ConfigError(
            f"{source}: target_hidden_size={config['target_hidden_size']} != hidden_size={config['hidden_size']}"
        )
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    values = dict(
        hidden_size=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
        intermediate_size=config["intermediate_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_vocab_size=config["vocab_size"],
        aux_layer_ids=tuple(layers),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(config["rope_theta"]),
        rope_scaling=normalize_rope_scaling(scaling, f"{source}: rope_scaling"),
        norm_before_residual=config["norm_before_residual"],
        fc_norm=config.get("fc_norm", False),
        norm_output=config.get("norm_output", False),
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope_interleave=config.get("rope_interleave", True),
    )
    try:
        return DrafterConfig.from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
