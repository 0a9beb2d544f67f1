"""The probe: real training steps at two lengths on this GPU, a line through the measured bytes, a choice of
max_seq_len; cached per (GPU, torch version, config hash). It can only lower the analytic choice (cli.choose).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3.files import atomic_write_json
from eagle3.plan.fit import budget_bytes, largest_fitting
from eagle3.plan.model import GIB, batch_bytes, dynamic_bytes, static_bytes
from eagle3.spec import RunSpec


def fit_line(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares a + b * S through (S, bytes) points (two points: the line through them).

    >>> fit_line([(4096, 5096), (8192, 9192)])
    (1000.0, 1.0)
    """
    if len({s for s, _ in points}) < 2:
        raise ValueError(f"need measurements at two different lengths, got {list(points)}")
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((s - mean_s) ** 2 for s, _ in points)
    b = sum((s - mean_s) * (y - mean_y) for s, y in points) / var
    return mean_y - b * mean_s, b


def config_hash(spec: RunSpec) -> str:
    """Hash of everything that changes the bytes of a step on one GPU (not paths, seeds, learning rates or the
    ranks: the probe measures one rank, the analytic static bytes add the rest).

    >>> from eagle3.plan.model import SHAPES, on_cuda
    >>> config_hash(on_cuda(SHAPES["tiny"])) == config_hash(on_cuda(SHAPES["tiny"], world_size=8))
    True
    >>> config_hash(on_cuda(SHAPES["tiny"])) == config_hash(on_cuda(SHAPES["tiny"], ttt_steps=3))
    False
    """
    run = dataclasses.asdict(spec.run)
    for per_run in ("world_size", "nodes", "notes", "sharded", "shard_layout"):
        run.pop(per_run)
    memory = {"data_bytes": spec.data_bytes, "keep_full_head": spec.keep_full_head}
    blob = json.dumps({"shape": spec.drafter.to_dict(), "run": run, "memory": memory}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def probe_cache_path(cache_dir: Path, gpu_name: str, torch_version: str, cfg_hash: str) -> Path:
    """One JSON file per (GPU name, torch version, config hash).

    >>> probe_cache_path(Path("/c"), "NVIDIA H200", "2.13.0+cu128", "abc").name
    'NVIDIA_H200__2.13.0_cu128__abc.json'
    """

    def clean(text: str) -> str:
        return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)

    return cache_dir / f"{clean(gpu_name)}__{clean(torch_version)}__{clean(cfg_hash)}.json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle3" / "plan"


class ProbeUnavailable(RuntimeError):
    """The probe needs CUDA; the analytic plan decides without it."""


def probe(
    spec: RunSpec,
    *,
    memory_gb: float,
    margin: float,
    lengths: Sequence[int] = (4096, 8192),
    measure: Callable[[int], tuple[int, int]] | None = None,
    gpu_name: str | None = None,
    torch_version: str | None = None,
    cache_dir: Path | None = None,
) -> dict:
    """Real steps at two lengths on this GPU, a line through the measured dynamic bytes, a choice; cached.

    measure(S) -> (static bytes before the step, peak bytes during it) on ONE rank; the default runs
    `cuda_measure`. The line a + b*S is fitted to peak - static; the prediction for `world_size` ranks adds the
    analytic static bytes of that world size (DDP buckets, FSDP shards cannot be measured on one GPU).
    Raises ProbeUnavailable without CUDA (unless `measure` is given, as the tests do).
    """
    if measure is None:
        import torch

        if not torch.cuda.is_available():
            raise ProbeUnavailable("no CUDA device: the probe needs a GPU; the analytic plan decides")
        gpu_name = gpu_name or torch.cuda.get_device_name()
        torch_version = torch_version or torch.__version__

        def measure(seq_len: int) -> tuple[int, int]:
            return cuda_measure(spec, seq_len)

    gpu_name = gpu_name or "unknown-gpu"
    torch_version = torch_version or "unknown-torch"
    cfg_hash = config_hash(spec)
    path = probe_cache_path(cache_dir or default_cache_dir(), gpu_name, torch_version, cfg_hash)
    cached = None
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except ValueError:
            cached = None  # a torn or foreign file: measure again and replace it
    if cached and sorted(cached.get("lengths", [])) == sorted(lengths):
        measured = [tuple(m) for m in cached["measured"]]
        from_cache = True
    else:
        measured = [(s, *measure(s)) for s in lengths]
        from_cache = False
    a, b = fit_line([(s, peak - static) for s, static, peak in measured])
    static_world = static_bytes(spec) + int(spec.reserve_gib * GIB)

    def predict(seq_len: int) -> int:
        return int(static_world + batch_bytes(spec, seq_len) + a + b * seq_len)

    budget = budget_bytes(memory_gb, margin)
    chosen = largest_fitting(predict, budget)
    analytic = [dynamic_bytes(spec, s) + batch_bytes(spec, s) for s, _, _ in measured]
    result = {
        "gpu": gpu_name,
        "torch": torch_version,
        "config_hash": cfg_hash,
        "lengths": list(lengths),
        "measured": [list(m) for m in measured],
        "fit_bytes": {"a": a, "b_per_token": b},
        "analytic_dynamic_bytes": analytic,
        "analytic_error": [
            round((an - (peak - static)) / max(peak - static, 1), 3)
            for an, (_, static, peak) in zip(analytic, measured, strict=True)
        ],
        "max_seq_len": chosen,
        "predicted_gb": round(predict(chosen) / GIB, 3) if chosen else None,
        "from_cache": from_cache,
        "cache_file": str(path),
    }
    if not from_cache:
        atomic_write_json(path, {**result, "created": time.time()})
    return result


def cuda_measure(spec: RunSpec, seq_len: int, steps: int = 2) -> tuple[int, int]:
    """(allocated bytes before a step, peak allocated during it) for `steps` real training steps on CUDA, set up
    as eagle3.train does it (bf16 autocast, frozen weights in bf16, fused AdamW, zero_grad(set_to_none=True)).

    Random weights and one document filling the row (the worst case for the mask). The model is freed after.
    """
    import torch

    from eagle3.model import ttt_forward

    device = torch.device("cuda")
    model, optimizer, batch = build_probe_step(spec, seq_len, device)
    try:
        for n in range(steps):
            if n == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=spec.run.autocast):
                loss, _ = ttt_forward(model, batch, **spec.run.ttt_kwargs())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        torch.cuda.synchronize()
        return before, torch.cuda.max_memory_allocated()
    finally:
        del model, optimizer, batch
        torch.cuda.empty_cache()


def build_probe_step(spec: RunSpec, seq_len: int, device):
    """A drafter with random target weights, its AdamW and one packed row (one document) on `device`."""
    import torch

    from eagle3.model import Eagle3Drafter

    cfg = spec.drafter
    h, vt, vd = cfg.hidden_size, cfg.target_vocab_size, cfg.draft_vocab_size
    gen = torch.Generator().manual_seed(0)
    t2d = torch.zeros(vt, dtype=torch.bool)
    chosen = torch.randperm(vt, generator=gen)[:vd].sort().values
    t2d[chosen] = True
    with torch.device(device):
        model = Eagle3Drafter(cfg)
    frozen_dtype = torch.bfloat16 if spec.run.frozen_bf16 else torch.float32
    model.load_target_weights(
        torch.randn(vt, h, device=device, dtype=frozen_dtype),
        torch.ones(h, device=device),
        torch.randn(vt, h, device=device, dtype=frozen_dtype) * 0.02,
        t2d.to(device),
        (chosen - torch.arange(vd)).to(device),
        keep_full_head=spec.keep_full_head,
    )
    if spec.run.frozen_bf16:
        model.frozen_to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, betas=(0.9, 0.95), **fused)
    data_dtype = torch.bfloat16 if spec.data_bytes == 2 else torch.float32
    batch = {
        "input_ids": torch.randint(0, vt, (seq_len,), device=device),
        "aux_hidden": torch.randn(seq_len, 3 * h, device=device, dtype=data_dtype),
        "last_hidden": torch.randn(seq_len, h, device=device, dtype=data_dtype),
        "loss_mask": torch.ones(seq_len, dtype=torch.bool, device=device),
        "document_ids": torch.zeros(seq_len, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq_len, device=device),
    }
    return model, optimizer, batch
