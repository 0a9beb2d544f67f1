"""Export to the speculators format that vLLM serves for EAGLE-3, and load it back.

    OUT_DIR/config.json          speculators_model_type "eagle3", speculators_config (algorithm, greedy
                                 proposal with speculative_tokens, verifier), transformer_layer_config
                                 (a one-layer Llama config), draft_vocab_size, norm_before_residual, ...;
                                 eagle3_pve (ours): version, drafter config, model.safetensors' size and
                                 sha256, verified before init_from or evaluate loads the export
    OUT_DIR/model.safetensors    fc, layers.0.*, norm, lm_head, d2t, t2d (+ embed_tokens, input_norm, fc_norm.{0,1,2})

vLLM reads `speculators_model_type`, `transformer_layer_config`, `draft_vocab_size`,
`norm_before_residual` (vLLM defaults it to True when absent, speculators to False, so it is always
written), `norm_before_fc`, `fc_norm`, `norm_output` (EAGLE 3.1, default False), `target_hidden_size`
and `eagle_aux_hidden_state_layer_ids`;
it loads `d2t` as the draft-to-target offsets and ignores `t2d`. Without `embed_tokens` in the file
vLLM shares the target's embedding (the drafter's is a frozen copy anyway).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3 import __version__
from eagle3.checkpoint import file_digest
from eagle3.errors import ConfigError, DataError
from eagle3.export_mla import (
    attention_names,
    check_exportable,
    config_from_deepseek_eagle3,
    deepseek_eagle3_config,
    is_mla_export,
)
from eagle3.model import Eagle3Drafter
from eagle3.options import TTT_STEPS
from eagle3.rope import normalize_rope_scaling
from eagle3.spec import DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def exported_names(cfg: DrafterConfig, include_embed_tokens: bool) -> list[str]:
    """Tensor names in model.safetensors, speculators spelling. The teacher (the target's frozen final norm and
    head rows, kept in the drafter for the loss) is never exported.

    >>> from eagle3.spec import DrafterConfig
    >>> names = exported_names(DrafterConfig(64, 4, 16, 128, 512, 1024, (1, 2, 3)), False)
    >>> names[:3], names[-4:]
    (['fc.weight', 'layers.0.self_attn.q_proj.weight', 'layers.0.self_attn.k_proj.weight'], ['norm.weight', 'lm_head.weight', 'd2t', 't2d'])
    """
    layer = "layers.0."
    names = ["fc.weight"]
    if cfg.mla is not None:
        names += attention_names(cfg)
    else:
        names += [f"{layer}self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
    names += [f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names += [f"{layer}{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    if cfg.norm_before_fc:
        names.append("input_norm.weight")
    if cfg.fc_norm:
        names += [f"fc_norm.{i}.weight" for i in range(3)]
    if include_embed_tokens:
        names.append("embed_tokens.weight")
    return [*names, "norm.weight", "lm_head.weight", "d2t", "t2d"]


def speculators_config(
    cfg: DrafterConfig,
    *,
    speculative_tokens: int,
    verifier_name_or_path: str | None,
    verifier_architectures: list[str],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """The config.json dictionary (speculators Eagle3SpeculatorConfig fields)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            # transformers 5 and 4 spell the rotary settings differently; both are written, and agree.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": cfg.rope_theta,
                **(cfg.rope_scaling or {}),
            },
            "rope_theta": cfg.rope_theta,
            **({"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}),
            "max_position_embeddings": max_position_embeddings,
            "vocab_size": cfg.target_vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": dtype_name,
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": dtype_name,
        "eagle3_pve": {"version": __version__, "drafter_config": cfg.to_dict()},
    }


def export_speculators(
    model_or_state: Eagle3Drafter | dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    cfg: DrafterConfig | None = None,
    speculative_tokens: int = TTT_STEPS,
    verifier_name_or_path: str | None = None,
    verifier_architectures: list[str] | tuple[str, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
    include_embed_tokens: bool = True,
    max_position_embeddings: int = 131072,
) -> Path:
    """Write config.json + model.safetensors into out_dir (created; existing files replaced). Returns out_dir.

    model_or_state: a drafter, or its state_dict together with `cfg`. Trainer checkpoints hold only
    the trainable weights; a frozen lm_head comes from the dataset's target, so build the drafter with
    load_target_weights, load the checkpoint into it, and pass the drafter.
    """
    if isinstance(model_or_state, Eagle3Drafter):
        cfg = model_or_state.cfg
        state = model_or_state.state_dict()
    else:
        if cfg is None:
            raise ConfigError("export_speculators got a state_dict without cfg; pass cfg=DrafterConfig(...)")
        state = dict(model_or_state)
    cfg.validate()
    if cfg.mla is not None:
        check_exportable(cfg)
    if not verifier_name_or_path or not verifier_architectures:
        raise ConfigError(
            f"export needs the verifier: verifier_name_or_path={verifier_name_or_path!r}, "
            f"verifier_architectures={list(verifier_architectures)!r}; both go into speculators_config.verifier "
            "(for example 'meta-llama/Llama-3.1-8B-Instruct' and ['LlamaForCausalLM'])"
        )
    if speculative_tokens < 1:
        raise ConfigError(f"speculative_tokens={speculative_tokens} must be at least 1 (usually the ttt_steps trained)")
    include_embed_tokens = include_embed_tokens and "embed_tokens.weight" in state
    names = exported_names(cfg, include_embed_tokens)
    missing = [n for n in names if n not in state]
    if missing:
        raise DataError(
            f"cannot export: the weights lack {missing}. Trainer checkpoints keep only trainable weights; "
            "build Eagle3Drafter(cfg), call load_target_weights with the dataset's target, load the checkpoint, "
            "and export the drafter"
        )
    if torch.isnan(state["lm_head.weight"].float()).any():
        raise DataError("lm_head.weight holds NaN; the drafter diverged or its target weights were never loaded")
    tensors = {}
    for name in names:
        t = state[name].detach().cpu()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.mla is None:
        config = speculators_config(
            cfg,
            speculative_tokens=speculative_tokens,
            verifier_name_or_path=verifier_name_or_path,
            verifier_architectures=list(verifier_architectures),
            max_position_embeddings=max_position_embeddings,
            dtype=dtype,
        )
    else:  # vLLM's EAGLE-3 DeepSeek layout (eagle3.export_mla): speculators' format has no MLA layer
        verifier = {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)}
        config = deepseek_eagle3_config(
            cfg,
            speculative_tokens=speculative_tokens,
            verifier=verifier,
            max_position_embeddings=max_position_embeddings,
            dtype=dtype,
        )
    # Write to temporary names, then rename: a crash never leaves a half-written export behind.
    tmp_weights, tmp_config = out / f".{WEIGHTS_FILE}.tmp", out / f".{CONFIG_FILE}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    # The weights' size and sha256 in config.json: whoever loads the export (init_from, evaluate) verifies them,
    # as training's resume verifies a checkpoint against its manifest.
    size, digest = file_digest(tmp_weights)
    config["eagle3_pve"]["files"] = {WEIGHTS_FILE: {"size": size, "sha256": digest}}
    tmp_config.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp_weights, out / WEIGHTS_FILE)
    os.replace(tmp_config, out / CONFIG_FILE)
    return out


# Every field speculators' Eagle3SpeculatorConfig and HF's PretrainedConfig write at the top level. A field
# outside these sets is refused by name: this reader would otherwise build a drafter the writer did not mean.
TOP_LEVEL_FIELDS = {
    "architectures",
    "speculators_model_type",
    "speculators_config",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
    "enable_sp_ulysses",
    "eagle_aux_hidden_state_layer_ids",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "speculators_version",
    "eagle3_pve",
}
# What transformers' save_pretrained adds (PretrainedConfig's own attributes, and auto_map for a config class kept
# beside the weights): read by name and ignored, because none of them changes the drafter's logits.
TOP_LEVEL_IGNORED = {
    "auto_map",
    "_name_or_path",
    "model_type",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
}
# transformer_layer_config (an HF LlamaConfig, `to_diff_dict` or full): the fields read below, and the ones
# that only matter for training or generation and cannot change the drafter's logits.
LAYER_FIELDS = {
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
}
# Fields whose value this drafter fixes: anything else is refused with the field's name.
LAYER_FIXED = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
}
SPECULATORS_CONFIG_FIELDS = {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}


def _refuse_unknown(fields, known, where: str, source: str) -> None:
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {unknown} in {where}; this reader knows {sorted(known)} "
            "and refuses what it cannot honour (docs/drafter-format.md)"
        )


def _rope(layer: dict, source: str) -> tuple[float, dict | None]:
    """rope_theta and the rotary scaling of transformer_layer_config: transformers 4 writes `rope_theta` and
    `rope_scaling`, transformers 5 `rope_parameters` (theta and scaling in one mapping); where both are present
    they must agree. The scaling is what eagle3.rope honours (linear, llama3, yarn); anything else is refused."""
    thetas, scalings = {}, {}
    if layer.get("rope_theta") is not None:
        thetas["transformer_layer_config.rope_theta"] = float(layer["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        value = layer.get(key)
        if value is None:
            continue
        where = f"{source}: transformer_layer_config.{key}"
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} is not a mapping")
        if value.get("rope_theta") is not None:
            thetas[f"transformer_layer_config.{key}.rope_theta"] = float(value["rope_theta"])
        scalings[f"transformer_layer_config.{key}"] = normalize_rope_scaling(value, where)
    if not thetas:
        raise ConfigError(
            f"{source}: no rope_theta: set transformer_layer_config.rope_theta or "
            "transformer_layer_config.rope_parameters.rope_theta"
        )
    if len(set(thetas.values())) > 1:
        raise ConfigError(f"{source}: rope_theta disagrees between {thetas}")
    distinct = {json.dumps(v, sort_keys=True) for v in scalings.values()}
    if len(distinct) > 1:
        raise ConfigError(f"{source}: the rotary scaling disagrees between {scalings}")
    return next(iter(thetas.values())), next(iter(scalings.values()), None)


def _transformer_layer(config: dict, source: str) -> dict:
    """The config's transformer_layer_config, once the top level, that layer and speculators_config hold only
    fields this drafter knows, with the values it implements; ConfigError naming the first that does not."""
    if config.get("speculators_model_type") != "eagle3":
        raise ConfigError(
            f"{source}: speculators_model_type={config.get('speculators_model_type')!r}, expected 'eagle3'"
        )
    _refuse_unknown(config, TOP_LEVEL_FIELDS | TOP_LEVEL_IGNORED, "the top level", source)
    for key in ("tie_word_embeddings",):
        if config.get(key, False) is not False:
            raise ConfigError(
                f"{source}: {key}={config[key]!r}; an EAGLE-3 drafter's lm_head (draft vocabulary) is its own"
            )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: transformer_layer_config is missing or not a mapping")
    _refuse_unknown(layer, LAYER_FIELDS, "transformer_layer_config", source)
    for key, value in LAYER_FIXED.items():
        if key in layer and layer[key] != value:
            raise ConfigError(
                f"{source}: transformer_layer_config.{key}={layer[key]!r}; this drafter implements only {value!r}"
            )
    spec = config.get("speculators_config")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ConfigError(f"{source}: speculators_config={spec!r} is not a mapping")
        _refuse_unknown(spec, SPECULATORS_CONFIG_FIELDS, "speculators_config", source)
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise ConfigError(f"{source}: speculators_config.algorithm={spec['algorithm']!r}, expected 'eagle3'")
    return layer


def config_from_export(config: dict, source: str = CONFIG_FILE) -> DrafterConfig:
    """DrafterConfig from a speculators eagle3 config.json dictionary.

    Strict: an unknown field, a value this drafter cannot run, or a missing field that changes the drafter
    (eagle_aux_hidden_state_layer_ids, norm_before_residual, rope_theta, ...) raises ConfigError naming it.
    """
    layer = _transformer_layer(config, source)
    if "norm_before_residual" not in config:
        raise ConfigError(
            f"{source}: norm_before_residual=absent; vLLM then assumes true, speculators false: "
            "write it explicitly (true or false) so every reader builds the same drafter"
        )
    if config.get("eagle_aux_hidden_state_layer_ids") is None:
        raise ConfigError(
            f"{source}: eagle_aux_hidden_state_layer_ids is missing; without it vLLM picks the verifier layers "
            "itself, which need not be the ones the drafter was trained on: write the 3 layer ids "
            "(the dataset's aux_layer_ids)"
        )
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{source}: {key}={config[key]!r} must be true or false")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps"):
        if layer.get(key) is None:
            raise ConfigError(f"{source}: transformer_layer_config.{key} is missing; re-export the drafter")
    if "draft_vocab_size" not in config:
        raise ConfigError(f"{source}: draft_vocab_size is missing; re-export the drafter")
    hidden = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    if config.get("target_hidden_size") not in (None, hidden):
        raise ConfigError(
            f"{source}: target_hidden_size={config['target_hidden_size']} != transformer_layer_config.hidden_size="
            f"{hidden}; this drafter's fc maps 3 x hidden_size (the verifier's) to hidden_size"
        )
    rope_theta, rope_scaling = _rope(layer, source)
    values = dict(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=layer.get("head_dim") or hidden // heads,
        intermediate_size=layer["intermediate_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_vocab_size=layer["vocab_size"],
        aux_layer_ids=tuple(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_before_fc=config.get("norm_before_fc", False),
        fc_norm=config.get("fc_norm", False),
        norm_output=config.get("norm_output", False),
        norm_before_residual=config["norm_before_residual"],
        # HF LlamaConfig: an absent or null num_key_value_heads means num_attention_heads (multi-head)
        num_kv_heads=layer.get("num_key_value_heads") or heads,
    )
    try:
        return DrafterConfig.from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def verify_export(directory: Path, config: dict) -> str | None:
    """Why the export's weights do not match the size and sha256 its config.json records (`eagle3_pve.files`,
    written by export_speculators), or None. An export without that record (speculators' own, or one written before
    the record existed) has nothing to be checked against: None.

    >>> verify_export(Path("/nonexistent"), {"eagle3_pve": {"version": "0.1"}}) is None
    True
    >>> verify_export(Path("/nonexistent"), {"eagle3_pve": {"files": {"model.safetensors": {"size": 8}}}})
    'model.safetensors is missing'
    """
    record = config.get("eagle3_pve")
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict):
        return None
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if not isinstance(want, dict) or size != want.get("size"):
            expected = want.get("size") if isinstance(want, dict) else None
            return f"{name} has {size} bytes, config.json records {expected} (truncated or overwritten)"
        if file_digest(path)[1] != want.get("sha256"):
            return f"{name} does not match the sha256 config.json records (changed after it was exported)"
    return None


def read_export_config(
    directory: Path, *, missing: str, prefix: str = "", bad_json: str = ""
) -> tuple[DrafterConfig, Path]:
    """The drafter config of an export directory and the path of its weights; ConfigError when either file is
    missing (`missing` says what to do), the config is not JSON, or the weights do not match the size and sha256
    the config records (verify_export). Messages start with `prefix`."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ConfigError(f"{prefix}{path} does not exist; {missing}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{prefix}{config_path} is not valid JSON ({e}){bad_json}") from e
    damage = verify_export(directory, config)
    if damage is not None:
        raise ConfigError(
            f"{prefix}the export {directory} is damaged ({damage}); it is not loaded: export it again "
            "(python -m eagle3 export RUN_DIR OUT_DIR) or name another export"
        )
    if is_mla_export(config):
        return config_from_deepseek_eagle3(config, str(config_path)), weights_path
    return config_from_export(config, str(config_path)), weights_path


def load_exported(out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """Load an export as an Eagle3Drafter (for checks and evaluation; the teacher weights are not in it)."""
    out = Path(out_dir)
    cfg, weights_path = read_export_config(
        out,
        missing=f"export with `python -m eagle3 export RUN_DIR {out}` first",
        bad_json="; re-export the drafter",
    )
    model = Eagle3Drafter(cfg)
    weights = load_file(str(weights_path))
    expected = exported_names(cfg, "embed_tokens.weight" in weights)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DataError(f"{weights_path}: missing {missing}, unexpected {unexpected}; re-export the drafter")
    model.load_state_dict(weights, strict=False)
    # The teacher is not exported: NaN makes any accidental use of it visible in the loss.
    model.verifier_lm_head.weight.data.fill_(float("nan"))
    model.verifier_norm.weight.data.fill_(float("nan"))
    return model.to(dtype)


# The drafter config fields an init_from export must share with the run (train_lm_head is the run's choice).
_INIT_KEYS = tuple(k for k in DrafterConfig.__dataclass_fields__ if k != "train_lm_head")


@torch.no_grad()
def init_from_export(model: Eagle3Drafter, src_dir: str | os.PathLike) -> list[str]:
    """Copy a speculators-format drafter's weights into `model` (built and given its target weights): the run
    starts from it, with the export's logits before the first step. Returns the names copied.

    The export must describe the same drafter as the run's config (every DrafterConfig field except
    train_lm_head) and the same vocab mapping (d2t, t2d) as the run's dataset; ConfigError / DataError name what
    differs. The embedding stays the dataset target's (frozen); lm_head is the export's.
    """
    src = Path(src_dir)
    cfg, weights_path = read_export_config(
        src, prefix="init_from: ", missing="point init_from at an `eagle3 export` directory"
    )
    theirs = cfg.to_dict()
    ours = model.cfg.to_dict()
    differ = {k: (theirs[k], ours[k]) for k in _INIT_KEYS if theirs[k] != ours[k]}
    if differ:
        raise ConfigError(
            f"init_from {src}: the export is another drafter: "
            + ", ".join(f"{k}={a!r} there, {b!r} in this run" for k, (a, b) in differ.items())
        )
    weights = load_file(str(weights_path))
    expected = exported_names(model.cfg, "embed_tokens.weight" in weights)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DataError(f"init_from {weights_path}: missing {missing}, unexpected {unexpected}")
    for name in ("d2t", "t2d"):
        if not torch.equal(weights[name].cpu(), getattr(model, name).cpu()):
            raise DataError(
                f"init_from {weights_path}: {name} differs from this run's dataset vocab mapping; "
                "the export was trained with another draft vocabulary"
            )
    state = model.state_dict()
    copied = [n for n in expected if n not in ("d2t", "t2d", "embed_tokens.weight")]
    for name in copied:
        target = state[name]
        if list(weights[name].shape) != list(target.shape):
            raise DataError(
                f"init_from {weights_path}: {name} has shape {list(weights[name].shape)}, expected {list(target.shape)}"
            )
        target.copy_(weights[name].to(device=target.device, dtype=target.dtype))
    return copied
