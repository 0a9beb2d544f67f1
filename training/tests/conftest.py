"""Shared tiny fixtures for the trainer's CPU tests (hidden 64, vocab 512/1024: a few ms per forward)."""

from __future__ import annotations

import os

import pytest
import torch

# Nothing here may reach the network: transformers and huggingface_hub read local folders only (a missing file is an
# error, never a download).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
from eagle3.model import Eagle3Drafter
from eagle3.spec import DrafterConfig


def _tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=64,
        num_heads=4,
        head_dim=16,
        intermediate_size=128,
        draft_vocab_size=512,
        target_vocab_size=1024,
        aux_layer_ids=(1, 3, 5),
    )
    values.update(overrides)
    return DrafterConfig(**values)


def _random_target(cfg: DrafterConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Frozen target pieces with a draft vocab of every other-ish target id (a random subset, ascending)."""
    gen = torch.Generator().manual_seed(seed)
    h, vt, vd = cfg.hidden_size, cfg.target_vocab_size, cfg.draft_vocab_size
    chosen = torch.randperm(vt, generator=gen)[:vd].sort().values  # [V_draft] target ids in the draft vocab
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[chosen] = True
    return {
        "embed": torch.randn(vt, h, generator=gen),
        "final_norm": 1.0 + 0.1 * torch.randn(h, generator=gen),
        "lm_head": torch.randn(vt, h, generator=gen) * 0.3,
        "t2d": t2d,
        "d2t": chosen - torch.arange(vd),
    }


def _row(cfg: DrafterConfig, doc_lengths, seq_len: int | None = None, seed: int = 0, mask_prob: float = 1.0):
    """One packed row: documents of the given lengths back to back, then padding (document id -1)."""
    gen = torch.Generator().manual_seed(seed)
    used = sum(doc_lengths)
    seq_len = used if seq_len is None else seq_len
    assert used <= seq_len
    doc = torch.full((seq_len,), -1, dtype=torch.long)
    pos = torch.zeros(seq_len, dtype=torch.long)
    start = 0
    for n, length in enumerate(doc_lengths):
        doc[start : start + length] = n
        pos[start : start + length] = torch.arange(length)
        start += length
    loss_mask = (torch.rand(seq_len, generator=gen) < mask_prob) & (doc >= 0)
    return {
        "input_ids": torch.randint(0, cfg.target_vocab_size, (seq_len,), generator=gen),
        "aux_hidden": torch.randn(seq_len, 3 * cfg.hidden_size, generator=gen),
        "last_hidden": torch.randn(seq_len, cfg.hidden_size, generator=gen),
        "loss_mask": loss_mask,
        "document_ids": doc,
        "position_ids": pos,
    }


def _model(cfg: DrafterConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    cfg = cfg or _tiny_config()
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    model.load_target_weights(**_random_target(cfg, seed))
    return model.to(dtype)


@pytest.fixture
def tiny_config():
    """Factory: tiny_config(**overrides) -> DrafterConfig (hidden 64, 4 heads x 16, vocab 512 of 1024)."""
    return _tiny_config


@pytest.fixture
def random_target():
    """Factory: random_target(cfg, seed) -> kwargs for Eagle3Drafter.load_target_weights."""
    return _random_target


@pytest.fixture
def make_row():
    """Factory: make_row(cfg, doc_lengths, seq_len=None, seed=0, mask_prob=1.0) -> one packed-row batch dict."""
    return _row


@pytest.fixture
def make_model():
    """Factory: make_model(cfg=None, seed=0, dtype=float32) -> Eagle3Drafter with random target weights loaded."""
    return _model


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory):
    """A drafter trained briefly on the tiny target, and its export: built once per session, shared by
    test_evaluate (the project's decoder) and test_vllm (vLLM serving the export). Tests only read it."""
    from pipeline_support import train_tiny_drafter

    return train_tiny_drafter(tmp_path_factory.mktemp("tiny-drafter"))
