"""Run options, resolved once: the user's config plus the device -> what a run actually does.

The config may say `auto`; what that means on a device, and which combinations cannot run, is decided here and
nowhere else. eagle3.spec.resolve_spec calls `resolve_options` for the trainer, the memory planner and the benches,
so the run the planner sizes is the run the trainer makes.

    device     auto -> cuda when torch sees a GPU, else cpu
    dtype      auto -> bf16 autocast on CUDA, none (fp32) on CPU; bf16 / fp32 as written
    frozen     the embedding and the target heads run in bf16 on CUDA under autocast (stored in bf16, or as
               FSDP's bf16 parameters when sharded)
    attention  auto -> flex on CUDA, exact (blockwise) on CPU; flex on CPU is refused (no backward there)
    sharding   fsdp shards over the ranks; with one rank it shards nothing and the run is unsharded (a note)
               shard_layout full: one FSDP2 group over all ranks; hsdp: a 2-D mesh (nodes x ranks per node),
               sharded within a node and replicated across nodes; hsdp without fsdp, or with a world size the
               node count does not divide, is refused; hsdp on one node shards as full does (a note)

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
        raise ConfigError("attention='flex' needs CUDA (flex_attention has no backward on CPU); use exact or auto")


# The experiment trackers of eagle3.trackers beside TensorBoard (config key `tracker`).
TRACKERS = ("none", "mlflow", "wandb")

# The packers of eagle3.packing, the first the default (config key `packing`).
PACKINGS = ("first_fit", "next_fit")


# glibc's dynamic mmap threshold stops rising at 32 MiB on 64-bit: a larger allocation is a mapping of its own,
# unmapped when freed, so a CPU step page-faults it in afresh every step (eagle3.distributed.keep_freed_host_memory,
# eagle3.plan.cpu_heap_chunk).
GLIBC_MMAP_CEILING = 32 << 20


# The TTT steps a drafter is trained to draft (config key `ttt_steps`; EAGLE-3 and speculators default to 5).
TTT_STEPS = 5

CHECKPOINT_MODES = ("none", "selective", "full")


def checkpoint_mode(value) -> str:
    """The activation checkpointing mode a config value names: none, selective or full.

    false / none / off: nothing recomputed. selective: each decoder step keeps its matmul outputs and recomputes
    the cheap work between them (norms, RoPE, SiLU, the attention's blockwise forward). full: each step keeps only
    its inputs and outputs and recomputes its whole forward. true means full, the leanest: a config that only
    says "checkpoint" gets the mode that holds least (selective keeps more per token, and is faster).

    >>> [checkpoint_mode(v) for v in (False, True, "false", "true", "selective", "full", "none")]
    ['none', 'full', 'none', 'full', 'selective', 'full', 'none']
    >>> checkpoint_mode("fast")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: activation_checkpointing='fast' is not one of false, selective, full (true means full)
    """
    if isinstance(value, bool):
        return "full" if value else "none"
    text = str(value).strip().lower()
    aliases = {"false": "none", "off": "none", "no": "none", "true": "full", "on": "full", "yes": "full"}
    text = aliases.get(text, text)
    if text not in CHECKPOINT_MODES:
        raise ConfigError(f"activation_checkpointing={value!r} is not one of false, selective, full (true means full)")
    return text


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
    activation_checkpointing: str  # none | selective | full (checkpoint_mode of the config's value)
    loss_chunk_size: int
    ttt_steps: int
    ttt_gamma: float
    notes: tuple[str, ...] = ()  # what the trainer logs about the choices ("note: ...")
    shard_layout: str = "full"  # full | hsdp, as the config asks
    nodes: int = 1  # torchrun agents (nodes) in the run
    context_parallel: int = 1  # ranks one row is split over (eagle3.context); world_size / it rows per step
    lk_weight: float = 0.0  # the acceptance-aware share of the loss (eagle3.loss)
    drop_oov_targets: bool = False  # no loss where the target's token is outside the draft vocabulary

    @property
    def data_parallel(self) -> int:
        """Rows per step: groups of `context_parallel` consecutive ranks share one row."""
        return self.world_size // self.context_parallel

    @property
    def hsdp(self) -> bool:
        """FSDP2 over a 2-D mesh: replicated across `nodes`, sharded over the ranks of a node."""
        return self.sharded and self.shard_layout == "hsdp" and self.nodes > 1

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the sharded state is spread over: all of them (full), a node's (hsdp).

        >>> RunOptions("cpu", 8, False, False, "exact", True, True, "none", 1, 1, 1.0, (), "hsdp", 2).shard_ranks
        4
        """
        return self.world_size // self.nodes if self.hsdp else self.world_size

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
            "lk_weight": self.lk_weight,
            "drop_oov_targets": self.drop_oov_targets,
        }


def resolve_options(cfg, device, world_size: int = 1, nodes: int = 1) -> RunOptions:
    """The run options of a trainer config (eagle3.config.TrainConfig) on `device` with `world_size` ranks.

    `device`: cuda, cpu or auto, or a torch.device; `nodes`: torchrun agents (WORLD_SIZE / LOCAL_WORLD_SIZE; 0 when
    that does not divide, i.e. the nodes run different numbers of ranks).
    Raises ConfigError for what cannot run (flex on CPU, a shard layout that does not fit the ranks).

    >>> from eagle3.config import TrainConfig
    >>> run = resolve_options(TrainConfig(), "cpu")
    >>> run.autocast, run.attention, run.frozen_bf16
    (False, 'exact', False)
    >>> run = resolve_options(TrainConfig(fsdp=True), "cuda", world_size=8)
    >>> run.autocast, run.attention, run.frozen_bf16, run.sharded, run.store_frozen_bf16
    (True, 'flex', True, True, False)
    >>> resolve_options(TrainConfig(fsdp=True), "cpu").notes
    ('note: fsdp: true with a single process shards nothing; training unsharded',)
    >>> resolve_options(TrainConfig(fsdp=True, shard_layout="hsdp"), "cpu", world_size=8, nodes=2).shard_ranks
    4
    >>> resolve_options(TrainConfig(shard_layout="hsdp"), "cpu", world_size=8, nodes=2)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: shard_layout=hsdp needs fsdp: true (HSDP is FSDP2 sharded within a node, replicated across nodes); set fsdp: true, or shard_layout: full
    """
    kind = device_type(getattr(device, "type", device))
    attention = attention_for(cfg.attention, kind)
    check_attention(attention, kind)
    autocast = cfg.dtype == "bf16" or (cfg.dtype == "auto" and kind == "cuda")
    notes = []
    if cfg.fsdp and world_size < 2:
        notes.append("note: fsdp: true with a single process shards nothing; training unsharded")
    check_layout(cfg.shard_layout, cfg.fsdp, world_size, nodes)
    check_context_parallel(cfg.context_parallel, world_size, cfg.max_seq_len, nodes)
    if cfg.shard_layout == "hsdp" and cfg.fsdp and nodes == 1 and world_size > 1:
        notes.append(f"note: shard_layout=hsdp on one node shards over all {world_size} ranks, as full does")
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
        activation_checkpointing=checkpoint_mode(cfg.activation_checkpointing),
        loss_chunk_size=cfg.loss_chunk_size,
        ttt_steps=cfg.ttt_steps,
        ttt_gamma=cfg.ttt_gamma,
        notes=tuple(notes),
        shard_layout=cfg.shard_layout,
        nodes=nodes,
        context_parallel=cfg.context_parallel,
        lk_weight=cfg.lk_weight,
        drop_oov_targets=cfg.drop_oov_targets,
    )


def check_context_parallel(cp: int, world_size: int, max_seq_len: int | None = None, nodes: int = 1) -> None:
    """Refuse a context-parallel size the workers cannot form: it must divide the workers (groups of cp consecutive
    workers share a row) and the row length (each holds max_seq_len / cp of its positions). The one statement of the
    rule: the Ansible role's early check (roles/eagle3_train/filter_plugins/train_inputs.py) calls it too.
    `nodes`: the torchrun agents (0: they run different numbers of workers), for the message.

    >>> check_context_parallel(3, 8, nodes=2)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: context_parallel=3 does not divide the 8 workers of the run (2 nodes x 4 workers): each group of 3 consecutive workers shares one row; allowed: a divisor of 8 (1, 2, 4, 8)
    >>> check_context_parallel(3, 6, 16384)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: context_parallel=3 does not divide max_seq_len=16384: each of the 3 workers of a row holds max_seq_len / 3 of its positions; allowed: a divisor of the run's 6 workers that divides 16384 (1, 2)
    """
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if cp < 1 or cp not in divisors:
        layout = "one node"
        if nodes > 1:
            layout = f"{nodes} nodes x {world_size // nodes} workers" if world_size % nodes == 0 else f"{nodes} nodes"
        elif nodes == 0:
            layout = "nodes of different sizes"
        workers = f"{world_size} worker{'s' if world_size != 1 else ''}"
        raise ConfigError(
            f"context_parallel={cp} does not divide the {workers} of the run ({layout}): each group of {cp} "
            f"consecutive workers shares one row; allowed: a divisor of {world_size} ({', '.join(map(str, divisors))})"
        )
    if max_seq_len and max_seq_len % cp:
        fitting = ", ".join(str(d) for d in divisors if max_seq_len % d == 0)
        raise ConfigError(
            f"context_parallel={cp} does not divide max_seq_len={max_seq_len}: each of the {cp} workers of a row "
            f"holds max_seq_len / {cp} of its positions; allowed: a divisor of the run's {world_size} workers that "
            f"divides {max_seq_len} ({fitting})"
        )


def check_layout(layout: str, fsdp: bool, world_size: int, nodes: int) -> None:
    """Refuse a shard layout the ranks cannot form, naming the sizes.

    >>> check_layout("hsdp", True, 6, 4)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: shard_layout=hsdp needs the same number of ranks on every node: world size 6 is not a multiple of 4 nodes; start the same --nproc-per-node on every node, or use shard_layout: full
    """
    if layout not in ("full", "hsdp"):
        raise ConfigError(f"shard_layout={layout!r} is not one of full, hsdp")
    if layout != "hsdp":
        return
    if not fsdp:
        raise ConfigError(
            "shard_layout=hsdp needs fsdp: true (HSDP is FSDP2 sharded within a node, replicated across nodes); "
            "set fsdp: true, or shard_layout: full"
        )
    if nodes < 1 or world_size % nodes:  # nodes 0: torchrun's agents run different numbers of ranks
        seen = (
            f"world size {world_size} is not a multiple of {nodes} nodes"
            if nodes > 0
            else (f"world size {world_size} is not a multiple of this node's LOCAL_WORLD_SIZE")
        )
        raise ConfigError(
            f"shard_layout=hsdp needs the same number of ranks on every node: {seen}; start the same "
            "--nproc-per-node on every node, or use shard_layout: full"
        )
