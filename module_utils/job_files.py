"""The sweep of a GPU job's stale files (standard library only): what a glob may name, and what is removed.

A job leaves files where the GPU stack puts them: NCCL's and PyTorch's shared-memory segments in /dev/shm
(``nccl-*``, ``torch_*``) and torchrun's log folders in the temp folder (``/tmp/torchelastic_<id>``). The sweep
removes those once no live process references them (a still-mapped NCCL segment crashes its user when removed).
A well-formed glob can still name the wrong thing (``/srv/userdata/*`` once deleted a user's tree, ``/*`` would
name the whole system), so a sweep glob must name files of a job, and nothing else:

- it lies directly in one of SWEEP_ROOTS (the folders a GPU job uses for such files), with no wildcard in the
  folder part, so it never reaches below or beside them;
- its name starts with a literal prefix of at least MIN_PREFIX characters (``nccl-*``, not ``*``), so it names
  one program's files, never every file of the folder;
- a directory it matches is removed only when it has the form of torchrun's own log folder (TREE_NAME), lies on
  the root's file system and holds no mount point: a directory tree the job did not create is kept, and reported.

The Ansible role checks gpu_cleanup_sweep with ``glob_problem`` before anything is touched; the gpu_cleanup module
checks it again, so the module refuses the same globs when called directly.
"""

from __future__ import annotations

import glob as globmod
import os
import re
import shutil
import stat

SWEEP_ROOTS = ("/dev/shm", "/tmp", "/var/tmp")
MIN_PREFIX = 3
# The only directory trees the sweep removes: torchrun's log folders (torch.distributed.elastic's tempfile.mkdtemp
# with the prefix "torchelastic_").
TREE_NAME = re.compile(r"torchelastic_[A-Za-z0-9_]+")
_LITERAL = re.compile(r"[A-Za-z0-9_+@,:=-][A-Za-z0-9._+@,:=-]*")
_WILD = re.compile(r"[*?\[]")


def glob_problem(glob: str) -> str | None:
    """Why ``glob`` may not be a sweep glob, or None.

    >>> glob_problem("/dev/shm/nccl-*") is None, glob_problem("/tmp/torchelastic_*") is None
    (True, True)
    >>> glob_problem("/srv/userdata/*")
    'lies outside the folders a GPU job leaves files in (/dev/shm, /tmp, /var/tmp)'
    >>> glob_problem("/tmp/*")
    'names every file of /tmp: start the name with at least 3 literal characters (e.g. /tmp/torchelastic_*)'
    >>> glob_problem("/dev/shm/*/x")
    'reaches below /dev/shm: a sweep glob names files directly in it (e.g. /dev/shm/nccl-*)'
    """
    if not isinstance(glob, str) or not glob.startswith("/") or os.path.normpath(glob) != glob:
        return "is not an absolute, normalised path glob"
    folder, name = os.path.split(glob)
    root = next((r for r in SWEEP_ROOTS if folder == r or folder.startswith(r + "/")), None)
    if root is None:
        return f"lies outside the folders a GPU job leaves files in ({', '.join(SWEEP_ROOTS)})"
    if folder != root:
        return f"reaches below {root}: a sweep glob names files directly in it (e.g. {root}/nccl-*)"
    prefix = _WILD.split(name, maxsplit=1)[0]
    if len(prefix) < MIN_PREFIX or not _LITERAL.fullmatch(prefix):
        example = "/tmp/torchelastic_*" if folder != "/dev/shm" else "/dev/shm/nccl-*"
        return (
            f"names every file of {folder}: start the name with at least {MIN_PREFIX} literal characters "
            f"(e.g. {example})"
        )
    return None


def _mount_inside(path: str, device: int) -> bool:
    """Whether any folder below ``path`` lies on another file system (a mount point the tree must not cross)."""
    for top, dirs, _files in os.walk(path):
        for d in dirs:
            try:
                if os.lstat(os.path.join(top, d)).st_dev != device:
                    return True
            except OSError:
                continue
    return False


def tree_problem(path: str) -> str | None:
    """Why the directory ``path`` is not a tree the job created (and so is kept), or None."""
    name = os.path.basename(path)
    if not TREE_NAME.fullmatch(name):
        return "a directory tree that is not torchrun's log folder (torchelastic_<id>): not the job's to remove"
    root_dev = os.lstat(os.path.dirname(path)).st_dev
    if os.lstat(path).st_dev != root_dev or _mount_inside(path, root_dev):
        return "a mount point lies in it"
    return None


def candidates(globs: list[str], held: set[str]) -> tuple[list[str], list[str], list[str]]:
    """Existing paths matching ``globs``: (to remove, in use, kept with the reason).

    A path is in use when a live process holds it or something below it; a directory that is not the job's tree
    is kept (see tree_problem). Globs that fail glob_problem match nothing here (the caller refuses them first).
    """
    free, busy, kept = [], [], []
    matched = sorted({p for g in globs if glob_problem(g) is None for p in globmod.glob(g)})
    for path in matched:
        prefix = path.rstrip("/") + "/"
        if path in held or any(h.startswith(prefix) for h in held):
            busy.append(path)
            continue
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        why = tree_problem(path) if stat.S_ISDIR(mode) else None
        (kept.append(f"{path}: {why}") if why else free.append(path))
    return free, busy, kept


def remove(path: str) -> str | None:
    """Remove a file, link or the job's directory tree (links are removed, never followed); the error, or None."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror}"
    return None
