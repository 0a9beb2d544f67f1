"""FLOPs of one training step, from the planner's shapes (eagle3.plan.Shape): forward, backward, and what
activation checkpointing recomputes, counted separately. Matmuls only (2 * m * n * k each); norms, softmax and the
elementwise work are a few per cent of a step at real shapes and are left out.

One packed row of `seq_len` slots, documents of `doc_len` tokens (the last one shorter), `ttt_steps` TTT steps:

    fc              forward 2 S 3H H; backward the weight gradient only (the aux hidden states need none)
    decoder step    q/k/v/o and the SwiGLU MLP: forward 2 S (2H (A + 2 KV) + A H + 3 H I); backward twice that
                    (input and weight gradients)
    attention       QK^T and PV over the keys a query sees: its document's slots up to itself at step 0, plus one
                    same-slot key per later step; backward 4 matmuls plus the blockwise path's recomputed QK^T
    loss            per step: draft logits 2 n H V_draft, their gradient with respect to norm(h) as much (FusedKL
                    makes it in forward; counted as backward), lm_head's weight gradient when it trains; the target
                    logits once per row whatever loss_chunk_size (each chunk of target slots is shared by every TTT
                    step and by the argmax below)
    target argmax   once per row, no gradient: the draft-vocab rows, and the target head rows outside the draft
                    vocab for the true-target accuracy (keep_full_head)
    recompute       activation checkpointing, full: every decoder step's forward again (attention and every matmul
                    but down_proj: its output is read by no backward, and the non-reentrant checkpoint stops
                    recomputing once backward has what it needs); selective: the attention's forward only (the
                    linear layers' outputs are kept; the elementwise work, not counted here, is redone)

where n = S - 1 - step supervised-able slots, A = heads * head_dim, KV = kv_heads * head_dim.

No torch at import time (the planner imports this).
"""

from __future__ import annotations


def attention_pairs(seq_len: int, doc_len, step: int) -> int:
    """Query-key pairs at TTT step `step`: causal within each document, plus one diagonal key per later step.
    `doc_len`: one length for every document (0: one document fills the row), or the row's document lengths.

    >>> attention_pairs(4, 4, 0), attention_pairs(4, 2, 0), attention_pairs(4, 4, 2), attention_pairs(4, [3, 1], 0)
    (10, 6, 18, 7)
    """
    if isinstance(doc_len, int):
        doc_len = doc_len or seq_len
        full, rest = divmod(seq_len, doc_len)
        lengths = [doc_len] * full + ([rest] if rest else [])
    else:
        lengths = list(doc_len)
    return sum(n * (n + 1) // 2 for n in lengths) + step * seq_len


def step_flops(
    shape,
    seq_len: int,
    ttt_steps: int,
    *,
    loss_chunk_size: int = 4096,
    activation_checkpointing: bool | str = False,
    doc_len=0,
    keep_full_head: bool = True,
) -> dict[str, int]:
    """FLOPs of one forward + backward of one row, by phase and term.

    Returns forward, backward, recompute and total, and the terms (fwd_*/bwd_*/recompute_*) they sum.
    `activation_checkpointing`: a config value (eagle3.options.checkpoint_mode: false or none, selective, full; true means full).
    `loss_chunk_size` no longer changes the count (the target side is made once per row); kept for the callers.

    >>> from eagle3.spec import SHAPES
    >>> f = step_flops(SHAPES["kimi-k2.5-eighth"], 1024, 3, loss_chunk_size=0, doc_len=512)
    >>> round(f["total"] / 1e9, 1), f["recompute"]
    (270.4, 0)
    """
    from eagle3.options import checkpoint_mode

    mode = checkpoint_mode(activation_checkpointing)
    h, a, i = shape.hidden_size, shape.attention_dim, shape.intermediate_size
    kv, hd, nh = shape.kv_dim, shape.head_dim, shape.num_heads
    vd, vt, s = shape.draft_vocab_size, shape.target_vocab_size, seq_len
    layer = 2 * s * (2 * h * (a + 2 * kv) + a * h + 3 * h * i)
    terms = {
        "fwd_fc": 2 * s * 3 * h * h,
        "bwd_fc": 2 * s * 3 * h * h,
        "fwd_target_argmax": 2 * s * h * vd + (2 * s * h * (vt - vd) if keep_full_head and vd < vt else 0),
        "fwd_layer": 0,
        "bwd_layer": 0,
        "fwd_attention": 0,
        "bwd_attention": 0,
        "fwd_draft_logits": 0,
        "bwd_loss": 0,
        "recompute_layer": 0,
        "recompute_attention": 0,
    }
    for step in range(ttt_steps):
        n = max(s - 1 - step, 0)
        attn = 2 * 2 * hd * nh * attention_pairs(s, doc_len, step)  # QK^T and PV
        terms["fwd_layer"] += layer
        terms["bwd_layer"] += 2 * layer
        terms["fwd_attention"] += attn
        terms["bwd_attention"] += attn * 5 // 2  # dV, dP, dQ, dK and the recomputed QK^T
        terms["fwd_draft_logits"] += 2 * n * h * vd
        terms["bwd_loss"] += 2 * n * h * vd * (2 if shape.train_lm_head else 1)
        if mode == "full":
            terms["recompute_layer"] += layer - 2 * s * i * h  # all but down_proj (see the module docstring)
        if mode != "none":
            terms["recompute_attention"] += attn
    out = {
        "forward": sum(v for k, v in terms.items() if k.startswith("fwd_")),
        "backward": sum(v for k, v in terms.items() if k.startswith("bwd_")),
        "recompute": sum(v for k, v in terms.items() if k.startswith("recompute_")),
    }
    out["total"] = out["forward"] + out["backward"] + out["recompute"]
    return {**out, **terms}


def optimizer_flops(shape) -> int:
    """AdamW's elementwise work per step (about 12 operations per trainable weight; not a matmul, for scale only).

    >>> from eagle3.spec import SHAPES
    >>> optimizer_flops(SHAPES["tiny"]) == 12 * SHAPES["tiny"].trainable_params()
    True
    """
    return 12 * shape.trainable_params()


# Dense datasheet peaks in FLOP/s (no sparsity) for the MFU the GPU check prints; by the name torch reports.
DATASHEET_PEAK = {
    # NVIDIA H200 / H100 SXM datasheets: BF16 Tensor Core 989 TFLOPS dense (1979 with sparsity), FP32 67 TFLOPS.
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    # A100 SXM datasheet: BF16 Tensor Core 312 TFLOPS dense, FP32 19.5 TFLOPS.
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


def datasheet_peak(device_name: str, dtype: str) -> float | None:
    """The datasheet peak of a GPU by the name torch.cuda.get_device_name gives, or None when unknown.

    >>> datasheet_peak("NVIDIA H200", "bf16")
    989000000000000.0
    >>> datasheet_peak("Some GPU", "bf16") is None
    True
    """
    for key, peaks in DATASHEET_PEAK.items():
        if key in device_name:
            return peaks.get(dtype)
    return None
