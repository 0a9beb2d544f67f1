"""The training loop: read top to bottom.

    setup      config -> stand-in device -> dataset checks (exit 2) -> process group -> memory limit -> model
               -> resume from the newest valid checkpoint
    each step  fetch one packed row per rank (prefetched) -> TTT forward -> backward -> clip -> AdamW -> scheduler
    boundary   one collective: stop flag (+ metrics at log steps) -> log -> validate -> checkpoint -> stop?
    exit       0 done or stopped cleanly, 2 bad config/data, 3 out of memory, 4 hang (watchdog), 5 a run_dir that
               refuses writes (full, read-only, no permission; the previous checkpoints intact), 1 anything else

Everything that can be checked without the GPU is checked before CUDA or the process group are touched, so
bad input exits with code 2 before any GPU memory is taken.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

from eagle3 import checkpoint as ckpt
from eagle3 import distributed as dist_utils
from eagle3 import options
from eagle3.checkpointer import Checkpointer
from eagle3.config import TrainConfig, dump_config, load_config
from eagle3.data import DatasetReader
from eagle3.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_OK,
    EXIT_OOM,
    EXIT_STORAGE,
    STATUS_FILE_ENV,
    STORAGE_KINDS,
    ConfigError,
    DataError,
    StorageError,
)
from eagle3.files import atomic_write_json
from eagle3.metrics import (
    SCALAR_SUM_KEYS,
    TIMER_KEYS,
    RunFiles,
    StatAccumulator,
    console_line,
    peak_memory_gb,
    status_fields,
    summarize,
    train_record,
    val_line,
    val_record,
)
from eagle3.model import DrafterConfig, Eagle3Drafter, ttt_forward
from eagle3.nodes import NODE_ROWS, gather_hosts, node_fields, own_column
from eagle3.observe import Observer, ProgressLine
from eagle3.packing import EpochPlan, build_row, plan_epoch, split_train_val
from eagle3.rope import normalize_rope_scaling
from eagle3.standin import hold_standin_device
from eagle3.trackers import check_available as check_tracker
from eagle3.watchdog import Watchdog, fault_hang_step, injected_hang


class StopRequested:
    """SIGTERM/SIGINT: the first asks for a checkpoint at the next step boundary, a second exits at once."""

    def __init__(self, on_second):
        self.requested = False
        self.signal_name = ""
        self._on_second = on_second

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self._on_second(name)
            os._exit(EXIT_CRASH)
        self.requested = True
        self.signal_name = name
        print(
            f"{name} received: checkpoint at the next step boundary, then exit (again to exit at once)",
            flush=True,
        )


def is_oom(exc: BaseException) -> bool:
    """CUDA OOM, CPU allocator failure or a Python MemoryError (RLIMIT_AS on CPU)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )


FAULT_OOM_ENV = "EAGLE3_FAULT_OOM_AT_STEP"


def inject_oom(step: int, rank: int, start_step: int = 0) -> None:
    """Tests only: EAGLE3_FAULT_OOM_AT_STEP=N (every rank) or N:rankR (rank R only) raises torch's own
    out-of-memory error in step N (1-based) after its forward, so the real OOM path runs (status.json error
    kind "oom", exit 3, the other ranks stopping) without starving the process of memory. ``+N`` counts from
    the step this run resumed at (``start_step``): +1 is the first step of the run, whatever its checkpoint."""
    raw = os.environ.get(FAULT_OOM_ENV, "")
    if not raw:
        return
    at, _, only = raw.strip().partition(":rank")
    target = start_step + int(at[1:]) if at.startswith("+") else int(at)
    if target == step and (not only or int(only) == rank):
        raise torch.OutOfMemoryError(f"fault injection: {FAULT_OOM_ENV}={raw} (step {step}, rank {rank})")


def apply_memory_limit(limit_gb: float, device: torch.device) -> None:
    """CUDA: per-process memory fraction. CPU: an address-space limit (RLIMIT_AS) so tests can provoke OOM."""
    if limit_gb <= 0:
        return
    limit = int(limit_gb * 2**30)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def verifier_settings(cfg: TrainConfig, index_meta: dict) -> dict:
    """rope_theta, rope_scaling and rms_norm_eps: the config's where set, else the dataset's recorded target config
    (index.json's `target_config`, written by `eagle3 generate`), else the Llama defaults.

    >>> verifier_settings(TrainConfig(), {})
    {'rope_theta': 10000.0, 'rope_scaling': None, 'rms_norm_eps': 1e-06}
    >>> target = {"rope_theta": 500000.0, "rms_norm_eps": 1e-05, "rope_scaling": {"rope_type": "linear", "factor": 2}}
    >>> verifier_settings(TrainConfig(rope_theta=1e6), {"target_config": target})
    {'rope_theta': 1000000.0, 'rope_scaling': {'rope_type': 'linear', 'factor': 2.0}, 'rms_norm_eps': 1e-05}
    >>> verifier_settings(TrainConfig(rope_scaling={"rope_type": "default"}), {"target_config": target})["rope_scaling"]
    """
    target = index_meta.get("target_config") or {}
    return {
        "rope_theta": float(cfg.rope_theta or target.get("rope_theta") or 10000.0),
        "rope_scaling": normalize_rope_scaling(cfg.rope_scaling or target.get("rope_scaling") or None),
        "rms_norm_eps": float(cfg.rms_norm_eps or target.get("rms_norm_eps") or 1e-6),
    }


def drafter_config(cfg: TrainConfig, index) -> DrafterConfig:
    """The drafter's shape: sizes from the dataset index, heads/MLP from the config or derived (0 = derive); rope
    and norm epsilon as the verifier's (verifier_settings)."""
    return DrafterConfig.from_shapes(
        index.hidden_size,
        index.draft_vocab_size,
        index.target_vocab_size,
        tuple(index.aux_layer_ids),
        num_heads=cfg.num_heads or None,
        head_dim=cfg.head_dim or None,
        intermediate_size=cfg.intermediate_size or None,
        norm_before_fc=cfg.norm_before_fc,
        num_kv_heads=cfg.num_kv_heads or None,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        norm_before_residual=cfg.norm_before_residual,
        **verifier_settings(cfg, index.meta),
    )


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


def check_run_dir_shared(cfg: TrainConfig, info: dist_utils.DistInfo) -> dict[int, int]:
    """dist_utils.check_shared_run_dir; a node that does not see rank 0's run_dir has a run_dir of its own, where
    its unit (eagle3.launch) reads status.json: its first rank records the config error there too, so every
    node's unit exits 2 (no restart), not only node 0's."""
    try:
        return dist_utils.check_shared_run_dir(cfg.run_dir, info)
    except dist_utils.RunDirNotShared as e:
        if info.local_rank == 0 and info.node_rank in e.blind_nodes:
            error = {"kind": "config", "message": str(e), "max_seq_len": cfg.max_seq_len}
            with contextlib.suppress(OSError):
                RunFiles(cfg.run_dir).update_status(phase="failed", max_seq_len=cfg.max_seq_len, error=error)
        raise


def lr_lambda(warmup: int, total: int):
    """Linear warmup, then cosine decay to 10 % of the peak at `total` steps.

    >>> f = lr_lambda(10, 110)
    >>> round(f(0), 3), round(f(9), 3), round(f(10), 3), round(f(110), 3)
    (0.1, 1.0, 1.0, 0.1)
    """

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def advance(state: ckpt.TrainerState, samples: int, plan_len: int) -> None:
    """Count one finished step: the position moves on in the epoch plan (`plan_len` steps), or to the next epoch.

    >>> s = ckpt.TrainerState(step=9, epoch=0, step_in_epoch=9, samples_seen=30, world_size=1, max_seq_len=512,
    ...                       seed=0)
    >>> advance(s, samples=3, plan_len=10)
    >>> s.step, s.epoch, s.step_in_epoch, s.samples_seen
    (10, 1, 0, 33)
    """
    state.step += 1
    state.step_in_epoch += 1
    state.samples_seen += samples
    if state.step_in_epoch >= plan_len:
        state.epoch, state.step_in_epoch = state.epoch + 1, 0


class RowPrefetcher:
    """Reads the coming steps' rows in one background thread while the current step computes.

    The thread has its own DatasetReader (its own shard handles), so nothing is shared with the main
    thread's reads during validation; every read of this reader runs on that one thread. A row is read
    straight into its final tensors (`DatasetReader.read_row`), in pinned memory when `pin_memory` (CUDA) so the
    step's copy to the GPU runs with non_blocking=True. Up to `depth` rows are queued ahead (`schedule`, in step
    order); rows rotate through depth + 2 row buffers, reused without a new allocation (page faults or pinned
    allocations cost as much as the read itself): a row returned by `get` stays valid until the next `get`
    returns (the trainer uses it for one step). Errors (bad shard, out of memory) surface in `get`.
    """

    def __init__(self, data_dir: str, max_seq_len: int, pin_memory: bool, depth: int = 1):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be at least 1")
        self.reader = DatasetReader(data_dir)
        self.max_seq_len = max_seq_len
        self.pin_memory = pin_memory
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-fetch")
        self.pending: list[tuple[tuple[int, int], Future]] = []  # oldest first, at most `depth`
        # the step's row, one spare, `depth` queued: a read never lands in the row the caller holds
        self.buffers: list[dict | None] = [None] * (depth + 2)
        self.turn = 0  # the buffer the next read fills (used on the worker thread only)

    def fetch(self, sample_ids: list[int], filler_id: int) -> tuple[dict, bool]:
        """The packed row of `sample_ids`; (row, real). An empty assignment becomes a zero-weight filler row
        (what Trainer.fetch_row returns, read without the per-sample copies)."""
        real = bool(sample_ids)
        ids = sample_ids if real else [filler_id]
        slot, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        row = self.reader.read_row(ids, self.max_seq_len, pin_memory=self.pin_memory, out=self.buffers[slot])
        self.buffers[slot] = row
        if not bool(row["loss_mask"].any()):
            real = False  # nothing supervised (all prompt): the loss is 0, the step keeps ranks in step
        return row, real

    def scheduled(self, key: tuple[int, int]) -> bool:
        return any(k == key for k, _ in self.pending)

    def schedule(self, key: tuple[int, int], sample_ids: list[int], filler_id: int) -> None:
        """Queue the read of an upcoming step's row; at most `depth` are queued (the oldest is dropped)."""
        if len(self.pending) >= self.depth:
            self.pending.pop(0)[1].cancel()
        self.pending.append((key, self.pool.submit(self.fetch, sample_ids, filler_id)))

    def get(self, key: tuple[int, int], sample_ids: list[int], filler_id: int) -> tuple[dict, bool]:
        while self.pending:
            queued, future = self.pending.pop(0)
            if queued == key:
                return future.result()
            future.cancel()  # a stale read (another position): dropped
        # Not prefetched (the first step, a resume): read it now, on the same thread, after any stale read.
        return self.pool.submit(self.fetch, sample_ids, filler_id).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
        self.buffers = [None] * len(self.buffers)


class Trainer:
    """One rank of a run. Set up with `check_data` (no GPU memory yet) and `build_model`, then `train`: resume,
    then per step `train_step` and the step boundary (`reduce_boundary`, validation, checkpoints)."""

    def __init__(self, cfg: TrainConfig, info: dist_utils.DistInfo, files: RunFiles, stop: StopRequested):
        self.cfg = cfg
        self.info = info
        self.files = files
        self.stop = stop
        self.started = time.time()
        self.hosts: list[str] = []  # every rank's host name (main(), once the process group is up)
        # main() replaces this with an armed one once the process group is up; off until then.
        self.watchdog = Watchdog(floor_s=0, factor=1, first_step_s=1, checkpoint_s=1)
        # check_data: the dataset, its split and the run options resolved for this device
        self.reader: DatasetReader | None = None
        self.train_ids: list[int] = []
        self.val_ids: list[int] = []
        self.run_options: options.RunOptions | None = None
        self._plans: dict[int, EpochPlan] = {}  # the two epoch plans last asked for (plan)
        # build_model: the drafter, what a step calls (DDP around it, or FSDP-sharded), optimizer and schedule
        self.drafter_config: DrafterConfig | None = None
        self.model: Eagle3Drafter | None = None
        self.step_module: torch.nn.Module | None = None
        self.autocast_dtype: torch.dtype | None = None  # bf16 under autocast, None without
        self.trainable: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.steps_per_epoch = 0
        self.total_steps = 0
        self.checkpoints: Checkpointer | None = None
        # train: the step this run resumed at (0 from scratch); EAGLE3_FAULT_OOM_AT_STEP=+N counts from it
        self.start_step = 0

    def log(self, msg: str) -> None:
        if self.info.is_main:
            print(msg, flush=True)

    # ----------------------------------------------------------------------------------- setup
    def check_data(self) -> None:
        """Dataset checks that need no model: exit 2 on any mismatch, before GPU memory is taken."""
        cfg = self.cfg
        self.reader = DatasetReader(cfg.data_dir)
        self.reader.validate()
        idx = self.reader.index
        if cfg.hidden_size and cfg.hidden_size != idx.hidden_size:
            raise DataError(
                f"hidden_size={cfg.hidden_size} in the config but the dataset {cfg.data_dir} has hidden_size="
                f"{idx.hidden_size}; remove hidden_size from the config or use a matching dataset"
            )
        self.train_ids, self.val_ids = split_train_val(idx.num_samples, cfg.val_fraction)
        if not self.train_ids:
            raise DataError(
                f"the dataset has {idx.num_samples} samples: none left for training after val_fraction"
            )
        shortest = min(idx.lengths[i] for i in self.train_ids)
        if cfg.max_seq_len < shortest:
            raise ConfigError(
                f"max_seq_len={cfg.max_seq_len} is smaller than the shortest document ({shortest} tokens): every "
                f"sample would be truncated; use at least {math.ceil(shortest / 128) * 128}"
            )
        if cfg.max_seq_len < cfg.ttt_steps + 2:
            raise ConfigError(
                f"max_seq_len={cfg.max_seq_len} leaves nothing to supervise at ttt_steps={cfg.ttt_steps}"
            )
        # dtype, attention, sharding and the TTT keywords, resolved for this device (one function for the
        # trainer, the planner and the benches); flex attention on a CPU device exits 2 here.
        self.run_options = options.resolve_options(
            cfg, self.info.device, self.info.world_size, nodes=self.info.nodes
        )
        for note in self.run_options.notes:
            self.log(note)

    def plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:  # two are kept: the prefetch queue may reach into the next epoch
            plan = plan_epoch(
                self.train_ids,
                self.reader.index.lengths,
                max_seq_len=self.cfg.max_seq_len,
                world_size=self.info.world_size,
                seed=self.cfg.seed,
                epoch=epoch,
                packing=self.cfg.packing,
            )
            self._plans = {**{e: p for e, p in self._plans.items() if e == epoch - 1}, epoch: plan}
        return plan

    def build_model(self) -> None:

        cfg, idx, device = self.cfg, self.reader.index, self.info.device
        self.drafter_config = drafter_config(cfg, idx)
        dc = self.drafter_config
        torch.manual_seed(cfg.seed)
        model = Eagle3Drafter(self.drafter_config)
        t2d, d2t = self.reader.vocab()
        target = self.reader.target_weights()
        model.load_target_weights(target["embed"], target["final_norm"], target["lm_head"], t2d, d2t)
        if cfg.init_from:  # a resumed run's checkpoint replaces these weights afterwards
            from eagle3.export import init_from_export

            init_from_export(model, cfg.init_from)
        self.model = model.to(device)
        run = self.run_options
        autocast_dtype = torch.bfloat16 if run.autocast else None
        self.autocast_dtype = autocast_dtype
        if run.store_frozen_bf16:
            self.model.frozen_to(torch.bfloat16)  # frozen embedding and target heads in bf16: half the bytes
        if run.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # One FSDP2 group over the whole drafter (a single decoder layer, called once per TTT step):
            # parameters, gradients and AdamW state are sharded; compute in bf16, gradients reduced in fp32.
            if run.hsdp:  # HSDP: replicated across the nodes, sharded over the ranks of each node
                mesh = init_device_mesh(
                    device.type, (run.nodes, run.shard_ranks), mesh_dim_names=("replicate", "shard")
                )
                self.log(
                    f"sharding: hsdp over {run.nodes} nodes x {run.shard_ranks} ranks (each node holds one "
                    "sharded copy; gradients are reduced within a node, then averaged across nodes)"
                )
            else:
                mesh = init_device_mesh(device.type, (self.info.world_size,))
            policy = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)
            self.step_module = self.model
        elif self.info.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            # ttt_forward calls model(batch, ...), so DDP's forward hooks run and gradients are all-reduced.
            # No buffer sync: the vocab maps and frozen target rows are identical on every rank, and the full
            # target head rows (a buffer of (V_target - V_draft) x H) would otherwise be broadcast every step.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
                self.step_module = DDP(self.model, device_ids=ids, broadcast_buffers=False)
        else:
            self.step_module = self.model
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), **fused
        )
        steps_per_epoch = len(self.plan(0))
        self.steps_per_epoch = steps_per_epoch
        # Each epoch's shuffle packs slightly differently: count every epoch's own plan.
        self.total_steps = cfg.max_steps or steps_per_epoch + sum(
            len(self.plan(epoch)) for epoch in range(1, cfg.epochs)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.warmup_steps, self.total_steps)
        )
        self.checkpoints = Checkpointer(
            cfg, self.info, self.files, self.model, self.optimizer, self.scheduler, log=self.log
        )
        n_train = sum(p.numel() for p in self.trainable)
        n_frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        plan = self.plan(0)
        self.log(
            f"model: hidden {idx.hidden_size}, {dc.num_heads} heads x {dc.head_dim}, mlp {dc.intermediate_size}, "
            f"draft vocab {idx.draft_vocab_size}/{idx.target_vocab_size}: {n_train / 1e6:.2f} M trainable, "
            f"{n_frozen / 1e6:.2f} M frozen | device {device} x {self.info.world_size}, "
            f"autocast {autocast_dtype or 'off'}, attention {cfg.attention}"
        )
        self.log(
            f"data: {len(self.train_ids)} train / {len(self.val_ids)} val samples, {steps_per_epoch} steps/epoch at "
            f"max_seq_len {cfg.max_seq_len} (fill {plan.fill:.0%}, {plan.truncated} truncated), "
            f"total {self.total_steps} steps"
        )

    # ----------------------------------------------------------------------------------- pieces
    def fetch_row(
        self, sample_ids: list[int], filler_id: int, reader: DatasetReader | None = None
    ) -> tuple[dict, bool]:
        """This rank's packed row; (row, real). An empty assignment becomes a zero-weight filler row."""
        reader = reader or self.reader
        real = bool(sample_ids)
        ids = sample_ids if real else [filler_id]
        samples = [reader.sample(i, self.cfg.max_seq_len) for i in ids]
        row = build_row(samples, self.cfg.max_seq_len, reader.index.hidden_size)
        if not bool(row["loss_mask"].any()):
            real = False  # nothing supervised (all prompt): the loss is 0, the step keeps ranks in step
        if self.info.device.type == "cuda":
            row = {k: v.pin_memory() for k, v in row.items()}  # lets the copy to the GPU run asynchronously
        return row, real

    def upcoming_positions(self, state: ckpt.TrainerState, n: int) -> list[tuple[int, int]]:
        """(epoch, index in the epoch plan) of the next n steps after the current one (fewer at the end)."""
        out, epoch, index = [], state.epoch, state.step_in_epoch
        for _ in range(max(0, min(n, self.total_steps - state.step - 1))):
            index += 1
            if index >= len(self.plan(epoch)):
                epoch, index = epoch + 1, 0
            out.append((epoch, index))
        return out

    def to_device(self, row: dict) -> dict:
        non_blocking = self.info.device.type == "cuda"
        return {k: v.to(self.info.device, non_blocking=non_blocking) for k, v in row.items()}

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.info.device.type, dtype=self.autocast_dtype)

    def sync(self) -> None:
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def save_checkpoint(self, state: ckpt.TrainerState, best: bool = False) -> Path | None:
        """A step checkpoint from every rank (eagle3.checkpointer), under the watchdog's checkpoint bound."""
        with self.watchdog.phase(f"checkpoint at step {state.step}", self.cfg.watchdog_checkpoint_s):
            return self.checkpoints.save(state, best)

    @torch.no_grad()
    def validate(self, step: int) -> dict | None:
        if not self.val_ids:
            return None
        self.files.update_status(phase="validating")
        self.model.eval()
        plan = plan_epoch(
            self.val_ids, self.reader.index.lengths, max_seq_len=self.cfg.max_seq_len,
            world_size=self.info.world_size, seed=self.cfg.seed, epoch=0, shuffle=False, packing=self.cfg.packing,
        )  # fmt: skip
        # val_max_batches: the first rows of the fixed plan, the same on every rank (FSDP runs them in step).
        cap = self.cfg.val_max_batches
        rows = plan.steps[:cap] if cap > 0 else plan.steps
        acc = StatAccumulator(self.cfg.ttt_steps)
        aborted = False
        for assignment in rows:
            # A stop must not wait for a long validation; the result is then dropped. Under FSDP every
            # forward is a collective, so the ranks agree on stopping row by row and run filler rows.
            stop = (
                dist_utils.any_rank(self.stop.requested, self.info)
                if self.run_options.sharded
                else self.stop.requested
            )
            if stop:
                aborted = True
                break
            self.watchdog.touch(f"validation at step {step}")
            ids = assignment[self.info.rank]
            if not ids and not self.run_options.sharded:
                continue
            row, real = self.fetch_row(ids, plan.steps[0][0][0])
            if not real and not self.run_options.sharded:
                continue
            with self.autocast():
                _, stats = ttt_forward(self.model, self.to_device(row), **self.run_options.ttt_kwargs())
            if real:
                acc.add_stats(stats)
        # One collective: the statistics and whether any rank gave up early.
        flat = torch.cat([torch.tensor([float(aborted)], dtype=torch.float64), acc.stats.flatten()])
        flat = dist_utils.all_reduce(flat, self.info)
        self.model.train()
        if flat[0] > 0:
            self.log(f"val step {step}: interrupted by a stop request, result dropped")
            return None
        summary = summarize(flat[1:].view_as(acc.stats))
        if summary["loss"][0] is None:
            self.log(f"val step {step}: no supervised positions in the validation split")
            return None
        val = val_record(step, summary, batches=len(rows), batches_total=len(plan.steps))
        self.log(val_line(val))
        return val

    # ----------------------------------------------------------------------------------- loop
    def train(self) -> int:
        cfg, info = self.cfg, self.info
        state = self.checkpoints.resume(plan_len=lambda epoch: len(self.plan(epoch)))
        self.start_step = state.step
        resumed_from = state.step if state.step else None
        self.files.update_status(
            phase="training", step=state.step, epoch=state.epoch, steps_per_epoch=self.steps_per_epoch,
            max_steps=self.total_steps, max_seq_len=cfg.max_seq_len, world_size=info.world_size,
            resumed_from_step=resumed_from, mem_kind="cuda" if info.device.type == "cuda" else "rss",
        )  # fmt: skip
        acc = StatAccumulator(cfg.ttt_steps)
        window_start = time.perf_counter()
        record_file = None
        if cfg.record_samples:
            record_file = (Path(cfg.run_dir) / f"samples_rank{info.rank}.jsonl").open("a")
        self.model.train()
        stopped = False
        prefetch = RowPrefetcher(
            cfg.data_dir, cfg.max_seq_len, pin_memory=info.device.type == "cuda", depth=cfg.prefetch_depth
        )
        hang_at = fault_hang_step(info.rank)  # tests only: EAGLE3_FAULT_HANG_AT_STEP
        progress = ProgressLine(cfg.progress_every_s, start_step=state.step)
        while state.step < self.total_steps:
            plan = self.plan(state.epoch)
            sample_ids = plan.steps[state.step_in_epoch][info.rank]
            if hang_at == state.step + 1:
                injected_hang(hang_at)

            t0 = time.perf_counter()
            row, real = self.next_row(prefetch, state, sample_ids)
            tokens = int((row["document_ids"] >= 0).sum()) if real else 0
            stats, seconds = self.train_step(row, real, state.step + 1, fetch_started=t0)
            if real:
                acc.add_stats(stats)
            acc.add_scalars(tokens=tokens, rows=1 if real else 0, steps=1, **seconds)
            if record_file is not None:
                record_file.write(
                    f'{{"step": {state.step + 1}, "epoch": {state.epoch}, "ids": {list(sample_ids)}}}\n'
                )
                record_file.flush()
            advance(state, len(sample_ids), len(plan))

            # Step boundary: one collective carries the stop flag (and the metrics at log steps).
            is_log = state.step % cfg.log_every == 0 or state.step >= self.total_steps
            stop_now = self.reduce_boundary(acc, state, is_log, window_start)
            if info.is_main and (line := progress.due(state.step, self.total_steps)):
                self.log(line)
            if is_log:
                acc.reset()
                window_start = time.perf_counter()
            # Re-armed for the next step: max(floor, factor x median of the recent step times).
            self.watchdog.step_done(time.perf_counter() - t0)
            self.validate_and_checkpoint(state, stop_now)
            if stop_now:
                stopped = True
                self.log(f"stopped cleanly at step {state.step} ({self.stop.signal_name or 'another rank'})")
                break

        prefetch.close()
        if record_file is not None:
            record_file.close()
        self.files.update_status(phase="stopped" if stopped else "done", step=state.step, epoch=state.epoch)
        self.log(f"{'stopped' if stopped else 'done'}: step {state.step}, {time.time() - self.started:.0f}s")
        return EXIT_OK

    def next_row(
        self, prefetch: RowPrefetcher, state: ckpt.TrainerState, sample_ids: list[int]
    ) -> tuple[dict, bool]:
        """This step's row (read ahead during earlier steps) and (row, real); queues the reads of the next
        `prefetch_depth` steps' rows, so one slow read is hidden behind several steps."""
        plan = self.plan(state.epoch)
        row, real = prefetch.get((state.epoch, state.step_in_epoch), sample_ids, plan.steps[0][0][0])
        for position in self.upcoming_positions(state, prefetch.depth):
            if not prefetch.scheduled(position):
                ahead = self.plan(position[0])
                prefetch.schedule(position, ahead.steps[position[1]][self.info.rank], ahead.steps[0][0][0])
        return row, real

    def train_step(
        self, row: dict, real: bool, step: int, fetch_started: float
    ) -> tuple[dict, dict[str, float]]:
        """Step `step` (1-based) on this rank's row: forward (TTT, under autocast), backward, clip, AdamW,
        scheduler. A filler row (`real` False) takes part with a zero loss, so every rank runs the same
        collectives. Returns the TTT statistics and the seconds of each phase (fetch runs from
        `fetch_started` to the row being on the device)."""
        batch = self.to_device(row)
        self.sync()
        t1 = time.perf_counter()
        with self.autocast():
            loss, stats = ttt_forward(self.step_module, batch, **self.run_options.ttt_kwargs())
        inject_oom(step, self.info.rank, self.start_step)  # tests only: EAGLE3_FAULT_OOM_AT_STEP
        if not real:
            loss = loss * 0.0
        self.sync()
        t2 = time.perf_counter()
        loss.backward()
        self.sync()
        t3 = time.perf_counter()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.sync()
        t4 = time.perf_counter()
        del loss, batch
        return stats, {"fetch": t1 - fetch_started, "fwd": t2 - t1, "bwd": t3 - t2, "opt": t4 - t3}

    def validate_and_checkpoint(self, state: ckpt.TrainerState, stop_now: bool) -> None:
        """After the boundary collective: validate when due, checkpoint when due (the last step, a stop, a new
        best validation loss, every checkpoint_every steps)."""
        cfg = self.cfg
        last = state.step >= self.total_steps
        # A stop request skips validation: systemd gives the unit a bounded time to exit.
        due_val = not stop_now and (last or (cfg.val_every > 0 and state.step % cfg.val_every == 0))
        val = self.validate(state.step) if due_val else None
        improved = self.note_validation(val, state)
        due_ckpt = last or stop_now or improved or state.step % cfg.checkpoint_every == 0
        if due_ckpt:
            self.save_checkpoint(state, best=improved)
        if due_val or due_ckpt:
            self.files.update_status(phase="training")

    def note_validation(self, val: dict | None, state: ckpt.TrainerState) -> bool:
        if val is None:
            return False
        self.files.update_status(
            val=val, acceptance_length=val["acceptance_length"], acceptance_length_step=val["step"]
        )
        if self.info.is_main:
            self.files.append_metrics({"kind": "val", **val})
        loss = val["loss"]
        if loss is not None and (state.best_val_loss is None or loss < state.best_val_loss):
            state.best_val_loss, state.best_step = loss, state.step
            return True
        return False

    def reduce_boundary(
        self, acc: StatAccumulator, state: ckpt.TrainerState, is_log: bool, window_start: float
    ) -> bool:
        """The step boundary collective: SUM over [stop flag, stats, scalars, per-rank memory and checksum slots].
        At log steps rank 0 writes the window's train record: console, metrics.jsonl, status.json."""
        info = self.info
        stop = 1.0 if self.stop.requested else 0.0
        if not is_log:
            return dist_utils.any_rank(bool(stop), info)
        mem_gb, mem_kind = peak_memory_gb(info.device)
        checksummed = (
            info.enabled and not self.run_options.sharded
        )  # FSDP ranks hold different shards by design
        slots = torch.zeros(2, info.world_size, dtype=torch.float64)  # [2, W] memory, parameter checksum
        slots[0, info.rank] = mem_gb
        if checksummed:
            slots[1, info.rank] = dist_utils.param_checksum(self.model)
        own = dict(zip(SCALAR_SUM_KEYS, acc.scalars.tolist(), strict=True))
        table = own_column(info.world_size, info.rank, own["tokens"], sum(own[k] for k in TIMER_KEYS))
        flat = torch.cat(
            [torch.tensor([stop], dtype=torch.float64), acc.flat(), slots.flatten(), table.flatten()]
        )
        flat = dist_utils.all_reduce(flat, info)
        stop_now = bool(flat[0] > 0)
        if not info.is_main:
            return stop_now
        n = acc.stats.numel() + len(SCALAR_SUM_KEYS)
        stats, sums = acc.unflatten(flat[1 : 1 + n])
        wall_s = time.perf_counter() - window_start
        slots = flat[1 + n : 1 + n + 2 * info.world_size].view(2, info.world_size)
        table = flat[1 + n + 2 * info.world_size :].view(NODE_ROWS, info.world_size)
        record = train_record(
            summarize(stats), dict(zip(SCALAR_SUM_KEYS, sums.tolist(), strict=True)), slots[0].tolist(),
            slots[1].tolist() if checksummed else None, step=state.step, epoch=state.epoch,
            max_steps=self.total_steps, lr=self.scheduler.get_last_lr()[0], wall_s=wall_s,
            world_size=info.world_size, mem_kind=mem_kind,
        )  # fmt: skip
        print(console_line(record), flush=True)
        self.files.append_metrics(record)
        bound = round(self.watchdog.bound(), 1) if self.watchdog.enabled else None
        nodes = node_fields(table.tolist(), self.hosts, wall_s, own["steps"])
        self.files.update_status(**status_fields(record), watchdog_bound_s=bound, nodes=nodes)
        return stop_now


# --------------------------------------------------------------------------------------- entry point
def _config_error_status(status_file: str | None, message: str, max_seq_len: int | None) -> None:
    """Record a config error in status.json, keeping what the file says of earlier runs (their last step and
    checkpoint stay visible). `status_file`: from the config's run_dir when it could be read, else where the
    launcher said (eagle3.errors.STATUS_FILE_ENV), else nowhere."""
    if not status_file or dist_utils.env_rank()[0] != 0:
        return
    path = Path(status_file)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    old = old if isinstance(old, dict) else {}
    error = {"kind": "config", "message": message, "max_seq_len": max_seq_len or old.get("max_seq_len") or 0}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**old, **_previous_run(old), "phase": "failed", "error": error,
                                 "pid": os.getpid(), "updated": time.time()})  # fmt: skip


def _previous_run(old: dict) -> dict:
    """What an earlier run's status.json said of itself, kept under `previous_run` by the next start.

    >>> _previous_run({"phase": "training", "step": 40, "epoch": 1, "updated": 5.0, "error": None})
    {'previous_run': {'phase': 'training', 'step': 40, 'epoch': 1, 'updated': 5.0, 'error_kind': None}}
    >>> _previous_run({"phase": "failed", "step": 0, "previous_run": {"step": 40}})  # a run that did no step
    {'previous_run': {'step': 40}}
    >>> _previous_run({})
    {}
    """
    if not old:
        return {}
    if not old.get("step") and old.get("previous_run"):
        return {"previous_run": old["previous_run"]}
    fields = {k: old.get(k) for k in ("phase", "step", "epoch", "updated")}
    return {"previous_run": {**fields, "error_kind": (old.get("error") or {}).get("kind")}}


def _carry_over(files: RunFiles) -> None:
    """Rank 0 at a start: the newest complete checkpoint on disk and the previous run's last step, so that a start
    that fails before resuming still shows them."""
    with contextlib.suppress(OSError, ValueError):
        old = json.loads((files.run_dir / "status.json").read_text())
        files.status.update(_previous_run(old if isinstance(old, dict) else {}))
    valid = ckpt.list_valid(files.run_dir)
    if valid:
        files.status["last_checkpoint_step"] = valid[-1][0]
        files.status["last_checkpoint_time"] = ckpt.checkpoint_time(valid[-1][1])


def _raw_value(argv: list[str], config_path: str | None, key: str) -> str | None:
    """Best effort: a key's raw value when the config failed validation (to place status.json). Never raises:
    the file may be the very thing that could not be parsed."""
    flag = "--" + key.replace("_", "-")
    for i, arg in enumerate(argv):
        if arg in (flag, "--" + key) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith((flag + "=", f"--{key}=")):
            return arg.split("=", 1)[1]
    if config_path:
        try:
            data = yaml.safe_load(Path(config_path).read_text())
        except (OSError, ValueError, yaml.YAMLError):
            return None
        if isinstance(data, dict) and data.get(key) is not None:
            return str(data[key])
    return None


def main(argv: list[str]) -> int:
    """`python -m eagle3 train --config FILE [--key value ...]`: returns the process exit code."""
    config_path = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
            i += 2
        elif argv[i].startswith("--config="):
            config_path = argv[i].split("=", 1)[1]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    try:
        cfg = load_config(config_path, rest)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        raw_len = _raw_value(rest, config_path, "max_seq_len")
        run_dir = _raw_value(rest, config_path, "run_dir")
        _config_error_status(
            str(Path(run_dir) / "status.json") if run_dir else os.environ.get(STATUS_FILE_ENV),
            str(e),
            int(raw_len) if (raw_len or "").isdigit() else None,
        )
        return EXIT_CONFIG

    rank = dist_utils.env_rank()[0]
    files = RunFiles(cfg.run_dir, enabled=rank == 0)
    files.status["max_seq_len"] = cfg.max_seq_len

    def record_error(kind: str, message: str, **detail) -> None:
        # Any rank may record an OOM or a hang (the others only see a broken or waiting collective); rank 0
        # records the rest.
        if rank != 0 and kind not in ("oom", "hang"):
            return
        if kind == "crash" and rank == 0 and any(sign in message for sign in PEER_LOST):
            # Only a symptom: another rank ended first, and if it ran out of memory its record may still be on the
            # way (a loaded machine delays it). Give it a moment, so that the cause, not the symptom, is recorded.
            deadline = time.monotonic() + PEER_RECORD_WAIT_S
            while time.monotonic() < deadline and not _recent_oom(files, since=started_at):
                time.sleep(0.1)
        if kind in ("crash", "hang") and _recent_oom(files, since=started_at):
            return
        if rank != 0:  # keep rank 0's progress fields, add the error
            with contextlib.suppress(OSError, ValueError):
                files.status.update(json.loads((files.run_dir / "status.json").read_text()))
        files.enabled = True
        try:
            files.update_status(
                phase="failed",
                error={"kind": kind, "message": message, "max_seq_len": cfg.max_seq_len, **detail},
            )
        except OSError as e:  # a full disk: the journal still has the message
            print(
                f"status.json not updated ({e.strerror or e}): {kind}: {message}", file=sys.stderr, flush=True
            )

    started_at = time.time()
    stop = StopRequested(lambda name: _second_signal(files, name, rank))
    stop.install()
    info = None
    watchdog = None
    observer = None
    try:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        # A missing MLflow or W&B package: exit 2 on every rank, before any GPU work.
        check_tracker(cfg.tracker)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        dist_utils.set_cuda_alloc_conf()
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device; use device: auto or cpu")
        describe = dist_utils.describe(cfg.device)
        host_malloc = dist_utils.keep_freed_host_memory(describe.device.type)
        hold_standin_device(cfg.standin_gpu_devices, rank)
        if rank == 0:
            ckpt.remove_stale(cfg.run_dir)
            dump_config(cfg, cfg.run_dir)
            _carry_over(files)
            files.update_status(phase="starting")
        trainer = Trainer(cfg, describe, files, stop)
        if host_malloc:
            trainer.log(host_malloc)
        if rank == 0:  # GPU telemetry, the Prometheus textfile, TensorBoard (eagle3.observe)
            observer = Observer(cfg, describe.device.type, trainer.log)
            files.observer = observer.start(lambda: files.status.get("step", 0))
            files.update_status()
        trainer.check_data()  # bad data exits 2 here, before CUDA or the process group take GPU memory
        info = dist_utils.init(describe, timeout_s=cfg.collective_timeout_s)
        trainer.hosts = gather_hosts(info)  # each rank's host, for the per-node lines of status.json
        # More than one node: run_dir must be one shared directory (exit 2 naming the node that cannot see it).
        nodes_of = check_run_dir_shared(cfg, info)
        if trainer.run_options.hsdp:
            check_hsdp_groups(nodes_of, trainer.run_options.shard_ranks, trainer.log)
        # Every rank: from here on, no finished step within the bound ends the process with EXIT_HANG.
        watchdog = Watchdog(
            floor_s=cfg.watchdog_floor_s, factor=cfg.watchdog_factor, first_step_s=cfg.watchdog_first_step_s,
            checkpoint_s=cfg.watchdog_checkpoint_s, on_hang=lambda message: record_error("hang", message),
        ).start()  # fmt: skip
        trainer.watchdog = watchdog
        apply_memory_limit(cfg.memory_limit_gb, info.device)
        if info.device.type == "cuda" and dist_utils.expandable_segments_active() is False:
            trainer.log(
                "warning: expandable_segments is not active in the CUDA allocator (PYTORCH_ALLOC_CONF)"
            )
        trainer.build_model()
        return trainer.train()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        record_error("config", str(e))
        return EXIT_CONFIG
    except StorageError as e:
        print(f"{e.kind}: {e}", file=sys.stderr, flush=True)
        record_error(e.kind, str(e), errno=e.errno_name, path=e.path)
        return EXIT_STORAGE
    except BaseException as e:
        if isinstance(e, SystemExit | KeyboardInterrupt) and not is_oom(e):
            raise
        if is_oom(e):
            message = f"out of memory at max_seq_len={cfg.max_seq_len}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}"
            # Drop the exception's frames (they pin tensors) before touching memory again.
            e.__traceback__ = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            print(
                f"OOM: {message}; lower max_seq_len or enable activation_checkpointing",
                file=sys.stderr,
                flush=True,
            )
            record_error("oom", message)
            return EXIT_OOM
        traceback.print_exc()
        errno_name = ckpt.storage_errno(e)
        if (
            errno_name
        ):  # a write into run_dir outside a checkpoint (status, metrics): the same, a restart cannot help
            path = str(getattr(e, "filename", None) or cfg.run_dir)
            record_error(
                STORAGE_KINDS[errno_name], f"{path}: {errno_name}: {e}"[:2000], errno=errno_name, path=path
            )
            return EXIT_STORAGE
        record_error("crash", f"{type(e).__name__}: {e}"[:2000])
        return EXIT_CRASH
    finally:
        if watchdog is not None:
            watchdog.stop()
        if observer is not None:
            observer.close()
        if info is not None:
            with contextlib.suppress(Exception):
                dist_utils.shutdown(info)


# A collective's error when another rank has gone (gloo, NCCL): the cause is that rank's, not this one's.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
PEER_RECORD_WAIT_S = 5.0


def _recent_oom(files: RunFiles, since: float) -> bool:
    """Whether another rank of this run already recorded an OOM in status.json."""
    try:
        status = json.loads((files.run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return False
    error = status.get("error") or {}
    return error.get("kind") == "oom" and status.get("updated", 0) >= since


def _second_signal(files: RunFiles, name: str, rank: int) -> None:
    print(f"second {name}: exiting at once without a checkpoint", flush=True)
    if rank == 0:
        with contextlib.suppress(Exception):
            files.update_status(phase="failed", error={"kind": "crash", "message": f"second {name}: exited at once "
                                "without a checkpoint", "max_seq_len": files.status.get("max_seq_len", 0)})  # fmt: skip
