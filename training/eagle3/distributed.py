"""torchrun integration: process group setup, the few collectives the trainer uses, CUDA and host allocator setup.

The trainer runs the same code with one process (no process group) and under torchrun (DDP): every
collective here is a no-op when the world size is 1.

Node identity comes from torchrun's environment: GROUP_RANK (this node's index, 0 .. nodes-1), LOCAL_RANK and
LOCAL_WORLD_SIZE (ranks on this node); the number of nodes is WORLD_SIZE / LOCAL_WORLD_SIZE. A run on more than
one node first checks that run_dir is the same directory on every node (`check_shared_run_dir`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.errors import ConfigError
from eagle3.files import atomic_write_text
from eagle3.options import GLIBC_MMAP_CEILING, device_type

ALLOC_CONF = "expandable_segments:True"


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 0  # ranks on this node (LOCAL_WORLD_SIZE); 0: all of them
    node_rank: int = 0  # this node's index (torchrun's GROUP_RANK)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def multi_node(self) -> bool:
        """More than one torchrun agent (node) in the run."""
        return 0 < self.local_world_size < self.world_size

    @property
    def nodes(self) -> int:
        """Nodes in the run: WORLD_SIZE / LOCAL_WORLD_SIZE; 0 when the nodes run different numbers of ranks.

        >>> cpu = torch.device("cpu")
        >>> DistInfo(0, 8, 0, cpu, 4).nodes, DistInfo(0, 8, 0, cpu).nodes, DistInfo(0, 6, 0, cpu, 4).nodes
        (2, 1, 0)
        """
        local = self.local_world_size or self.world_size
        return self.world_size // local if self.world_size % local == 0 else 0

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


def env_node() -> tuple[int, int]:
    """(node rank, ranks on this node) from torchrun's GROUP_RANK and LOCAL_WORLD_SIZE, or (0, WORLD_SIZE)."""
    return int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", env_rank()[1]))


def set_cuda_alloc_conf() -> None:
    """Ask for expandable segments before CUDA initialises (both names: torch renamed the variable)."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = f"{current},{ALLOC_CONF}" if current else ALLOC_CONF


# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
HOST_KEEP_BYTES = 1 << 30
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_host_memory(device: str, keep_bytes: int = HOST_KEEP_BYTES) -> str:
    """On CPU, let glibc's malloc keep up to `keep_bytes` of freed heap for reuse; returns what was done, in words.

    glibc gives the top of its heap back to the kernel once more than its trim threshold is free there (the
    threshold follows the mmap threshold: twice it, dynamic), so a CPU step whose tensors come and go page-faults
    the same memory in again every step: 3-7 % of a step in the kernel at max_seq_len 8192-16384 at the bench's tiny
    shape (docs/speed.md). Here the mmap threshold is fixed at 32 MiB, the ceiling glibc's dynamic threshold reaches
    anyway, so blocks are placed as before, and the trim threshold at `keep_bytes`, so the heap's top stays mapped
    and the next step reuses it; the trainer's address space did not grow (its peak resident set can: freed heap no
    later request fits stays resident). Tensors above 32 MiB are still mappings of their own (on CPU the planner
    advises a loss_chunk_size that keeps the loss's under it, eagle3.plan.cpu_heap_chunk). Only on CPU: on CUDA the
    step's tensors live in torch's caching allocator, and a GPU host should give back what a checkpoint save
    borrowed. Left alone where the user chose (the MALLOC_*_ variables, a glibc.malloc tunable, another allocator in
    LD_PRELOAD) and on a libc other than glibc.
    """
    if device_type(device) != "cpu":
        return ""
    chosen = [k for k in _MALLOC_ENV if k in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        chosen.append("LD_PRELOAD")
    if chosen:
        return f"host malloc left as set ({', '.join(chosen)})"
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return ""
    mallopt = ctypes.CDLL(None).mallopt
    if not (mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_CEILING) and mallopt(M_TRIM_THRESHOLD, keep_bytes)):
        return "host malloc: glibc refused mallopt; its default thresholds stay"
    return (
        f"host malloc: up to {keep_bytes / 2**30:g} GiB of freed heap kept for the next step "
        f"(glibc M_TRIM_THRESHOLD; M_MMAP_THRESHOLD {GLIBC_MMAP_CEILING >> 20} MiB)"
    )


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
    node_rank, local_world = env_node()
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=local,
        device=resolve_device(requested_device, local),
        local_world_size=local_world,
        node_rank=node_rank,
    )


_joined = False  # whether this process joined a process group (init); see exit_process


def init(info: DistInfo, timeout_s: float = 600.0) -> DistInfo:
    """Bind this rank to its GPU (before anything creates a CUDA context) and join the process group."""
    global _joined
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.enabled and not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        kwargs = {"device_id": info.device} if info.device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        _joined = True
    return info


def joined_process_group() -> bool:
    return _joined


def exit_process(code: int) -> None:
    """End a rank that joined a process group with `code`: atexit handlers, flushed streams, then os._exit.

    The interpreter's own finalization is skipped on purpose. destroy_process_group drops the process group from
    torch's registry, but FSDP2's parameter groups still hold it (mesh_info.shard_process_group), so its C++ worker
    threads (gloo's; NCCL's watchdog) live until the interpreter tears the last objects down. A worker thread that
    then frees a tensor Python created must take the GIL, and on Python 3.11-3.13 a thread that takes the GIL during
    finalization is ended by pthread_exit, whose unwinding through a C++ destructor calls std::terminate: "terminate
    called without an active exception", SIGABRT. Rarely, and more often on a loaded machine, a finished run then
    exits -6, torchrun reports it failed, and on several nodes the node whose agent hosts the rendezvous leaves it,
    so the others fail too. Everything the trainer writes is closed (and fsynced) before main returns; the atexit
    handlers (torch's included) still run here, while the interpreter is whole."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


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


SHARED_MARKER = ".shared-storage-check"
SHARED_WAIT_S = 5.0  # how long a node looks for the marker (shared file systems may publish a new file late)


def shared_storage_verdict(run_dir: str, seen: dict[int, bool], writer: int = 0) -> str | None:
    """The error for the nodes that did not see the marker of node `writer` (`seen`: node -> saw it), or None.

    >>> print(shared_storage_verdict("/runs/a", {1: True, 2: False}))  # doctest: +ELLIPSIS
    run_dir /runs/a is not shared storage: node 2 does not see the marker written by node 0 (...
    >>> shared_storage_verdict("/runs/a", {1: True}) is None
    True
    """
    blind = sorted(node for node, saw in seen.items() if not saw)
    if not blind:
        return None
    who = f"node {blind[0]} does" if len(blind) == 1 else f"nodes {', '.join(map(str, blind))} do"
    return (
        f"run_dir {run_dir} is not shared storage: {who} not see the marker written by node {writer} "
        f"({SHARED_MARKER} with a fresh random nonce); every node must mount the same run_dir at the same path "
        "(rank 0 writes the checkpoints, every rank reads them on resume): put it on shared storage (NFS, "
        "CephFS, ...) mounted on every node"
    )


class RunDirNotShared(ConfigError):
    """run_dir is not one directory on every node (exit 2); `blind_nodes` are the nodes that did not see it."""

    def __init__(self, message: str, blind_nodes: list[int]):
        super().__init__(message)
        self.blind_nodes = blind_nodes


def check_shared_run_dir(run_dir: str, info: DistInfo, wait_s: float = SHARED_WAIT_S) -> dict[int, int]:
    """On more than one node: rank 0 writes a random nonce into run_dir, and the first rank of every other node
    must read it back; otherwise every rank raises RunDirNotShared (a ConfigError: exit 2) with
    `shared_storage_verdict`'s message.
    Returns {rank: node rank} of every rank (one gather), {} on a single node, where nothing is checked."""
    if not info.multi_node:
        return {}
    marker = Path(run_dir) / SHARED_MARKER
    nonce = None
    if info.is_main:
        nonce = secrets.token_hex(16)
        atomic_write_text(marker, nonce)
    # Also the barrier: the marker exists before anyone looks. Rank 0's node is node 0 under torchrun.
    nonce, writer = broadcast_object((nonce, info.node_rank), info)
    saw = None
    if info.local_rank == 0 and info.node_rank != writer:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.listdir(run_dir)  # revalidates the directory on NFS-like file systems
                saw = marker.read_text().strip() == nonce
            except OSError:
                saw = False
            if saw or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, (info.rank, info.node_rank, saw))
    if info.is_main:
        with contextlib.suppress(OSError):
            marker.unlink()
    seen = {node: s for _, node, s in gathered if s is not None}
    message = shared_storage_verdict(run_dir, seen, writer)
    if message:
        raise RunDirNotShared(message, sorted(node for node, s in seen.items() if not s))
    return {rank: node for rank, node, _ in gathered}


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


# ------------------------------------------------------------------------------------ the drafter over the ranks
def wrap_for_ranks(model: torch.nn.Module, run, info: DistInfo, autocast_dtype, log) -> torch.nn.Module:
    """What a step calls: the drafter sharded by FSDP2 (HSDP over nodes), inside DDP, or as it is (one rank).
    `run`: the resolved run options (eagle3.options.RunOptions)."""
    device = info.device
    if run.sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # One FSDP2 group over the whole drafter (a single decoder layer, called once per TTT step):
        # parameters, gradients and AdamW state are sharded; compute in bf16, gradients reduced in fp32.
        if run.hsdp:  # HSDP: replicated across the nodes, sharded over the ranks of each node
            mesh = init_device_mesh(device.type, (run.nodes, run.shard_ranks), mesh_dim_names=("replicate", "shard"))
            log(
                f"sharding: hsdp over {run.nodes} nodes x {run.shard_ranks} ranks (each node holds one "
                "sharded copy; gradients are reduced within a node, then averaged across nodes)"
            )
        else:
            mesh = init_device_mesh(device.type, (info.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    if info.enabled:
        import warnings

        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        # ttt_forward calls model(batch, ...), so DDP's forward hooks run and gradients are all-reduced.
        # No buffer sync: the vocab maps and frozen target rows are identical on every rank, and the full
        # target head rows (a buffer of (V_target - V_draft) x H) would otherwise be broadcast every step.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            return DDP(model, device_ids=ids, broadcast_buffers=False)
    return model


def check_hsdp_groups(nodes_of: dict[int, int], shard_ranks: int, log) -> None:
    """Warn when an HSDP shard group (ranks i*shard_ranks ..) spans nodes: still correct, but its all-gathers and
    reduce-scatters then cross the network. torchrun numbers ranks node by node, so this should not happen.

    >>> check_hsdp_groups({0: 0, 1: 0, 2: 1, 3: 1}, 2, print)
    >>> check_hsdp_groups({0: 0, 1: 1, 2: 0, 3: 1}, 2, print)
    warning: hsdp shard group of ranks [0, 1] spans nodes [0, 1]: collectives cross nodes
    """
    for start in range(0, len(nodes_of), shard_ranks):
        ranks = list(range(start, start + shard_ranks))
        spans = sorted({nodes_of[r] for r in ranks if r in nodes_of})
        if len(spans) > 1:
            log(f"warning: hsdp shard group of ranks {ranks} spans nodes {spans}: collectives cross nodes")
            return
