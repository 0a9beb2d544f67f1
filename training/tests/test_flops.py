"""FLOP accounting (eagle3.flops) against a count made by hand for a tiny shape."""

from __future__ import annotations

import doctest

import eagle3.flops as flops_module
from eagle3 import plan as P
from eagle3.flops import attention_pairs, step_flops

# hidden 8, 2 heads x 4, MLP 16, draft vocab 10 of a target vocab of 20
TINY = P.DrafterConfig(8, 2, 4, 16, 10, 20)


def test_docstring_examples_hold():
    assert doctest.testmod(flops_module).failed == 0


def test_step_flops_match_a_hand_count():
    # S = 4, one document, 2 TTT steps, one-pass loss, no checkpointing.
    f = step_flops(TINY, 4, 2, loss_chunk_size=0, doc_len=4)
    fc = 2 * 4 * 24 * 8  # [4, 24] @ [24, 8]
    argmax = 2 * 4 * 8 * 10 + 2 * 4 * 8 * 10  # draft-vocab rows + the 10 rows outside it
    layer = 2 * 4 * (2 * 8 * (8 + 16) + 8 * 8 + 3 * 8 * 16)  # q,k,v from 2H; o; gate, up, down
    assert layer == 6656
    attn = [4 * 4 * 2 * 10, 4 * 4 * 2 * 14]  # 10 causal pairs; step 1 adds 4 diagonal keys
    draft = 2 * 3 * 8 * 10 + 2 * 2 * 8 * 10  # n = 3 then 2 supervisable slots
    assert f["forward"] == fc + argmax + 2 * layer + sum(attn) + draft == 17696
    assert f["backward"] == fc + 2 * 2 * layer + sum(a * 5 // 2 for a in attn) + draft == 30880
    assert f["recompute"] == 0 and f["total"] == 48576


def test_chunked_loss_and_checkpointing_add_what_they_recompute():
    off = step_flops(TINY, 4, 2, loss_chunk_size=0, doc_len=4)
    chunked = step_flops(TINY, 4, 2, loss_chunk_size=2, doc_len=4)
    full = step_flops(TINY, 4, 2, loss_chunk_size=2, activation_checkpointing="full", doc_len=4)
    selective = step_flops(TINY, 4, 2, loss_chunk_size=2, activation_checkpointing="selective", doc_len=4)
    assert chunked == off  # the target side once per row, chunked or not
    down = 2 * 4 * 16 * 8  # down_proj [4, 16] @ [16, 8]: not recomputed (its output is read by no backward)
    attn_fwd = 4 * 4 * 2 * (10 + 14)
    assert full["recompute"] == 2 * (6656 - down) + attn_fwd  # one more forward of each decoder step
    assert selective["recompute"] == attn_fwd  # the matmul outputs kept: only the attention's forward again
    assert step_flops(TINY, 4, 2, activation_checkpointing=True, doc_len=4) == full  # true is full
    for f in (full, selective):
        assert f["forward"] == chunked["forward"] and f["backward"] == chunked["backward"]


def test_attention_pairs_follow_documents():
    assert attention_pairs(6, 3, 0) == 2 * 6  # two documents of 3: 1+2+3 each
    assert attention_pairs(5, 3, 1) == 6 + 3 + 5  # documents of 3 and 2, plus 5 diagonal keys
