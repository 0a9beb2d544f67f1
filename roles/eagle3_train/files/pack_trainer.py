#!/usr/bin/env python3
"""Pack the trainer package into a byte-for-byte reproducible tar, so that `copy` sees a change only when
the sources changed (sorted entries, fixed mtime, owner and mode; no __pycache__).

Usage: pack_trainer.py TRAINING_DIR OUT.tar   (prints the tar's sha256)
"""

import hashlib
import io
import os
import sys
import tarfile
import tempfile
from pathlib import Path


def pack(training_dir: str, out: str) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(_files(training_dir)):
            data = Path(training_dir, rel).read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    if not os.path.exists(out) or Path(out).read_bytes() != blob:
        # A temporary name of its own: two plays packing at once (two scenarios, two inventories) never share one.
        fd, tmp = tempfile.mkstemp(prefix=".eagle3-trainer.", suffix=".tmp", dir=os.path.dirname(os.path.abspath(out)))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except BaseException:
            os.unlink(tmp)
            raise
    return hashlib.sha256(blob).hexdigest()


def _files(training_dir: str):
    for base, dirs, files in os.walk(os.path.join(training_dir, "eagle3")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(base, name), training_dir)
    if os.path.exists(os.path.join(training_dir, "pyproject.toml")):
        yield "pyproject.toml"


if __name__ == "__main__":
    os.makedirs(os.path.dirname(os.path.abspath(sys.argv[2])), exist_ok=True)
    print(pack(sys.argv[1], sys.argv[2]))
