"""Chunked forward KL: same loss and gradients as the eager reference, without fp32 [N, V] at once."""

from __future__ import annotations

import doctest

import eagle3.loss as loss_module
import pytest
import torch
from eagle3.loss import chunked_kl, eager_kl
from torch.utils._python_dispatch import TorchDispatchMode


def _inputs(model, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = model.fc.weight.dtype
    hidden = torch.randn(n, model.cfg.hidden_size, generator=gen, dtype=dtype).requires_grad_()
    target_hidden = torch.randn(n, model.cfg.hidden_size, generator=gen, dtype=dtype)
    weight = (torch.rand(n, generator=gen) < 0.7).to(dtype) / n  # some positions unsupervised
    return hidden, target_hidden, weight


def test_docstring_examples_hold():
    assert doctest.testmod(loss_module).failed == 0


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_matches_eager_loss_and_gradients(make_model, tiny_config, chunk_size):
    model = make_model(tiny_config(train_lm_head=True), dtype=torch.float64)
    hidden, target_hidden, weight = _inputs(model, 150)
    params = [hidden, model.norm.weight, model.lm_head.weight]

    ref_loss, ref_kl, ref_ids = eager_kl(model, hidden, target_hidden, weight)
    ref_grads = torch.autograd.grad(ref_loss, params)
    loss, kl, ids = chunked_kl(model, hidden, target_hidden, weight, chunk_size)
    grads = torch.autograd.grad(loss, params)

    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-12)
    assert torch.equal(ids, ref_ids)
    for name, a, b in zip(["hidden", "norm.weight", "lm_head.weight"], grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14, msg=f"gradient of {name}")


def test_kl_is_zero_when_draft_equals_target_and_positive_otherwise(make_model):
    model = make_model(dtype=torch.float64)
    with torch.no_grad():
        model.norm.weight.copy_(model.verifier_norm.weight)
        model.lm_head.weight.copy_(model.verifier_lm_head.weight)
    hidden, _, weight = _inputs(model, 40)
    _, kl_same, _ = eager_kl(model, hidden, hidden.detach(), weight)
    _, kl_other, _ = eager_kl(model, hidden, hidden.detach().flip(0), weight)
    assert kl_same.abs().max() < 1e-12
    assert (kl_other > 0).all()


class _LargestFloat32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_never_holds_fp32_logits_for_all_positions(make_model):
    model = make_model()
    n, chunk, vocab = 600, 64, model.cfg.draft_vocab_size
    hidden, target_hidden, weight = _inputs(model, n)
    with _LargestFloat32() as chunked:
        loss, _, _ = chunked_kl(model, hidden, target_hidden, weight, chunk)
        loss.backward()
    with _LargestFloat32() as eager:
        loss, _, _ = eager_kl(model, hidden, target_hidden, weight)
        loss.backward()
    # Besides one chunk's logits, the largest fp32 tensors are the [N, H] activations and their gradient.
    assert chunked.largest <= max(chunk * vocab, n * model.cfg.hidden_size) < n * vocab
    assert eager.largest >= n * vocab  # the probe does see full-size logits when they exist


def test_zero_chunk_size_is_refused_with_a_hint(make_model):
    model = make_model()
    hidden, target_hidden, weight = _inputs(model, 4)
    with pytest.raises(ValueError, match="loss_chunk_size=0 must be at least 1"):
        chunked_kl(model, hidden, target_hidden, weight, 0)


def _ttt_run(make_model, cfg, batch, **kw):
    from eagle3.model import ttt_forward

    model = make_model(cfg, dtype=torch.float64)
    loss, stats = ttt_forward(model, batch, ttt_steps=3, attention="exact", **kw)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), stats, grads


def _reference_loss(make_model, cfg, batch):
    """The former per-step path: each TTT step's loss made as the step is made, every loss chunk under checkpoint
    with its target logits made there (eagle3.loss.checkpointed_kl)."""
    from eagle3.supervision import step_supervision

    model = make_model(cfg, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for step, hidden in enumerate(model.ttt_hidden_states(batch, 3, "exact")):
        _, supervised = step_supervision(batch["document_ids"], batch["loss_mask"], step)
        n = supervised.shape[0]
        weight = supervised.float() / supervised.sum().clamp(min=1).float()  # as the trainer: fp32 weights
        part, _, _ = loss_module.checkpointed_kl(model, hidden[:n], batch["last_hidden"][1 + step :], weight, 40)
        loss = loss + part
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("chunk", [1, 40, 4096])
def test_ttt_loss_paths_agree_with_the_checkpointed_one(make_model, make_row, tiny_config, chunk):
    """The target-chunked loss (a chunk's target side made once and shared by the TTT steps) gives the former
    per-step checkpointed path's loss and gradients, and the one pass's (loss_chunk_size 0) loss, statistics and
    gradients (lm_head training, so its gradient made in forward is checked too)."""
    cfg = tiny_config(train_lm_head=True)
    row = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in row.items()}
    loss, stats, grads = _ttt_run(make_model, cfg, batch, loss_chunk_size=chunk)
    one_loss, one_stats, one_grads = _ttt_run(make_model, cfg, batch, loss_chunk_size=0)
    ref_loss, ref_grads = _reference_loss(make_model, cfg, batch)
    for want, want_grads in ((ref_loss, ref_grads), (one_loss, one_grads)):
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        assert grads.keys() == want_grads.keys() and "lm_head.weight" in grads
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-10, atol=1e-13, msg=name)
    for key in one_stats:
        torch.testing.assert_close(stats[key], one_stats[key], rtol=1e-12, atol=1e-12, msg=key)


def test_chunked_loss_makes_the_target_logits_once_per_row(make_model, make_row, tiny_config):
    """With loss chunks smaller than the row the target head runs over each target slot once (not once per TTT
    step): the verifier head's matmuls see S rows in all, as the one pass's."""
    from eagle3.model import ttt_forward

    cfg = tiny_config()
    row = make_row(cfg, [50, 30, 20], seq_len=128, mask_prob=0.8)
    for chunk in (0, 16):
        model = make_model(cfg)
        rows = []
        model.verifier_lm_head.register_forward_hook(lambda m, i, o, rows=rows: rows.append(i[0].shape[0]))
        ttt_forward(model, row, ttt_steps=3, attention="exact", loss_chunk_size=chunk)
        assert sum(rows) == 128, (chunk, rows)


def test_fused_kl_keeps_no_vocab_sized_tensor_for_backward(make_model):
    """FusedKL leaves no fp32 [N, V] logits for backward (saved-tensor hooks see nothing vocab-sized; what it keeps
    is the [N, H] gradient of h), and backward still reaches h."""
    model = make_model()
    n, vocab = 300, model.cfg.draft_vocab_size
    hidden, target_hidden, weight = _inputs(model, n)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = chunked_kl(model, hidden, target_hidden, weight, 1000)
    assert all(size < n * vocab for size in sizes)
    loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
