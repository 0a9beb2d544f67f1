"""TTT attention: the exact blockwise path against a dense reference and against flex_attention."""

from __future__ import annotations

import doctest

import eagle3.attention as attention_module
import pytest
import torch
from eagle3.attention import (
    TTTAttention,
    document_starts,
    exact_ttt_attention,
    validate_document_ids,
)
from eagle3.errors import DataError
from eagle3.model import ttt_forward
from reference_attention import reference_ttt_attention
from torch.utils._python_dispatch import TorchDispatchMode

# Three documents of different lengths and a padding tail: block boundaries fall inside documents.
DOCS = torch.tensor([0] * 5 + [1] * 9 + [2] * 3 + [-1] * 3)


def _qkv(step: int, seq_len: int, dtype=torch.float64, heads: int = 2, head_dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def t():
        return torch.randn(heads, seq_len, head_dim, generator=gen, dtype=dtype).requires_grad_()

    return t(), [t() for _ in range(step + 1)], [t() for _ in range(step + 1)]


def test_docstring_examples_hold():
    assert doctest.testmod(attention_module).failed == 0


@pytest.mark.parametrize("step", [0, 1, 3])
@pytest.mark.parametrize("block_size", [4, 7, 64])
def test_exact_matches_dense_reference_forward_and_backward(step, block_size):
    q, keys, values = _qkv(step, DOCS.shape[0])
    ref = reference_ttt_attention(q, keys, values, DOCS)
    out = exact_ttt_attention(q, keys, values, document_starts(DOCS), block_size)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    inputs = [q, *keys, *values]
    ref_grads = torch.autograd.grad((ref * grad).sum(), inputs)
    out_grads = torch.autograd.grad((out * grad).sum(), inputs)
    for name, a, b in zip(
        ["q"] + [f"k{i}" for i in range(step + 1)] + [f"v{i}" for i in range(step + 1)],
        out_grads,
        ref_grads,
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


@pytest.mark.slow
def test_exact_backward_passes_gradcheck():
    q, keys, values = _qkv(2, DOCS.shape[0], head_dim=4)
    starts = document_starts(DOCS)

    def fn(q, *kv):
        return exact_ttt_attention(q, kv[:3], kv[3:], starts, 4)

    assert torch.autograd.gradcheck(fn, (q, *keys, *values))


def test_query_sees_only_its_document_and_its_own_slot_of_later_steps():
    # Changing document 1's step-0 keys, or any other slot's later-step keys, must not move document 0's output.
    q, keys, values = _qkv(1, DOCS.shape[0])
    starts = document_starts(DOCS)
    before = exact_ttt_attention(q, keys, values, starts, 4).detach()
    keys = [k.detach().clone() for k in keys]
    values = [v.detach().clone() for v in values]
    keys[0][:, 5:14] += 3.0  # document 1, step 0
    values[1][:, 1:] += 3.0  # later step, every slot but 0
    after = exact_ttt_attention(q, keys, values, starts, 4).detach()
    torch.testing.assert_close(after[:, :5][:, [0]], before[:, :5][:, [0]])  # slot 0 sees neither change
    assert not torch.allclose(after[:, 1:5], before[:, 1:5])  # slots 1-4 see their own later-step values
    assert not torch.allclose(after[:, 5:14], before[:, 5:14])


@pytest.mark.parametrize("step", [0, 1, 2, 4])
def test_exact_matches_flex_forward_on_cpu(step):
    # flex_attention runs forward on CPU (eager); the exact path must agree with it.
    doc = torch.tensor([0] * 100 + [1] * 60 + [2] * 70 + [-1] * 26)  # S = 256, 2 flex blocks of 128
    q, keys, values = _qkv(step, doc.shape[0], dtype=torch.float32, heads=2, head_dim=16, seed=step)
    q, keys, values = q.detach(), [k.detach() for k in keys], [v.detach() for v in values]
    with torch.no_grad():
        flex = TTTAttention(doc, "flex")(q, keys, values)
        exact = TTTAttention(doc, "exact", block_size=48)(q, keys, values)
    torch.testing.assert_close(exact, flex, rtol=1e-5, atol=1e-5)


def test_full_ttt_forward_agrees_between_flex_and_exact(make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = make_model(cfg)
    batch = make_row(cfg, [90, 70, 60], seq_len=256, mask_prob=0.8)
    with torch.no_grad():
        loss_flex, stats_flex = ttt_forward(model, batch, ttt_steps=3, attention="flex")
        loss_exact, stats_exact = ttt_forward(model, batch, ttt_steps=3, attention="exact")
    torch.testing.assert_close(loss_exact, loss_flex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_exact["loss_sum"], stats_flex["loss_sum"], rtol=1e-5, atol=1e-4)
    assert torch.equal(stats_exact["count"], stats_flex["count"])


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_exact_path_never_builds_an_s_by_s_tensor():
    seq_len, heads, block = 2048, 2, 128
    doc = torch.zeros(seq_len, dtype=torch.long)  # one long document: the worst case for the key span
    q, keys, values = _qkv(2, seq_len, dtype=torch.float32, heads=heads, head_dim=8)
    with _LargestTensor() as probe:
        out = exact_ttt_attention(q, keys, values, document_starts(doc), block)
        out.sum().backward()
    assert probe.largest <= heads * block * seq_len < seq_len * seq_len


def test_scattered_document_is_rejected_with_its_slots():
    with pytest.raises(DataError, match=r"document 0 appears in 2 separate runs \(first at slots 0 and 3\)"):
        validate_document_ids(torch.tensor([0, 0, 1, 0, -1]))


def test_flex_backward_is_unavailable_on_cpu_as_documented():
    doc = torch.zeros(128, dtype=torch.long)
    q, keys, values = _qkv(0, 128, dtype=torch.float32)
    with pytest.raises(NotImplementedError):
        TTTAttention(doc, "flex")(q, keys, values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs CUDA")
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention (compiled flex with enable_gqa)
def test_flex_matches_exact_forward_and_backward_on_cuda(make_model, make_row, tiny_config, checkpointing, kv_heads):
    cfg = tiny_config(num_kv_heads=kv_heads)
    batch = make_row(cfg, [200, 150, 100], seq_len=512, mask_prob=0.8)
    results = {}
    for kind in ("exact", "flex"):
        model = make_model(cfg).cuda()
        loss, stats = ttt_forward(model, batch, ttt_steps=3, attention=kind, activation_checkpointing=checkpointing)
        loss.backward()
        results[kind] = (
            loss.detach(),
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
            stats,
        )
    (loss_e, grads_e, stats_e), (loss_f, grads_f, stats_f) = results["exact"], results["flex"]
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-4, atol=1e-4)
    assert torch.equal(stats_f["count"], stats_e["count"])
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-3, atol=1e-4, msg=name)


def _gqa_qkv(step: int, seq_len: int, heads: int, kv_heads: int, dtype=torch.float64, head_dim: int = 8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def t(n):
        return torch.randn(n, seq_len, head_dim, generator=gen, dtype=dtype).requires_grad_()

    return t(heads), [t(kv_heads) for _ in range(step + 1)], [t(kv_heads) for _ in range(step + 1)]


@pytest.mark.parametrize("step", [0, 2])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_kv_heads_match_the_reference_with_repeated_heads(step, kv_heads):
    # Grouped-query attention: 4 query heads over kv_heads key/value heads. The reference gets the key/value heads
    # repeated explicitly (query head h reads kv head h // groups, HF repeat_kv), so autograd sums their gradients.
    q, keys, values = _gqa_qkv(step, DOCS.shape[0], 4, kv_heads)
    groups = 4 // kv_heads
    ref = reference_ttt_attention(
        q,
        [k.repeat_interleave(groups, 0) for k in keys],
        [v.repeat_interleave(groups, 0) for v in values],
        DOCS,
    )
    out = exact_ttt_attention(q, keys, values, document_starts(DOCS), 7)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    inputs = [q, *keys, *values]
    ref_grads = torch.autograd.grad((ref * grad).sum(), inputs)
    out_grads = torch.autograd.grad((out * grad).sum(), inputs)
    for a, b in zip(out_grads, ref_grads, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # flex (forward only on CPU) expands the heads itself (enable_gqa)
        flex = TTTAttention(DOCS, "flex")(q.float(), [k.float() for k in keys], [v.float() for v in values])
    torch.testing.assert_close(flex, ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_grouped_kv_backward_passes_gradcheck():
    # Three documents, padding and a partial last block (block 4) over 10 slots: every case the exact path's
    # backward has, with a quarter of DOCS' inputs (gradcheck's cost grows with inputs x forward).
    docs = torch.tensor([0] * 3 + [1] * 4 + [2] * 2 + [-1])
    q, keys, values = _gqa_qkv(1, docs.shape[0], 4, 2, head_dim=2)
    starts = document_starts(docs)

    def fn(q, *kv):
        return exact_ttt_attention(q, kv[:2], kv[2:], starts, 4)

    assert torch.autograd.gradcheck(fn, (q, *keys, *values))
