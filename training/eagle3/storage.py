"""An output folder that refuses writes, outside training: `eagle3 generate` classifies it as training classifies
its checkpoint folder (eagle3.errors.STORAGE_KINDS, StorageError, EXIT_STORAGE) and ends with one line naming the
folder, the errno and the error kind, which library/datagen_job.py reads back from the journal. How such a write
fails through safetensors: docs/facts.md#files-and-storage."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from eagle3.errors import STORAGE_KINDS, StorageError

# error kind -> what the output folder is, and what to do about it (the line eagle3 generate ends with).
FOLDER_FAULTS = {
    "disk_full": ("is full", "free space there"),
    "read_only": ("is read-only", "remount it read-write, or choose another folder (eagle3_datagen_out)"),
    "no_permission": ("cannot be written by this user", "give the user the job runs as write access to it"),
}


@contextmanager
def output_writes(out: Path):
    """A write into `out` that the folder refuses (eagle3.errors.STORAGE_KINDS: full, read-only, not ours to write;
    also a safetensors error that says so only in its text, see eagle3.checkpoint.storage_errno) becomes a
    StorageError naming `out`. Other errors, and errors about a file outside `out`, pass unchanged.

    >>> with output_writes(Path("/data")):
    ...     raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    Traceback (most recent call last):
    ...
    eagle3.errors.StorageError: the output folder /data is full (ENOSPC, disk_full)
    """
    from eagle3.checkpoint import storage_errno

    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        name = storage_errno(e)
        filename = next((x.filename for x in _chain(e) if getattr(x, "filename", None)), None)
        if name is None or (filename and not _about(filename, out)):
            raise
        kind = STORAGE_KINDS[name]
        message = f"the output folder {out} {FOLDER_FAULTS[kind][0]} ({name}, {kind})"
        raise StorageError(message, errno_name=name, path=str(out)) from e


def _about(filename, out: Path) -> bool:
    """Whether the file an OSError names is the output folder, in it, or a folder above it that it is made in.

    >>> _about("/data/shards/x", Path("/data")), _about("/data", Path("/data/ds")), _about("/models/t", Path("/data"))
    (True, True, False)
    """
    path, folder = Path(filename).resolve(), out.resolve()
    return path == folder or folder in path.parents or path in folder.parents


def _chain(e: BaseException | None):
    """The exception and the ones it was raised from or during, each once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def storage_line(e: StorageError) -> str:
    """The one line eagle3 generate ends with on a storage fault (library/datagen_job.py reads it back: its format
    is a contract, docs/contracts.md). The complete shards stay: the next run resumes after them.

    >>> storage_line(StorageError("the output folder /nonexistent is full (ENOSPC, disk_full)", errno_name="ENOSPC",
    ...                           path="/nonexistent"))
    'eagle3 generate: the output folder /nonexistent is full (ENOSPC, disk_full): free space there, then run datagen.yml (or this command) again; the 0 complete shards are kept'
    """
    try:
        complete = sum(1 for _ in (Path(e.path) / "shards").glob("shard_*.safetensors"))
    except OSError:
        complete = 0
    return (
        f"eagle3 generate: {e}: {FOLDER_FAULTS[e.kind][1]}, then run datagen.yml (or this command) again; "
        f"the {complete} complete shards are kept"
    )
