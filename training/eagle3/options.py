"""Run options, resolved once: the user's config plus the device -> what a run actually does.

The config may say `auto`; what that means on a device, and which combinations cannot run, is decided here and
nowhere else. The trainer (eagle3.train), the memory planner (eagle3.plan) and the benches (bench/) all call
`resolve_options`, so the run the planner sizes is the run the trainer makes.

    device     auto -> cuda when torch sees a GPU, else cpu
    dtype      auto -> bf16 autocast on CUDA, none (fp32) on CPU; bf16 / fp32 as written
    frozen     the embedding and the target heads run in bf16 on CUDA under autocast (stored in bf16, or as
               FSDP's bf16 parameters when sharded)
    attention  auto -> flex on CUDA, exact (blockwise) on CPU; flex on CPU is refused (no backward there)
    sharding   fsdp shards over the ranks; with one rank it shards nothing and the run is unsharded (a note)

No torch at import time: the planner must start where torch is missing or slow to import.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import ConfigError

DEVICES = ("cuda", "cpu")


def device_type(requested: str) -> str:
    """'cuda' or 'cpu' for a config's device; auto is cuda when torch sees a GPU.

    >>> device_type("cpu"), device_type("cuda")
    ('cpu', 'cuda')
    """
    if requested in DEVICES:
        return requested
    if requested != "auto":
        raise ConfigError(f"device={requested!r} is not one of auto, cpu, cuda")
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def attention_for(attention: str, device: str) -> str:
    """The attention kernel on a device type: auto is flex on CUDA and exact elsewhere.

    >>> attention_for("auto", "cuda"), attention_for("auto", "cpu"), attention_for("exact", "cuda")
    ('flex', 'exact', 'exact')
    """
    if attention != "auto":
        return attention
    return "flex" if device == "cuda" else "exact"


def check_attention(attention: str, device: str) -> None:
    """Refuse flex attention on a CPU device (given in the config, or what auto resolved to).

    >>> check_attention("flex", "cpu")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: attention='flex' needs CUDA (flex_attention has no backward on CPU); use exact or auto
    """
    if attention == "flex" and device == "cpu":
        raise ConfigError(
            "attention='flex' needs CUDA (flex_attention has no backward on CPU); use exact or auto"
        )


@dataclass(frozen=True)
class RunOptions:
    """How a run computes, every `auto` resolved for one device and world size."""

    device: str  # cuda | cpu
    world_size: int
    autocast: bool  # bf16 autocast around forward and loss
    frozen_bf16: bool  # embedding and target heads are bf16 in the forward (see the module docstring)
    attention: str  # flex | exact
    fsdp: bool  # as the config asks
    sharded: bool  # FSDP2 really shards: fsdp with more than one rank
    activation_checkpointing: bool
    loss_chunk_size: int
    ttt_steps: int
    ttt_gamma: float
    notes: tuple[str, ...] = ()  # what the trainer logs about the choices ("note: ...")

    @property
    def store_frozen_bf16(self) -> bool:
        """Whether the trainer casts the frozen weights to bf16 itself (FSDP's policy does it when sharded)."""
        return self.frozen_bf16 and not self.sharded

    def ttt_kwargs(self) -> dict:
        """The keywords of eagle3.model.ttt_forward these options fix."""
        return {
            "ttt_steps": self.ttt_steps,
            "gamma": self.ttt_gamma,
            "activation_checkpointing": self.activation_checkpointing,
            "loss_chunk_size": self.loss_chunk_size,
            "attention": self.attention,
        }


def resolve_options(cfg, device, world_size: int = 1) -> RunOptions:
    """The run options of a trainer config (eagle3.config.TrainConfig) on `device` with `world_size` ranks.

    `device`: cuda, cpu or auto, or a torch.device. Raises ConfigError for what cannot run (flex on CPU).

    >>> from eagle3.config import TrainConfig
    >>> run = resolve_options(TrainConfig(), "cpu")
    >>> run.autocast, run.attention, run.frozen_bf16
    (False, 'exact', False)
    >>> run = resolve_options(TrainConfig(fsdp=True), "cuda", world_size=8)
    >>> run.autocast, run.attention, run.frozen_bf16, run.sharded, run.store_frozen_bf16
    (True, 'flex', True, True, False)
    >>> resolve_options(TrainConfig(fsdp=True), "cpu").notes
    ('note: fsdp: true with a single process shards nothing; training unsharded',)
    """
    kind = device_type(getattr(device, "type", device))
    attention = attention_for(cfg.attention, kind)
    check_attention(attention, kind)
    autocast = cfg.dtype == "bf16" or (cfg.dtype == "auto" and kind == "cuda")
    notes = []
    if cfg.fsdp and world_size < 2:
        notes.append("note: fsdp: true with a single process shards nothing; training unsharded")
    if kind == "cuda" and cfg.dtype == "fp32":
        notes.append("note: dtype fp32 on CUDA (no autocast); bf16 is faster and smaller")
    return RunOptions(
        device=kind,
        world_size=world_size,
        autocast=autocast,
        frozen_bf16=autocast and kind == "cuda",
        attention=attention,
        fsdp=cfg.fsdp,
        sharded=cfg.fsdp and world_size > 1,
        activation_checkpointing=cfg.activation_checkpointing,
        loss_chunk_size=cfg.loss_chunk_size,
        ttt_steps=cfg.ttt_steps,
        ttt_gamma=cfg.ttt_gamma,
        notes=tuple(notes),
    )
