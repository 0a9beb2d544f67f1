"""The resolved run spec: what a run is, decided once from the trainer config, the data set's index and the device.

    drafter   DrafterConfig: sizes from the data set's index, heads and MLP from the config or derived Llama-style,
              rope and norm epsilon as the verifier's (the config's, else the target config the data set records)
    run       eagle3.options.RunOptions: device, dtype, attention, the checkpoint mode, ttt_steps, sharding and the
              ranks (every `auto` resolved for this device and world size)
    memory    what the memory planner adds for this device: the data set's bytes per hidden element, the memory
              outside torch's counters (reserve_gib) and the allocator's overhead on live tensors

The trainer builds its model from `spec.drafter` and runs with `spec.run`; the memory planner (eagle3.plan) sizes
exactly that object; `eagle3 report`, the checkpointer's replan and the benches read the same. No torch at import
time: the planner must start where torch is missing or slow to import.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from eagle3 import options
from eagle3.config import TrainConfig
from eagle3.errors import ConfigError
from eagle3.rope import normalize_rope_scaling

# The dimensions of a drafter (num_kv_heads apart, 0 meaning num_heads); the planner's command line takes each.
SHAPE_KEYS = (
    "hidden_size",
    "num_heads",
    "head_dim",
    "intermediate_size",
    "draft_vocab_size",
    "target_vocab_size",
)


# The trainer config keys of multi-head latent attention, DrafterConfig fields of the same names.
MLA_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
)


@dataclass(frozen=True)
class MLAShape:
    """The MLA dimensions of DeepSeek-V3's config.json (q_lora_rank 0: queries projected directly, no low rank).

    >>> MLAShape(128, 1536, 512, 128, 64, 128).qk_head_dim
    192
    >>> MLAShape(128, 1536, 512, 128, 64, 128).latent_dim  # what a TTT step keeps per token, for all 128 heads
    576
    """

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per token and TTT step: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self) -> None:
        """ConfigError naming the field that cannot make an MLA layer."""
        for key in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ConfigError(f"q_lora_rank={self.q_lora_rank!r} must be 0 (no low-rank query) or positive")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")


@dataclass
class DrafterConfig:
    """Shape of the drafter. `aux_layer_ids` are the 3 target layers whose hidden states feed `fc`."""

    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    # The 3 target layers whose hidden states feed fc: they label the data set and the export, not a size. A shape
    # built for sizing alone (the planner's named shapes, the benches) takes the default; from_dict requires it.
    aux_layer_ids: tuple[int, ...] = (2, 3, 4)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The verifier's rotary scaling (eagle3.rope: linear, llama3, yarn), canonical; None: unscaled.
    rope_scaling: dict | None = None
    norm_before_fc: bool = False
    # Grouped-query attention: key/value heads, a divisor of num_heads (None: num_heads, plain multi-head).
    num_kv_heads: int | None = None
    # EAGLE 3.1 norms (speculators Eagle3SpeculatorConfig, vLLM llama_eagle3): fc_norm, one RMSNorm per aux
    # state before fc (fc_norm.{0,1,2}); norm_output, the next TTT step reads norm(hidden), not hidden;
    # norm_before_residual, the residual of the decoder layer is hidden_norm(hidden), not hidden.
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    # speculators keeps lm_head frozen at the target's rows (docs/facts.md#eagle-3-drafter counts it as frozen).
    train_lm_head: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3, eagle3.mla) in place of q/k/v/o: kv_lora_rank > 0 selects it,
    # with num_heads heads of qk_nope_head_dim + qk_rope_head_dim (queries, keys) and v_head_dim (values); q_lora_rank
    # 0: queries projected directly. rope_interleave: the rotary pairs are adjacent (DeepSeek's weights).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.kv_lora_rank:  # MLA: a query/key head is qk_nope + qk_rope wide (head_dim is not read otherwise)
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        """Build and validate; unknown or missing keys raise ConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown drafter config key(s) {unknown}; known keys: {', '.join(sorted(names))}")
        required = {*SHAPE_KEYS, "aux_layer_ids"}
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"drafter config is missing {missing}; every one of {sorted(required)} is required")
        values = dict(data)
        if isinstance(values["aux_layer_ids"], list | tuple):
            values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
        cfg = cls(**values)
        cfg.validate()
        return cfg

    @classmethod
    def from_shapes(
        cls,
        hidden_size: int,
        draft_vocab_size: int,
        target_vocab_size: int,
        aux_layer_ids,
        num_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        **options,
    ) -> DrafterConfig:
        """Derive the unset shape keys Llama-style: head_dim 64 (H/4 below H=256), heads = H / head_dim,
        MLP width 8H/3 rounded up to a multiple of 64.

        >>> c = DrafterConfig.from_shapes(64, 512, 1024, (2, 4, 5))
        >>> (c.num_heads, c.head_dim, c.intermediate_size)
        (4, 16, 192)
        >>> c = DrafterConfig.from_shapes(7168, 32000, 163840, (2, 30, 58), num_heads=64)
        >>> (c.num_heads, c.head_dim, c.intermediate_size)
        (64, 64, 19136)
        """
        if head_dim is None:
            head_dim = 64 if hidden_size >= 256 else max(2, hidden_size // 4 // 2 * 2)
        if num_heads is None:
            num_heads = max(1, hidden_size // head_dim)
        if intermediate_size is None:
            intermediate_size = max(64, math.ceil(8 * hidden_size / 3 / 64) * 64)
        cfg = cls(
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=target_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids),
            **options,
        )
        cfg.validate()
        return cfg

    @property
    def mla(self) -> MLAShape | None:
        """The MLA dimensions, or None for the Llama-style q/k/v attention."""
        if not self.kv_lora_rank:
            return None
        return MLAShape(
            self.num_heads,
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns: the head's (Llama-style), or MLA's decoupled qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def attention_dim(self) -> int:
        """Width of the queries and of the attention output (q_proj, o_proj)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and of the values (k_proj, v_proj): smaller by heads / kv_heads under GQA."""
        return (self.num_kv_heads or self.num_heads) * self.head_dim

    @property
    def attention_kv_heads(self) -> int:
        """Key/value heads the attention reads: num_kv_heads, or MLA's one latent that every head shares."""
        return 1 if self.mla is not None else self.num_kv_heads

    def context_heads(self, cp: int) -> tuple[int, int]:
        """(query heads, key/value heads) each of `cp` ranks attends with under context parallelism (eagle3.context):
        the query heads split evenly; key/value heads split too when cp divides them, else each is repeated to cp
        copies first (cp a multiple of them: every rank's query heads read one of them). MLA: the one latent of all
        heads goes to every rank. Raises ConfigError naming the heads when they cannot split over cp ranks.

        >>> DrafterConfig(64, 8, 8, 128, 512, 1024, num_kv_heads=2).context_heads(4)
        (2, 1)
        >>> DrafterConfig(64, 6, 8, 128, 512, 1024, num_kv_heads=2).context_heads(4)
        Traceback (most recent call last):
        ...
        eagle3.errors.ConfigError: context_parallel=4 does not divide num_heads=6: the query heads are split over the context-parallel ranks; use a divisor of 6 (1, 2, 3, 6)
        """
        kv = self.attention_kv_heads
        if self.num_heads % cp:
            divisors = ", ".join(str(d) for d in range(1, self.num_heads + 1) if self.num_heads % d == 0)
            raise ConfigError(
                f"context_parallel={cp} does not divide num_heads={self.num_heads}: the query heads are split over "
                f"the context-parallel ranks; use a divisor of {self.num_heads} ({divisors})"
            )
        if kv % cp and cp % kv:
            raise ConfigError(
                f"context_parallel={cp} and num_kv_heads={kv} neither divide each other: the key/value heads are "
                f"split over the context-parallel ranks, or repeated to them; use a divisor or a multiple of {kv}"
            )
        return self.num_heads // cp, max(kv // cp, 1)

    def linear_params(self) -> int:
        """Trainable Linear weights (autocast keeps a bf16 copy of each): fc, q/k/v/o, gate/up/down, lm_head if trained.

        >>> SHAPES["kimi-k2.5"].linear_params()  # docs/facts.md#eagle-3-drafter: ~756 M trainable
        756023296
        """
        h, i = self.hidden_size, self.intermediate_size
        n = 3 * h * h + self.attention_params() + 3 * h * i
        return n + (h * self.draft_vocab_size if self.train_lm_head else 0)

    def attention_params(self) -> int:
        """The attention's Linear weights: q/k/v/o; or MLA's q_a/q_b (or q_proj), kv_a, kv_b and o (over 2H input).

        >>> DrafterConfig(64, 4, 16, 128, 512, 1024).attention_params() == 2 * 64 * 64 * 3 + 64 * 64
        True
        >>> mla = DrafterConfig(64, 4, 16, 128, 512, 1024, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        ...                     qk_rope_head_dim=8, v_head_dim=12)
        >>> mla.attention_params() == 128 * 24 + 24 * 4 * 16 + 128 * (16 + 8) + 16 * 4 * (8 + 12) + 4 * 12 * 64
        True
        """
        h, m = self.hidden_size, self.mla
        if m is None:
            a, kv = self.attention_dim, self.kv_dim
            return 2 * h * a + 2 * (2 * h * kv) + a * h
        heads = m.num_heads
        q = (
            2 * h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
            if m.q_lora_rank
            else 2 * h * heads * m.qk_head_dim
        )
        kv = 2 * h * m.latent_dim + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h

    def trainable_params(self) -> int:
        """Linear weights plus the trainable RMSNorm weights (input/hidden/post-attention/final, input_norm over 3H)."""
        h, m = self.hidden_size, self.mla
        mla_norms = (m.q_lora_rank + m.kv_lora_rank) if m else 0  # q_a_layernorm, kv_a_layernorm
        return self.linear_params() + 4 * h + (3 * h if self.norm_before_fc or self.fc_norm else 0) + mla_norms

    def frozen_params(self, keep_full_head: bool = True) -> int:
        """Embedding, verifier norm and head, the frozen lm_head and, for the true-target accuracy, the target head
        rows outside the draft vocab (Eagle3Drafter.verifier_lm_head_rest).

        >>> round(SHAPES["kimi-k2.5"].frozen_params() / 1e9, 2)
        2.58
        """
        h, vt, vd = self.hidden_size, self.target_vocab_size, self.draft_vocab_size
        n = vt * h + h + vd * h + (0 if self.train_lm_head else vd * h)
        return n + ((vt - vd) * h if keep_full_head and vd < vt else 0)

    def validate(self) -> None:
        """Raise ConfigError naming the key, the value and what is expected."""
        for key in (*SHAPE_KEYS, "num_kv_heads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ConfigError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                f"(grouped-query attention); one of {divisors}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError(
                "norm_before_fc and fc_norm are mutually exclusive (speculators refuses both): "
                "one RMSNorm over the 3H concat, or one per aux state; set one of them"
            )
        if self.mla is not None:
            self.mla.validate()
        elif self.q_lora_rank or self.qk_nope_head_dim or self.qk_rope_head_dim or self.v_head_dim:
            raise ConfigError(
                "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim shape multi-head latent attention, "
                "which kv_lora_rank > 0 selects: set kv_lora_rank too, or leave them 0"
            )
        if self.head_dim % 2 and self.mla is None:
            raise ConfigError(
                f"head_dim={self.head_dim} must be even (rotary embedding pairs); try {self.head_dim + 1}"
            )
        if self.draft_vocab_size > self.target_vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} is larger than target_vocab_size={self.target_vocab_size}; "
                f"the draft vocabulary is a subset of the target's: use at most {self.target_vocab_size}"
            )
        ids = self.aux_layer_ids
        if (
            not isinstance(ids, tuple | list)
            or len(ids) != 3
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
            or len(set(ids)) != 3
        ):
            raise ConfigError(
                f"aux_layer_ids={ids!r} must be 3 distinct target layer indices >= 0, "
                "for example [2, n//2, n-3] for a target with n layers"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be positive, for example 1e-6")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be positive, for example 10000.0")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)


SHAPES = {
    # docs/facts.md#eagle-3-drafter: the Kimi-K2.x-shaped drafter of the story.
    "kimi-k2.5": DrafterConfig(7168, 64, 64, 18432, 32000, 163840),
    # the same drafter scaled by 1/8 in width and vocabulary: small enough to measure on a CPU (bench/memory.py).
    "kimi-k2.5-eighth": DrafterConfig(896, 8, 64, 2304, 4000, 20480),
    # the same drafter with DeepSeek-V3's multi-head latent attention at Kimi-K2's ranks (64 heads; queries through
    # rank 1536, keys and values through one latent of 512 plus a 64-wide rotary key; value heads of 128), the layer
    # vLLM's deepseek_eagle3 serves; head_dim is unused by MLA.
    "kimi-k2.5-mla": DrafterConfig(
        7168,
        64,
        64,
        18432,
        32000,
        163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # the tests' tiny drafter (training/tests/conftest.py).
    "tiny": DrafterConfig(64, 4, 16, 128, 512, 1024),
}


def verifier_settings(cfg: TrainConfig, index_meta: dict) -> dict:
    """rope_theta, rope_scaling and rms_norm_eps: the config's where set, else the dataset's recorded target config
    (index.json's `target_config`, written by `eagle3 generate`), else the Llama defaults.

    >>> verifier_settings(TrainConfig(), {})
    {'rope_theta': 10000.0, 'rope_scaling': None, 'rms_norm_eps': 1e-06}
    >>> target = {"rope_theta": 500000.0, "rms_norm_eps": 1e-05, "rope_scaling": {"rope_type": "linear", "factor": 2}}
    >>> verifier_settings(TrainConfig(rope_theta=1e6), {"target_config": target})
    {'rope_theta': 1000000.0, 'rope_scaling': {'rope_type': 'linear', 'factor': 2.0}, 'rms_norm_eps': 1e-05}
    >>> verifier_settings(TrainConfig(rope_scaling={"rope_type": "default"}), {"target_config": target})["rope_scaling"]
    """
    target = index_meta.get("target_config") or {}
    return {
        "rope_theta": float(cfg.rope_theta or target.get("rope_theta") or 10000.0),
        "rope_scaling": normalize_rope_scaling(cfg.rope_scaling or target.get("rope_scaling") or None),
        "rms_norm_eps": float(cfg.rms_norm_eps or target.get("rms_norm_eps") or 1e-6),
    }


def drafter_config(cfg: TrainConfig, index) -> DrafterConfig:
    """The drafter's shape: sizes from the dataset index, heads/MLP from the config or derived (0 = derive); rope
    and norm epsilon as the verifier's (verifier_settings)."""
    return DrafterConfig.from_shapes(
        index.hidden_size,
        index.draft_vocab_size,
        index.target_vocab_size,
        tuple(index.aux_layer_ids),
        num_heads=cfg.num_heads or None,
        head_dim=cfg.head_dim or None,
        intermediate_size=cfg.intermediate_size or None,
        norm_before_fc=cfg.norm_before_fc,
        num_kv_heads=cfg.num_kv_heads or None,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        norm_before_residual=cfg.norm_before_residual,
        train_lm_head=cfg.train_lm_head,
        **{key: getattr(cfg, key) for key in MLA_KEYS},
        **verifier_settings(cfg, index.meta),
    )


def data_bytes_of(index) -> int:
    """Bytes per hidden-state element of a data set: 4 for fp32 shards, else 2 (bf16, what generate writes)."""
    return {"float32": 4, "fp32": 4}.get(str(index.dtype).replace("torch.", ""), 2)


# Process memory per byte of live tensors on CPU: glibc keeps freed blocks mapped, and the trainer's address space
# grew 1.43 x as fast as its live tensors (measured: VmPeak of `eagle3 train` at max_seq_len 2048 and 8320, hidden
# 64); memory_limit_gb there is RLIMIT_AS. CUDA's caching allocator with expandable segments: 1.
CPU_ALLOCATOR_FACTOR = 1.5


def cpu_reserve_gib(num_threads: int = 0) -> float:
    """Address space of a CPU trainer before its tensors: interpreter, torch, the mapped dataset shards and
    thread stacks (VmPeak 1.0 GiB at 3 threads, measured), plus 64 MiB of malloc arena per extra thread.

    >>> cpu_reserve_gib(3)
    1.125
    """
    threads = num_threads or os.cpu_count() or 1
    return 1.0 + max(threads - 1, 0) * 0.0625


FP32 = 4


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: the drafter it trains, how it computes, and the memory facts of its device.

    >>> spec = spec_for(SHAPES["tiny"], device="cpu", num_threads=3)
    >>> spec.run.attention, spec.run.activation_checkpointing, spec.run.ttt_steps, spec.act_bytes, spec.reserve_gib
    ('exact', 'none', 5, 4, 1.125)
    """

    drafter: DrafterConfig
    run: options.RunOptions
    data_bytes: int = 2  # the data set's hidden states: bf16
    reserve_gib: float = 1.0  # outside torch's counters: CUDA context, NCCL buffers, slack; on CPU the process
    allocator_factor: float = 1.0  # process memory per byte of live tensors (CPU_ALLOCATOR_FACTOR on CPU)
    optimizer_state_bytes: int = 8  # AdamW: exp_avg + exp_avg_sq in fp32
    keep_full_head: bool = True  # the target head rows outside the draft vocab stay (the true-target accuracy)

    @property
    def checkpointing(self) -> bool:
        """Whether the decoder steps recompute anything in the backward (selective or full)."""
        return self.run.activation_checkpointing != "none"

    @property
    def act_bytes(self) -> int:
        """Bytes per element of matmul outputs: bf16 under autocast, fp32 otherwise."""
        return 2 if self.run.autocast else FP32

    @property
    def bf16_params(self) -> bool:
        """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): every weight the forward sees is bf16."""
        return self.run.sharded and self.run.autocast

    @property
    def frozen_bytes(self) -> int:
        return 2 if self.run.frozen_bf16 else FP32

    def with_run(self, **changes) -> RunSpec:
        """This spec with some run options changed (the planner tries memory options this way)."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **changes))


def resolve_spec(cfg: TrainConfig, index, device, world_size: int = 1, nodes: int = 1) -> RunSpec:
    """The spec of a trainer config (eagle3.config.TrainConfig) over its data set's index (eagle3.data.Index) on
    `device` (cuda, cpu, auto or a torch.device) with `world_size` ranks on `nodes` nodes. Raises ConfigError for
    what cannot run (eagle3.options.resolve_options, DrafterConfig.validate)."""
    return spec_of(drafter_config(cfg, index), cfg, device, world_size, nodes, data_bytes_of(index))


def spec_of(
    drafter: DrafterConfig, cfg: TrainConfig, device, world_size: int = 1, nodes: int = 1, data_bytes: int = 2
) -> RunSpec:
    """A drafter shape under a trainer config on `device`: the run options resolved as the trainer resolves them,
    the memory facts of that device."""
    run = options.resolve_options(cfg, device, world_size, nodes)
    # the heads split over the context-parallel ranks, or ConfigError
    drafter.context_heads(run.context_parallel)
    cuda = run.device == "cuda"
    return RunSpec(
        drafter=drafter,
        run=run,
        data_bytes=data_bytes,
        reserve_gib=1.0 if cuda else cpu_reserve_gib(cfg.num_threads),
        allocator_factor=1.0 if cuda else CPU_ALLOCATOR_FACTOR,
    )


def spec_for(drafter: DrafterConfig, world_size: int = 1, nodes: int = 1, data_bytes: int = 2, **config) -> RunSpec:
    """The spec of a drafter shape under trainer config keys (`device`, `dtype`, `attention`, `fsdp`, `ttt_steps`,
    ...; the trainer's defaults otherwise): for the tests, the benches and the examples.

    >>> spec_for(SHAPES["tiny"], device="cuda", fsdp=True, world_size=8).run.sharded
    True
    """
    cfg = TrainConfig(**config)
    return spec_of(drafter, cfg, cfg.device, world_size, nodes, data_bytes)
