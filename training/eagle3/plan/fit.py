"""Choosing for a budget with the analytic model (plan/model.py): the largest max_seq_len that fits, the plan the
role parses, and the fastest memory options (checkpoint mode, loss chunking) that fit a length."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eagle3 import options
from eagle3.bounds import SEQ_BLOCK  # flex_attention block size; rows are padded to a multiple of it
from eagle3.errors import ConfigError
from eagle3.plan.model import (
    DEFAULT_LENGTHS,
    GIB,
    MAX_SEARCH_LEN,
    predict_peak_bytes,
    static_bytes,
)
from eagle3.spec import (
    SHAPES,  # noqa: F401 (the named shapes of the examples below)
    DrafterConfig,
    RunSpec,
)


def budget_bytes(memory_gb: float, margin: float) -> int:
    """Usable bytes: the memory less the safety margin (a fraction).

    >>> round(budget_bytes(96, 0.1) / GIB, 2)
    86.4
    """
    return int(memory_gb * GIB * (1.0 - margin))


def largest_fitting(
    predict: Callable[[int], int], budget: int, max_len: int = MAX_SEARCH_LEN, step: int = SEQ_BLOCK
) -> int | None:
    """Largest multiple of `step` up to `max_len` whose predicted peak fits `budget`, or None if not even `step`.

    `predict` must grow with the length (every term does); binary search over the multiples.

    >>> largest_fitting(lambda s: 1000 + 10 * s, budget=1000 + 10 * 1000)
    896
    >>> largest_fitting(lambda s: 10**12, budget=100) is None
    True
    """
    lo, hi = 0, max_len // step  # predict(lo * step) fits (lo = 0 by convention), hi may not
    if predict(step) > budget:
        return None
    lo = 1
    if predict(hi * step) <= budget:
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predict(mid * step) <= budget:
            lo = mid
        else:
            hi = mid
    return lo * step


@dataclass
class Plan:
    spec: RunSpec
    memory_gb: float
    margin: float
    max_seq_len: int | None
    predicted_gb: float | None
    static_gb: float
    table: list[dict]
    source: str = "analytic"  # or "probe"
    probe: dict | None = None
    # the loss chunking memory needs at max_seq_len: 0 (one pass, fastest) when it fits, else a chunk size
    loss_chunk_size: int | None = None
    # context_parallel_choice's table when the context-parallel size was chosen (auto), else None
    context_parallel_table: list[dict] | None = None

    @property
    def shard_layout(self) -> str:
        """unsharded (DDP or one rank), full (FSDP over all ranks) or hsdp (FSDP within a node)."""
        run = self.spec.run
        return "unsharded" if not run.sharded else "hsdp" if run.hsdp else "full"

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the sharded state spans (1 when unsharded)."""
        return self.spec.run.shard_ranks if self.spec.run.sharded else 1

    def to_json(self) -> dict:
        run = self.spec.run
        return {
            "max_seq_len": self.max_seq_len,
            "predicted_gb": self.predicted_gb,
            "memory_gb": self.memory_gb,
            "margin": self.margin,
            "budget_gb": round(budget_bytes(self.memory_gb, self.margin) / GIB, 3),
            "static_gb": self.static_gb,
            "world_size": run.world_size,
            "nnodes": run.nodes,
            "nproc_per_node": run.world_size // run.nodes,
            "shard_layout": self.shard_layout,
            "shard_ranks": self.shard_ranks,
            "context_parallel": run.context_parallel,
            "data_parallel": run.data_parallel,
            "context_parallel_table": self.context_parallel_table,
            "ttt_steps": run.ttt_steps,
            "source": self.source,
            "table": self.table,
            "options": self.describe_options(),
            "shape": self.spec.drafter.to_dict(),
            "probe": self.probe,
            "loss_chunk_size": self.loss_chunk_size,
        }

    def describe_options(self) -> dict:
        """The run options and the memory facts the prediction used."""
        spec = self.spec
        return {
            **dataclasses.asdict(spec.run),
            "data_bytes": spec.data_bytes,
            "reserve_gib": spec.reserve_gib,
            "allocator_factor": spec.allocator_factor,
        }


def make_plan(
    spec: RunSpec,
    *,
    memory_gb: float,
    margin: float,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    predict: Callable[[int], int] | None = None,
) -> Plan:
    """The table for `lengths` and the largest fitting length. Raises ConfigError when the budget is below the
    static footprint or no length fits (the message carries the figures and what to change)."""
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin={margin} must be in [0, 1), for example 0.1 (keep 10 % free)")
    if memory_gb <= 0:
        raise ConfigError(f"memory_gb={memory_gb} must be positive: the memory of one GPU in GiB, for example 96")
    predict = predict or (lambda s: predict_peak_bytes(spec, s))
    budget = budget_bytes(memory_gb, margin)
    fixed = static_bytes(spec) + int(spec.reserve_gib * GIB)
    static_gb = round(fixed / GIB, 3)
    if fixed >= budget:
        raise ConfigError(
            f"memory budget {budget / GIB:.1f} GiB ({memory_gb} GiB less {margin:.0%} margin) is below the static "
            f"footprint {static_gb:.1f} GiB (weights, gradients, optimizer, frozen heads, reserve) at "
            f"world_size={spec.run.world_size}; use a larger GPU, more ranks with fsdp, or a smaller drafter"
        )
    table = []
    for s in lengths:
        peak = predict(s)
        table.append({"max_seq_len": s, "predicted_gb": round(peak / GIB, 3), "fits": peak <= budget})
    chosen = largest_fitting(predict, budget, step=math.lcm(SEQ_BLOCK, spec.run.context_parallel))
    if chosen is None:
        smallest = predict(SEQ_BLOCK) / GIB
        raise ConfigError(
            f"no max_seq_len fits: even {SEQ_BLOCK} tokens need {smallest:.1f} GiB against a budget of "
            f"{budget / GIB:.1f} GiB (static {static_gb:.1f} GiB); turn on activation_checkpointing or fsdp, "
            "or lower ttt_steps"
        )
    return Plan(
        spec=spec,
        memory_gb=memory_gb,
        margin=margin,
        max_seq_len=chosen,
        predicted_gb=round(predict(chosen) / GIB, 3),
        static_gb=static_gb,
        table=table,
        loss_chunk_size=loss_chunk_choice(spec, chosen, budget),
    )


LOSS_CHUNKS = (4096, 2048, 1024, 512, 256)


def cpu_heap_chunk(drafter: DrafterConfig, seq_len: int) -> int | None:
    """On CPU, the loss chunk that beats one pass: the largest of LOSS_CHUNKS whose fp32 [chunk, target vocab]
    tensors stay in glibc's heap, when the one pass's would not (docs/speed.md: 4-6 % per token at 16384 at the
    bench's shape); None when one pass is as fast (its tensors are in the heap too) or no chunk is.

    >>> tiny = DrafterConfig(64, 4, 16, 192, 512, 1024)
    >>> cpu_heap_chunk(tiny, 4096), cpu_heap_chunk(tiny, 8192), cpu_heap_chunk(tiny, 16384)
    (None, 4096, 4096)
    >>> cpu_heap_chunk(SHAPES["kimi-k2.5"], 16384) is None  # 256 rows of 163840 logits are 160 MiB already
    True
    """
    row_bytes = drafter.target_vocab_size * 4
    if seq_len * row_bytes < options.GLIBC_MMAP_CEILING:
        return None
    return next((c for c in LOSS_CHUNKS if c < seq_len and c * row_bytes < options.GLIBC_MMAP_CEILING), None)


def loss_chunk_choice(spec: RunSpec, seq_len: int, budget: int):
    """The loss chunking memory needs at `seq_len`: 0 (one pass over the row, nothing recomputed, the target side
    made once; the fastest, docs/speed.md) when its peak fits `budget`, else the largest chunk of LOSS_CHUNKS
    that fits, else None. On CPU, where one pass's tensors are page-faulted in every step, the chunk of
    `cpu_heap_chunk` comes first.

    >>> from eagle3.plan.model import on_cuda
    >>> from eagle3.spec import spec_for
    >>> kimi = SHAPES["kimi-k2.5"]
    >>> on = on_cuda(kimi, world_size=8, activation_checkpointing=True, fsdp=True)
    >>> loss_chunk_choice(on, 8192, budget_bytes(141, 0.1)), loss_chunk_choice(on, 145024, budget_bytes(141, 0.1))
    (0, 4096)
    >>> cpu = spec_for(DrafterConfig(64, 4, 16, 192, 512, 1024), device="cpu")
    >>> cpu = dataclasses.replace(cpu, reserve_gib=1.0, allocator_factor=1.0)
    >>> [loss_chunk_choice(cpu, s, 2**31) for s in (4096, 16384)]
    [0, 4096]
    """
    heap = cpu_heap_chunk(spec.drafter, seq_len) if spec.run.device == "cpu" else None
    for chunk in (0, *LOSS_CHUNKS) if heap is None else (heap, 0, *LOSS_CHUNKS):
        if predict_peak_bytes(spec.with_run(loss_chunk_size=chunk), seq_len) <= budget:
            return chunk
    return None


# The memory options from the fastest to the leanest (docs/speed.md): no checkpointing, selective (the step's matmul
# outputs kept), full (the step's forward recomputed).
CHECKPOINT_CHOICES = options.CHECKPOINT_MODES


def memory_options_choice(spec: RunSpec, seq_len: int, budget: int) -> tuple[str, int] | None:
    """The fastest memory options that fit `budget` at `seq_len`: (activation_checkpointing, loss_chunk_size),
    checkpointing only when memory needs it and then the selective mode before the full one, each with the loss
    chunking it needs (loss_chunk_choice); None when nothing fits.

    >>> from eagle3.plan.model import on_cuda
    >>> kimi, budget = on_cuda(SHAPES["kimi-k2.5"], world_size=8, fsdp=True), budget_bytes(141, 0.1)
    >>> [memory_options_choice(kimi, s, budget) for s in (8192, 32768, 65536, 131072)]
    [('none', 0), ('none', 0), ('selective', 0), ('full', 0)]
    """
    for mode in CHECKPOINT_CHOICES:
        chunk = loss_chunk_choice(spec.with_run(activation_checkpointing=mode), seq_len, budget)
        if chunk is not None:
            return mode, chunk
    return None


def context_parallel_sizes(spec: RunSpec, seq_len: int | None = None) -> list[int]:
    """The context-parallel sizes the run can form: divisors of the world size that split the heads
    (DrafterConfig.context_heads) and, given, the row length.

    >>> from eagle3.plan.model import on_cuda
    >>> context_parallel_sizes(on_cuda(SHAPES["kimi-k2.5"], world_size=8))
    [1, 2, 4, 8]
    >>> context_parallel_sizes(on_cuda(DrafterConfig(64, 6, 16, 128, 512, 1024), world_size=8))
    [1, 2]
    """
    world = spec.run.world_size
    sizes = []
    for cp in range(1, world + 1):
        try:
            options.check_context_parallel(cp, world, seq_len or None)  # the workers and the row split
            spec.drafter.context_heads(cp)  # the heads split
        except ConfigError:
            continue
        sizes.append(cp)
    return sizes


def context_parallel_choice(spec: RunSpec, budget: int, target: int | None) -> tuple[int, list[dict]]:
    """`context_parallel: auto`: the smallest size whose largest fitting length reaches `target` (the length asked
    for: an explicit max_seq_len, or under max_seq_len auto the longest document), else the largest size (the
    longest rows); with no target, 1. Returns (size, table): per size the largest fitting length and its peak.

    Kimi-K2.5's drafter shape, 5 TTT steps, 8 GPUs of 96 GiB, activation checkpointing and FSDP2: 32768 tokens fit
    without context parallelism, 131072 need 2 ranks per row.

    >>> from eagle3.plan.model import on_cuda
    >>> kimi = on_cuda(SHAPES["kimi-k2.5"], world_size=8, activation_checkpointing=True, fsdp=True)
    >>> budget = budget_bytes(96, 0.1)
    >>> context_parallel_choice(kimi, budget, 32768)[0], context_parallel_choice(kimi, budget, 131072)[0]
    (1, 2)
    >>> [(row["context_parallel"], row["max_seq_len"]) for row in context_parallel_choice(kimi, budget, None)[1]]
    [(1, 93056), (2, 185216), (4, 363648), (8, 680704)]
    """
    table = []
    for cp in context_parallel_sizes(spec, target):
        candidate = spec.with_run(context_parallel=cp)
        largest = largest_fitting(lambda s, c=candidate: predict_peak_bytes(c, s), budget, step=math.lcm(SEQ_BLOCK, cp))
        row = {
            "context_parallel": cp,
            "max_seq_len": largest,
            "predicted_gb": round(predict_peak_bytes(candidate, largest) / GIB, 3) if largest else None,
        }
        if target:
            peak = predict_peak_bytes(candidate, target)
            row |= {"target_gb": round(peak / GIB, 3), "fits_target": peak <= budget}
        table.append(row)
    if not table:
        raise ConfigError(
            f"no context_parallel size fits {spec.run.world_size} ranks, {spec.drafter.num_heads} heads"
            + (f" and max_seq_len={target}" if target else "")
        )
    if not target:
        return 1, table
    fitting = [row["context_parallel"] for row in table if row["fits_target"]]
    return (fitting[0] if fitting else table[-1]["context_parallel"]), table
