"""Atomic step checkpoints with a validity marker, keep-last-k, best-by-validation and automatic resume.

    <run_dir>/checkpoints/step_00000120/
        model.safetensors     trainable weights + d2t/t2d (frozen target tensors come from the dataset)
        optimizer.pt          optimizer and scheduler state
        trainer_state.json    step, epoch, position in the epoch plan, best validation loss, world size
        rng_rank{r}.pt        each rank's RNG states
        COMPLETE              written last: a directory without it is ignored

A checkpoint is written into `.tmp_step_*`, fsynced, marked COMPLETE and renamed into place, so a crash
or SIGKILL at any moment leaves either the previous valid checkpoints or a temporary directory that the
next start removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARKER = "COMPLETE"
STEP_RE = re.compile(r"^step_(\d{8})$")
BEST = "best"


@dataclass
class TrainerState:
    step: int  # optimizer steps done
    epoch: int  # epoch of the next step
    step_in_epoch: int  # index into the epoch plan of the next step
    samples_seen: int
    world_size: int
    max_seq_len: int
    seed: int
    best_val_loss: float | None = None
    best_step: int | None = None


def step_dir_name(step: int) -> str:
    """Name of the directory of a step checkpoint.

    >>> step_dir_name(120)
    'step_00000120'
    """
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def list_valid(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete step checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = STEP_RE.match(child.name)
        if m and (child / MARKER).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def newest_valid(run_dir: str | os.PathLike) -> Path | None:
    valid = list_valid(run_dir)
    return valid[-1][1] if valid else None


def remove_stale(run_dir: str | os.PathLike) -> list[str]:
    """Delete temporary and unmarked step directories left by a crash; returns their names."""
    root = checkpoints_dir(run_dir)
    removed = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        stale_tmp = child.name.startswith(".tmp_")
        unmarked = STEP_RE.match(child.name) and not (child / MARKER).is_file()
        if child.is_dir() and (stale_tmp or unmarked):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def trainable_names(model: torch.nn.Module) -> set[str]:
    """Names saved in a checkpoint: trainable parameters and the vocab maps (frozen target copies are in the dataset)."""
    keep = {name for name, p in model.named_parameters() if p.requires_grad}
    keep |= {name for name, _ in model.named_buffers() if name.split(".")[-1] in ("d2t", "t2d")}
    return keep


def trainable_state(
    model: torch.nn.Module, full_state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The checkpointed subset of `full_state` (default: the model's own, unsharded state dict)."""
    keep = trainable_names(model)
    state = model.state_dict() if full_state is None else full_state
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k in keep}


def tmp_dir_for(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / f".tmp_{step_dir_name(step)}"


def write_rng(tmp: Path, rank: int) -> None:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, tmp / f"rng_rank{rank}.pt")


def write_main(
    tmp: Path, model_state: dict, optimizer_state: dict, scheduler, state: TrainerState, config: dict
) -> None:
    """Rank 0's part: weights, optimizer state (keyed by parameter name), scheduler, trainer state."""
    save_file(model_state, str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def finalize(run_dir: str | os.PathLike, step: int, keep_last: int) -> Path:
    """fsync, write the marker, rename into place and prune old checkpoints (rank 0 only)."""
    tmp = tmp_dir_for(run_dir, step)
    for f in tmp.iterdir():
        _fsync_file(f)
    (tmp / MARKER).write_text(f"{step}\n")
    _fsync_file(tmp / MARKER)
    _fsync_dir(tmp)
    final = checkpoints_dir(run_dir) / step_dir_name(step)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    prune(run_dir, keep_last)
    return final


def prune(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    valid = list_valid(run_dir)
    doomed = [p for _, p in valid[:-keep_last]] if keep_last > 0 else []
    for path in doomed:
        # Unmark first, so a crash mid-delete never leaves a half-deleted directory that looks valid.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def save_best(run_dir: str | os.PathLike, step_checkpoint: Path) -> Path:
    """Publish a complete step checkpoint as `checkpoints/best` atomically (link or copy, then rename over)."""
    root = checkpoints_dir(run_dir)
    tmp = root / ".tmp_best"
    shutil.rmtree(tmp, ignore_errors=True)
    # Hard links: step checkpoints are never modified once complete, and a copy of a large drafter's
    # optimizer state would take minutes. Falls back to copying across filesystems.
    try:
        shutil.copytree(step_checkpoint, tmp, copy_function=os.link)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(step_checkpoint, tmp)
    _fsync_dir(tmp)
    old = root / ".old_best"
    best = root / BEST
    if best.exists():
        os.rename(best, old)
    os.rename(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(root)
    return best


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def load_optimizer_state(path: Path) -> dict:
    return torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)


def restore_rng(path: Path, rank: int) -> bool:
    f = path / f"rng_rank{rank}.pt"
    if not f.is_file():
        return False
    state = torch.load(f, map_location="cpu", weights_only=True)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True
