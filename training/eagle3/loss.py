"""Forward KL(target || draft) over the draft vocabulary, chunked so fp32 [S, V] logits never exist at once.

For supervised positions i with drafter hidden h_i and target last hidden y_i:

    p_t = softmax(verifier_lm_head(verifier_norm(y_i)))   (target restricted to the draft vocab, no grad)
    p_d = softmax(lm_head(norm(h_i)))
    KL_i = sum_v p_t[v] * (log p_t[v] - log p_d[v])

`chunked_kl` walks the positions in chunks of `chunk_size`; each chunk runs under non-reentrant
`torch.utils.checkpoint`, so autograd keeps only the chunk's inputs (views of h and y) and the
fp32 [chunk, V] tensors exist only while one chunk is computed, in forward and again in backward.
`eager_kl` is the plain reference (all positions at once) used by the parity tests.

The model passed in provides `draft_logits(h)` and `target_logits(y)` (see eagle3.model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 4096


def kl_terms(model, hidden: torch.Tensor, target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(target || draft) [N] in fp32 and the draft argmax [N] (draft-vocab ids).

    >>> import types
    >>> same = types.SimpleNamespace(draft_logits=lambda h: h, target_logits=lambda y: y)
    >>> kl, ids = kl_terms(same, torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 3.0]]))
    >>> round(float(kl[0]), 6), ids.tolist()
    (0.0, [1])
    """
    log_p_draft = F.log_softmax(model.draft_logits(hidden).float(), dim=-1)  # [N, V]
    with torch.no_grad():
        log_p_target = F.log_softmax(model.target_logits(target_hidden).float(), dim=-1)  # [N, V]
        p_target = log_p_target.exp()  # [N, V]
    kl = (p_target * (log_p_target - log_p_draft)).sum(-1)  # [N]
    return kl, log_p_draft.detach().argmax(-1)


def _weighted_chunk(model, hidden, target_hidden, weight):
    kl, draft_ids = kl_terms(model, hidden, target_hidden)
    return (kl * weight).sum(), kl.detach(), draft_ids


def chunked_kl(
    model,
    hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_i weight_i * KL_i (scalar, differentiable), KL_i [N] (detached) and draft argmax [N].

    hidden, target_hidden: [N, H]; weight: [N] fp32 (0 for unsupervised positions).
    """
    if chunk_size < 1:
        raise ValueError(f"loss_chunk_size={chunk_size} must be at least 1, for example 4096")
    n = hidden.shape[0]
    use_checkpoint = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in _head_params(model))
    )
    total = hidden.new_zeros((), dtype=torch.float32)
    kls, ids = [], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        args = (model, hidden[a:b], target_hidden[a:b], weight[a:b])
        if use_checkpoint:
            part, kl, draft_ids = checkpoint(_weighted_chunk, *args, use_reentrant=False)
        else:
            part, kl, draft_ids = _weighted_chunk(*args)
        total = total + part
        kls.append(kl)
        ids.append(draft_ids)
    if not kls:
        return (
            total,
            hidden.new_zeros(0, dtype=torch.float32),
            torch.zeros(0, dtype=torch.long, device=hidden.device),
        )
    return total, torch.cat(kls), torch.cat(ids)


def eager_kl(
    model, hidden: torch.Tensor, target_hidden: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for `chunked_kl`: every position at once, no checkpointing (fp32 [N, V] kept for backward)."""
    return _weighted_chunk(model, hidden, target_hidden, weight)


def _head_params(model):
    heads = [getattr(model, name, None) for name in ("norm", "lm_head")]
    return [p for m in heads if m is not None for p in m.parameters()]
