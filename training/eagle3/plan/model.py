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

from eagle3.spec import (
    FP32,
    SHAPES,  # noqa: F401 (the named shapes of the examples below)
    DrafterConfig,
    RunSpec,
    spec_for,
)

GIB = 1 << 30
MAX_SEARCH_LEN = 1048576
DEFAULT_LENGTHS = (4096, 8192, 16384, 24576, 32768, 49152, 65536)
# Query block of the exact (CPU) attention path: eagle3.attention.DEFAULT_BLOCK_SIZE (not imported: torch).
EXACT_BLOCK = 256


def on_cuda(drafter: DrafterConfig, world_size: int = 1, nodes: int = 1, data_bytes: int = 2, **config) -> RunSpec:
    """A drafter on CUDA under trainer config keys, the trainer's defaults otherwise (bf16 autocast, flex attention,
    no checkpointing, loss chunks of 4096): the examples here use it."""
    return spec_for(drafter, world_size, nodes, data_bytes, device="cuda", **config)


# ----------------------------------------------------------------------------------------------- context parallel


def local_len(spec: RunSpec, seq_len: int) -> int:
    """Slots of the row one rank holds: max_seq_len / context_parallel (eagle3.context)."""
    return seq_len // spec.run.context_parallel


def kv_width(spec: RunSpec) -> int:
    """Numbers per local slot of one key (or value) tensor in the attention's layout. Without context parallelism the
    key heads' width; with it a rank holds kv_heads/cp heads over the whole row, or one repeated head when cp is
    larger (MLA: the whole latent on every rank), so per local slot max(kv_heads, cp) heads.

    >>> llama = on_cuda(DrafterConfig(4096, 32, 128, 14336, 32000, 128256, num_kv_heads=8), 8, context_parallel=8)
    >>> kv_width(llama) == 8 * 128, kv_width(on_cuda(SHAPES["kimi-k2.5-mla"], 8, context_parallel=8)) == 8 * 576
    (True, True)
    """
    d = spec.drafter
    width = d.mla.latent_dim if d.mla is not None else d.head_dim
    return max(d.attention_kv_heads, spec.run.context_parallel) * width


def all_to_all_bytes(spec: RunSpec, seq_len: int) -> int:
    """The backward's exchanges at the attention (eagle3.context): the gradients of q, k and v sent back to the
    sequence layout, each as a contiguous send copy and a receive buffer at once; 0 without context parallelism."""
    if spec.run.context_parallel == 1:
        return 0
    d, s = spec.drafter, local_len(spec, seq_len)
    q = d.mla.num_heads * d.mla.latent_dim if d.mla is not None else d.attention_dim
    kv = kv_width(spec) if d.mla is not None else 2 * kv_width(spec)
    return 2 * s * (q + kv) * spec.act_bytes


# ----------------------------------------------------------------------------------------------- static


def static_terms(spec: RunSpec) -> dict[str, int]:
    """Bytes that do not depend on max_seq_len, per rank, by name.

    DDP (spec.run.world_size > 1): fp32 weights, fp32 gradients, AdamW state and DDP's fp32 bucket copy of the gradients
    (gradient_as_bucket_view is off); frozen weights replicated (bf16 on CUDA). FSDP2 as eagle3/train.py does it
    (one fully_shard group over the whole drafter, bf16 parameters, fp32 reduction): every parameter, frozen ones
    included, sharded in fp32; weights and AdamW state of the trainable ones sharded; the whole drafter unsharded in
    bf16 for the forward and backward, with the bf16 gradients of the trainable weights; the target head rows
    outside the draft vocab are a buffer, replicated in fp32.

    >>> t = static_terms(on_cuda(SHAPES["kimi-k2.5"], world_size=8))
    >>> round(sum(t.values()) / GIB, 1)
    18.9
    >>> t = static_terms(on_cuda(SHAPES["kimi-k2.5"], world_size=8, fsdp=True))
    >>> round(sum(t.values()) / GIB, 1)
    11.5

    HSDP over 2 nodes x 4 GPUs shards over the 4 ranks of a node, not all 8: larger shards.

    >>> t = static_terms(on_cuda(SHAPES["kimi-k2.5"], world_size=8, nodes=2, fsdp=True, shard_layout="hsdp"))
    >>> round(sum(t.values()) / GIB, 1)
    13.7
    """
    p = spec.drafter.trainable_params()
    h, vt, vd = spec.drafter.hidden_size, spec.drafter.target_vocab_size, spec.drafter.draft_vocab_size
    rest = (vt - vd) * h if spec.keep_full_head and vd < vt else 0  # verifier_lm_head_rest, a buffer
    frozen = spec.drafter.frozen_params(spec.keep_full_head) - rest
    terms = {
        # d2t long[V_draft], t2d bool[V_target], rest_target_ids long[V_target - V_draft]
        "vocab_maps": 8 * vd + vt + (8 * (vt - vd) if rest else 0),
    }
    if spec.run.sharded:
        param_bytes = 2 if spec.run.autocast else FP32
        shards = spec.run.shard_ranks  # HSDP: the ranks of one node
        terms |= {
            "weights_fp32_shard": FP32 * p // shards,
            "grads_fp32_shard": FP32 * p // shards,
            "optimizer_state_shard": spec.optimizer_state_bytes * p // shards,
            "frozen_weights_shard": FP32 * frozen // shards,
            "frozen_head_rest": FP32 * rest,
            "fsdp_unsharded_params": param_bytes * (p + frozen),
            "fsdp_unsharded_grads": param_bytes * p,
        }
        return terms
    terms |= {
        "weights_fp32": FP32 * p,
        "grads_fp32": FP32 * p,
        "optimizer_state": spec.optimizer_state_bytes * p,
        "frozen_weights": spec.frozen_bytes * (frozen + rest),
    }
    if spec.run.world_size > 1:
        terms["ddp_buckets"] = FP32 * p
    return terms


def static_bytes(spec: RunSpec) -> int:
    return sum(static_terms(spec).values())


def batch_bytes(spec: RunSpec, seq_len: int) -> int:
    """The packed row on the device: input_ids, document_ids, position_ids (long), loss_mask (bool),
    aux_hidden [S, 3H] and last_hidden [S, H] in the dataset dtype.

    >>> batch_bytes(on_cuda(SHAPES["tiny"], data_bytes=4), 128) == 128 * (8 * 3 + 1 + 4 * 4 * 64)
    True

    Context parallelism: the id vectors whole, the hidden states of this rank's slots (last_hidden with the
    ttt_steps slots of the halo).
    """
    s, h = local_len(spec, seq_len), spec.drafter.hidden_size
    halo = spec.run.ttt_steps if spec.run.context_parallel > 1 else 0
    return seq_len * (3 * 8 + 1) + spec.data_bytes * h * (4 * s + halo)


# ----------------------------------------------------------------------------------------------- activations


def step_held_terms(spec: RunSpec, seq_len: int, step: int) -> dict[str, int]:
    """Bytes the forward of TTT step `step` keeps for backward without activation checkpointing (model.py
    Eagle3DecoderLayer.forward, RMSNorm, apply_rope; attention.py; loss.py), per row of `seq_len` tokens.

    lp is the matmul output dtype (bf16 under autocast, fp32 otherwise); RMSNorm saves its fp32 input copy, the
    normalised tensor in the input dtype and the fp32 output that feeds the next matmul.
    """
    h, a, i, nh = (
        spec.drafter.hidden_size,
        spec.drafter.attention_dim,
        spec.drafter.intermediate_size,
        spec.drafter.num_heads,
    )
    lp, fb, s = spec.act_bytes, spec.frozen_bytes, local_len(spec, seq_len)
    ac = spec.run.autocast
    casts = input_casts(spec)
    post_out = 4 * h if not spec.bf16_params else lp * h
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
        "rope_tables": s * 2 * FP32 * spec.drafter.rope_dim,  # cos, sin
        "loss_weight": s * FP32,
        "loss_grad": s * lp * h,  # FusedKL: the gradient of the step output, made in forward (loss.py)
        "lse": s * FP32 * nh,
    }
    if spec.drafter.mla is not None:
        terms |= mla_held_terms(spec, seq_len, step)
    elif spec.run.attention == "exact":
        # q, k, v, out (k, v are also the cache of later steps); keys and values are kv_heads wide (GQA)
        terms["attention"] = s * (2 * a + 2 * kv_width(spec)) * lp
    else:
        # flex saves q, the K/V concatenated over steps 0..step, its output, and o_proj saves the [S, A] copy
        terms["attention"] = s * (3 * a + 2 * (step + 1) * kv_width(spec)) * lp
    if step and spec.drafter.norm_output:
        terms["norm_output"] = norm_output_bytes(spec, seq_len)
    return terms


def input_casts(spec: RunSpec) -> int:
    """Copies of the [S, 2H] concat the attention's matmuls save: under autocast each casts it to bf16 for itself
    (q, k, v; MLA: q_a or q, kv_a), otherwise they share it. FSDP's bf16 parameters: the RMSNorm weights are bf16
    too, so the concat is bf16 already and no matmul casts it."""
    if not spec.run.autocast or spec.bf16_params:
        return 1
    return 3 if spec.drafter.mla is None else 2


def cache_width(spec: RunSpec) -> int:
    """Numbers per local slot a TTT step keeps for the later steps: its K and V (kv_heads wide), or MLA's one latent
    (kv_width: their layout under context parallelism)."""
    return kv_width(spec) if spec.drafter.mla is not None else 2 * kv_width(spec)


def kept_matmul_width(d: DrafterConfig) -> int:
    """Numbers per token selective checkpointing keeps: the outputs of the layer's 2-D matmuls (eagle3.model
    SAVED_OPS; MLA's per-head einsums into and out of the latent are batched matmuls, recomputed)."""
    h, i, m = d.hidden_size, d.intermediate_size, d.mla
    if m is None:
        return d.attention_dim + 2 * d.kv_dim + 2 * h + 2 * i  # q, k, v, o, down, gate, up
    q = m.q_lora_rank + m.num_heads * m.qk_head_dim if m.q_lora_rank else m.num_heads * m.qk_head_dim
    return q + m.latent_dim + 2 * h + 2 * i  # q_a/q_b (or q), kv_a, o, down, gate, up


def largest_attention_weight(d: DrafterConfig) -> int:
    h, m = d.hidden_size, d.mla
    if m is None:
        return 2 * h * d.attention_dim
    heads = m.num_heads
    q = (
        (2 * h * m.q_lora_rank, m.q_lora_rank * heads * m.qk_head_dim)
        if m.q_lora_rank
        else (2 * h * heads * m.qk_head_dim,)
    )
    return max(
        *q,
        2 * h * m.latent_dim,
        m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim),
        heads * m.v_head_dim * h,
    )


def mla_held_terms(spec: RunSpec, seq_len: int, step: int) -> dict[str, int]:
    """What an MLA step's attention keeps for backward (eagle3.mla.MLAAttention.forward), per row.

    The concat's casts for q_a (or q) and kv_a; q_a_layernorm's fp32 copy and normed tensor and q_b's input; the
    queries (their no-position part is saved by the einsum into the latent); the scaled latent-space queries; the
    latent's norm (its fp32 copy, or without autocast the fp32 kv_a output it aliases, and the normed tensor); this
    step's latent (exact) or the latents of steps 0..step concatenated once for keys and values (flex); the
    attention's output (saved again, as a view, by the einsum out of the latent); o_proj's input.
    """
    d, m = spec.drafter, spec.drafter.mla
    lp, s, heads = spec.act_bytes, local_len(spec, seq_len), m.num_heads
    q_low = (FP32 + 2 * lp) * m.q_lora_rank if m.q_lora_rank else 0
    latent_norm = (FP32 * m.kv_lora_rank if spec.run.autocast else FP32 * m.latent_dim) + lp * m.kv_lora_rank
    keys = kv_width(spec) * (1 if spec.run.attention == "exact" else step + 1)
    per_token = (
        q_low
        + lp * heads * m.qk_head_dim
        + lp * heads * m.latent_dim
        + latent_norm
        + lp * keys
        + lp * heads * m.latent_dim
        + lp * heads * m.v_head_dim
    )
    return {"qkv_input": s * input_casts(spec) * 2 * d.hidden_size * lp, "attention": s * per_token}


def attention_grad_bytes(spec: RunSpec, seq_len: int, k: int) -> int:
    """The attention's backward at the last step (k = ttt_steps - 1): the gradients of q and of every step's keys
    and values (fp32 accumulators in the exact path, with its per-block tensors; the flex outputs and the rotary
    fp32 intermediates on CUDA). MLA: heads of latent width against one latent per step, passed as keys and as
    values (two gradients, summed)."""
    d, s, lp = spec.drafter, local_len(spec, seq_len), spec.act_bytes
    m = d.mla
    if m is None:
        q, kv, rot = d.attention_dim, kv_width(spec), d.attention_dim + d.kv_dim
    else:
        q, kv, rot = m.num_heads * m.latent_dim, kv_width(spec), (m.num_heads + 1) * m.qk_rope_head_dim
    if spec.run.attention == "exact":  # the blocks span the whole row, for this rank's share of the heads
        heads = d.num_heads // spec.run.context_parallel
        return s * (q + (2 + 2 * k) * kv) * FP32 + FP32 * heads * exact_block_elements(seq_len)
    return s * (q + 2 * (k + 1) * kv) * lp + s * FP32 * rot


def norm_output_bytes(spec: RunSpec, seq_len: int) -> int:
    """norm_output (EAGLE 3.1): the RMSNorm a step after the first applies to the hidden state it reads, outside
    any checkpoint: its fp32 input copy (an alias without autocast), the normed tensor and its fp32 output."""
    h, lp = spec.drafter.hidden_size, spec.act_bytes
    return local_len(spec, seq_len) * ((FP32 * h if spec.run.autocast else 0) + lp * h + FP32 * h)


def once_held_terms(spec: RunSpec, seq_len: int) -> dict[str, int]:
    """Bytes held once per row, not per step: fc's saved input and output, autocast's weight copies."""
    h, s, lp = spec.drafter.hidden_size, local_len(spec, seq_len), spec.act_bytes
    # autocast saves its bf16 cast of aux_hidden; without autocast, fc's .to(fp32) copy unless already fp32
    no_copy = spec.data_bytes == (2 if spec.bf16_params else FP32)
    if spec.bf16_params:  # aux_hidden (bf16 data) goes into fc as it is: the batch itself is saved
        fc_input = 0 if no_copy else 2 * 3 * h
    else:
        fc_input = 2 * 3 * h if spec.run.autocast else (0 if no_copy else FP32 * 3 * h)
    if spec.drafter.norm_before_fc or spec.drafter.fc_norm:
        # one RMSNorm over 3H or three over H, the same bytes: the weight multiply saves the normed tensor in the
        # data dtype; its fp32 output takes the place of the fp32 copy fc would save (measured: tests/test_plan.py)
        fc_input += spec.data_bytes * 3 * h
    fc_output = lp * h if (spec.checkpointing or not spec.run.autocast) else 0
    return {
        "fc_input": s * fc_input,
        "fc_output": s * fc_output,
        # autocast caches a bf16 copy of each trainable weight per forward; a matmul saves it when its input needs
        # a gradient: not fc's (aux_hidden has none), and under activation checkpointing none (made again later)
        "autocast_weight_copies": (
            0
            if not spec.run.autocast or spec.bf16_params or spec.checkpointing
            else 2 * (spec.drafter.linear_params() - 3 * h * h)
        ),
    }


def checkpointed_step_terms(spec: RunSpec, seq_len: int, step: int) -> dict[str, int]:
    """What a step keeps with activation checkpointing: the inputs and outputs of its checkpoint."""
    s, lp = local_len(spec, seq_len), spec.act_bytes
    return {
        "step_output": s * lp * spec.drafter.hidden_size,
        # this step's K/V, needed by later steps (the last step's are dropped at once)
        "kv_cache": s * cache_width(spec) * lp if step < spec.run.ttt_steps - 1 else 0,
        "rope_tables": s * 2 * FP32 * spec.drafter.rope_dim,
        "token_ids": seq_len * 8,  # the shifted ids of the whole row (a rank's slots are a view of them)
        "loss_weight": s * FP32,
        "loss_grad": s * lp * spec.drafter.hidden_size,  # FusedKL: the gradient of the step output, made in forward
        "norm_output": norm_output_bytes(spec, seq_len) if step and spec.drafter.norm_output else 0,
    }


def activation_terms(spec: RunSpec, seq_len: int) -> dict[str, int]:
    """Bytes held at the end of the forward pass (summed over the TTT steps), by name."""
    terms = dict(once_held_terms(spec, seq_len))
    mode = spec.run.activation_checkpointing
    for step in range(spec.run.ttt_steps):
        if mode != "none":
            step_terms = checkpointed_step_terms(spec, seq_len, step)
            if mode == "selective":  # eagle3.model SAVED_OPS: the outputs of the layer's matmuls
                step_terms["kept_matmuls"] = local_len(spec, seq_len) * spec.act_bytes * kept_matmul_width(spec.drafter)
        else:
            step_terms = step_held_terms(spec, seq_len, step)
        for name, value in step_terms.items():
            terms[name] = terms.get(name, 0) + value
    if spec.run.attention == "flex":  # every step's BlockMask, held through the forward and the backward
        terms["block_masks"] = block_mask_bytes(seq_len, spec.run.ttt_steps)
    return terms


def activation_bytes(spec: RunSpec, seq_len: int) -> int:
    """Bytes the forward of one packed row keeps for backward.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> round(activation_bytes(on_cuda(kimi), 32768) / GIB, 1)
    73.5
    >>> round(activation_bytes(on_cuda(kimi, activation_checkpointing=True), 32768) / GIB, 1)
    8.2
    """
    return sum(activation_terms(spec, seq_len).values())


def gqa_savings(spec: RunSpec) -> dict[str, int]:
    """What grouped-query attention saves against the multi-head drafter of the same shape: the bytes per
    token the forward keeps for backward (activation_bytes, the K/V of every TTT step), and the k/v_proj weights.

    A Llama-3.1-8B-like drafter (hidden 4096, 32 query heads x 128, 8 key/value heads), bf16 autocast, 5 TTT steps:
    flex (the CUDA default; it saves the K/V of steps 0..k at step k) keeps 180 KiB less per token, exact attention
    60 KiB, activation checkpointing (only the K/V cache of the steps before the last) 48 KiB; and 50.3 M fewer
    k/v_proj weights.

    >>> llama8b = DrafterConfig(4096, 32, 128, 14336, 32000, 128256, num_kv_heads=8)
    >>> gqa_savings(on_cuda(llama8b))
    {'activation_bytes_per_token': 184320, 'weights': 50331648}
    >>> gqa_savings(on_cuda(llama8b, attention="exact"))["activation_bytes_per_token"]
    61440
    >>> gqa_savings(on_cuda(llama8b, activation_checkpointing=True))["activation_bytes_per_token"]
    49152
    """
    mha = dataclasses.replace(spec, drafter=dataclasses.replace(spec.drafter, num_kv_heads=None))

    def per_token(s: RunSpec) -> int:  # the slope in seq_len (autocast's weight copies do not grow with it)
        return activation_bytes(s, 2) - activation_bytes(s, 1)

    return {
        "activation_bytes_per_token": per_token(mha) - per_token(spec),
        "weights": mha.drafter.linear_params() - spec.drafter.linear_params(),
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


def transient_terms(spec: RunSpec, seq_len: int) -> dict[str, int]:
    """The backward phases on top of the held bytes; the peak adds the largest (returned as a dict of phases).

    loss_chunk: the forward of the last step's loss (FusedKL makes the gradient there, nothing is recomputed): target
    probabilities, draft logits turned in place into log-probabilities and then into the logit gradient, their
    product, the matmul outputs: four fp32 [chunk, V] at once, and with the LK share of the loss (lk_weight > 0) a
    one-byte mask of that size (measured: its other temporaries come after the peak's buffers are freed); one pass (loss_chunk_size 0, or a chunk that
    holds the row) adds the target probabilities of the whole row, made once and shared by every TTT step.
    decoder_step: backward of the last TTT step. MLP phase: the hidden gradient and three [S, I] gradients.
    Attention phase (the MLP and post-attention norm tensors of the step are freed by then): the gradients of q
    and of every K/V of steps 0..k (fp32 accumulators in the exact path, the flex outputs and rotary fp32
    intermediates on CUDA); the exact path adds its per-block tensors (exact_block_elements).
    With activation checkpointing the step's forward is recomputed first: its saved tensors come on top.
    """
    h, a, i = spec.drafter.hidden_size, spec.drafter.attention_dim, spec.drafter.intermediate_size
    lp, s, k = spec.act_bytes, local_len(spec, seq_len), spec.run.ttt_steps - 1
    chunk = min(spec.run.loss_chunk_size or s, s)
    grad_h = s * lp * h
    one_pass = spec.run.loss_chunk_size == 0 or spec.run.loss_chunk_size >= s  # model.py: the target side once per row
    shared = FP32 * s * spec.drafter.draft_vocab_size if one_pass else 0
    per_element = 4 * FP32 + (1 if spec.run.lk_weight > 0 else 0)
    loss_chunk = per_element * chunk * spec.drafter.draft_vocab_size + shared
    last = step_held_terms(spec, seq_len, k)
    mlp_phase = 2 * grad_h + s * 3 * i * lp
    attn = attention_grad_bytes(spec, seq_len, k)
    # Weight gradients: every TTT step adds into the same per-weight gradient buffer (in the matmul dtype: under
    # autocast the bf16 weight copy collects them before the cast back to fp32), which is passed on only after
    # the last use; so a phase holds the buffers of the weights already reached, plus one new weight gradient.
    layer = spec.drafter.linear_params() - 3 * h * h
    m = spec.drafter.mla
    mlp_o = 3 * h * i + (m.num_heads * m.v_head_dim * h if m else a * h)
    largest = max(largest_attention_weight(spec.drafter), h * i)
    attn_phase = grad_h + attn + all_to_all_bytes(spec, seq_len) - last["mlp"] - last["norm_post"]
    # the attention's input gradients: one per cast copy of the concat, summed in fp32 (attention tensors freed)
    casts = input_casts(spec)
    qkv_phase = grad_h + s * 2 * h * (casts * lp + FP32) - last["mlp"] - last["norm_post"] - last["attention"]
    # Without checkpointing the peak is in the last step's backward, the first to fill the buffers (the MLP's
    # first); with it, every step's backward looks alike and the later steps have filled the buffers already.
    buffers = (layer, layer, layer) if spec.checkpointing else (0, mlp_o, layer)
    phases = (mlp_phase, attn_phase, qkv_phase)
    decoder = max(p + lp * b for p, b in zip(phases, buffers, strict=True)) + lp * largest
    if spec.checkpointing:
        # the recomputed forward saves what the plain step saves, except what lives outside the checkpoint
        outside = ("step_output", "loss_weight", "rope_tables", "norm_output")
        decoder += sum(v for name, v in last.items() if name not in outside)
        if spec.run.activation_checkpointing == "selective":
            decoder -= s * lp * 2 * i  # gate and up: kept from the forward (kept_matmuls), not made again
        if spec.run.autocast and not spec.bf16_params:
            decoder += 2 * layer  # the layer's bf16 weight copies, made again
    return {"loss_chunk": loss_chunk, "decoder_step": decoder}


def transient_bytes(spec: RunSpec, seq_len: int) -> int:
    return max(transient_terms(spec, seq_len).values())


def dynamic_bytes(spec: RunSpec, seq_len: int) -> int:
    """Held + largest transient: what eagle3.memtrack measures for one forward+backward (static state excluded)."""
    return activation_bytes(spec, seq_len) + transient_bytes(spec, seq_len)


def reduce_phase_bytes(spec: RunSpec) -> int:
    """FSDP's end of backward: the unsharded gradients cast to fp32 for the reduce-scatter (activations freed)."""
    return FP32 * spec.drafter.trainable_params() if spec.run.sharded else 0


def predict_peak_bytes(spec: RunSpec, seq_len: int) -> int:
    """Peak bytes per rank, the reserve included.

    >>> kimi = SHAPES["kimi-k2.5"]
    >>> on = on_cuda(kimi, world_size=8, activation_checkpointing=True, fsdp=True)
    >>> round(predict_peak_bytes(on, 32768) / GIB, 1)
    39.4
    """
    dynamic = max(dynamic_bytes(spec, seq_len), reduce_phase_bytes(spec))
    growing = int((batch_bytes(spec, seq_len) + dynamic) * spec.allocator_factor)
    return static_bytes(spec) + growing + int(spec.reserve_gib * GIB)


def breakdown(spec: RunSpec, seq_len: int) -> dict:
    """Every term of the prediction in GiB, for the table and the bench."""

    def gib(d: dict[str, int]) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in d.items() if v}

    return {
        "static": gib(static_terms(spec)),
        "batch": round(batch_bytes(spec, seq_len) / GIB, 3),
        "held": gib(activation_terms(spec, seq_len)),
        "transient": gib(transient_terms(spec, seq_len)),
        "reserve": spec.reserve_gib,
        "allocator_factor": spec.allocator_factor,
        "peak": round(predict_peak_bytes(spec, seq_len) / GIB, 3),
    }


def block_mask_bytes(seq_len: int, ttt_steps: int, block: int = 128) -> int:
    """Bytes of the flex BlockMasks of all TTT steps, held together (TTTAttention keeps every step's mask for the
    whole forward and backward); eagle3.blockmask builds them.

    Step k has nQ = ceil(S / block) query blocks and nKV = ceil(S * (k + 1) / block) key blocks; its int32 tensors
    are kv_indices and full_kv_indices [nQ, nKV], their transposes q_indices and full_q_indices [nKV, nQ]
    (BlockMask.from_kv_blocks), and the four block counts ([nQ] twice, [nKV] twice).

    >>> [round(block_mask_bytes(s, 5) / 2**20, 1) for s in (32768, 131072, 262144)]  # MiB
    [15.0, 240.2, 960.3]
    >>> block_mask_bytes(32768, 5), block_mask_bytes(131072, 5), block_mask_bytes(262144, 5)
    (15769600, 251822080, 1006960640)
    """
    n_q = -(-seq_len // block)
    total = 0
    for step in range(ttt_steps):
        n_kv = -(-seq_len * (step + 1) // block)
        total += 4 * (4 * n_q * n_kv + 2 * (n_q + n_kv))
    return total
