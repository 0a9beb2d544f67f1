"""One packed row as the TTT steps read it: its checks, the teacher-forced tokens of step k and the slots step k
supervises (eagle3.model's docstring draws the alignment)."""

from __future__ import annotations

import torch

from eagle3.attention import validate_document_ids
from eagle3.context import SINGLE, ContextShard
from eagle3.errors import DataError
from eagle3.spec import DrafterConfig


def shift_tokens(input_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """input_ids moved left by `shift`, zero-filled at the end (the teacher-forced token of each slot).

    >>> shift_tokens(torch.tensor([5, 6, 7, 8]), 2).tolist()
    [7, 8, 0, 0]
    """
    out = torch.zeros_like(input_ids)
    if shift < input_ids.shape[0]:
        out[: input_ids.shape[0] - shift] = input_ids[shift:]
    return out


def step_supervision(document_ids: torch.Tensor, loss_mask: torch.Tensor, step: int):
    """(valid, supervised) for slots 0..S-2-step at TTT step `step`; the target slot is j+1+step.

    valid: the target slot is in the same (non-padding) document; supervised: valid and loss_mask there.

    >>> doc = torch.tensor([0, 0, 0, 1, 1, -1]); mask = torch.tensor([1, 1, 1, 1, 1, 0]).bool()
    >>> [v.int().tolist() for v in step_supervision(doc, mask, 0)]
    [[1, 1, 0, 1, 0], [1, 1, 0, 1, 0]]
    >>> [v.int().tolist() for v in step_supervision(doc, mask, 1)]
    [[1, 0, 0, 0], [1, 0, 0, 0]]
    """
    n = max(document_ids.shape[0] - 1 - step, 0)
    here, there = document_ids[:n], document_ids[1 + step : 1 + step + n]
    valid = (here >= 0) & (here == there)
    return valid, valid & loss_mask[1 + step : 1 + step + n].bool()


def check_batch(cfg: DrafterConfig, batch: dict, context: ContextShard = SINGLE, halo: int = 0) -> int:
    """Check names, shapes, dtypes and id ranges of one packed row; return S. DataError names what is wrong.

    context: a rank's share of the row (eagle3.context.shard_row): aux_hidden of its slots, last_hidden (and
    target_ids) of its slots and `halo` more."""
    needed = ("input_ids", "aux_hidden", "last_hidden", "loss_mask", "document_ids", "position_ids")
    missing = [k for k in needed if k not in batch]
    if missing:
        raise DataError(f"batch lacks {missing}; a packed row needs {list(needed)}")
    seq_len = batch["input_ids"].shape[0]
    a, b, end = context.held(seq_len, halo)  # (0, S, S) on one rank
    h = cfg.hidden_size
    shapes = {
        "input_ids": [seq_len],
        "aux_hidden": [b - a, 3 * h],
        "last_hidden": [end - a, h],
        "loss_mask": [seq_len],
        "document_ids": [seq_len],
        "position_ids": [seq_len],
    }
    if "target_ids" in batch:
        shapes["target_ids"] = [end - a]
    for key, shape in shapes.items():
        if list(batch[key].shape) != shape:
            raise DataError(
                f"batch[{key!r}] has shape {list(batch[key].shape)}, expected {shape} "
                f"(S={seq_len}, hidden_size={h}); the dataset's hidden size must match the drafter config"
            )
    for key in ("input_ids", "document_ids", "position_ids"):
        if batch[key].is_floating_point():
            raise DataError(f"batch[{key!r}] has dtype {batch[key].dtype}, expected an integer dtype (torch.long)")
    ids = batch["input_ids"]
    if seq_len and (int(ids.min()) < 0 or int(ids.max()) >= cfg.target_vocab_size):
        raise DataError(
            f"batch['input_ids'] holds ids in [{int(ids.min())}, {int(ids.max())}], "
            f"outside the target vocab [0, {cfg.target_vocab_size}); the dataset was made for another target"
        )
    validate_document_ids(batch["document_ids"])
    return seq_len
