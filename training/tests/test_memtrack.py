"""The byte counters the planner is validated against must themselves count right: known tensors, known bytes."""

from __future__ import annotations

import torch
from eagle3.memtrack import (
    LiveBytesTracker,
    SavedTensorsTracker,
    measure_drafter_step,
    measure_train_step,
    storage_nbytes,
)
from torch.utils.checkpoint import checkpoint


def test_views_count_once_and_freed_storage_leaves_the_total():
    with LiveBytesTracker() as t:
        a = torch.zeros(1000)  # 4000 bytes
        views = [a[10:], a.view(10, 100), a.view(10, 100).t()]
        assert t.live_bytes == 4000
        b = a + 1  # a second storage
        assert t.live_bytes == 8000
        del a, views
        assert t.live_bytes == 4000, "the storage of `a` must be released once its last view is gone"
        del b
    assert t.live_bytes == 0
    assert t.peak_bytes == 8000


def test_tensors_made_before_the_tracker_are_never_counted_even_when_written_in_place():
    weight = torch.ones(256, 256)  # 256 KiB, exists before the tracker: static state, not activations
    with LiveBytesTracker() as t:
        weight.add_(1.0)  # returns `weight` itself
        weight.mul_(2.0)
        out = weight.sum(0)  # 1 KiB, new
    assert t.live_bytes == storage_nbytes([out]) == 1024


def test_backward_allocations_are_seen_and_the_peak_covers_them():
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 512, bias=False), torch.nn.Linear(512, 64, bias=False)
    x = torch.randn(200, 64)
    m = measure_train_step(lambda: lin2(lin1(x).relu()).square().mean())
    # forward keeps relu's output [200, 512] and lin2's output [200, 64] (for square) and the scalar loss
    assert m.forward == 200 * 512 * 4 + 200 * 64 * 4 + 4
    # backward needs at least the gradient of relu's output next to it
    assert m.peak >= m.forward + 200 * 512 * 4
    # the weights had no gradients yet: they are what is left after backward
    assert m.after == (512 * 64 + 64 * 512) * 4


def test_activation_checkpointing_shrinks_what_the_forward_keeps():
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 512, bias=False), torch.nn.Linear(512, 64, bias=False)
    x = torch.randn(200, 64)

    def block(inp):
        return lin2(lin1(inp).relu())

    plain = measure_train_step(lambda: block(x).square().mean())
    ckpt = measure_train_step(lambda: checkpoint(block, x, use_reentrant=False).square().mean())
    assert ckpt.forward == 200 * 64 * 4 + 4  # only the block output (for square) and the loss
    assert plain.forward - ckpt.forward == 200 * 512 * 4


def test_saved_tensor_hooks_count_unique_saved_storages_without_the_excluded():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32)
    with SavedTensorsTracker(exclude=[w, x]) as s:
        h = x @ w  # saves x and w: both excluded
        y = h.tanh()  # saves its output [16, 32]
        z = (y * y).sum()  # saves y twice: one storage
    assert s.saved_bytes == 16 * 32 * 4
    z.backward()


def test_a_drafter_step_excludes_gradients_and_returns_to_zero(make_model, make_row, tiny_config):
    cfg = tiny_config()
    model = make_model(cfg)
    batch = make_row(cfg, [100, 156])
    m = measure_drafter_step(model, batch, ttt_steps=2, attention="exact")
    assert m.forward > 0 and m.peak > m.forward
    assert m.after == 0, "gradients existed before the measured step; nothing else may outlive it"
