"""Trainer configuration: one flat dataclass, loaded from YAML/JSON, overridden on the command line.

The keys are a public contract: the Ansible role `eagle3_train` templates them. Every key can be
overridden as `--max-seq-len 16384` or `--max_seq_len=16384`. Validation happens before any data is
read or any GPU memory is taken, and every message names the key, the value seen and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3.errors import ConfigError

# flex_attention works on 128-token blocks; rows are padded to exactly max_seq_len.
SEQ_BLOCK = 128


@dataclass
class TrainConfig:
    """Every trainer option. Defaults are for a real run; the tests override them with tiny values."""

    data_dir: str = ""
    run_dir: str = ""
    max_seq_len: int = 4096
    ttt_steps: int = 5
    ttt_gamma: float = 1.0
    epochs: int = 1
    max_steps: int = 0  # 0: the epochs decide
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 0.5
    seed: int = 0
    log_every: int = 10
    val_every: int = 500  # 0: validate only at the end
    val_fraction: float = 0.1
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | bf16 | fp32
    activation_checkpointing: bool = False
    fsdp: bool = False
    memory_limit_gb: float = 0.0  # 0: off
    attention: str = "auto"  # auto | flex | exact
    loss_chunk_size: int = 4096
    num_threads: int = 0  # CPU threads per rank; 0: torch's default
    standin_gpu_devices: list[str] = field(default_factory=list)
    record_samples: bool = (
        False  # write the sample ids of every step to samples_rank{r}.jsonl (tests, audits)
    )
    # Drafter shape: hidden size and vocab sizes come from the dataset index; these may be set, 0 = derived.
    hidden_size: int = 0  # when set, must equal the dataset's hidden size
    num_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    norm_before_fc: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "bf16", "fp32"),
    "attention": ("auto", "flex", "exact"),
}


def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def suggest_seq_len(value: int) -> str:
    """Nearest valid lengths for a message.

    >>> suggest_seq_len(24000)
    'try 23936 or 24064'
    >>> suggest_seq_len(100)
    'try 128'
    """
    lower = (value // SEQ_BLOCK) * SEQ_BLOCK
    upper = lower + SEQ_BLOCK
    if lower <= 0:
        return f"try {upper}"
    return f"try {lower} or {upper}"


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
    types = _field_types()
    if key not in types:
        raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(types))}")
    kind = types[key]
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
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.lower() in ("on", "off", "y", "n"):
                return value.lower() in ("on", "y")
            raise TypeError
        if kind is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if not isinstance(value, int):
                raise TypeError
            return value
        if kind is float:
            if isinstance(value, str):
                value = float(value)  # YAML 1.1 reads `3e-4` (no dot) as a string
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError
            return float(value)
        if kind is str:
            if value is None:
                return ""
            if not isinstance(value, str | int | float):
                raise TypeError
            return str(value)
        if kind == list[str]:
            if value is None:
                return []
            if isinstance(value, str):
                return [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TypeError
            return list(value)
    except (TypeError, ValueError):
        pass
    type_name = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        kind, "a list of strings"
    )
    raise ConfigError(f"{key}={raw!r} is not {type_name}; set {key} to {type_name}")


def parse_overrides(argv: list[str]) -> dict[str, object]:
    """Turn `--max-seq-len 16384 --fsdp --lr=3e-4` into {'max_seq_len': '16384', 'fsdp': True, 'lr': '3e-4'}.

    >>> parse_overrides(["--max-seq-len", "16384", "--fsdp", "--lr=3e-4"])
    {'max_seq_len': '16384', 'fsdp': True, 'lr': '3e-4'}
    """
    types = _field_types()
    out: dict[str, object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --max-seq-len 16384")
        name, eq, inline = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key not in types:
            raise ConfigError(
                f"unknown config key {key!r} (from {arg!r}); known keys: {', '.join(sorted(types))}"
            )
        if eq:
            out[key] = inline
            i += 1
        elif types[key] is bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
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
        raise ConfigError(
            f"cannot read config file {str(p)!r}: {e.strerror}; pass an existing YAML/JSON file"
        ) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML/JSON: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a flat mapping of keys, found {type(data).__name__}"
        )
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


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data. Raises ConfigError with the key, the value and the fix."""
    if not cfg.data_dir:
        raise ConfigError(
            "data_dir is empty; set it to a dataset directory made by `eagle3 synth` or `eagle3 import`"
        )
    if not cfg.run_dir:
        raise ConfigError("run_dir is empty; set it to a directory for checkpoints, metrics and status.json")
    if cfg.max_seq_len <= 0 or cfg.max_seq_len % SEQ_BLOCK:
        raise ConfigError(
            f"max_seq_len={cfg.max_seq_len} is not a positive multiple of {SEQ_BLOCK} (flex_attention block size); "
            f"{suggest_seq_len(max(cfg.max_seq_len, 1))}"
        )
    for key, choices in CHOICES.items():
        value = getattr(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
    positive_ints = (
        "ttt_steps",
        "epochs",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "loss_chunk_size",
    )
    for key in positive_ints:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    non_negative = (
        "hidden_size",
        "max_steps",
        "warmup_steps",
        "val_every",
        "num_threads",
        "num_heads",
        "head_dim",
        "intermediate_size",
    )
    for key in non_negative:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be 0 or more")
    if not 0.0 < cfg.ttt_gamma <= 1.0:
        raise ConfigError(
            f"ttt_gamma={cfg.ttt_gamma} must be in (0, 1] (1.0 speculators, 0.8 EAGLE/SpecForge)"
        )
    if cfg.lr <= 0:
        raise ConfigError(f"lr={cfg.lr} must be positive, for example 1e-4")
    if cfg.weight_decay < 0 or cfg.grad_clip < 0 or cfg.memory_limit_gb < 0:
        bad = next(k for k in ("weight_decay", "grad_clip", "memory_limit_gb") if getattr(cfg, k) < 0)
        raise ConfigError(f"{bad}={getattr(cfg, bad)} must be 0 or more")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(
            f"val_fraction={cfg.val_fraction} must be in [0, 1), for example 0.1 (the last 10 %)"
        )
    if cfg.device == "cpu" and cfg.attention == "flex":
        raise ConfigError(
            "attention='flex' needs CUDA (flex_attention has no backward on CPU); use attention: exact"
        )


def dump_config(cfg: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config as `<run_dir>/config.yaml` (atomically) and return its path."""
    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")
