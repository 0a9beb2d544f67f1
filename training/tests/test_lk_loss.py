"""The acceptance-aware loss (config key lk_weight): -log sum_v min(p_target, p_draft), alone or mixed with KL.

Its value and gradient against a case computed by hand; the fused path (the gradient made in forward) against plain
autograd for the mixes; the expected acceptance it logs; and a drafter trained on it raising that figure.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from eagle3.loss import FusedKL, chunked_kl, eager_kl, kl_terms, target_probs

IDENTITY = types.SimpleNamespace(draft_logits=lambda h: h, target_logits=lambda y: y)
P_TARGET = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
P_DRAFT = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)


def test_lk_value_and_gradient_by_hand():
    # alpha = min(.7, .2) + min(.2, .5) + min(.1, .3) = 0.5, LK = -log 0.5.
    # The draft is the minimum only at token 0 (m = [1, 0, 0]); s = sum_v m_v p_d[v] = 0.2;
    # d LK / d z_j = -p_d[j] (m_j - s) / alpha = -[0.2 * 0.8, 0.5 * -0.2, 0.3 * -0.2] / 0.5 = [-0.32, 0.2, 0.12].
    logits = P_DRAFT.log().clone().requires_grad_()
    loss, _ = kl_terms(IDENTITY, logits, P_TARGET.log(), lk=1.0)
    assert float(loss[0].detach()) == pytest.approx(math.log(2), abs=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    torch.testing.assert_close(grad, torch.tensor([[-0.32, 0.2, 0.12]], dtype=torch.float64))


def test_the_fused_gradient_is_the_hand_computed_one():
    # FusedKL with H = V = 3, lm_head = I and a norm weight that undoes the RMSNorm of this h: logits = h.
    h = P_DRAFT.log().clone()
    rms = float(h.pow(2).mean().sqrt())
    h = (h / rms).requires_grad_()  # its RMS is 1, so norm(h) = h with eps 0
    norm_w = torch.full((3,), rms, dtype=torch.float64, requires_grad=True)
    head = torch.eye(3, dtype=torch.float64, requires_grad=True)
    p_t, neg_entropy = target_probs(P_TARGET.log())
    one = torch.ones(1, dtype=torch.float64)
    total, _, _, alpha = FusedKL.apply(h, norm_w, head, p_t, neg_entropy, one, 0.0, (False, False, True), 1.0)
    assert float(alpha[0]) == pytest.approx(0.5, abs=1e-12)
    assert float(total.detach()) == pytest.approx(math.log(2), abs=1e-12)
    (grad_head,) = torch.autograd.grad(total, [head])
    # d loss / d W = (d loss / d logits)^T x, x = norm(h): row v of the gradient is g_v x
    x = (norm_w * h).detach()
    torch.testing.assert_close(grad_head, torch.tensor([[-0.32], [0.2], [0.12]], dtype=torch.float64) * x)


@pytest.mark.parametrize("lk", [0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [7, 1000])
def test_fused_lk_matches_autograd_loss_and_gradients(make_model, tiny_config, lk, chunk_size):
    model = make_model(tiny_config(train_lm_head=True), dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    n = 60
    hidden = torch.randn(n, model.cfg.hidden_size, generator=gen, dtype=torch.float64).requires_grad_()
    target_hidden = torch.randn(n, model.cfg.hidden_size, generator=gen, dtype=torch.float64)
    weight = (torch.rand(n, generator=gen) < 0.7).double() / n
    params = [hidden, model.norm.weight, model.lm_head.weight]
    ref_loss, ref_per, _ = eager_kl(model, hidden, target_hidden, weight, lk)
    ref_grads = torch.autograd.grad(ref_loss, params)
    loss, per, _ = chunked_kl(model, hidden, target_hidden, weight, chunk_size, lk)
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per, ref_per, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["hidden", "norm.weight", "lm_head.weight"], grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14, msg=f"gradient of {name}")
    # lk 0.5 is the mean of the two objectives
    if lk == 0.5:
        kl, _, _ = eager_kl(model, hidden, target_hidden, weight, 0.0)
        only_lk, _, _ = eager_kl(model, hidden, target_hidden, weight, 1.0)
        torch.testing.assert_close(loss, (kl + only_lk) / 2, rtol=1e-12, atol=1e-12)


def test_no_overlap_gives_a_finite_loss_and_gradient():
    # The draft puts all its mass where the target has none: alpha underflows to 0, the floor keeps both finite.
    logits = torch.tensor([[0.0, 200.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = kl_terms(IDENTITY, logits, torch.tensor([[200.0, 0.0]], dtype=torch.float64), lk=1.0)
    assert torch.isfinite(loss).all() and float(loss[0].detach()) > 10
    h = logits.detach().clone().requires_grad_()
    p_t, neg_entropy = target_probs(torch.tensor([[200.0, 0.0]], dtype=torch.float64))
    norm_w = torch.full((2,), float(h.detach().pow(2).mean().sqrt()), dtype=torch.float64)  # logits = h
    head, one = torch.eye(2, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    total, _, _, alpha = FusedKL.apply(h, norm_w, head, p_t, neg_entropy, one, 0.0, (True, False, False), 1.0)
    (g,) = torch.autograd.grad(total, [h])
    assert float(alpha[0]) < 1e-6 and torch.isfinite(g).all()


def _row(make_row, cfg):
    row = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    return {k: v.double() if v.is_floating_point() else v for k, v in row.items()}


def _expected_acc(stats) -> list:
    from eagle3.metrics import summarize
    from eagle3.model import STAT_KEYS

    return summarize(torch.stack([stats[k] for k in STAT_KEYS]))["expected_acc"]


def test_the_ttt_loss_mixes_linearly_and_logs_the_expected_acceptance(make_model, make_row, tiny_config):
    """Through ttt_forward (the trainer's path, target chunks shared by the TTT steps): lk_weight 0.5 gives the mean
    of the KL and LK losses, and the expected acceptance per step is a probability, whatever the loss."""
    from eagle3.model import ttt_forward

    cfg = tiny_config()
    batch = _row(make_row, cfg)
    losses, accs = {}, {}
    for lk in (0.0, 0.5, 1.0):
        model = make_model(cfg, dtype=torch.float64)
        loss, stats = ttt_forward(model, batch, ttt_steps=3, attention="exact", loss_chunk_size=40, lk_weight=lk)
        losses[lk], accs[lk] = float(loss), _expected_acc(stats)
    assert losses[0.5] == pytest.approx((losses[0.0] + losses[1.0]) / 2, rel=1e-12)
    assert accs[0.0] == accs[1.0] and len(accs[0.0]) == 3 and all(0 < v < 1 for v in accs[0.0])


def test_training_on_lk_raises_the_expected_acceptance(make_model, make_row, tiny_config):
    """Forty AdamW steps on one row with lk_weight 1 raise the expected acceptance of every TTT step."""
    from eagle3.model import ttt_forward

    cfg = tiny_config()
    batch = _row(make_row, cfg)
    model = make_model(cfg, dtype=torch.float64)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    before = None
    for _ in range(40):
        loss, stats = ttt_forward(model, batch, ttt_steps=3, attention="exact", lk_weight=1.0)
        before = before or _expected_acc(stats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, stats = ttt_forward(model, batch, ttt_steps=3, attention="exact", lk_weight=1.0)
    after = _expected_acc(stats)
    assert all(a > b + 0.05 for a, b in zip(after, before, strict=True)), (before, after)
