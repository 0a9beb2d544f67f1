"""The training loop of one rank: read top to bottom. eagle3.train sets the process up (signals, stand-in
device, process group, watchdog, memory limit) and turns how the loop ended into the exit code.

    build      dataset checks (bad data: DataError) -> model and target weights -> optimizer -> resume from the
               newest valid checkpoint
    each step  fetch one packed row per rank (prefetched) -> TTT forward -> backward -> clip -> AdamW -> scheduler
    boundary   one collective: stop flag (+ metrics at log steps) -> log -> validate -> checkpoint -> stop?
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from eagle3 import checkpoint as ckpt
from eagle3 import distributed as dist_utils
from eagle3 import options
from eagle3.bounds import seq_len_for
from eagle3.checkpointer import Checkpointer
from eagle3.config import TrainConfig
from eagle3.context import SINGLE, data_parallel_rank, make_shard
from eagle3.data import DatasetReader
from eagle3.errors import (
    EXIT_OK,
    ConfigError,
    DataError,
)
from eagle3.feed import RowPrefetcher, advance
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
from eagle3.model import Eagle3Drafter, ttt_forward
from eagle3.nodes import NODE_ROWS, node_fields, own_column
from eagle3.observe import ProgressLine
from eagle3.packing import EpochPlan, plan_epoch, split_train_val
from eagle3.process import StopRequested, inject_oom
from eagle3.spec import DrafterConfig, RunSpec, resolve_spec
from eagle3.watchdog import Watchdog, fault_hang_step, injected_hang


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
        self.spec: RunSpec | None = None  # the drafter's shape and the run options, resolved for this device
        self.context = SINGLE  # build_model: this rank's share of a row (context parallelism, eagle3.context)
        self._plans: dict[int, EpochPlan] = {}  # the two epoch plans last asked for (plan)
        # build_model: the drafter, what a step calls (DDP around it, or FSDP-sharded), optimizer and schedule
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
            raise DataError(f"the dataset has {idx.num_samples} samples: none left for training after val_fraction")
        shortest = min(idx.lengths[i] for i in self.train_ids)
        if cfg.max_seq_len < shortest:
            raise ConfigError(
                f"max_seq_len={cfg.max_seq_len} is smaller than the shortest document ({shortest} tokens): every "
                f"sample would be truncated; use at least {seq_len_for(shortest)}"
            )
        if cfg.max_seq_len < cfg.ttt_steps + 2:
            raise ConfigError(f"max_seq_len={cfg.max_seq_len} leaves nothing to supervise at ttt_steps={cfg.ttt_steps}")
        # The drafter's shape, dtype, attention, sharding and the TTT keywords, resolved for this device (the
        # object the planner sizes); flex attention on a CPU device, or a shape that cannot be built, exits 2 here.
        self.spec = resolve_spec(cfg, idx, self.info.device, self.info.world_size, nodes=self.info.nodes)
        for note in self.spec.run.notes:
            self.log(note)

    @property
    def run_options(self) -> options.RunOptions:
        return self.spec.run

    @property
    def drafter_config(self) -> DrafterConfig:
        return self.spec.drafter

    @property
    def row_rank(self) -> int:
        """The index of this rank's row in a step (its data-parallel rank): context-parallel ranks share one."""
        return data_parallel_rank(self.info.rank, self.run_options.context_parallel)

    def ttt_kwargs(self) -> dict:
        return {**self.run_options.ttt_kwargs(), "context": self.context}

    def plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:  # two are kept: the prefetch queue may reach into the next epoch
            plan = plan_epoch(
                self.train_ids,
                self.reader.index.lengths,
                max_seq_len=self.cfg.max_seq_len,
                world_size=self.run_options.data_parallel,
                seed=self.cfg.seed,
                epoch=epoch,
                packing=self.cfg.packing,
            )
            self._plans = {**{e: p for e, p in self._plans.items() if e == epoch - 1}, epoch: plan}
        return plan

    def build_model(self) -> None:

        cfg, idx, device = self.cfg, self.reader.index, self.info.device
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
        self.context = make_shard(self.info.rank, self.info.world_size, run.context_parallel, device.type)
        spans_nodes = self.info.multi_node and self.info.local_world_size % run.context_parallel
        if self.context.enabled and spans_nodes:
            self.log(
                f"warning: context_parallel={run.context_parallel} does not divide the {self.info.local_world_size} "
                "ranks per node: some rows are split across nodes, and their all-to-alls cross the network"
            )
        if self.context.enabled:
            self.log(
                f"context parallel: each row split over {run.context_parallel} ranks (a {run.data_parallel} x "
                f"{run.context_parallel} dp x cp mesh; {self.cfg.max_seq_len // run.context_parallel} slots per rank, "
                "attention by all-to-all over heads)"
            )
        self.autocast_dtype = torch.bfloat16 if run.autocast else None
        if run.store_frozen_bf16:
            self.model.frozen_to(torch.bfloat16)  # frozen embedding and target heads in bf16: half the bytes
        self.step_module = dist_utils.wrap_for_ranks(self.model, run, self.info, self.autocast_dtype, self.log)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            **fused,
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
            f"autocast {self.autocast_dtype or 'off'}, attention {cfg.attention}"
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
        # pinned on CUDA: the copy to the GPU runs asynchronously; a context-parallel rank reads its share only
        pin = self.info.device.type == "cuda"
        row = reader.read_row(ids, self.cfg.max_seq_len, pin_memory=pin, held=self.held_slots())
        if not bool(row["loss_mask"].any()):
            real = False  # nothing supervised (all prompt): the loss is 0, the step keeps ranks in step
        return row, real

    def held_slots(self) -> tuple[int, int, int] | None:
        """The slots of a row this rank reads (eagle3.context); None: the whole row."""
        return self.context.held(self.cfg.max_seq_len, self.cfg.ttt_steps) if self.context.enabled else None

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
            self.val_ids,
            self.reader.index.lengths,
            max_seq_len=self.cfg.max_seq_len,
            world_size=self.run_options.data_parallel,
            seed=self.cfg.seed,
            epoch=0,
            shuffle=False,
            packing=self.cfg.packing,
        )
        # val_max_batches: the first rows of the fixed plan, the same on every rank (FSDP runs them in step).
        cap = self.cfg.val_max_batches
        rows = plan.steps[:cap] if cap > 0 else plan.steps
        acc = StatAccumulator(self.cfg.ttt_steps)
        aborted = False
        for assignment in rows:
            # A stop must not wait for a long validation; the result is then dropped. Under FSDP every
            # forward is a collective, so the ranks agree on stopping row by row and run filler rows.
            collective = self.run_options.sharded or self.context.enabled
            stop = dist_utils.any_rank(self.stop.requested, self.info) if collective else self.stop.requested
            if stop:
                aborted = True
                break
            self.watchdog.touch(f"validation at step {step}")
            ids = assignment[self.row_rank]
            if not ids and not collective:
                continue
            row, real = self.fetch_row(ids, plan.steps[0][0][0])
            if not real and not collective:
                continue
            with self.autocast():
                kwargs = {**self.ttt_kwargs(), "walk_max_new": self.cfg.val_max_new}
                _, stats = ttt_forward(self.model, self.to_device(row), **kwargs)
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
            phase="training",
            step=state.step,
            epoch=state.epoch,
            steps_per_epoch=self.steps_per_epoch,
            max_steps=self.total_steps,
            max_seq_len=cfg.max_seq_len,
            world_size=info.world_size,
            context_parallel=self.run_options.context_parallel,
            data_parallel=self.run_options.data_parallel,
            resumed_from_step=resumed_from,
            mem_kind="cuda" if info.device.type == "cuda" else "rss",
        )
        acc = StatAccumulator(cfg.ttt_steps)
        window_start = time.perf_counter()
        record_file = None
        if cfg.record_samples:
            record_file = (Path(cfg.run_dir) / f"samples_rank{info.rank}.jsonl").open("a")
        self.model.train()
        stopped = False
        prefetch = RowPrefetcher(
            cfg.data_dir,
            cfg.max_seq_len,
            pin_memory=info.device.type == "cuda",
            depth=cfg.prefetch_depth,
            held=self.held_slots(),
        )
        hang_at = fault_hang_step(info.rank)  # tests only: EAGLE3_FAULT_HANG_AT_STEP
        progress = ProgressLine(cfg.progress_every_s, start_step=state.step)
        while state.step < self.total_steps:
            plan = self.plan(state.epoch)
            sample_ids = plan.steps[state.step_in_epoch][self.row_rank]
            if hang_at == state.step + 1:
                injected_hang(hang_at)

            t0 = time.perf_counter()
            row, real = self.next_row(prefetch, state, sample_ids)
            own = slice(*self.context.bounds(row["document_ids"].shape[0]))  # this rank's slots of the row
            tokens = int((row["document_ids"][own] >= 0).sum()) if real else 0
            stats, seconds = self.train_step(row, real, state.step + 1, fetch_started=t0)
            if real:
                acc.add_stats(stats)
            # a row counts once, on the first rank of its context-parallel group
            first = self.context.index == 0
            acc.add_scalars(tokens=tokens, rows=1 if real and first else 0, steps=1, **seconds)
            if record_file is not None:
                record_file.write(f'{{"step": {state.step + 1}, "epoch": {state.epoch}, "ids": {list(sample_ids)}}}\n')
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

    def next_row(self, prefetch: RowPrefetcher, state: ckpt.TrainerState, sample_ids: list[int]) -> tuple[dict, bool]:
        """This step's row (read ahead during earlier steps) and (row, real); queues the reads of the next
        `prefetch_depth` steps' rows, so one slow read is hidden behind several steps."""
        plan = self.plan(state.epoch)
        row, real = prefetch.get((state.epoch, state.step_in_epoch), sample_ids, plan.steps[0][0][0])
        for position in self.upcoming_positions(state, prefetch.depth):
            if not prefetch.scheduled(position):
                ahead = self.plan(position[0])
                prefetch.schedule(position, ahead.steps[position[1]][self.row_rank], ahead.steps[0][0][0])
        return row, real

    def train_step(self, row: dict, real: bool, step: int, fetch_started: float) -> tuple[dict, dict[str, float]]:
        """Step `step` (1-based) on this rank's row: forward (TTT, under autocast), backward, clip, AdamW,
        scheduler. A filler row (`real` False) takes part with a zero loss, so every rank runs the same
        collectives. Returns the TTT statistics and the seconds of each phase (fetch runs from
        `fetch_started` to the row being on the device)."""
        batch = self.to_device(row)
        self.sync()
        t1 = time.perf_counter()
        with self.autocast():
            loss, stats = ttt_forward(self.step_module, batch, **self.ttt_kwargs())
        inject_oom(step, self.info.rank, self.start_step)  # tests only: EAGLE3_FAULT_OOM_AT_STEP
        if not real:
            loss = loss * 0.0
        self.sync()
        t2 = time.perf_counter()
        # DDP and FSDP average the gradients over every rank; a row's are the sum over its context-parallel ranks
        # (each holds its slots' share of the loss): scaled by cp, the average is over rows, as without cp.
        (loss * self.run_options.context_parallel if self.context.enabled else loss).backward()
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
        # The best checkpoint: the highest predicted tau_real; the lowest loss where there is no prediction (context
        # parallelism) or no run chose by it yet.
        tau, loss = val.get("tau_predicted"), val["loss"]
        if tau is not None:
            if state.best_tau is None or tau > state.best_tau:
                state.best_tau, state.best_val_loss, state.best_step = tau, loss, state.step
                return True
            return False
        if state.best_tau is None and loss is not None and (state.best_val_loss is None or loss < state.best_val_loss):
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
        checksummed = info.enabled and not self.run_options.sharded  # FSDP ranks hold different shards by design
        slots = torch.zeros(2, info.world_size, dtype=torch.float64)  # [2, W] memory, parameter checksum
        slots[0, info.rank] = mem_gb
        if checksummed:
            slots[1, info.rank] = dist_utils.param_checksum(self.model)
        own = dict(zip(SCALAR_SUM_KEYS, acc.scalars.tolist(), strict=True))
        table = own_column(info.world_size, info.rank, own["tokens"], sum(own[k] for k in TIMER_KEYS))
        flat = torch.cat([torch.tensor([stop], dtype=torch.float64), acc.flat(), slots.flatten(), table.flatten()])
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
            summarize(stats),
            dict(zip(SCALAR_SUM_KEYS, sums.tolist(), strict=True)),
            slots[0].tolist(),
            slots[1].tolist() if checksummed else None,
            step=state.step,
            epoch=state.epoch,
            max_steps=self.total_steps,
            lr=self.scheduler.get_last_lr()[0],
            wall_s=wall_s,
            world_size=info.world_size,
            mem_kind=mem_kind,
        )
        print(console_line(record), flush=True)
        self.files.append_metrics(record)
        bound = round(self.watchdog.bound(), 1) if self.watchdog.enabled else None
        nodes = node_fields(table.tolist(), self.hosts, wall_s, own["steps"])
        self.files.update_status(**status_fields(record), watchdog_bound_s=bound, nodes=nodes)
        return stop_now
