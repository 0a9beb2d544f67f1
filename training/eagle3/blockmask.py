"""The flex_attention BlockMask of one TTT step, built from the document structure block by block.

`create_block_mask` evaluates the mask_mod on every (query, key) pair: uncompiled it materialises the whole
[S, S * (k + 1)] grid (TorchSpec measured ~112 GB at 49K queries). `document_block_mask` derives the same blocks from
the document starts instead, with vectorised ops over blocks and nothing of size [S, S].

At step k query q sees (ttt_mask_mod) the step-0 slots [start(q), q], start(q) the first slot of
its document (a padding slot is a document of one), and slot s * S + q of every later step s. For the query block
i holding queries a..z (B = block_size, at most B queries, the last block may be short):

* step-0 key blocks touched: lo..i with lo = start(a) // B. The spans [start(q), q] of consecutive queries are
  adjacent (q + 1 either continues q's document or starts a new one), so their union is [start(a), z].
* full blocks (every pair visible): the key blocks j in [ceil(start(z) / B), i - 1], when block i has B queries.
  Documents are contiguous, so the document of z then covers slots j * B..z, every query of block i included.
  The diagonal block i is never full (its upper triangle is hidden; B >= 2).
* later steps: the key blocks holding s * S + a and s * S + z (one block when B divides S, otherwise two).

`kv_indices` rows list the partial blocks ascending (lo..full_lo - 1, then the distinct diagonal blocks),
`full_kv_indices` rows full_lo..i - 1, as create_block_mask orders them; the unused tail of a row is 0 (never read).

Memory: kv_indices and full_kv_indices are int32 [1, 1, nQ, nKV], their transposes q_indices and full_q_indices
(computed by BlockMask.from_kv_blocks) int32 [1, 1, nKV, nQ], the four counts int32 [1, 1, nQ] or [1, 1, nKV], with
nQ = ceil(S / B) and nKV = ceil(S * (k + 1) / B): 16 * nQ * nKV + 8 * (nQ + nKV) bytes per step
(eagle3.plan.model.block_mask_bytes). While building, from_kv_blocks' transposition holds a few more
[nQ, nKV]-sized temporaries (an int64 argsort among them), then frees them.

Two documents, slots 0..199 and 200..511, step 1 (key blocks 0..3 are step 0, 4..7 step 1):

>>> mask = document_block_mask(torch.tensor([0] * 200 + [1] * 312), step=1)
>>> [row[:n].tolist() for row, n in zip(mask.kv_indices[0, 0], mask.kv_num_blocks[0, 0])]  # partial
[[0, 4], [0, 1, 5], [1, 2, 6], [1, 3, 7]]
>>> [row[:n].tolist() for row, n in zip(mask.full_kv_indices[0, 0], mask.full_kv_num_blocks[0, 0])]  # full
[[], [], [], [2]]
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Slot where the document of each slot begins; padding slots (-1) are one-slot documents.

    >>> document_starts(torch.tensor([0, 0, 0, 1, 1, -1, -1])).tolist()
    [0, 0, 0, 3, 3, 5, 6]
    """
    seq_len = document_ids.shape[0]
    slots = torch.arange(seq_len, device=document_ids.device)
    begins = torch.ones(seq_len, dtype=torch.bool, device=document_ids.device)
    begins[1:] = document_ids[1:] != document_ids[:-1]
    begins |= document_ids < 0
    return torch.where(begins, slots, torch.zeros_like(slots)).cummax(0).values  # [S]


def ttt_mask_mod(document_ids: torch.Tensor):
    """flex_attention mask_mod over KV = steps 0..k concatenated (KV slot = step * S + slot).

    Causal within the document for step-0 keys, plus the same slot of every step (the diagonal).
    """
    seq_len = document_ids.shape[0]

    def mask_mod(_b, _h, q_idx, kv_idx):
        kv_slot = kv_idx % seq_len
        same_doc = (document_ids[q_idx] == document_ids[kv_slot]) & (document_ids[q_idx] >= 0)
        causal_step0 = (kv_idx <= q_idx) & same_doc  # kv_idx <= q_idx < S only holds for step-0 keys
        return causal_step0 | (kv_slot == q_idx)

    return mask_mod


def _ceil_div(x, d: int):
    return -(-x // d)


def _query_block_ranges(document_ids: torch.Tensor, block_size: int):
    """Per query block i: (i, first query a, last query z, first touched key block, first full key block).

    Tensors of [nQ] int64; no full block is ever before the first touched one, nor at or after i.
    """
    seq_len = document_ids.shape[0]
    starts = document_starts(document_ids)  # [S]
    block = torch.arange(_ceil_div(seq_len, block_size), device=document_ids.device)  # [nQ]
    first = block * block_size
    last = (first + block_size).clamp(max=seq_len) - 1
    touched_lo = starts[first] // block_size
    full_lo = torch.minimum(_ceil_div(starts[last], block_size), block)
    full_lo = torch.where(last - first + 1 == block_size, full_lo, block)  # a short block is never full
    return block, first, last, touched_lo, full_lo


def _diagonal_blocks(block, first, last, seq_len: int, step: int, block_size: int, n_kv: int):
    """The partial key blocks from the diagonal block i on: step 0's block i, then per later step the blocks of
    s * S + a and s * S + z, distinct and ascending; [nQ, 1 + 2 * step] (unused entries n_kv) and their count.
    """
    shifts = torch.arange(1, step + 1, device=block.device) * seq_len  # [k]
    later = torch.stack([shifts + first[:, None], shifts + last[:, None]], dim=-1).flatten(1)  # [nQ, 2k]
    cand = torch.cat([block[:, None], later // block_size], dim=1)  # [nQ, 1 + 2k], non-decreasing per row
    new = torch.ones_like(cand, dtype=torch.bool)
    new[:, 1:] = cand[:, 1:] != cand[:, :-1]
    cand = torch.where(new, cand, n_kv).sort(dim=1).values  # duplicates (now n_kv) to the end
    return cand, new.sum(1)


def _ordered_rows(n_kv: int, head_start, head_len, tail=None, tail_len=None) -> torch.Tensor:
    """int32 [nQ, n_kv] rows: head_start + 0..head_len - 1, then tail[:, :tail_len], then 0 (unused)."""
    width = n_kv if tail is None else n_kv + tail.shape[1]  # room for the tail past a row's last used entry
    cols = torch.arange(width, dtype=torch.int32, device=head_start.device)
    head_start, head_len = head_start.to(torch.int32), head_len.to(torch.int32)
    rows = torch.where(cols < head_len[:, None], cols + head_start[:, None], 0)  # [nQ, width] int32
    if tail is None:
        return rows
    slot = torch.arange(tail.shape[1], device=tail.device)  # [t]
    used = slot < tail_len[:, None]  # [nQ, t]
    rows.scatter_(1, head_len[:, None].long() + slot, torch.where(used, tail, 0).to(torch.int32))
    return rows[:, :n_kv].contiguous()


def document_block_mask(document_ids: torch.Tensor, step: int, block_size: int = 128) -> BlockMask:
    """BlockMask of TTT step `step` (KV = steps 0..step concatenated, length S * (step + 1)) for one packed row,
    broadcast over batch and heads ([1, 1, ...] tensors, as create_block_mask with B=None, H=None), with the
    mask_mod eagle3.attention.ttt_mask_mod. Any S; block_size >= 2. Same blocks as create_block_mask.
    """
    if document_ids.dim() != 1:
        raise ValueError(f"document_ids has shape {list(document_ids.shape)}, expected [S] (one packed row)")
    if step < 0 or block_size < 2:
        raise ValueError(f"need step >= 0 and block_size >= 2, got step={step}, block_size={block_size}")
    seq_len = document_ids.shape[0]
    kv_len = seq_len * (step + 1)
    n_kv = _ceil_div(kv_len, block_size)
    block, first, last, touched_lo, full_lo = _query_block_ranges(document_ids, block_size)
    diag, n_diag = _diagonal_blocks(block, first, last, seq_len, step, block_size, n_kv)
    partial_head = full_lo - touched_lo  # step-0 partial blocks before the full ones
    kv_indices = _ordered_rows(n_kv, touched_lo, partial_head, diag, n_diag)
    full_kv_indices = _ordered_rows(n_kv, full_lo, block - full_lo)
    return BlockMask.from_kv_blocks(
        (partial_head + n_diag).to(torch.int32)[None, None],
        kv_indices[None, None],
        (block - full_lo).to(torch.int32)[None, None],
        full_kv_indices[None, None],
        BLOCK_SIZE=block_size,
        mask_mod=ttt_mask_mod(document_ids),
        seq_lengths=(seq_len, kv_len),
    )
