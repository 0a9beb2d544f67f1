"""Writing a file so that no reader ever sees half of it: a temporary file beside it, then one rename.

Every file another process reads while the trainer runs goes through here: status.json (train_health polls it),
config.yaml, the tracker record, the Prometheus textfile (node_exporter's textfile collector reads it on every
scrape) and the planner's probe cache. The rename is atomic within one file system, which a sibling temp file
guarantees.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None, fsync: bool = True) -> None:
    """Replace `path` with `text`; `mode` sets the new file's permissions (mkstemp makes it 0600).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write_text(d / "a" / "x.txt", "one", mode=0o644)
    >>> (d / "a" / "x.txt").read_text(), oct((d / "a" / "x.txt").stat().st_mode & 0o777), sorted(os.listdir(d / "a"))
    ('one', '0o644', ['x.txt'])
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: object, fsync: bool = True) -> None:
    """`obj` as indented JSON, replaced atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n", fsync=fsync)
