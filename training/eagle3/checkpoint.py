"""Atomic step checkpoints with a validity marker, keep-last-k, best-by-validation and automatic resume.

    <run_dir>/checkpoints/step_00000120/
        model.safetensors     trainable weights + d2t/t2d (frozen target tensors come from the dataset)
        optimizer.pt          optimizer and scheduler state
        trainer_state.json    step, epoch, position in the epoch plan, best validation loss, world size
        rng_rank{r}.pt        each rank's RNG states
        config.json           the config that wrote it
        COMPLETE              written last: the manifest {step, time, files: {name: {size, sha256}}}

A checkpoint is written into `.tmp_step_*`, fsynced, given its manifest and renamed into place, so a crash
or SIGKILL at any moment leaves either the previous valid checkpoints or a temporary directory that the
next start removes. A directory without COMPLETE is ignored (and removed at the next start).

On resume the newest checkpoint is verified against its manifest (every file's size and sha256, and the
trainer state); one that fails (truncated or zeroed file, unreadable or bad marker) is renamed aside to
`step_XXXXXXXX.corrupt` (never deleted), one warning line names it and why, and the next older one is
tried. When none is usable training starts from step 0 (the corrupt ones stay aside for inspection).
Markers from before manifests (just the step number) are checked by loading every file instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import STORAGE_KINDS

MARKER = "COMPLETE"
STEP_RE = re.compile(r"^step_(\d{8})$")
BEST = "best"
CORRUPT_SUFFIX = ".corrupt"
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.json")
# (number, name) of the errnos in eagle3.errors.STORAGE_KINDS, to recognise them in wrapped messages.
STORAGE_ERRNOS = tuple((getattr(errno, name), name) for name in STORAGE_KINDS)
_CHUNK = 8 * 2**20


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
    best_tau: float | None = None  # the best checkpoint's tau_predicted (None: chosen by the loss, or before the key)
    packing: str = "next_fit"  # the packer of the epoch plans; checkpoints from before the key used next_fit
    context_parallel: int = 1  # ranks per row (the plan has world_size / it rows per step); 1 before the key


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
    _torch_save(state, tmp / f"rng_rank{rank}.pt")


def _torch_save(obj, path: Path) -> None:
    # Through a Python file object: a full disk then surfaces as OSError(ENOSPC) (in the RuntimeError's
    # context); torch.save(obj, path) reports only "file write failed".
    with open(path, "wb") as f:
        torch.save(obj, f)


def write_main(
    tmp: Path, model_state: dict, optimizer_state: dict, scheduler, state: TrainerState, config: dict
) -> None:
    """Rank 0's part: weights, optimizer state (keyed by parameter name), scheduler, trainer state."""
    save_file(model_state, str(tmp / "model.safetensors"))
    _torch_save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def storage_errno(exc: BaseException) -> str | None:
    """The errno name when `exc` is a folder refusing a write (eagle3.errors.STORAGE_KINDS), else None.

    The OSError may be wrapped: safetensors says so only in its message ("... (os error 30)"), torch.save (to a
    file object) keeps it as the context of its RuntimeError.

    >>> storage_errno(OSError(errno.ENOSPC, "No space left on device"))
    'ENOSPC'
    >>> storage_errno(RuntimeError("Error while serializing: I/O error: Read-only file system (os error 30)"))
    'EROFS'
    >>> storage_errno(OSError(errno.EACCES, "Permission denied")), storage_errno(OSError(errno.EIO, "I/O"))
    ('EACCES', None)
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and errno.errorcode.get(exc.errno) in STORAGE_KINDS:
            return errno.errorcode[exc.errno]
        text = str(exc)
        for number, name in STORAGE_ERRNOS:
            if f"(os error {number})" in text or os.strerror(number) in text:
                return name
        exc = exc.__cause__ or exc.__context__
    return None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT, possibly wrapped (see storage_errno).

    >>> is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    True
    >>> is_disk_full(OSError(errno.EROFS, "Read-only file system"))
    False
    """
    return STORAGE_KINDS.get(storage_errno(exc) or "") == "disk_full"


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_marker(directory: Path, step: int) -> dict:
    """fsync every file, then write the manifest as the marker (the last file written); returns it."""
    files = {}
    for f in sorted(directory.iterdir()):
        if f.name == MARKER or not f.is_file():
            continue
        _fsync_file(f)
        size, digest = file_digest(f)
        files[f.name] = {"size": size, "sha256": digest}
    manifest = {"step": step, "time": time.time(), "files": files}
    with open(directory / MARKER, "w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return manifest


def finalize(run_dir: str | os.PathLike, step: int, keep_last: int) -> Path:
    """fsync, write the manifest marker, rename into place and prune old checkpoints (rank 0 only)."""
    tmp = tmp_dir_for(run_dir, step)
    write_marker(tmp, step)
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


def _copy_file(src: str, dst: str) -> str:
    """Copy one file's bytes with copy_file_range (falls back to shutil.copyfile), fsynced."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        try:
            done = 0
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, _CHUNK)
        os.fsync(fout.fileno())
    shutil.copystat(src, dst)
    return dst


def save_best(run_dir: str | os.PathLike, step_checkpoint: Path) -> Path:
    """Publish a complete step checkpoint as `checkpoints/best` atomically (copy, then rename over).

    A real copy, not hard links: damage to the step's files in place (a disk error, a stray write) must not
    reach `best`. copy_file_range lets the kernel copy without the data passing through this process, and
    shares the blocks (reflink) on filesystems that can (XFS, Btrfs). A failure (a full disk while copying)
    removes the temporary copy and leaves the previous `best` as it was.
    """
    root = checkpoints_dir(run_dir)
    tmp = root / ".tmp_best"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(step_checkpoint, tmp, copy_function=_copy_file)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = root / ".old_best"
    best = root / BEST
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        os.rename(best, old)
    os.rename(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(root)
    return best


def read_manifest(path: Path) -> dict | None:
    """The marker's manifest; None for a marker from before manifests (just the step number).

    Raises ValueError when the marker is neither.
    """
    text = (path / MARKER).read_text()
    if text.strip().isdigit():
        return None
    try:
        manifest = json.loads(text)
    except ValueError:
        raise ValueError(f"bad {MARKER} marker ({len(text)} bytes, not a manifest)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"bad {MARKER} marker (no file list)")
    return manifest


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None when it verifies.

    With a manifest: each listed file's size and sha256, the required files listed, the step in the marker and in
    trainer_state.json equal to the directory's. Without one (an old marker): every file is loaded.
    """
    m = STEP_RE.match(path.name)
    dir_step = int(m.group(1)) if m else None
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        return str(e) if isinstance(e, ValueError) else f"unreadable {MARKER} marker ({e.strerror or e})"
    try:
        if manifest is None:
            marker_step = int((path / MARKER).read_text())
            if dir_step is not None and marker_step != dir_step:
                return f"the marker says step {marker_step}"
            load_file(str(path / "model.safetensors"))
            torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        else:
            if dir_step is not None and manifest.get("step") != dir_step:
                return f"the marker says step {manifest.get('step')}"
            files = manifest["files"]
            missing = [name for name in REQUIRED_FILES if name not in files]
            if missing:
                return f"the manifest lacks {', '.join(missing)}"
            for name, want in files.items():
                f = path / name
                if not f.is_file():
                    return f"{name} is missing"
                size = f.stat().st_size
                if size != want.get("size"):
                    return f"{name} has {size} bytes, the manifest says {want.get('size')} (truncated or overwritten)"
                if file_digest(f)[1] != want.get("sha256"):
                    return f"{name} does not match its sha256 in the manifest (changed after it was written)"
        state = read_state(path)
        if dir_step is not None and state.step != dir_step:
            return f"trainer_state.json says step {state.step}"
    except OSError as e:
        return f"unreadable: {e.strerror or e}" + (f" ({Path(e.filename).name})" if e.filename else "")
    except Exception as e:  # a corrupt file that still loads this far: any parser error
        return f"does not load: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def quarantine(path: Path) -> Path:
    """Rename a corrupt checkpoint aside (`step_XXXXXXXX.corrupt`, `.corrupt.1`, ...) so it is kept, not used."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}.{n}")
    os.rename(path, target)
    _fsync_dir(path.parent)
    return target


def choose_resume(run_dir: str | os.PathLike, warn: Callable[[str], None] = print) -> tuple[Path | None, list[dict]]:
    """The newest checkpoint that verifies, and the ones skipped on the way ({name, reason, moved_to}).

    Each skipped one is renamed aside (or, when that fails, left in place and said so) with one warning line.
    """
    skipped = []
    for _step, path in reversed(list_valid(run_dir)):
        reason = verify(path)
        if reason is None:
            return path, skipped
        try:
            moved = quarantine(path)
            where = f"moved aside to {moved}"
            moved_to = moved.name
        except OSError as e:
            where = f"left in place (renaming it failed: {e.strerror or e}); it will be tried again next start"
            moved_to = None
        warn(f"warning: checkpoint {path} skipped: {reason}; {where}")
        skipped.append({"name": path.name, "reason": reason, "moved_to": moved_to})
    return None, skipped


def newest_verified(run_dir: str | os.PathLike, warn: Callable[[str], None] = print) -> tuple[Path | None, list[dict]]:
    """The newest checkpoint that verifies, and the damaged ones passed over on the way ({name, reason}), for the
    commands that only read a run (`eagle3 evaluate`, `eagle3 export`): like choose_resume, but nothing is renamed.

    One warning line per damaged checkpoint, naming it and why; it stays where it is (the next training start
    verifies it again and moves it aside).
    """
    skipped = []
    for _step, path in reversed(list_valid(run_dir)):
        reason = verify(path)
        if reason is None:
            return path, skipped
        warn(
            f"warning: checkpoint {path} skipped: {reason}; left in place (this command only reads the run; "
            "the next training start moves it aside)"
        )
        skipped.append({"name": path.name, "reason": reason})
    return None, skipped


def checkpoint_time(path: Path) -> float:
    """When the checkpoint was completed: the manifest's time, else the marker's modification time."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError):
        manifest = None
    if manifest and isinstance(manifest.get("time"), int | float):
        return float(manifest["time"])
    return (path / MARKER).stat().st_mtime


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
