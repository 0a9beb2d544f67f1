"""Forward KL(target || draft) over the draft vocabulary, chunked so fp32 [S, V] logits never exist at once.

For supervised positions i with drafter hidden h_i and target last hidden y_i:

    p_t = softmax(verifier_lm_head(verifier_norm(y_i)))   (target restricted to the draft vocab, no grad)
    p_d = softmax(lm_head(norm(h_i)))
    KL_i = sum_v p_t[v] * (log p_t[v] - log p_d[v])

The gradient is computed in the forward pass (`FusedKL`): d KL_i / d logits = p_d - p_t, so each chunk
computes its draft and target logits once, turns them into the gradient with respect to norm(h) [chunk, H]
(and lm_head's when it trains), and keeps only that for backward, which scales it by the incoming gradient.
Nothing is recomputed and no fp32 [chunk, V] tensor outlives its chunk; what stays is one [N, H] gradient per
TTT step, the size of the hidden state itself (docs/speed.md).

The trainer (eagle3.model._ttt_loss) runs every TTT step first, then walks the row in chunks of *target* slots
(loss_chunk_size; 0: the whole row): a chunk's target logits, argmax and probabilities (`target_probs`) are made
once and shared by every TTT step whose supervised slots read that chunk (step k's slot j reads target slot
j+1+k), one `fused_kl` call per chunk and step, so the target side costs one pass over the row at any chunk size.
`chunked_kl` walks the positions of one step in chunks of `chunk_size` (the target logits of each chunk computed
there); `checkpointed_kl` is the former path (each chunk under `torch.utils.checkpoint`, both logits recomputed in
backward), kept for the parity tests; `eager_kl` is the plain autograd reference (all positions at once).

The acceptance-aware share (config key lk_weight, lambda below): each position's loss becomes

    loss_i = (1 - lambda) KL_i + lambda LK_i,    LK_i = -log alpha_i,    alpha_i = sum_v min(p_t[v], p_d[v])

alpha_i is the probability that speculative sampling accepts the draft's token at that position (Leviathan et al.,
2023, "Fast Inference from Transformers via Speculative Decoding", section 3.3: the expected acceptance is
1 - TV(p_t, p_d) = sum_v min(p_t, p_d)); LK maximises it directly instead of matching the whole distribution.
With D = p_d - p_t and m_v = [p_d[v] < p_t[v]] (where the draft sets the minimum): alpha = 1 - |D|_1 / 2, and
d LK / d logits_j = -p_d[j] (m_j - sum_v m_v p_d[v]) / alpha. alpha is computed (and returned) whatever lambda is:
the mean per TTT step is logged as the expected acceptance (eagle3.metrics).

The model passed in provides `draft_logits(h)` and `target_logits(y)` (see eagle3.model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 4096
# alpha below this is taken as this in -log alpha: a draft with no overlap with the target (alpha 0) gets a large,
# finite loss and gradient instead of inf and nan.
ALPHA_FLOOR = 1e-6


def kl_terms(
    model, hidden: torch.Tensor, target_hidden: torch.Tensor, lk: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss [N] in fp32 (KL(target || draft), or its mix with LK: the module docstring) and the draft
    argmax [N] (draft-vocab ids). Plain autograd: the reference the fused path is tested against.

    >>> import types
    >>> same = types.SimpleNamespace(draft_logits=lambda h: h, target_logits=lambda y: y)
    >>> kl, ids = kl_terms(same, torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 3.0]]))
    >>> round(float(kl[0]), 6), ids.tolist()
    (0.0, [1])
    >>> lk, _ = kl_terms(same, torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 50.0]]), lk=1.0)
    >>> round(float(lk[0]), 4)  # alpha = min(0.5, 0) + min(0.5, 1) = 0.5
    0.6931
    """
    log_p_draft = F.log_softmax(_acc(model.draft_logits(hidden)), dim=-1)  # [N, V]
    with torch.no_grad():
        log_p_target = F.log_softmax(_acc(model.target_logits(target_hidden)), dim=-1)  # [N, V]
        p_target = log_p_target.exp()  # [N, V]
    loss = (p_target * (log_p_target - log_p_draft)).sum(-1)  # [N]
    if lk:
        alpha = torch.minimum(log_p_draft.exp(), p_target).sum(-1)
        loss = (1 - lk) * loss - lk * alpha.clamp_min(ALPHA_FLOOR).log()
    return loss, log_p_draft.detach().argmax(-1)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Logits in the loss dtype: fp32 for bf16/fp32, fp64 stays fp64 (the parity tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _weighted_chunk(model, hidden, target_hidden, weight, lk=0.0):
    kl, draft_ids = kl_terms(model, hidden, target_hidden, lk)
    return (kl * weight).sum(), kl.detach(), draft_ids


@torch.no_grad()
def target_probs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target probabilities p_t [N, V] fp32 and sum_v p_t log p_t [N] (minus the entropy) from target logits.

    >>> p, neg_entropy = target_probs(torch.zeros(1, 4))
    >>> p.tolist(), round(float(neg_entropy[0]), 6)
    ([[0.25, 0.25, 0.25, 0.25]], -1.386294)
    """
    log_p = F.log_softmax(_acc(logits), dim=-1)
    p = log_p.exp()
    return p, (p * log_p).sum(-1)


class FusedKL(torch.autograd.Function):
    """sum_i w_i loss_i for draft logits lm_head(norm(h)) against fixed target probabilities, the gradient made in
    forward; loss_i is KL_i, or (1 - lk) KL_i + lk LK_i (the module docstring).

    Inputs: the pre-norm hidden state h [N, H], the final norm's weight [H], the lm_head weight W [V, H], p_t [N, V]
    and neg_entropy [N] (target_probs), w [N], the norm's eps, which gradients are wanted and lk. The norm is
    RMSNorm as eagle3.model computes it, differentiated by hand: for n = h r, r = rsqrt(mean(h^2) + eps) and
    x = weight * n, dL/dh = r (g - n mean(g n)) with g = weight * dL/dx. What is kept for backward is dL/dh
    [N, H] in h's dtype (and the weights' gradients); backward scales them by the incoming gradient.
    Returns (sum_i w_i loss_i, loss [N] detached, draft argmax [N], alpha [N]: the expected acceptance).
    Memory at the peak: four fp32 [N, V], and with lk > 0 a bool mask of that size (eagle3.plan.model counts them).
    """

    @staticmethod
    def forward(ctx, h, norm_w, w_head, p_t, neg_entropy, weight, eps: float, need: tuple, lk: float = 0.0):
        h32 = _acc(h)
        r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)  # [N, 1]
        n32 = h32 * r  # [N, H]
        normed = n32.to(h.dtype)
        x = norm_w * normed  # as RMSNorm.forward
        logits = _acc(torch.matmul(x.to(w_head.dtype), w_head.t()))  # [N, V]
        draft_ids = logits.argmax(-1)
        logits -= torch.logsumexp(logits, -1, keepdim=True)  # log p_d, in place
        loss = neg_entropy - (p_t * logits).sum(-1)  # [N]: KL
        d = logits.exp_().sub_(p_t)  # D = p_d - p_t, in place
        alpha = 1 - 0.5 * torch.linalg.vector_norm(d, ord=1, dim=-1)  # sum_v min(p_t, p_d)
        if lk:
            floor = alpha.clamp_min(ALPHA_FLOOR)
            loss = (1 - lk) * loss - lk * floor.log()
        total = (loss * weight).sum()
        grads = [None, None, None]
        if any(need):
            if lk:
                below = d < 0  # m: where the draft's probability is the minimum
                p_d = d + p_t
                s = (p_d * below).sum(-1, keepdim=True)  # sum_v m_v p_d[v]
                # d LK / d logits = -p_d (m - s) / alpha, mixed with the KL's D
                d.mul_(1 - lk).sub_(p_d.mul_(below.to(p_d.dtype).sub_(s)).mul_((lk / floor)[:, None]))
                del below, p_d
            d_logits = d.mul_(weight[:, None]).to(w_head.dtype)  # w_i d loss_i / d logits
            if need[2]:
                grads[2] = torch.matmul(d_logits.t(), x.to(w_head.dtype)).to(w_head.dtype)  # [V, H]
            del logits, d
            gx = _acc(torch.matmul(d_logits, w_head))  # [N, H]
            del d_logits
            if need[1]:
                grads[1] = (gx * _acc(normed)).sum(0).to(norm_w.dtype)  # [H]
            if need[0]:
                g = gx * _acc(norm_w)
                grads[0] = (r * (g - n32 * (g * n32).mean(-1, keepdim=True))).to(h.dtype)  # [N, H]
        ctx.grads = grads
        if hasattr(ctx, "mark_non_differentiable"):
            ctx.mark_non_differentiable(loss, draft_ids, alpha)
        return total, loss, draft_ids, alpha

    @staticmethod
    def backward(ctx, grad_total, _grad_loss, _grad_ids, _grad_alpha):
        grads, ctx.grads = ctx.grads, None
        scaled = [None if g is None else g * grad_total.to(g.dtype) for g in grads]
        return (*scaled, None, None, None, None, None, None)


class _NoCtx:
    """Stands in for autograd's ctx when nothing needs a gradient (validation, no_grad)."""


def fused_kl(model, hidden, p_t, neg_entropy, weight, lk: float = 0.0):
    """One FusedKL call with the draft side of `model`: its final norm and lm_head. (total, loss [N], draft argmax
    [N], alpha [N])."""
    norm_w, head = model.norm.weight, model.lm_head.weight
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and norm_w.requires_grad, grad and head.requires_grad)
    if not any(need):
        with torch.no_grad():
            return FusedKL.forward(_NoCtx(), hidden, norm_w, head, p_t, neg_entropy, weight, model.norm.eps, need, lk)
    return FusedKL.apply(hidden, norm_w, head, p_t, neg_entropy, weight, model.norm.eps, need, lk)


def chunked_kl(
    model,
    hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lk: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_i weight_i * loss_i (scalar, differentiable), loss_i [N] (detached) and draft argmax [N]; loss_i is KL_i,
    or its mix with LK (lk > 0).

    hidden, target_hidden: [N, H]; weight: [N] fp32 (0 for unsupervised positions). Chunks of `chunk_size`
    positions through FusedKL: the target logits of a chunk made there, nothing recomputed in backward.
    """
    if chunk_size < 1:
        raise ValueError(f"loss_chunk_size={chunk_size} must be at least 1, for example 4096")
    n = hidden.shape[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    kls, ids = [], []
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        with torch.no_grad():
            p_t, neg_entropy = target_probs(model.target_logits(target_hidden[a:b]))
        part, kl, draft_ids, _ = fused_kl(model, hidden[a:b], p_t, neg_entropy, weight[a:b], lk)
        del p_t
        total = total + part
        kls.append(kl)
        ids.append(draft_ids)
    return _joined(total, kls, ids, hidden)


def _joined(total: torch.Tensor, kls: list, ids: list, hidden: torch.Tensor):
    """(loss, per-position KL, draft argmax) from the chunks' parts; empty tensors for a row without positions."""
    if not kls:
        return (
            total,
            hidden.new_zeros(0, dtype=torch.float32),
            torch.zeros(0, dtype=torch.long, device=hidden.device),
        )
    return total, torch.cat(kls), torch.cat(ids)


def checkpointed_kl(
    model,
    hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lk: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The former chunked path: each chunk under non-reentrant checkpoint, both logits recomputed in backward."""
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
        args = (model, hidden[a:b], target_hidden[a:b], weight[a:b], lk)
        if use_checkpoint:
            part, kl, draft_ids = checkpoint(_weighted_chunk, *args, use_reentrant=False)
        else:
            part, kl, draft_ids = _weighted_chunk(*args)
        total = total + part
        kls.append(kl)
        ids.append(draft_ids)
    return _joined(total, kls, ids, hidden)


def eager_kl(
    model, hidden: torch.Tensor, target_hidden: torch.Tensor, weight: torch.Tensor, lk: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for `chunked_kl`: every position at once, no checkpointing (fp32 [N, V] kept for backward)."""
    return _weighted_chunk(model, hidden, target_hidden, weight, lk)


def _head_params(model):
    heads = [getattr(model, name, None) for name in ("norm", "lm_head")]
    return [p for m in heads if m is not None for p in m.parameters()]
