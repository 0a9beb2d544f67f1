"""torchrun integration: process group setup, the few collectives the trainer uses, CUDA allocator setup.

The trainer runs the same code with one process (no process group) and under torchrun (DDP): every
collective here is a no-op when the world size is 1.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3.options import device_type

ALLOC_CONF = "expandable_segments:True"


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment, or (0, 1, 0)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def set_cuda_alloc_conf() -> None:
    """Ask for expandable segments before CUDA initialises (both names: torch renamed the variable)."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = f"{current},{ALLOC_CONF}" if current else ALLOC_CONF


def expandable_segments_active() -> bool | None:
    """Whether the caching allocator parsed `expandable_segments:True`; None when torch cannot say."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:
        return None
    return "expandable_segments:true" in str(getter()).replace(" ", "").lower()


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if device_type(requested) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def describe(requested_device: str) -> DistInfo:
    """Rank, world size and device from the environment, without touching CUDA or the network."""
    rank, world, local = env_rank()
    return DistInfo(
        rank=rank, world_size=world, local_rank=local, device=resolve_device(requested_device, local)
    )


def init(info: DistInfo, timeout_s: float = 600.0) -> DistInfo:
    """Bind this rank to its GPU (before anything creates a CUDA context) and join the process group."""
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.enabled and not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        kwargs = {"device_id": info.device} if info.device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return info


def all_reduce(tensor: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """All-reduce a CPU tensor across ranks (moved to the device for NCCL) and return it on the CPU."""
    if not info.enabled:
        return tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    work = tensor.to(info.device) if info.device.type == "cuda" else tensor.clone()
    dist.all_reduce(work, op=reduce_op)
    return work.cpu()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if it is True on any rank (one small collective)."""
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    return bool(all_reduce(t, info, "max").item() > 0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def param_checksum(model: torch.nn.Module) -> float:
    """Sum of all trainable parameters in float64: equal on every rank when DDP keeps them in sync."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.requires_grad:
            total += p.detach().to("cpu", torch.float64).sum()
    return float(total)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
