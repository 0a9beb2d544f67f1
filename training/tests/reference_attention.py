"""The dense TTT attention the flex and exact paths are tested against (tests only)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from eagle3.attention import _acc, _expand_kv
from eagle3.blockmask import ttt_mask_mod


def reference_ttt_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], document_ids: torch.Tensor
) -> torch.Tensor:
    """Dense eager reference for tests on tiny rows: builds the full [S, S*(k+1)] mask from `ttt_mask_mod`;
    grouped key/value heads are repeated to the query heads up front (HF repeat_kv)."""
    seq_len = q.shape[1]
    kv_len = seq_len * len(keys)
    mask = ttt_mask_mod(document_ids)(
        None, None, torch.arange(seq_len)[:, None], torch.arange(kv_len)[None, :]
    )  # [S, S*(k+1)]
    groups = q.shape[0] // keys[0].shape[0]
    k = _expand_kv(_acc(torch.cat(list(keys), dim=1)), groups)  # [nh, KV, hd]
    v = _expand_kv(_acc(torch.cat(list(values), dim=1)), groups)
    scores = torch.matmul(_acc(q), k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # [nh, S, KV]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v).to(q.dtype)  # [nh, S, hd]
