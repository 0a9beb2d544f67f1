"""Trainer configuration: one flat dataclass, loaded from YAML/JSON, overridden on the command line.

The keys are a public contract: the Ansible role `eagle3_train` templates them. Every key can be
overridden as `--max-seq-len 16384` or `--max_seq_len=16384`. Validation happens before any data is
read or any GPU memory is taken, and every message names the key, the value seen and what to do.

Each key is declared once, below, with its type, default, allowed values or bound (eagle3.bounds) and one line of
meaning.
Coercion, validation, the planner's shared options, and (in eagle3.config_help) `eagle3 train --help` and the key
table in training/README.md are all derived from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3.bounds import (
    AT_LEAST_1,
    CHECKPOINT_MODE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    REQUIRED,
    SEQ_MULTIPLE,
    UNIT_CLOSED,
    UNIT_INTERVAL,
    Bound,
    suggest_seq_len,
)
from eagle3.bounds import (
    SEQ_BLOCK as SEQ_BLOCK,  # the length block, where the role reads it (config.SEQ_BLOCK)
)
from eagle3.errors import ConfigError
from eagle3.files import atomic_write_text
from eagle3.options import PACKINGS, TRACKERS, TTT_STEPS, check_attention, checkpoint_mode
from eagle3.rope import normalize_rope_scaling


def about(
    help: str,
    *,
    choices: tuple[str, ...] = (),
    bound: Bound | None = None,
    fix: str | Callable[[typing.Any], str] = "",
) -> dict:
    """The metadata of one key: one line of meaning, allowed values or a bound, and the fix a message adds."""
    return {"help": help, "choices": choices, "bound": bound, "fix": fix}


def option(default: object, help: str, **kwargs):
    """One config key with an immutable default (see `about` for the rest)."""
    return field(default=default, metadata=about(help, **kwargs))


@dataclass
class TrainConfig:
    """Every trainer option. Defaults are for a real run; the tests override them with tiny values."""

    data_dir: str = option(
        "",
        "dataset directory made by `eagle3 synth` or `eagle3 import`",
        bound=REQUIRED,
        fix="set it to a dataset directory made by `eagle3 synth` or `eagle3 import`",
    )
    run_dir: str = option(
        "",
        "directory for checkpoints, metrics.jsonl and status.json (a restart resumes from it)",
        bound=REQUIRED,
        fix="set it to a directory for checkpoints, metrics and status.json",
    )
    max_seq_len: int = option(
        4096,
        "tokens in each packed row (one row per rank per step)",
        bound=SEQ_MULTIPLE,
        fix=lambda v: suggest_seq_len(max(v, 1)),
    )
    packing: str = option(
        PACKINGS[0],
        "how samples are packed into rows: first_fit puts each into the fullest row of the step with "
        "room, passing over up to 64 that fit nowhere (rows 97-99 per cent full); next_fit closes a row at the first "
        "sample that does not fit (earlier versions' plans: their checkpoints resume on the same plan with it)",
        choices=PACKINGS,
    )
    ttt_steps: int = option(
        TTT_STEPS, "training-time-test steps: tokens drafted ahead and supervised", bound=AT_LEAST_1
    )
    ttt_gamma: float = option(
        1.0,
        "loss weight of TTT step k is ttt_gamma**k",
        bound=UNIT_INTERVAL,
        fix="1.0 as in speculators, 0.8 as in EAGLE/SpecForge",
    )
    lk_weight: float = option(
        0.0,
        "share of the acceptance-aware LK loss, -log sum_v min(p_target, p_draft), in each position's loss: "
        "(1 - lk_weight) x KL + lk_weight x LK; 0: KL only, 1: LK only",
        bound=UNIT_CLOSED,
        fix="0 (KL), 1 (LK) or a mix such as 0.5",
    )
    drop_oov_targets: bool = option(
        False,
        "train only where the target's token (its argmax over the whole vocabulary) is in the draft vocabulary, as "
        "SpecForge does; the dropped positions still count in each step's mean, and in the accuracies",
    )
    epochs: int = option(1, "passes over the training split (when max_steps is 0)", bound=AT_LEAST_1)
    max_steps: int = option(0, "optimizer steps in all; 0: the epochs decide", bound=NON_NEGATIVE)
    lr: float = option(1e-4, "peak AdamW learning rate", bound=POSITIVE, fix="for example 1e-4")
    weight_decay: float = option(0.0, "AdamW weight decay", bound=NON_NEGATIVE)
    adam_beta1: float = option(0.9, "AdamW beta1 (the gradient's running mean)", bound=FRACTION)
    adam_beta2: float = option(0.95, "AdamW beta2 (the squared gradient's running mean)", bound=FRACTION)
    warmup_steps: int = option(100, "linear warmup steps, then cosine decay to 10 % of lr", bound=NON_NEGATIVE)
    grad_clip: float = option(0.5, "clip the gradient norm to this; 0: off", bound=NON_NEGATIVE)
    seed: int = option(0, "seed of the weight init and the per-epoch shuffle")
    log_every: int = option(10, "steps between metrics lines (metrics.jsonl, status.json, console)", bound=AT_LEAST_1)
    val_every: int = option(500, "steps between validations; 0: validate only at the end", bound=NON_NEGATIVE)
    val_fraction: float = option(
        0.1,
        "the last fraction of samples held out for validation",
        bound=FRACTION,
        fix="for example 0.1 (the last 10 %)",
    )
    val_max_batches: int = option(
        0,
        "validation rows per rank at most (the first of the fixed validation plan); 0: all",
        bound=NON_NEGATIVE,
    )
    val_max_new: int = option(
        0,
        "tau_predicted replays only each validation response's first N tokens, as a decoder that writes N tokens "
        "per prompt (evaluate's --max-new); 0: whole responses",
        bound=NON_NEGATIVE,
    )
    checkpoint_every: int = option(
        1000, "steps between checkpoints (one is also written at the end and on a stop)", bound=AT_LEAST_1
    )
    keep_checkpoints: int = option(3, "step checkpoints kept (checkpoints/best is extra)", bound=AT_LEAST_1)
    device: str = option(
        "auto", "where to train; auto: cuda when torch sees a GPU, else cpu", choices=("auto", "cpu", "cuda")
    )
    dtype: str = option(
        "auto", "compute dtype; auto: bf16 autocast on CUDA, fp32 on CPU", choices=("auto", "bf16", "fp32")
    )
    activation_checkpointing: bool | str = option(
        False,
        "recompute in backward, less memory for more compute: selective keeps the decoder step's matmul "
        "outputs and recomputes the cheap work between them (under 1 per cent more FLOPs); full (or true) keeps only "
        "the step's inputs (least memory, about 17 per cent more FLOPs)",
        bound=CHECKPOINT_MODE,
    )
    fsdp: bool = option(
        False, "FSDP2 fully_shard over the drafter (needs torchrun): bf16 params on CUDA, fp32 grad reduction"
    )
    shard_layout: str = option(
        "full",
        "with fsdp: full shards over all ranks; hsdp shards within a node and replicates across nodes "
        "(a 2-D mesh, nodes x ranks per node from torchrun)",
        choices=("full", "hsdp"),
    )
    context_parallel: int = option(
        1,
        "ranks one packed row is split over (Ulysses context parallelism: an all-to-all from sequence shards to "
        "head shards around the attention); must divide the world size and the attention heads; 1: off",
        bound=AT_LEAST_1,
    )
    memory_limit_gb: float = option(
        0.0, "memory per rank in GiB (CUDA: memory fraction, CPU: RLIMIT_AS); 0: off", bound=NON_NEGATIVE
    )
    attention: str = option(
        "auto",
        "TTT attention kernel; auto: flex on CUDA, exact (blockwise) elsewhere",
        choices=("auto", "flex", "exact"),
    )
    loss_chunk_size: int = option(
        4096,
        "positions per chunk of the vocab projection in the loss (bounds its memory); 0, or a row no longer "
        "than the chunk: one pass, the target side made once and shared by the TTT steps (fastest)",
        bound=NON_NEGATIVE,
    )
    num_threads: int = option(0, "CPU threads per rank; 0: torch's default", bound=NON_NEGATIVE)
    prefetch_depth: int = option(
        2,
        "rows the background loader reads ahead of the step; each holds a row of max_seq_len x (4 x hidden "
        "x 2 + 9) bytes (pinned on CUDA; depth + 2 of them): 2 hides one slow read behind two steps",
        bound=AT_LEAST_1,
    )
    standin_gpu_devices: list[str] = field(
        default_factory=list,
        metadata=about("rank r holds entry r % n open, as a CUDA process holds /dev/nvidia* (tests)"),
    )
    record_samples: bool = option(False, "write the sample ids of every step to samples_rank{r}.jsonl (tests, audits)")
    collective_timeout_s: float = option(
        600.0, "torch.distributed timeout of one collective (init_process_group), seconds", bound=POSITIVE
    )
    watchdog_floor_s: float = option(
        300.0,
        "hang watchdog: a step may take max(this, watchdog_factor x median step time) s; 0: off",
        bound=NON_NEGATIVE,
        fix="for example 300",
    )
    watchdog_factor: float = option(
        10.0, "hang watchdog: multiple of the median of the recent step times", bound=AT_LEAST_1
    )
    watchdog_first_step_s: float = option(
        1800.0,
        "hang watchdog: bound for model build + resume + the first step (compile, warm-up), s",
        bound=POSITIVE,
    )
    watchdog_checkpoint_s: float = option(1800.0, "hang watchdog: bound for writing one checkpoint, s", bound=POSITIVE)
    # Drafter shape: hidden size and vocab sizes come from the dataset index; these may be set, 0 = derived.
    hidden_size: int = option(
        0, "0, or the dataset's hidden size (a check: it comes from the dataset)", bound=NON_NEGATIVE
    )
    num_heads: int = option(0, "attention heads; 0: derived from the hidden size", bound=NON_NEGATIVE)
    head_dim: int = option(0, "dimension per head; 0: derived", bound=NON_NEGATIVE)
    intermediate_size: int = option(0, "MLP width; 0: derived from the hidden size", bound=NON_NEGATIVE)
    norm_before_fc: bool = option(False, "RMS-normalize the three aux hidden states before the fc projection")
    num_kv_heads: int = option(
        0,
        "key/value heads (grouped-query attention, a divisor of num_heads); 0: num_heads",
        bound=NON_NEGATIVE,
    )
    fc_norm: bool = option(False, "one RMSNorm per aux hidden state before fc (EAGLE 3.1; not with norm_before_fc)")
    norm_output: bool = option(False, "each TTT step after the first reads the post-norm hidden state (EAGLE 3.1)")
    norm_before_residual: bool = option(
        False, "the decoder layer's residual is the normed hidden half (vLLM assumes true when absent)"
    )
    train_lm_head: bool = option(
        False,
        "train the drafter's LM head (its rows start as the target's); false keeps them frozen (SpecForge trains it)",
    )
    # Multi-head latent attention (DeepSeek-V3's, for Kimi/DeepSeek targets): kv_lora_rank > 0 selects it.
    kv_lora_rank: int = option(0, "MLA latent width; 0: Llama-style q/k/v attention", bound=NON_NEGATIVE)
    q_lora_rank: int = option(0, "MLA low-rank query width; 0: queries projected directly", bound=NON_NEGATIVE)
    qk_nope_head_dim: int = option(0, "MLA query/key dimensions per head without rope", bound=NON_NEGATIVE)
    qk_rope_head_dim: int = option(0, "MLA query/key dimensions per head that rope turns", bound=NON_NEGATIVE)
    v_head_dim: int = option(0, "MLA value dimensions per head", bound=NON_NEGATIVE)
    rope_interleave: bool = option(True, "MLA: the rotary pairs are adjacent dimensions (DeepSeek's weights)")
    # The verifier's rotary embedding and norm epsilon (a drafter is served with the verifier's positions).
    rope_theta: float = option(
        0.0,
        "rotary base; 0: the dataset's target config (`eagle3 generate` records it), else 10000",
        bound=NON_NEGATIVE,
    )
    rope_scaling: dict = field(
        default_factory=dict,
        metadata=about(
            "rotary scaling as a Hugging Face config writes it ({rope_type: yarn|llama3|linear, factor: ...}); "
            "{}: the dataset's target config, else none; {rope_type: default}: none"
        ),
    )
    rms_norm_eps: float = option(0.0, "RMSNorm epsilon; 0: the dataset's target config, else 1e-6", bound=NON_NEGATIVE)
    init_from: str = option(
        "", "a speculators-format drafter directory (an export) to start from; empty: random initialisation"
    )
    # Observability (eagle3.observe; docs/observability.md)
    telemetry_every_s: float = option(
        10.0,
        "seconds between GPU samples (power, utilisation, SM clock, memory) in telemetry.jsonl; 0: off",
        bound=NON_NEGATIVE,
    )
    progress_every_s: float = option(
        60.0,
        "seconds between progress lines with the ETA in the log (the first at step 1); 0: off",
        bound=NON_NEGATIVE,
    )
    prometheus_textfile_dir: str = option(
        "", "directory of eagle3_train.prom (node_exporter's textfile collector directory); empty: run_dir"
    )
    tensorboard: bool = option(
        True, "TensorBoard event files in run_dir/tensorboard when the tensorboard package is installed"
    )
    tracker: str = option(
        "none",
        "an experiment tracker beside TensorBoard, through its own library: mlflow, or wandb (offline, "
        "uploaded later with wandb sync); its package must be installed",
        choices=TRACKERS,
    )
    tracker_project: str = option("eagle3", "the tracker's MLflow experiment or W&B project", bound=REQUIRED)
    mlflow_tracking_uri: str = option("", "MLflow's tracking URI; empty: a file store in run_dir/mlruns")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KeySpec:
    """The declaration of one key, as coercion, validation, --help and the README read it."""

    name: str
    kind: object  # int, float, bool, str, list[str] or dict
    default: object
    help: str
    choices: tuple[str, ...]
    bound: Bound | None
    fix: str | Callable[[typing.Any], str]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.kind, "list")

    @property
    def allowed(self) -> str:
        """Allowed values or the bound, for --help and the README ('' when any value of the type goes)."""
        if self.choices:
            return ", ".join(self.choices)
        return self.bound.label if self.bound else ""

    def fix_for(self, value: object) -> str:
        return self.fix(value) if callable(self.fix) else self.fix


TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", bool | str: "bool|str", dict: "mapping"}


def _specs() -> dict[str, KeySpec]:
    hints = typing.get_type_hints(TrainConfig)
    specs = {}
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        md = f.metadata
        specs[f.name] = KeySpec(f.name, hints[f.name], default, md["help"], md["choices"], md["bound"], md["fix"])
    return specs


SPECS: dict[str, KeySpec] = _specs()
CHOICES: dict[str, tuple[str, ...]] = {name: s.choices for name, s in SPECS.items() if s.choices}


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a key (the planner's argparse shares them).

    >>> choices("dtype")
    ('auto', 'bf16', 'fp32')
    """
    return SPECS[key].choices


def format_default(value: object) -> str:
    """
    >>> format_default(""), format_default([]), format_default(False), format_default(1e-4)
    ('""', '[]', 'false', '0.0001')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    return str(value)


def _unknown_key(key: str, origin: str = "") -> ConfigError:
    return ConfigError(
        f"unknown config key {key!r}{origin}; known keys: {', '.join(sorted(SPECS))} "
        "(`eagle3 train --help` describes each)"
    )


def _to_mode(value):
    """activation_checkpointing: false / true as they are, or a mode's name (ConfigError naming the allowed)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        mode = checkpoint_mode(value)
        return {"none": False}.get(mode, True if value.strip().lower() in ("true", "on", "yes") else mode)
    raise TypeError


def _to_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("on", "off", "y", "n"):
        return value.lower() in ("on", "y")
    raise TypeError


def _to_int(value):
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int):
        raise TypeError
    return value


def _to_float(value):
    if isinstance(value, str):
        value = float(value)  # YAML 1.1 reads `3e-4` (no dot) as a string
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError
    return float(value)


def _to_str(value):
    if value is None:
        return ""
    if not isinstance(value, str | int | float):
        raise TypeError
    return str(value)


def _to_dict(value):
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError
    return dict(value)


def _to_list(value):
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError
    return list(value)


# A key's declared type -> its conversion from what YAML or the command line gave (TypeError: not that type).
_CONVERT = {
    bool | str: _to_mode,
    bool: _to_bool,
    int: _to_int,
    float: _to_float,
    str: _to_str,
    dict: _to_dict,
    list[str]: _to_list,
}


def coerce_value(key: str, value: object) -> object:
    """Convert a YAML/CLI value to the type of `key`, or raise ConfigError naming the key.

    >>> coerce_value("max_seq_len", "16384")
    16384
    >>> coerce_value("fsdp", "yes")
    True
    >>> coerce_value("lr", "3e-4")
    0.0003
    >>> coerce_value("standin_gpu_devices", "/dev/nvidia0,/dev/nvidia1")
    ['/dev/nvidia0', '/dev/nvidia1']
    """
    if key not in SPECS:
        raise _unknown_key(key)
    kind = SPECS[key].kind
    raw = value
    if isinstance(value, str) and kind is not str:
        # CLI values arrive as strings; YAML gives `true`, `1e-4`, `[a, b]` their natural types.
        if kind == list[str]:
            text = value.strip()
            if text.startswith("["):
                value = yaml.safe_load(text)
            else:
                value = [p for p in (s.strip() for s in text.split(",")) if p]
        else:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
    try:
        return _CONVERT[kind](value)
    except (TypeError, ValueError):
        pass
    type_name = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        bool | str: "false, selective or full",
        dict: "a mapping",
    }.get(kind, "a list of strings")
    raise ConfigError(f"{key}={raw!r} is not {type_name}; set {key} to {type_name}")


def parse_overrides(argv: list[str]) -> dict[str, object]:
    """Turn `--max-seq-len 16384 --fsdp --lr=3e-4` into {'max_seq_len': '16384', 'fsdp': True, 'lr': '3e-4'}.

    >>> parse_overrides(["--max-seq-len", "16384", "--fsdp", "--lr=3e-4"])
    {'max_seq_len': '16384', 'fsdp': True, 'lr': '3e-4'}
    """
    out: dict[str, object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --max-seq-len 16384")
        name, eq, inline = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key not in SPECS:
            raise _unknown_key(key, f" (from {arg!r})")
        if eq:
            out[key] = inline
            i += 1
        elif SPECS[key].kind in (bool, bool | str) and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            out[key] = True  # a bare flag: --fsdp
            i += 1
        elif i + 1 < len(argv):
            out[key] = argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"option {arg} needs a value, for example {arg} <value>")
    return out


def load_config_file(path: str | os.PathLike) -> dict[str, object]:
    """Read a flat YAML or JSON mapping (JSON is valid YAML)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror}; pass an existing YAML/JSON file") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML/JSON: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a flat mapping of keys, found {type(data).__name__}")
    return data


def build_config(file_values: dict[str, object], overrides: dict[str, object]) -> TrainConfig:
    """File values, then command-line overrides, each coerced and the whole validated."""
    merged = {**file_values, **overrides}
    values = {key: coerce_value(key, value) for key, value in merged.items()}
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def load_config(config_path: str | None, argv: list[str]) -> TrainConfig:
    file_values = load_config_file(config_path) if config_path else {}
    return build_config(file_values, parse_overrides(argv))


def check_key(key: str, value: object) -> None:
    """One key's value against its declared choices and bound (also for code that takes the value as an argument,
    such as eagle3.model.ttt_forward's ttt_steps). Raises ConfigError with the key, the value and the fix.

    >>> check_key("ttt_steps", 0)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: ttt_steps=0 must be at least 1
    """
    spec = SPECS[key]
    if spec.choices and value not in spec.choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(spec.choices)}")
    if spec.bound is not None and not spec.bound.holds(value):
        message = f"{key} {spec.bound.says}" if spec.bound is REQUIRED else f"{key}={value!r} {spec.bound.says}"
        fix = spec.fix_for(value)
        raise ConfigError(f"{message}; {fix}" if fix else message)


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data, from the declaration. Raises ConfigError with the key, the value and the fix."""
    for spec in SPECS.values():
        check_key(spec.name, getattr(cfg, spec.name))
    check_attention(cfg.attention, cfg.device)  # device: cpu written out; auto is checked once resolved
    if cfg.rope_scaling:
        normalize_rope_scaling(cfg.rope_scaling, "rope_scaling")


def dump_config(cfg: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config as `<run_dir>/config.yaml` (atomically) and return its path."""
    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path
