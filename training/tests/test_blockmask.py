"""The TTT BlockMask built block by block (eagle3.blockmask) against create_block_mask over the whole grid."""

from __future__ import annotations

import warnings

import pytest
import torch
from eagle3.attention import ttt_block_mask
from eagle3.blockmask import document_block_mask, ttt_mask_mod
from eagle3.memtrack import LiveBytesTracker, storage_nbytes
from eagle3.plan.model import block_mask_bytes
from reference_attention import reference_ttt_attention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def _docs(*lengths: int, pad: int = 0) -> torch.Tensor:
    """Documents of the given lengths back to back, then `pad` padding slots (document id -1)."""
    ids = [n for n, length in enumerate(lengths) for _ in range(length)]
    return torch.tensor(ids + [-1] * pad)


LAYOUTS = {
    "one document": _docs(512),
    "crossing block edges": _docs(200, 60, 130, 122),
    "padding tail": _docs(100, 200, pad=212),
    "documents on block edges": _docs(128, 128, 256),
    "single slots": torch.arange(256),
    "tiny documents and padding": _docs(*([1, 2, 3] * 20), 100, pad=36),
    "padding only": torch.full((256,), -1),
    "short row (S < block)": _docs(5, 9, 3, pad=3),
    "S not a multiple of the block": _docs(150, 100, pad=50),
    "one document, S not a multiple of the block": _docs(300),
}


def _reference(document_ids: torch.Tensor, step: int, block: int) -> BlockMask:
    seq_len = document_ids.shape[0]
    return create_block_mask(
        ttt_mask_mod(document_ids), None, None, seq_len, seq_len * (step + 1), device="cpu", BLOCK_SIZE=block
    )


def _used(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The listed blocks of every row, the unused tail of each row blanked to -1."""
    cols = torch.arange(indices.shape[-1])
    return torch.where(cols < num[..., None], indices, -1)


def _dense(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[nQ, nKV] bool: the blocks a row lists."""
    rows = _used(num, indices)[0, 0].long()
    dense = torch.zeros(rows.shape[0], rows.shape[1] + 1, dtype=torch.bool)
    dense.scatter_(1, torch.where(rows < 0, rows.shape[1], rows), True)
    return dense[:, :-1]


def _kernel_mask_mod(mask: BlockMask):
    """What a block-sparse kernel reads: full blocks unmasked, partial ones through mask_mod, no others."""
    partial = _dense(mask.kv_num_blocks, mask.kv_indices)
    full = _dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    q_block, kv_block = mask.BLOCK_SIZE
    base = mask.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // q_block, kv_idx // kv_block
        return full[qb, kb] | (partial[qb, kb] & base(b, h, q_idx, kv_idx))

    return mask_mod


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_match_create_block_mask(layout, block):
    document_ids = LAYOUTS[layout]
    for step in range(4):
        mine, ref = document_block_mask(document_ids, step, block), _reference(document_ids, step, block)
        assert mine.seq_lengths == ref.seq_lengths and mine.BLOCK_SIZE == ref.BLOCK_SIZE
        assert mine.kv_indices.shape == ref.kv_indices.shape and mine.q_indices.shape == ref.q_indices.shape
        assert torch.equal(mine.to_dense(), ref.to_dense()), (layout, step)
        assert torch.equal(mine.kv_num_blocks, ref.kv_num_blocks)
        assert torch.equal(mine.full_kv_num_blocks, ref.full_kv_num_blocks)
        # the same blocks in the same (ascending) order, and the same transposes
        assert torch.equal(_used(mine.kv_num_blocks, mine.kv_indices), _used(ref.kv_num_blocks, ref.kv_indices))
        assert torch.equal(
            _used(mine.full_kv_num_blocks, mine.full_kv_indices),
            _used(ref.full_kv_num_blocks, ref.full_kv_indices),
        )
        assert torch.equal(mine.q_num_blocks, ref.q_num_blocks)
        assert torch.equal(mine.full_q_num_blocks, ref.full_q_num_blocks)
        assert all(t.dtype == torch.int32 for t in (mine.kv_indices, mine.kv_num_blocks, mine.q_indices))


@pytest.mark.parametrize("layout", ["crossing block edges", "padding tail", "tiny documents and padding"])
def test_blocks_give_the_attention_of_the_mask_mod(layout):
    # Eager flex on CPU evaluates mask_mod over the whole grid and ignores the blocks; the kernel's reading of
    # the blocks (full: no mask_mod; partial: mask_mod; unlisted: skipped) is replayed as a mask_mod and checked
    # against ttt_mask_mod on the whole (tiny) grid.
    document_ids = LAYOUTS[layout]
    seq_len, heads, head_dim = document_ids.shape[0], 2, 16
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        q = torch.randn(heads, seq_len, head_dim, generator=gen)
        keys = [torch.randn(heads, seq_len, head_dim, generator=gen) for _ in range(step + 1)]
        values = [torch.randn(heads, seq_len, head_dim, generator=gen) for _ in range(step + 1)]
        k, v = torch.cat(keys, dim=1)[None], torch.cat(values, dim=1)[None]
        mine = document_block_mask(document_ids, step)
        grid = torch.arange(seq_len)[:, None], torch.arange(seq_len * (step + 1))[None, :]
        kernel_view = _kernel_mask_mod(mine)(None, None, *grid)  # [S, S * (step + 1)]: tiny S only
        assert torch.equal(kernel_view, ttt_mask_mod(document_ids)(None, None, *grid))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            ref = _reference(document_ids, step, 128)
            outs = [flex_attention(q[None], k, v, block_mask=m)[0] for m in (mine, ref)]
        expected = reference_ttt_attention(q, keys, values, document_ids)
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_ttt_block_mask_is_the_block_built_mask():
    document_ids = LAYOUTS["padding tail"]
    for compile_mask in (False, True):  # the flag no longer changes anything
        mask = ttt_block_mask(document_ids, 2, compile_mask)
        assert torch.equal(mask.to_dense(), _reference(document_ids, 2, 128).to_dense())


@pytest.mark.parametrize(("seq_len", "ttt_steps", "block"), [(512, 5, 128), (300, 3, 128), (256, 4, 64)])
def test_bytes_match_the_plan_formula(seq_len, ttt_steps, block):
    document_ids = _docs(seq_len // 3, seq_len // 3, pad=seq_len - 2 * (seq_len // 3))
    masks = [document_block_mask(document_ids, step, block) for step in range(ttt_steps)]
    tensors = [getattr(m, name) for m in masks for name in BlockMask._TENSOR_ATTRS]
    assert sum(t is None for t in tensors) == 3 * ttt_steps  # only the dq write-order metadata is absent
    assert storage_nbytes(t for t in tensors if t is not None) == block_mask_bytes(seq_len, ttt_steps, block)


def test_building_at_32k_stays_far_below_the_grid():
    seq_len, step = 32768, 4
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1200, (50,), generator=gen).tolist()  # 29143 slots, then padding
    document_ids = _docs(*lengths, pad=seq_len - sum(lengths))
    with LiveBytesTracker() as tracker:
        mask = document_block_mask(document_ids, step)
    grid_bytes = seq_len * seq_len * (step + 1)  # one bool per (query, key): what create_block_mask evaluates
    assert tracker.peak_bytes < 64 * 2**20 < grid_bytes // 64
    assert mask.kv_indices.shape == (1, 1, 256, 1280)
    held = storage_nbytes(getattr(mask, n) for n in BlockMask._TENSOR_ATTRS if getattr(mask, n) is not None)
    assert held == block_mask_bytes(seq_len, step + 1) - block_mask_bytes(seq_len, step)
    assert tracker.live_bytes >= held
