"""Attention of the EAGLE-3 drafter during training-time test (TTT), for one packed row.

At TTT step k the query at slot j sees (docs/facts.md#training-time-test):

* the step-0 keys of its own document at slots <= j (causal, within the document), and
* exactly one key per later step 1..k, the one at the same slot j (the "diagonal").

Worked example, two documents `[0, 0, 1]`, step 1 (keys are step 0 slots 0..2, then step 1 slots 0..2):

    query 0: step-0 {0}      + step-1 {0}
    query 1: step-0 {0, 1}   + step-1 {1}
    query 2: step-0 {2}      + step-1 {2}     (document 1 starts at slot 2)

Padding slots (document id -1) see only their own slot at every step.

Two implementations with the same result:

* `flex`: `torch.nn.attention.flex_attention` over the concatenated K/V of steps 0..k with a
  document BlockMask built once per step (`B=None, H=None`) from the document starts, block by block
  (eagle3.blockmask, never the S x S grid); flex_attention is compiled on CUDA. On CPU the forward
  works (eager) but there is no backward, so it is used there only to check parity.
* `exact`: a blockwise attention with its own backward (`BlockwiseTTTAttention`): per block of
  queries it scores only the step-0 keys from the block's first document start to the block end,
  plus the diagonal keys. It saves q, k, v, the output and the log-sum-exp for backward and
  recomputes the scores block by block, so memory is O(S * block), never S x S.

Grouped-query attention: q has `heads` heads, every key/value `kv_heads` (a divisor); query head h
reads key/value head h // (heads / kv_heads), as HF's repeat_kv. flex gets `enable_gqa=True`; the
exact path expands each block's key/value span only (`_expand_kv`) and sums the key/value gradients
back over the group (`_fold_kv`), so no full-length copy of the cache is ever made.

Documents must be contiguous runs of one id (packing guarantees it); `validate_document_ids` checks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eagle3.blockmask import document_block_mask, document_starts
from eagle3.errors import DataError
from eagle3.options import attention_for

ATTENTION_KINDS = ("auto", "flex", "exact")

# Query block of the exact path. 256 keeps the per-block score tensor small ([heads, 256, doc span])
# while the per-block Python overhead stays negligible at S = 16384 (64 blocks per step).
DEFAULT_BLOCK_SIZE = 256


def validate_document_ids(document_ids: torch.Tensor) -> None:
    """Raise DataError unless every document id >= 0 occupies one contiguous run of slots.

    >>> validate_document_ids(torch.tensor([0, 0, 1, -1]))
    >>> validate_document_ids(torch.tensor([0, 1, 0]))
    Traceback (most recent call last):
    ...
    eagle3.errors.DataError: document_ids: document 0 appears in 2 separate runs (first at slots 0 and 2); packing must place each document in one contiguous run
    """
    if document_ids.dim() != 1:
        raise DataError(f"document_ids has shape {list(document_ids.shape)}, expected [S] (one packed row)")
    ids = document_ids.detach().cpu()
    begins = torch.ones_like(ids, dtype=torch.bool)
    begins[1:] = ids[1:] != ids[:-1]
    run_ids = ids[begins & (ids >= 0)]
    unique, counts = torch.unique(run_ids, return_counts=True)
    if bool((counts > 1).any()):
        doc = int(unique[counts > 1][0])
        first = torch.nonzero(begins & (ids == doc)).flatten()[:2].tolist()
        raise DataError(
            f"document_ids: document {doc} appears in {int(counts[counts > 1][0])} separate runs "
            f"(first at slots {first[0]} and {first[1]}); packing must place each document in one contiguous run"
        )


def resolve_attention(kind: str, device: torch.device) -> str:
    """'auto' means flex on CUDA and exact elsewhere.

    >>> resolve_attention("auto", torch.device("cpu"))
    'exact'
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention={kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
    return attention_for(kind, device.type)


def _query_blocks(doc_start: torch.Tensor, block_size: int) -> Iterator[tuple[int, int, int, int]]:
    """(first query a, end query b, first key, last document start) per block of queries.

    Keys of a block run from its first query's document start to b; keys before the block's last
    document start are the only ones a document boundary can hide.

    >>> list(_query_blocks(torch.tensor([0, 0, 2, 2, 2]), 2))
    [(0, 2, 0, 0), (2, 4, 2, 2), (4, 5, 2, 2)]
    """
    seq_len = doc_start.shape[0]
    firsts = doc_start[::block_size].tolist()  # two host syncs per call, not two per block
    lasts = [*doc_start[block_size - 1 :: block_size].tolist(), int(doc_start[-1])]
    for n, key_start in enumerate(firsts):
        a = n * block_size
        yield a, min(a + block_size, seq_len), int(key_start), int(lasts[n])


def _acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: fp32 for bf16/fp16/fp32 inputs, fp64 stays fp64 (gradcheck in tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _acc_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[kv_heads, ...] -> [kv_heads * groups, ...], each key/value head repeated for its group of query heads.

    >>> _expand_kv(torch.tensor([[1.0], [2.0]]), 2).flatten().tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    return t if groups == 1 else t.repeat_interleave(groups, dim=0)


def _fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand_kv`: [kv_heads * groups, ...] summed back to [kv_heads, ...].

    >>> _fold_kv(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), 2).flatten().tolist()
    [3.0, 7.0]
    """
    return t if groups == 1 else t.view(t.shape[0] // groups, groups, *t.shape[1:]).sum(1)


def _block_scores(q_scaled, k0, doc_start, block):
    """Masked step-0 scores of one query block against its key span, fp32 [heads, B, R] (q pre-scaled).

    Only two sub-regions need a mask: the trailing [B, B] square (causality) and the keys before the
    block's last document start (document boundaries); everything else is visible.
    """
    a, b, key_start, last_start = block
    groups = q_scaled.shape[0] // k0.shape[0]
    scores = torch.matmul(q_scaled, _expand_kv(_acc(k0[:, key_start:b]), groups).transpose(1, 2))  # [nh, B, R]
    n_q = b - a
    idx = torch.arange(n_q, device=scores.device)
    future = idx[None, :] > idx[:, None]  # [B, B] (bool triu_ is ~1000x slower on CPU here)
    scores[:, :, -n_q:].masked_fill_(future, float("-inf"))
    if last_start > key_start:
        k_pos = torch.arange(key_start, last_start, device=scores.device)
        other_doc = k_pos[None, :] < doc_start[a:b, None]  # [B, last_start - key_start]
        scores[:, :, : last_start - key_start].masked_fill_(other_doc, float("-inf"))
    return scores


def _diag_scores(q_scaled, diag_keys, a, b):
    """Scores of each query against the same-slot key of each later step: [heads, B, m]."""
    if not diag_keys:
        return q_scaled.new_empty(q_scaled.shape[0], q_scaled.shape[1], 0)
    groups = q_scaled.shape[0] // diag_keys[0].shape[0]
    return torch.stack([(q_scaled * _expand_kv(_acc(kd[:, a:b]), groups)).sum(-1) for kd in diag_keys], dim=-1)


class BlockwiseTTTAttention(torch.autograd.Function):
    """Exact TTT attention, blockwise, with a recomputing backward (flash-attention style, on any device).

    Inputs: `q` [heads, S, head_dim], `k0, v0` [kv_heads, S, head_dim] (step 0), then `k1, v1, ..., km, vm`
    for steps 1..m; kv_heads divides heads (grouped-query attention).
    """

    @staticmethod
    def forward(ctx, block_size: int, doc_start: torch.Tensor, q, k0, v0, *diag):
        # Under autocast the block matmuls would drop to bf16; this path accumulates in fp32 itself.
        with torch.autocast(q.device.type, enabled=False):
            out, lse = BlockwiseTTTAttention._forward(block_size, doc_start, q, k0, v0, diag)
        ctx.block_size = block_size
        ctx.save_for_backward(doc_start, q, k0, v0, out, lse, *diag)
        return out

    @staticmethod
    def _forward(block_size, doc_start, q, k0, v0, diag):
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[0] // k0.shape[0]
        diag_k, diag_v = diag[0::2], diag[1::2]
        out = torch.empty_like(q)  # [nh, S, hd]
        lse = _acc_zeros(q[..., 0])  # [nh, S]
        for block in _query_blocks(doc_start, block_size):
            a, b, key_start, _ = block
            q_scaled = _acc(q[:, a:b]) * scale  # [nh, B, hd]
            p = _block_scores(q_scaled, k0, doc_start, block)  # [nh, B, R]
            d_scores = _diag_scores(q_scaled, diag_k, a, b)  # [nh, B, m]
            row_max = p.amax(-1)  # [nh, B]; finite: every query sees its own step-0 key
            if diag_k:
                row_max = torch.maximum(row_max, d_scores.amax(-1))
            p = p.sub_(row_max[..., None]).exp_()  # [nh, B, R], in place: one block-sized buffer
            p_diag = torch.exp(d_scores - row_max[..., None])  # [nh, B, m]
            denom = p.sum(-1) + p_diag.sum(-1)  # [nh, B]
            o = torch.matmul(p, _expand_kv(_acc(v0[:, key_start:b]), groups))  # [nh, B, hd]
            for i, vd in enumerate(diag_v):
                o += p_diag[..., i, None] * _expand_kv(_acc(vd[:, a:b]), groups)
            out[:, a:b] = (o / denom[..., None]).to(q.dtype)
            lse[:, a:b] = row_max + torch.log(denom)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out):
        doc_start, q, k0, v0, out, lse, *diag = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            grads = BlockwiseTTTAttention._backward(ctx.block_size, grad_out, doc_start, q, k0, v0, out, lse, diag)
        return None, None, *grads

    @staticmethod
    def _backward(block_size, grad_out, doc_start, q, k0, v0, out, lse, diag):
        diag_k, diag_v = diag[0::2], diag[1::2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[0] // k0.shape[0]
        dq = _acc_zeros(q)
        dk0 = _acc_zeros(k0)
        dv0 = _acc_zeros(v0)
        d_diag = [_acc_zeros(t) for t in diag]
        for block in _query_blocks(doc_start, block_size):
            a, b, key_start, _ = block
            q_scaled = _acc(q[:, a:b]) * scale  # [nh, B, hd]
            k_rng = _expand_kv(_acc(k0[:, key_start:b]), groups)  # [nh, R, hd]
            v_rng = _expand_kv(_acc(v0[:, key_start:b]), groups)  # [nh, R, hd]
            blk_lse = lse[:, a:b, None]  # [nh, B, 1]
            p = _block_scores(q_scaled, k0, doc_start, block).sub_(blk_lse).exp_()  # [nh, B, R]
            p_diag = torch.exp(_diag_scores(q_scaled, diag_k, a, b) - blk_lse)  # [nh, B, m]
            g = _acc(grad_out[:, a:b])  # [nh, B, hd]
            delta = (g * _acc(out[:, a:b])).sum(-1, keepdim=True)  # [nh, B, 1]
            dv0[:, key_start:b] += _fold_kv(torch.matmul(p.transpose(1, 2), g), groups)
            ds = torch.matmul(g, v_rng.transpose(1, 2)).sub_(delta).mul_(p)  # [nh, B, R]
            dq_blk = torch.matmul(ds, k_rng)  # [nh, B, hd] (times scale below)
            dk0[:, key_start:b] += _fold_kv(torch.matmul(ds.transpose(1, 2), q_scaled), groups)
            for i, (kd, vd) in enumerate(zip(diag_k, diag_v, strict=True)):
                pd = p_diag[..., i, None]  # [nh, B, 1]
                dsd = pd * ((g * _expand_kv(_acc(vd[:, a:b]), groups)).sum(-1, keepdim=True) - delta)  # [nh, B, 1]
                dq_blk += dsd * _expand_kv(_acc(kd[:, a:b]), groups)
                d_diag[2 * i][:, a:b] = _fold_kv(dsd * q_scaled, groups)
                d_diag[2 * i + 1][:, a:b] = _fold_kv(pd * g, groups)
            dq[:, a:b] = dq_blk * scale
        grads = [dq.to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype)]
        grads += [d.to(t.dtype) for d, t in zip(d_diag, diag, strict=True)]
        return grads


def exact_ttt_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    doc_start: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """TTT attention of step len(keys)-1; q [heads, S, head_dim], every key/value [kv_heads, S, head_dim]."""
    diag = [t for kv in zip(keys[1:], values[1:], strict=True) for t in kv]
    return BlockwiseTTTAttention.apply(block_size, doc_start, q, keys[0], values[0], *diag)


def ttt_block_mask(document_ids: torch.Tensor, step: int, compile_mask: bool) -> BlockMask:
    """BlockMask of step `step` (KV length S * (step + 1)), broadcast over batch and heads (B=None, H=None).

    Built from the document structure block by block (eagle3.blockmask.document_block_mask): nothing of size
    [S, S], unlike create_block_mask, which evaluates the mask over the whole Q x KV grid
    (docs/facts.md#memory-and-flex-attention). `compile_mask` is unused (nothing left to compile); it stays for
    the callers.
    """
    del compile_mask
    return document_block_mask(document_ids, step)


_COMPILED_FLEX = None


def allow_recompiles(limit: int = 64) -> None:
    """The compiled flex_attention makes one graph per (length, TTT step): ttt_steps graphs per length, twice
    that in a two-length probe. Past torch's recompile limit (8) flex falls back to the unfused path, which
    materialises the whole score matrix (docs/facts.md#memory-and-flex-attention): raise the limit for this
    process."""
    import torch._dynamo

    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def _flex_fn(compiled: bool):
    """The compiled flex_attention is made once per process (static shapes: one graph per TTT step)."""
    global _COMPILED_FLEX
    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        allow_recompiles()
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


class TTTAttention:
    """The attention of one packed row, built once per batch; call it with the K/V list of steps 0..k.

    Holds no state across batches (the flex BlockMasks live as long as this object: one per step).
    """

    def __init__(self, document_ids: torch.Tensor, kind: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE):
        self.kind = resolve_attention(kind, document_ids.device)
        self.document_ids = document_ids
        self.block_size = block_size
        self.doc_start = document_starts(document_ids) if self.kind == "exact" else None
        self.compiled = document_ids.device.type == "cuda"
        self._block_masks: dict[int, BlockMask] = {}

    def block_mask(self, step: int) -> BlockMask:
        if step not in self._block_masks:
            self._block_masks[step] = ttt_block_mask(self.document_ids, step, self.compiled)
        return self._block_masks[step]

    def to_heads(self, t: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """The layout the attention reads: the identity on one rank (eagle3.context.UlyssesAttention: head shards)."""
        return t

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def __call__(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        """q [heads, S, head_dim], each key/value [kv_heads, S, head_dim]; returns [heads, S, head_dim]."""
        if self.kind == "exact":
            return exact_ttt_attention(q, keys, values, self.doc_start, self.block_size)
        step = len(keys) - 1
        k = torch.cat(list(keys), dim=1)[None]  # [1, nkv, S*(step+1), hd]
        # the same list as values (MLA: the latents are keys and values): one concatenation serves both
        v = k if values is keys else torch.cat(list(values), dim=1)[None]  # [1, nkv, S*(step+1), hd]
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[0] else {}
        with warnings.catch_warnings():
            # Eager flex on CPU (parity tests only) warns that it is unfused; that is expected there.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = _flex_fn(self.compiled)(q[None], k, v, block_mask=self.block_mask(step), **gqa)
        return out[0]  # [nh, S, hd]
