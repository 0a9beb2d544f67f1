"""The trainer's checkpoints across ranks: resume from the newest valid one, write one with the ranks agreeing
after every stage. The files themselves (atomic step directories, manifests, verification, best) are in
checkpoint.py; this module is what the ranks do around them.

    resume  rank 0 verifies and chooses (corrupt ones moved aside), every rank loads the same checkpoint (under
            FSDP each keeps its shard), the epoch plan is re-placed when world size, max_seq_len or seed changed.
            A checkpoint holds full (unsharded) tensors, so any world size and layout resumes it (DDP, FSDP over
            all ranks, HSDP): set_model_state_dict / set_optimizer_state_dict re-shard it on load.
    save    rank 0 makes the temporary directory -> agree -> every rank writes its RNG state, rank 0 the weights,
            optimizer, scheduler, trainer state and config -> agree -> rank 0 finalizes (and publishes best)
            -> agree. A failed stage removes the temporary directory on every rank and raises: StorageError
            for a folder that refuses the write (the previous checkpoints intact), the error itself otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from eagle3 import checkpoint as ckpt
from eagle3 import distributed as dist_utils
from eagle3.config import TrainConfig
from eagle3.errors import STORAGE_KINDS, ConfigError, StorageError
from eagle3.metrics import RunFiles


def replan_on_resume(state: ckpt.TrainerState, changed: list[str], plan_len: int) -> str | None:
    """Place a resumed state in the epoch plan of the current settings; returns the warning to log, if any.

    `changed` lists the plan inputs that differ from the checkpoint's ("world_size 2 -> 1"); `plan_len` is the
    length of the plan of `state.epoch` under the current settings. When that plan is shorter than the position
    reached, epoch `state.epoch` is over and training continues with the next epoch from its start; otherwise
    the rest of the same epoch is re-planned.

    >>> s = ckpt.TrainerState(step=70, epoch=1, step_in_epoch=30, samples_seen=0, world_size=1, max_seq_len=512,
    ...                       seed=0)
    >>> print(replan_on_resume(s, ["world_size 1 -> 2"], plan_len=50))
    warning: world_size 1 -> 2 since the checkpoint: the rest of epoch 1 is re-planned (from step 30 of 50)
    >>> print(replan_on_resume(s, ["world_size 1 -> 2"], plan_len=20))  # doctest: +NORMALIZE_WHITESPACE
    warning: world_size 1 -> 2 since the checkpoint: epoch 1 now has 20 steps and 30 were done, so the rest of
    epoch 1 is skipped; training continues with epoch 2 from its start
    >>> s.epoch, s.step_in_epoch
    (2, 0)
    """
    what = f"warning: {', '.join(changed)} since the checkpoint"
    if state.step_in_epoch >= plan_len:
        done, epoch = state.step_in_epoch, state.epoch
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if not changed:
            return None
        return (
            f"{what}: epoch {epoch} now has {plan_len} steps and {done} were done, so the rest of epoch {epoch} "
            f"is skipped; training continues with epoch {epoch + 1} from its start"
        )
    if changed and state.step_in_epoch:
        # The epoch plan depends on these; continuing mid-epoch with a new plan may repeat or skip samples.
        return f"{what}: the rest of epoch {state.epoch} is re-planned (from step {state.step_in_epoch} of {plan_len})"
    return None


class Checkpointer:
    """Resume and save for one rank of a run: the model (DDP/FSDP-unwrapped), its optimizer and scheduler."""

    def __init__(
        self,
        cfg: TrainConfig,
        info: dist_utils.DistInfo,
        files: RunFiles,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        log: Callable[[str], None],
    ):
        self.cfg = cfg
        self.info = info
        self.files = files
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.log = log

    # ----------------------------------------------------------------------------------- resume
    def resume(self, plan_len: Callable[[int], int]) -> ckpt.TrainerState:
        """The state to continue from: the newest valid checkpoint's, or step 0. `plan_len(epoch)` is the number
        of steps of that epoch's plan under the current settings."""
        cfg = self.cfg
        fresh = ckpt.TrainerState(
            step=0,
            epoch=0,
            step_in_epoch=0,
            samples_seen=0,
            world_size=self.info.world_size,
            max_seq_len=cfg.max_seq_len,
            seed=cfg.seed,
            packing=cfg.packing,
            context_parallel=cfg.context_parallel,
        )
        choice = None
        if self.info.is_main:  # rank 0 verifies (hashes every file once) and tells the others
            found, skipped = ckpt.choose_resume(cfg.run_dir, warn=self.log)
            choice = (str(found) if found is not None else None, skipped)
        found, skipped = dist_utils.broadcast_object(choice, self.info)
        if skipped:
            self.files.update_status(skipped_checkpoints=skipped)
        if found is None:
            if skipped:
                self.log(
                    f"warning: none of the {len(skipped)} checkpoints in {ckpt.checkpoints_dir(cfg.run_dir)} is "
                    "usable (each was moved aside, see above): training starts from step 0"
                )
            return fresh
        path = Path(found)
        state = ckpt.read_state(path)
        self._load(path)
        note = self.layout_note(path, state.world_size)
        if note:
            self.log(note)
        # The epoch plan's inputs (eagle3.packing.plan_epoch) as the checkpoint recorded them and as they are now.
        now = {
            "world_size": self.info.world_size,
            "context_parallel": cfg.context_parallel,
            "max_seq_len": cfg.max_seq_len,
            "seed": cfg.seed,
            "packing": cfg.packing,
        }
        changed = [
            f"{k} {getattr(state, k)} -> {v}"
            + (f" (packing: {state.packing} keeps the checkpoint's plan)" if k == "packing" else "")
            for k, v in now.items()
            if getattr(state, k) != v
        ]
        resumed_at = state.step
        note = replan_on_resume(state, changed, plan_len(state.epoch))
        if note:
            self.log(note)
        for k, v in now.items():
            setattr(state, k, v)
        self.log(
            f"resumed from step {resumed_at} (checkpoint {path}): next is epoch {state.epoch}, "
            f"step {state.step_in_epoch} in the epoch"
        )
        self.files.update_status(
            resumed_from_step=resumed_at,
            resumed_from_checkpoint=str(path),
            last_checkpoint_step=resumed_at,
            last_checkpoint_time=ckpt.checkpoint_time(path),
        )
        return state

    def layout_note(self, path: Path, saved_world: int) -> str | None:
        """What re-sharding a checkpoint means here, when it was written under another world size or layout."""
        try:
            saved = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            saved = {}

        def layout(world: int, fsdp: bool, shard_layout: str) -> str:
            return f"{world} ranks, " + (f"fsdp {shard_layout}" if fsdp and world > 1 else "unsharded")

        before = layout(saved_world, saved.get("fsdp", False), saved.get("shard_layout", "full"))
        after = layout(self.info.world_size, self.cfg.fsdp, self.cfg.shard_layout)
        if before == after:
            return None
        return f"note: checkpoint {path.name} was written with {before}; its full tensors are re-sharded for {after}"

    def _load(self, path: Path) -> None:
        """Weights, optimizer, scheduler and this rank's RNG from `path`; a checkpoint of another shape exits 2."""
        weights = ckpt.load_model_state(path)
        own = self.model.state_dict()
        for key, value in weights.items():
            if key not in own:
                raise ConfigError(f"checkpoint {path} has {key!r}, which this model lacks; use a new run_dir")
            if own[key].shape != value.shape:
                raise ConfigError(
                    f"checkpoint {path}: {key} has shape {list(value.shape)} but the model built from this config "
                    f"has {list(own[key].shape)}; the shape options changed, use a new run_dir"
                )
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and n not in weights]
        if missing:
            raise ConfigError(f"checkpoint {path} lacks trainable weights {missing[:3]}; use a new run_dir")
        full = StateDictOptions(full_state_dict=True, strict=False)
        # Every rank reads the full checkpoint; under FSDP each keeps its own shard.
        set_model_state_dict(self.model, weights, options=full)
        opt = ckpt.load_optimizer_state(path)
        set_optimizer_state_dict(self.model, self.optimizer, opt["optimizer"], options=full)
        self.scheduler.load_state_dict(opt["scheduler"])
        ckpt.restore_rng(path, self.info.rank)

    # ----------------------------------------------------------------------------------- save
    def save(self, state: ckpt.TrainerState, best: bool = False) -> Path | None:
        """Write a step checkpoint (every rank takes part) and, when `best`, publish it as checkpoints/best.

        The ranks agree after each stage. A failed write removes the temporary directory and keeps the previous
        checkpoints; a folder that refuses the write (full, read-only, no permission) raises StorageError on every
        rank (exit 5, status.json error kind disk_full, read_only or no_permission: training does not go on
        without checkpoints, and a restart would lose the same steps again), any other failure is raised as it is.
        """
        main = self.info.is_main
        tmp = ckpt.tmp_dir_for(self.cfg.run_dir, state.step)
        failure = None
        if main:
            try:
                self.files.update_status(phase="checkpointing")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except Exception as e:
                failure = e
        self._agree(failure, state.step, tmp)  # also the barrier before the other ranks write
        try:
            ckpt.write_rng(tmp, self.info.rank)
        except Exception as e:
            failure = e
        # Collectives under FSDP (every rank takes part); full tensors on the CPU of rank 0.
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=full)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=full)
        if main and failure is None:
            try:
                ckpt.write_main(
                    tmp,
                    ckpt.trainable_state(self.model, model_state),
                    optimizer_state,
                    self.scheduler,
                    state,
                    self.cfg.to_dict(),
                )
            except Exception as e:
                failure = e
        del model_state, optimizer_state
        self._agree(failure, state.step, tmp)
        final = None
        if main:
            try:
                final = ckpt.finalize(self.cfg.run_dir, state.step, self.cfg.keep_checkpoints)
                self.files.update_status(
                    last_checkpoint_step=state.step, last_checkpoint_time=ckpt.checkpoint_time(final)
                )
                self.log(f"checkpoint: {final}")
                if best:
                    ckpt.save_best(self.cfg.run_dir, final)
            except Exception as e:
                failure = e
        self._agree(failure, state.step, tmp, written=final)
        return final

    def _agree(self, failure: Exception | None, step: int, tmp: Path, written: Path | None = None) -> None:
        """One collective: did any rank fail? If so clean up, say so and raise on every rank.

        The code each rank contributes: 0 fine, 1 any other failure, 2 + i a folder refusing the write with the
        i-th errno of ckpt.STORAGE_ERRNOS (the largest wins, so every rank raises the same StorageError).
        """
        errno_name = ckpt.storage_errno(failure) if failure is not None else None
        names = [name for _, name in ckpt.STORAGE_ERRNOS]
        code = 0 if failure is None else 1 if errno_name is None else 2 + names.index(errno_name)
        code = int(dist_utils.all_reduce(torch.tensor([float(code)], dtype=torch.float64), self.info, "max").item())
        if code == 0:
            return
        root = ckpt.checkpoints_dir(self.cfg.run_dir)
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(root / ".tmp_best", ignore_errors=True)
        if code == 1:
            if failure is not None:
                raise failure
            raise RuntimeError(f"checkpoint at step {step} not written: another rank failed writing it")
        errno_name = names[code - 2]
        if not self.info.is_main:
            raise StorageError(
                f"checkpoint at step {step} not written: {errno_name} (rank 0 names the path)",
                errno_name=errno_name,
                path=str(root),
            )
        valid = ckpt.list_valid(self.cfg.run_dir)
        kept = f"previous checkpoint step {valid[-1][0]} kept" if valid else "no previous checkpoint"
        if written is not None and valid and valid[-1][1] == written:
            head = f"checkpoint at step {step} written, but best/ or status.json not updated"
            kept = f"checkpoint step {step} kept"
        else:
            head = f"checkpoint at step {step} not written"
        message = f"{head}: {storage_problem(root, errno_name)}; {kept}; the run stops (a restart would lose the same steps again)"
        self.log(message)
        raise StorageError(message, errno_name=errno_name, path=str(root)) from failure


def storage_problem(root: Path, errno_name: str) -> str:
    """What is wrong with the checkpoint folder, for a person: the path, the errno and the free space when full.

    >>> storage_problem(Path("/nonexistent/ckpt"), "EROFS")
    '/nonexistent/ckpt is read-only (EROFS: Read-only file system): remount it read-write or choose another run_dir'
    >>> storage_problem(Path("/nonexistent/ckpt"), "EACCES")
    '/nonexistent/ckpt cannot be written by this user (EACCES: Permission denied): fix its owner or mode'
    """
    why = f"{errno_name}: {os.strerror(getattr(errno, errno_name))}"
    kind = STORAGE_KINDS[errno_name]
    if kind == "read_only":
        return f"{root} is read-only ({why}): remount it read-write or choose another run_dir"
    if kind == "no_permission":
        return f"{root} cannot be written by this user ({why}): fix its owner or mode"
    free = ""
    with contextlib.suppress(OSError):
        free_bytes = shutil.disk_usage(root).free
        free = (
            f", {free_bytes / 2**30:.1f} GiB free now" if free_bytes >= 2**30 else f", {free_bytes >> 20} MiB free now"
        )
    return f"disk full on {root} ({why}{free}): free space or choose another run_dir"
