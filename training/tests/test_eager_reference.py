"""bench/eager_reference.py (the plain implementation bench/trainer.py times against) gives the trainer's loss,
statistics and gradients at a tiny shape, so the reference cannot drift from the maths it stands for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from eagle3.model import ttt_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from eager_reference import reference_step


@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 2, "norm_output": True}])
def test_reference_matches_the_trainer(make_model, make_row, tiny_config, overrides):
    cfg = tiny_config(**overrides)
    row = make_row(cfg, [50, 30, 20], seq_len=112, mask_prob=0.8)
    model = make_model(cfg)
    loss, stats = ttt_forward(model, row, ttt_steps=3, attention="exact", loss_chunk_size=0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    ref_loss, ref_stats = reference_step(model, row, 3)
    ref_loss.backward()
    torch.testing.assert_close(ref_loss, loss, rtol=1e-5, atol=1e-6)
    for key in ref_stats:
        torch.testing.assert_close(ref_stats[key], stats[key], rtol=1e-4, atol=1e-3, msg=key)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
