"""The analytic memory model: predicted peak bytes per rank for (drafter shape, ttt_steps, max_seq_len, world size,
options), and the largest max_seq_len that fits a budget.

The model follows the code it predicts (eagle3/model.py, attention.py, loss.py, train.py): every term below names
the tensors it stands for. It is checked on CPU against eagle3.memtrack (bytes the real forward+backward allocates;
tests/test_plan.py, within 15 %), and on a GPU by the probe (gpu_probe.py) and bench/gpu_check.sh.

peak = static (weights, gradients, AdamW, DDP buckets; FSDP shards them)
     + allocator_factor * (
         batch (the packed row on the device)
       + held (what the forward keeps for backward: per token and TTT step, plus once per row)
       + transient (the largest backward phase: one loss chunk, or one decoder step's gradients,
                    plus the recomputed step under activation checkpointing))
     + reserve (CUDA context, NCCL buffers, allocator slack: not seen by torch's counters)

allocator_factor is 1 on CUDA; on CPU (memory_limit_gb is an address-space limit there) glibc keeps freed blocks
mapped: 1.5, measured on the trainer. The attention terms assume one document filling the row (the worst case).

Sizes are GiB (2**30 bytes) everywhere, as torch and nvidia-smi report them; lengths are multiples of 128.
No torch at import time: the planner must run where torch is missing or slow to import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eagle3 import options
from eagle3.config import SEQ_BLOCK  # flex_attention block size; rows are padded to a multiple of it
from eagle3.errors import ConfigError

GIB = 1 << 30
MAX_SEARCH_LEN = 262144
DEFAULT_LENGTHS = (4096, 8192, 16384, 24576, 32768, 49152, 65536)
FP32 = 4
# Query block of the exact (CPU) attention path: eagle3.attention.DEFAULT_BLOCK_SIZE (not imported: torch).
EXACT_BLOCK = 256


@dataclass(frozen=True)
class Shape:
    """Drafter dimensions (eagle3.model.DrafterConfig without the metadata)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    norm_before_fc: bool = False
    train_lm_head: bool = False
    num_kv_heads: int | None = None  # grouped-query attention; None: num_heads
    fc_norm: bool = False  # one RMSNorm per aux state before fc (3 x H weights, like norm_before_fc)
    norm_output: bool = False  # steps after the first read norm(hidden): one more RMSNorm per step

    def drafter_config(self, aux_layer_ids: tuple[int, ...] = (2, 3, 4)):
        """The model config of this shape (the aux layer ids only label an export)."""
        from eagle3.model import DrafterConfig

        # Every Shape field is a DrafterConfig field of the same name (tests/test_plan.py builds models from it).
        return DrafterConfig(**dataclasses.asdict(self), aux_layer_ids=aux_layer_ids)

    @property
    def attention_dim(self) -> int:
        """Width of the queries and of the attention output (q_proj, o_proj)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and of the values (k_proj, v_proj): smaller by heads / kv_heads under GQA."""
        return (self.num_kv_heads or self.num_heads) * self.head_dim

    def linear_params(self) -> int:
        """Trainable Linear weights (autocast keeps a bf16 copy of each): fc, q/k/v/o, gate/up/down, lm_head if trained.

        >>> SHAPES["kimi-k2.5"].linear_params()  # docs/facts.md#eagle-3-drafter: ~756 M trainable
        756023296
        """
        h, a, i, kv = self.hidden_size, self.attention_dim, self.intermediate_size, self.kv_dim
        n = 3 * h * h + 2 * h * a + 2 * (2 * h * kv) + a * h + 3 * h * i
        return n + (h * self.draft_vocab_size if self.train_lm_head else 0)

    def trainable_params(self) -> int:
        """Linear weights plus the trainable RMSNorm weights (input/hidden/post-attention/final, input_norm over 3H)."""
        h = self.hidden_size
        return self.linear_params() + 4 * h + (3 * h if self.norm_before_fc or self.fc_norm else 0)

    def frozen_params(self, keep_full_head: bool = True) -> int:
        """Embedding, verifier norm and head, the frozen lm_head and, for the true-target accuracy, the target head
        rows outside the draft vocab (Eagle3Drafter.verifier_lm_head_rest).

        >>> round(SHAPES["kimi-k2.5"].frozen_params() / 1e9, 2)
        2.58
        """
        h, vt, vd = self.hidden_size, self.target_vocab_size, self.draft_vocab_size
        n = vt * h + h + vd * h + (0 if self.train_lm_head else vd * h)
        return n + ((vt - vd) * h if keep_full_head and vd < vt else 0)


SHAPES = {
    # docs/facts.md#eagle-3-drafter: the Kimi-K2.x-shaped drafter of the story.
    "kimi-k2.5": Shape(7168, 64, 64, 18432, 32000, 163840),
    # issue 7 item 6: the same drafter scaled by 1/8 (bench/memory.py measures it on CPU).
    "kimi-k2.5-eighth": Shape(896, 8, 64, 2304, 4000, 20480),
    # the tests' tiny drafter (training/tests/conftest.py).
    "tiny": Shape(64, 4, 16, 128, 512, 1024),
}


@dataclass(frozen=True)
class Options:
    """How the trainer runs, as far as memory is concerned: the resolved run options (eagle3.options.RunOptions,
    see `from_run`) plus what only the memory model needs. Tests and benches also build them by hand.

    autocast: bf16 autocast (dtype bf16, or auto on CUDA); activations from matmuls are bf16, norms stay fp32.
    frozen_bf16: embedding and target heads in bf16 in the forward (the trainer's choice on CUDA with autocast).
    fsdp: as the config asks (check_options refuses it on one rank, where the trainer would not shard).
    shard_ranks: the ranks one copy of the FSDP state is sharded over; 0: all of them (shard_layout full). Under
    HSDP (shard_layout hsdp on several nodes) it is the ranks per node: each node holds a whole sharded copy, so
    every rank holds 1/shard_ranks of the weights, gradients and AdamW state instead of 1/world_size.
    """

    activation_checkpointing: bool = False
    fsdp: bool = False
    autocast: bool = True
    frozen_bf16: bool = True
    attention: str = "flex"  # flex (CUDA) | exact (CPU path)
    loss_chunk_size: int = 4096
    data_bytes: int = 2  # dataset hidden states: bf16
    optimizer_state_bytes: int = 8  # AdamW: exp_avg + exp_avg_sq in fp32
    keep_full_head: bool = True
    device: str = "cuda"
    # not seen by torch's counters: CUDA context, NCCL buffers, slack; on CPU the process's own mappings
    reserve_gib: float = 1.0
    # process memory per byte of live tensors: 1 with CUDA's caching allocator (expandable segments); on CPU glibc
    # keeps freed blocks mapped, and the trainer's address space grew 1.43 x as fast as its live tensors (measured:
    # VmPeak of `eagle3 train` at max_seq_len 2048 and 8320, hidden 64); memory_limit_gb there is RLIMIT_AS
    allocator_factor: float = 1.0
    shard_ranks: int = 0

    @classmethod
    def from_run(cls, run: options.RunOptions, **memory) -> Options:
        """The memory view of resolved run options; `memory` sets the fields only the planner has."""
        return cls(
            activation_checkpointing=run.activation_checkpointing,
            fsdp=run.fsdp,
            autocast=run.autocast,
            frozen_bf16=run.frozen_bf16,
            attention=run.attention,
            loss_chunk_size=run.loss_chunk_size,
            device=run.device,
            shard_ranks=run.shard_ranks if run.hsdp else 0,
            **memory,
        )

    @property
    def act_bytes(self) -> int:
        """Bytes per element of matmul outputs: bf16 under autocast, fp32 otherwise."""
        return 2 if self.autocast else FP32

    @property
    def bf16_params(self) -> bool:
        """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): every weight the forward sees is bf16."""
        return self.fsdp and self.autocast

    @property
    def frozen_bytes(self) -> int:
        return 2 if self.frozen_bf16 else FP32

    def describe(self) -> dict:
        return dataclasses.asdict(self)

    def forward_kwargs(self) -> dict:
        """The ttt_forward keywords these options fix (the probe, the CPU tracker and the GPU check pass them)."""
        return {
            "activation_checkpointing": self.activation_checkpointing,
            "loss_chunk_size": self.loss_chunk_size,
            "attention": self.attention,
        }


def check_options(opts: Options, world_size: int) -> None:
    """Raise ConfigError for combinations the trainer cannot run, naming both options.

    >>> check_options(Options(attention="flex", device="cpu", reserve_gib=0), 1)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: attention=flex does not combine with device=cpu (flex_attention has no backward on CPU); use attention exact on CPU
    """
    if opts.attention not in ("flex", "exact"):
        raise ConfigError(f"attention={opts.attention!r} is not one of flex, exact")
    if opts.device not in ("cuda", "cpu"):
        raise ConfigError(f"device={opts.device!r} is not one of cuda, cpu")
    if opts.attention == "flex" and opts.device == "cpu":
        raise ConfigError(
            "attention=flex does not combine with device=cpu (flex_attention has no backward on CPU); "
            "use attention exact on CPU"
        )
    if opts.fsdp and world_size < 2:
        raise ConfigError(
            f"fsdp does not combine with world_size={world_size}: sharding over one rank saves nothing; "
            "drop --fsdp or plan for --world-size 2 or more"
        )
    if opts.shard_ranks and not opts.fsdp:
        raise ConfigError(f"shard_ranks={opts.shard_ranks} (hsdp) needs fsdp: HSDP is FSDP2 within a node")
    if opts.shard_ranks < 0 or (opts.shard_ranks and world_size % opts.shard_ranks):
        raise ConfigError(
            f"hsdp shards over {opts.shard_ranks} ranks per node, which does not divide world_size={world_size}; "
            "give --nproc-per-node with --nnodes"
        )
    if opts.frozen_bf16 and not opts.autocast:
        raise ConfigError(
            "frozen bf16 weights do not combine with dtype fp32 (the trainer keeps them in fp32 without autocast)"
        )
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be at least 1")
    if opts.loss_chunk_size < 0:
        raise ConfigError(
            f"loss_chunk_size={opts.loss_chunk_size} must be 0 (one pass over the row) or a chunk, for example 4096"
        )


# ----------------------------------------------------------------------------------------------- static


def static_terms(shape: Shape, opts: Options, world_size: int) -> dict[str, int]:
    """Bytes that do not depend on max_seq_len, per rank, by name.

    DDP (world_size > 1): fp32 weights, fp32 gradients, AdamW state and DDP's fp32 bucket copy of the gradients
    (gradient_as_bucket_view is off); frozen weights replicated (bf16 on CUDA). FSDP2 as eagle3/train.py does it
    (one fully_shard group over the whole drafter, bf16 parameters, fp32 reduction): every parameter, frozen ones
    included, sharded in fp32; weights and AdamW state of the trainable ones sharded; the whole drafter unsharded in
    bf16 for the forward and backward, with the bf16 gradients of the trainable weights; the target head rows
    outside the draft vocab are a buffer, replicated in fp32.

    >>> t = static_terms(SHAPES["kimi-k2.5"], Options(), 8)
    >>> round(sum(t.values()) / GIB, 1)
    18.9
    >>> t = static_terms(SHAPES["kimi-k2.5"], Options(fsdp=True), 8)
    >>> round(sum(t.values()) / GIB, 1)
    11.5

    HSDP over 2 nodes x 4 GPUs shards over the 4 ranks of a node, not all 8: larger shards.

    >>> t = static_terms(SHAPES["kimi-k2.5"], Options(fsdp=True, shard_ranks=4), 8)
    >>> round(sum(t.values()) / GIB, 1)
    13.7
    """
    p = shape.trainable_params()
    h, vt, vd = shape.hidden_size, shape.target_vocab_size, shape.draft_vocab_size
    rest = (vt - vd) * h if opts.keep_full_head and vd < vt else 0  # verifier_lm_head_rest, a buffer
    frozen = shape.frozen_params(opts.keep_full_head) - rest
    terms = {
        # d2t long[V_draft], t2d bool[V_target], rest_target_ids long[V_target - V_draft]
        "vocab_maps": 8 * vd + vt + (8 * (vt - vd) if rest else 0),
    }
    if opts.fsdp:
        param_bytes = 2 if opts.autocast else FP32
        shards = opts.shard_ranks or world_size  # HSDP: the ranks of one node
        terms |= {
            "weights_fp32_shard": FP32 * p // shards,
            "grads_fp32_shard": FP32 * p // shards,
            "optimizer_state_shard": opts.optimizer_state_bytes * p // shards,
            "frozen_weights_shard": FP32 * frozen // shards,
            "frozen_head_rest": FP32 * rest,
            "fsdp_unsharded_params": param_bytes * (p + frozen),
            "fsdp_unsharded_grads": param_bytes * p,
        }
        return terms
    terms |= {
        "weights_fp32": FP32 * p,
        "grads_fp32": FP32 * p,
        "optimizer_state": opts.optimizer_state_bytes * p,
        "frozen_weights": opts.frozen_bytes * (frozen + rest),
    }
    if world_size > 1:
        terms["ddp_buckets"] = FP32 * p
    return terms


def static_bytes(shape: Shape, opts: Options, world_size: int) -> int:
    return sum(static_terms(shape, opts, world_size).values())


def batch_bytes(shape: Shape, seq_len: int, opts: Options) -> int:
    """The packed row on the device: input_ids, document_ids, position_ids (long), loss_mask (bool),
    aux_hidden [S, 3H] and last_hidden [S, H] in the dataset dtype.

    >>> batch_bytes(SHAPES["tiny"], 128, Options(data_bytes=4)) == 128 * (8 * 3 + 1 + 4 * 4 * 64)
    True
    """
    return seq_len * (3 * 8 + 1 + opts.data_bytes * 4 * shape.hidden_size)


# ----------------------------------------------------------------------------------------------- activations


def step_held_terms(shape: Shape, seq_len: int, step: int, opts: Options) -> dict[str, int]:
    """Bytes the forward of TTT step `step` keeps for backward without activation checkpointing (model.py
    Eagle3DecoderLayer.forward, RMSNorm, apply_rope; attention.py; loss.py), per row of `seq_len` tokens.

    lp is the matmul output dtype (bf16 under autocast, fp32 otherwise); RMSNorm saves its fp32 input copy, the
    normalised tensor in the input dtype and the fp32 output that feeds the next matmul.
    """
    h, a, i, nh = shape.hidden_size, shape.attention_dim, shape.intermediate_size, shape.num_heads
    lp, fb, s = opts.act_bytes, opts.frozen_bytes, seq_len
    ac = opts.autocast
    # FSDP's bf16 parameters: RMSNorm weights are bf16 too, so norm outputs are bf16 and no matmul casts its input
    casts = 3 if ac and not opts.bf16_params else 1
    post_out = 4 * h if not opts.bf16_params else lp * h
    terms = {
        # input_layernorm(embeds): weight * normed saves normed in the embedding dtype
        "norm_embed": s * fb * h,
        # hidden_norm(hidden): fp32 copy of the input (aliases the fp32 input without autocast) + normed
        "norm_hidden": s * ((FP32 * h if ac else 0) + lp * h),
        # concat [S, 2H]: q/k/v each save their own bf16 cast under autocast, one shared fp32 tensor without
        "qkv_input": s * casts * 2 * h * lp,
        # post_attention_layernorm: fp32 input, normed, and the fp32 output (gate/up save a bf16 cast each)
        "norm_post": s * (FP32 * h + lp * h + post_out),
        "mlp": s * 4 * i * lp,  # gate, up, silu(gate), silu*up
        "step_output": s * lp * h,  # the new hidden: input of the next step and of the loss chunks
        "rope_tables": s * 2 * FP32 * shape.head_dim,  # cos, sin
        "loss_weight": s * FP32,
        "loss_grad": s * lp * h,  # FusedKL: the gradient of the step output, made in forward (loss.py)
        "lse": s * FP32 * nh,
    }
    kv = shape.kv_dim  # keys and values are kv_heads wide (grouped-query attention); q and the output are not
    if opts.attention == "exact":
        # q, k, v, out (k, v are also the cache of later steps)
        terms["attention"] = s * (2 * a + 2 * kv) * lp
    else:
        # flex saves q, the K/V concatenated over steps 0..step, its output, and o_proj saves the [S, A] copy
        terms["attention"] = s * (3 * a + 2 * (step + 1) * kv) * lp
    if step and shape.norm_output:
        terms["norm_output"] = norm_output_bytes(shape, seq_len, opts)
    return terms


def norm_output_bytes(shape: Shape, seq_len: int, opts: Options) -> int:
    """norm_output (EAGLE 3.1): the RMSNorm a step after the first applies to the hidden state it reads, outside
    any checkpoint: its fp32 input copy (an alias without autocast), the normed tensor and its fp32 output."""
    h, lp = shape.hidden_size, opts.act_bytes
    return seq_len * ((FP32 * h if opts.autocast else 0) + lp * h + FP32 * h)


def once_held_terms(shape: Shape, seq_len: int, opts: Options) -> dict[str, int]:
    """Bytes held once per row, not per step: fc's saved input and output, autocast's weight copies."""
    h, s, lp = shape.hidden_size, seq_len, opts.act_bytes
    # autocast saves its bf16 cast of aux_hidden; without autocast, fc's .to(fp32) copy unless already fp32
    no_copy = opts.data_bytes == (2 if opts.bf16_params else FP32)
    if opts.bf16_params:  # aux_hidden (bf16 data) goes into fc as it is: the batch itself is saved
        fc_input = 0 if no_copy else 2 * 3 * h
    else:
        fc_input = 2 * 3 * h if opts.autocast else (0 if no_copy else FP32 * 3 * h)
    if shape.norm_before_fc or shape.fc_norm:
        # one RMSNorm over 3H or three over H, the same bytes: the weight multiply saves the normed tensor in the
        # data dtype; its fp32 output takes the place of the fp32 copy fc would save (measured: tests/test_plan.py)
        fc_input += opts.data_bytes * 3 * h
    fc_output = lp * h if (opts.activation_checkpointing or not opts.autocast) else 0
    return {
        "fc_input": s * fc_input,
        "fc_output": s * fc_output,
        # autocast caches a bf16 copy of each trainable weight per forward; a matmul saves it when its input needs
        # a gradient: not fc's (aux_hidden has none), and under activation checkpointing none (made again later)
        "autocast_weight_copies": (
            0
            if not opts.autocast or opts.bf16_params or opts.activation_checkpointing
            else 2 * (shape.linear_params() - 3 * h * h)
        ),
    }


def checkpointed_step_terms(
    shape: Shape, seq_len: int, step: int, ttt_steps: int, opts: Options
) -> dict[str, int]:
    """What a step keeps with activation checkpointing: the inputs and outputs of its checkpoint."""
    kv, s, lp = shape.kv_dim, seq_len, opts.act_bytes
    return {
        "step_output": s * lp * shape.hidden_size,
        # this step's K/V, needed by later steps (the last step's are dropped at once)
        "kv_cache": s * 2 * kv * lp if step < ttt_steps - 1 else 0,
        "rope_tables": s * 2 * FP32 * shape.head_dim,
        "token_ids": s * 8,
        "loss_weight": s * FP32,
        "loss_grad": s * lp * shape.hidden_size,  # FusedKL: the gradient of the step output, made in forward
        "norm_output": norm_output_bytes(shape, seq_len, opts) if step and shape.norm_output else 0,
    }


def activation_terms(shape: Shape, seq_len: int, ttt_steps: int, opts: Options) -> dict[str, int]:
    """Bytes held at the end of the forward pass (summed over the TTT steps), by name."""
    terms = dict(once_held_terms(shape, seq_len, opts))
    mode = options.checkpoint_mode(opts.activation_checkpointing)
    for step in range(ttt_steps):
        if mode != "none":
            step_terms = checkpointed_step_terms(shape, seq_len, step, ttt_steps, opts)
            if mode == "selective":  # eagle3.model SAVED_OPS: the outputs of q/k/v, o, gate, up and down
                h, i = shape.hidden_size, shape.intermediate_size
                step_terms["kept_matmuls"] = (
                    seq_len * opts.act_bytes * (shape.attention_dim + 2 * shape.kv_dim + 2 * h + 2 * i)
                )
        else:
            step_terms = step_held_terms(shape, seq_len, step, opts)
        for name, value in step_terms.items():
            terms[name] = terms.get(name, 0) + value
    return terms


def activation_bytes(shape: Shape, seq_len: int, ttt_steps: int, opts: Options) -> int:
    """Bytes the forward of one packed row keeps for backward.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> round(activation_bytes(kimi, 32768, 5, Options()) / GIB, 1)
    73.5
    >>> round(activation_bytes(kimi, 32768, 5, Options(activation_checkpointing=True)) / GIB, 1)
    8.2
    """
    return sum(activation_terms(shape, seq_len, ttt_steps, opts).values())


def gqa_savings(shape: Shape, ttt_steps: int = 5, opts: Options | None = None) -> dict[str, int]:
    """What grouped-query attention saves against the multi-head drafter of the same shape: the bytes per
    token the forward keeps for backward (activation_bytes, the K/V of every TTT step), and the k/v_proj weights.

    A Llama-3.1-8B-like drafter (hidden 4096, 32 query heads x 128, 8 key/value heads), bf16 autocast, 5 TTT steps:
    flex (the CUDA default; it saves the K/V of steps 0..k at step k) keeps 180 KiB less per token, exact attention
    60 KiB, activation checkpointing (only the K/V cache of the steps before the last) 48 KiB; and 50.3 M fewer
    k/v_proj weights.

    >>> llama8b = Shape(4096, 32, 128, 14336, 32000, 128256, num_kv_heads=8)
    >>> gqa_savings(llama8b)
    {'activation_bytes_per_token': 184320, 'weights': 50331648}
    >>> gqa_savings(llama8b, opts=Options(attention="exact"))["activation_bytes_per_token"]
    61440
    >>> gqa_savings(llama8b, opts=Options(activation_checkpointing=True))["activation_bytes_per_token"]
    49152
    """
    opts = opts or Options()
    mha = dataclasses.replace(shape, num_kv_heads=None)

    def per_token(s: Shape) -> int:  # the slope in seq_len (autocast's weight copies do not grow with it)
        return activation_bytes(s, 2, ttt_steps, opts) - activation_bytes(s, 1, ttt_steps, opts)

    return {
        "activation_bytes_per_token": per_token(mha) - per_token(shape),
        "weights": mha.linear_params() - shape.linear_params(),
    }


def exact_block_elements(seq_len: int, block: int = EXACT_BLOCK) -> int:
    """Largest number of score elements per head the exact path's backward holds at once, one document filling
    the row: the probabilities and their gradient (two [q, R], q queries, keys from the document start to the
    block end; attention.py computes both in place) and the gradient left from the block before.

    >>> exact_block_elements(512)  # blocks of 256: 2 * 256 * 512 + 256 * 256
    327680
    >>> exact_block_elements(384)  # the last block has 128 queries: 2 * 128 * 384 + 256 * 256
    163840
    """
    best, previous = 0, 0
    for start in range(0, seq_len, block):
        queries = min(block, seq_len - start)
        current = queries * (start + queries)
        best = max(best, 2 * current + previous)
        previous = current
    return best


def transient_terms(shape: Shape, seq_len: int, ttt_steps: int, opts: Options) -> dict[str, int]:
    """The backward phases on top of the held bytes; the peak adds the largest (returned as a dict of phases).

    loss_chunk: the forward of the last step's loss (FusedKL makes the gradient there, nothing is recomputed): target
    probabilities, draft logits turned in place into log-probabilities and then into the logit gradient, their
    product, the matmul outputs: four fp32 [chunk, V] at once; one pass (loss_chunk_size 0, or a chunk that
    holds the row) adds the target probabilities of the whole row, made once and shared by every TTT step.
    decoder_step: backward of the last TTT step. MLP phase: the hidden gradient and three [S, I] gradients.
    Attention phase (the MLP and post-attention norm tensors of the step are freed by then): the gradients of q
    and of every K/V of steps 0..k (fp32 accumulators in the exact path, the flex outputs and rotary fp32
    intermediates on CUDA); the exact path adds its per-block tensors (exact_block_elements).
    With activation checkpointing the step's forward is recomputed first: its saved tensors come on top.
    """
    h, a, i, nh = shape.hidden_size, shape.attention_dim, shape.intermediate_size, shape.num_heads
    lp, s, k = opts.act_bytes, seq_len, ttt_steps - 1
    chunk = min(opts.loss_chunk_size or s, s)
    grad_h = s * lp * h
    one_pass = (
        opts.loss_chunk_size == 0 or opts.loss_chunk_size >= s
    )  # model.py: the target side once per row
    shared = FP32 * s * shape.draft_vocab_size if one_pass else 0
    loss_chunk = 4 * FP32 * chunk * shape.draft_vocab_size + shared
    last = step_held_terms(shape, seq_len, k, opts)
    mlp_phase = 2 * grad_h + s * 3 * i * lp
    kv = shape.kv_dim
    if opts.attention == "exact":
        attn = s * (a + (2 + 2 * k) * kv) * FP32 + FP32 * nh * exact_block_elements(s)
    else:
        attn = s * (a + 2 * (k + 1) * kv) * lp + s * FP32 * (a + kv)
    # Weight gradients: every TTT step adds into the same per-weight gradient buffer (in the matmul dtype: under
    # autocast the bf16 weight copy collects them before the cast back to fp32), which is passed on only after
    # the last use; so a phase holds the buffers of the weights already reached, plus one new weight gradient.
    layer = shape.linear_params() - 3 * h * h
    mlp_o = 3 * h * i + a * h
    largest = max(2 * h * a, h * i)
    attn_phase = grad_h + attn - last["mlp"] - last["norm_post"]
    # q/k/v input gradients: one per cast copy of the concat, summed in fp32 (attention tensors freed by then)
    casts = 3 if opts.autocast and not opts.bf16_params else 1
    qkv_phase = grad_h + s * 2 * h * (casts * lp + FP32) - last["mlp"] - last["norm_post"] - last["attention"]
    # Without checkpointing the peak is in the last step's backward, the first to fill the buffers (the MLP's
    # first); with it, every step's backward looks alike and the later steps have filled the buffers already.
    buffers = (layer, layer, layer) if opts.activation_checkpointing else (0, mlp_o, layer)
    phases = (mlp_phase, attn_phase, qkv_phase)
    decoder = max(p + lp * b for p, b in zip(phases, buffers, strict=True)) + lp * largest
    if opts.activation_checkpointing:
        # the recomputed forward saves what the plain step saves, except what lives outside the checkpoint
        outside = ("step_output", "loss_weight", "rope_tables", "norm_output")
        decoder += sum(v for name, v in last.items() if name not in outside)
        if options.checkpoint_mode(opts.activation_checkpointing) == "selective":
            decoder -= s * lp * 2 * i  # gate and up: kept from the forward (kept_matmuls), not made again
        if opts.autocast and not opts.bf16_params:
            decoder += 2 * layer  # the layer's bf16 weight copies, made again
    return {"loss_chunk": loss_chunk, "decoder_step": decoder}


def transient_bytes(shape: Shape, seq_len: int, ttt_steps: int, opts: Options) -> int:
    return max(transient_terms(shape, seq_len, ttt_steps, opts).values())


def dynamic_bytes(shape: Shape, seq_len: int, ttt_steps: int, opts: Options) -> int:
    """Held + largest transient: what eagle3.memtrack measures for one forward+backward (static state excluded)."""
    return activation_bytes(shape, seq_len, ttt_steps, opts) + transient_bytes(
        shape, seq_len, ttt_steps, opts
    )


def reduce_phase_bytes(shape: Shape, opts: Options) -> int:
    """FSDP's end of backward: the unsharded gradients cast to fp32 for the reduce-scatter (activations freed)."""
    return FP32 * shape.trainable_params() if opts.fsdp else 0


def predict_peak_bytes(shape: Shape, seq_len: int, ttt_steps: int, opts: Options, world_size: int = 1) -> int:
    """Peak bytes per rank, the reserve included.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> on = Options(activation_checkpointing=True, fsdp=True)
    >>> round(predict_peak_bytes(kimi, 32768, 5, on, world_size=8) / GIB, 1)
    39.4
    """
    dynamic = max(dynamic_bytes(shape, seq_len, ttt_steps, opts), reduce_phase_bytes(shape, opts))
    growing = int((batch_bytes(shape, seq_len, opts) + dynamic) * opts.allocator_factor)
    return static_bytes(shape, opts, world_size) + growing + int(opts.reserve_gib * GIB)


def breakdown(shape: Shape, seq_len: int, ttt_steps: int, opts: Options, world_size: int = 1) -> dict:
    """Every term of the prediction in GiB, for the table and the bench."""

    def gib(d: dict[str, int]) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in d.items() if v}

    return {
        "static": gib(static_terms(shape, opts, world_size)),
        "batch": round(batch_bytes(shape, seq_len, opts) / GIB, 3),
        "held": gib(activation_terms(shape, seq_len, ttt_steps, opts)),
        "transient": gib(transient_terms(shape, seq_len, ttt_steps, opts)),
        "reserve": opts.reserve_gib,
        "allocator_factor": opts.allocator_factor,
        "peak": round(predict_peak_bytes(shape, seq_len, ttt_steps, opts, world_size) / GIB, 3),
    }


# ----------------------------------------------------------------------------------------------- choosing a length


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
    shape: Shape
    options: Options
    ttt_steps: int
    world_size: int
    memory_gb: float
    margin: float
    max_seq_len: int | None
    predicted_gb: float | None
    static_gb: float
    table: list[dict]
    source: str = "analytic"  # or "probe"
    probe: dict | None = None
    nnodes: int = 1
    # the loss chunking memory needs at max_seq_len: 0 (one pass, fastest) when it fits, else a chunk size
    loss_chunk_size: int | None = None

    @property
    def shard_layout(self) -> str:
        """unsharded (DDP or one rank), full (FSDP over all ranks) or hsdp (FSDP within a node)."""
        return "unsharded" if not self.options.fsdp else "hsdp" if self.options.shard_ranks else "full"

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the sharded state spans (1 when unsharded)."""
        return self.options.shard_ranks or self.world_size if self.options.fsdp else 1

    def to_json(self) -> dict:
        return {
            "max_seq_len": self.max_seq_len,
            "predicted_gb": self.predicted_gb,
            "memory_gb": self.memory_gb,
            "margin": self.margin,
            "budget_gb": round(budget_bytes(self.memory_gb, self.margin) / GIB, 3),
            "static_gb": self.static_gb,
            "world_size": self.world_size,
            "nnodes": self.nnodes,
            "nproc_per_node": self.world_size // self.nnodes,
            "shard_layout": self.shard_layout,
            "shard_ranks": self.shard_ranks,
            "ttt_steps": self.ttt_steps,
            "source": self.source,
            "table": self.table,
            "options": self.options.describe(),
            "shape": dataclasses.asdict(self.shape),
            "probe": self.probe,
            "loss_chunk_size": self.loss_chunk_size,
        }


def make_plan(
    shape: Shape,
    opts: Options,
    *,
    ttt_steps: int,
    world_size: int,
    memory_gb: float,
    margin: float,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    predict: Callable[[int], int] | None = None,
) -> Plan:
    """The table for `lengths` and the largest fitting length. Raises ConfigError when the budget is below the
    static footprint or no length fits (the message carries the figures and what to change)."""
    check_options(opts, world_size)
    if ttt_steps < 1:
        raise ConfigError(f"ttt_steps={ttt_steps} must be at least 1 (default 5)")
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin={margin} must be in [0, 1), for example 0.1 (keep 10 % free)")
    if memory_gb <= 0:
        raise ConfigError(
            f"memory_gb={memory_gb} must be positive: the memory of one GPU in GiB, for example 96"
        )
    predict = predict or (lambda s: predict_peak_bytes(shape, s, ttt_steps, opts, world_size))
    budget = budget_bytes(memory_gb, margin)
    fixed = static_bytes(shape, opts, world_size) + int(opts.reserve_gib * GIB)
    static_gb = round(fixed / GIB, 3)
    if fixed >= budget:
        raise ConfigError(
            f"memory budget {budget / GIB:.1f} GiB ({memory_gb} GiB less {margin:.0%} margin) is below the static "
            f"footprint {static_gb:.1f} GiB (weights, gradients, optimizer, frozen heads, reserve) at "
            f"world_size={world_size}; use a larger GPU, more ranks with fsdp, or a smaller drafter"
        )
    table = []
    for s in lengths:
        peak = predict(s)
        table.append({"max_seq_len": s, "predicted_gb": round(peak / GIB, 3), "fits": peak <= budget})
    chosen = largest_fitting(predict, budget)
    if chosen is None:
        smallest = predict(SEQ_BLOCK) / GIB
        raise ConfigError(
            f"no max_seq_len fits: even {SEQ_BLOCK} tokens need {smallest:.1f} GiB against a budget of "
            f"{budget / GIB:.1f} GiB (static {static_gb:.1f} GiB); turn on activation_checkpointing or fsdp, "
            "or lower ttt_steps"
        )
    return Plan(
        shape=shape,
        options=opts,
        ttt_steps=ttt_steps,
        world_size=world_size,
        memory_gb=memory_gb,
        margin=margin,
        max_seq_len=chosen,
        predicted_gb=round(predict(chosen) / GIB, 3),
        static_gb=static_gb,
        table=table,
        loss_chunk_size=loss_chunk_choice(shape, chosen, ttt_steps, opts, world_size, budget),
    )


LOSS_CHUNKS = (4096, 2048, 1024, 512, 256)


def cpu_heap_chunk(shape: Shape, seq_len: int) -> int | None:
    """On CPU, the loss chunk that beats one pass: the largest of LOSS_CHUNKS whose fp32 [chunk, target vocab]
    tensors stay in glibc's heap, when the one pass's would not (docs/speed.md: 4-6 % per token at 16384 at the
    bench's shape); None when one pass is as fast (its tensors are in the heap too) or no chunk is.

    >>> tiny = Shape(64, 4, 16, 192, 512, 1024)
    >>> cpu_heap_chunk(tiny, 4096), cpu_heap_chunk(tiny, 8192), cpu_heap_chunk(tiny, 16384)
    (None, 4096, 4096)
    >>> cpu_heap_chunk(SHAPES["kimi-k2.5"], 16384) is None  # 256 rows of 163840 logits are 160 MiB already
    True
    """
    row_bytes = shape.target_vocab_size * 4
    if seq_len * row_bytes < options.GLIBC_MMAP_CEILING:
        return None
    return next((c for c in LOSS_CHUNKS if c < seq_len and c * row_bytes < options.GLIBC_MMAP_CEILING), None)


def loss_chunk_choice(
    shape: Shape, seq_len: int, ttt_steps: int, opts: Options, world_size: int, budget: int
):
    """The loss chunking memory needs at `seq_len`: 0 (one pass over the row, nothing recomputed, the target side
    made once; the fastest, docs/speed.md) when its peak fits `budget`, else the largest chunk of LOSS_CHUNKS
    that fits, else None. On CPU, where one pass's tensors are page-faulted in every step, the chunk of
    `cpu_heap_chunk` comes first.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> loss_chunk_choice(kimi, 8192, 5, Options(activation_checkpointing=True, fsdp=True), 8, budget_bytes(141, 0.1))
    0
    >>> loss_chunk_choice(kimi, 145280, 5, Options(activation_checkpointing=True, fsdp=True), 8, budget_bytes(141, 0.1))
    4096
    >>> tiny, cpu = Shape(64, 4, 16, 192, 512, 1024), Options(device="cpu", autocast=False, attention="exact")
    >>> [loss_chunk_choice(tiny, s, 5, cpu, 1, 2**31) for s in (4096, 16384)]
    [0, 4096]
    """
    heap = cpu_heap_chunk(shape, seq_len) if opts.device == "cpu" else None
    for chunk in (0, *LOSS_CHUNKS) if heap is None else (heap, 0, *LOSS_CHUNKS):
        o = dataclasses.replace(opts, loss_chunk_size=chunk)
        if predict_peak_bytes(shape, seq_len, ttt_steps, o, world_size) <= budget:
            return chunk
    return None


# The memory options from the fastest to the leanest (docs/speed.md): no checkpointing, selective (the step's matmul
# outputs kept), full (the step's forward recomputed).
CHECKPOINT_CHOICES = (False, "selective", "full")


def memory_options_choice(
    shape: Shape, seq_len: int, ttt_steps: int, opts: Options, world_size: int, budget: int
) -> tuple[bool | str, int] | None:
    """The fastest memory options that fit `budget` at `seq_len`: (activation_checkpointing, loss_chunk_size),
    checkpointing only when memory needs it and then the selective mode before the full one, each with the loss
    chunking it needs (loss_chunk_choice); None when nothing fits.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> memory_options_choice(kimi, 8192, 5, Options(fsdp=True), 8, budget_bytes(141, 0.1))
    (False, 0)
    >>> memory_options_choice(kimi, 32768, 5, Options(fsdp=True), 8, budget_bytes(141, 0.1))
    (False, 0)
    >>> memory_options_choice(kimi, 65536, 5, Options(fsdp=True), 8, budget_bytes(141, 0.1))
    ('selective', 0)
    >>> memory_options_choice(kimi, 131072, 5, Options(fsdp=True), 8, budget_bytes(141, 0.1))
    ('full', 0)
    """
    for mode in CHECKPOINT_CHOICES:
        o = dataclasses.replace(opts, activation_checkpointing=mode)
        chunk = loss_chunk_choice(shape, seq_len, ttt_steps, o, world_size, budget)
        if chunk is not None:
            return mode, chunk
    return None


# ----------------------------------------------------------------------------------------------- from a trainer config


def options_from_config(cfg, device: str, world_size: int = 1, nodes: int = 1) -> Options:
    """Options of a trainer config (eagle3.config.TrainConfig) on `device` (cuda | cpu | auto) and `world_size`
    ranks on `nodes` nodes, resolved by eagle3.options.resolve_options as the trainer resolves them, with the
    reserve and allocator of that device."""
    run = options.resolve_options(cfg, device, world_size, nodes)
    cuda = run.device == "cuda"
    return Options.from_run(
        run,
        reserve_gib=1.0 if cuda else cpu_reserve_gib(cfg.num_threads),
        allocator_factor=1.0 if cuda else CPU_ALLOCATOR_FACTOR,
    )


CPU_ALLOCATOR_FACTOR = 1.5  # see Options.allocator_factor


def cpu_reserve_gib(num_threads: int = 0) -> float:
    """Address space of a CPU trainer before its tensors: interpreter, torch, the mapped dataset shards and
    thread stacks (VmPeak 1.0 GiB at 3 threads, measured), plus 64 MiB of malloc arena per extra thread.

    >>> cpu_reserve_gib(3)
    1.125
    """
    threads = num_threads or os.cpu_count() or 1
    return 1.0 + max(threads - 1, 0) * 0.0625
