"""Stand-in GPU devices for CPU ranks: hold a device path open the way a CUDA process holds /dev/nvidia*.

The local CT demo and the cleanup tests pass `standin_gpu_devices` (for example a regular file bind-mounted
at /dev/nvidia0). Rank r opens entry `r % len(paths)` and keeps it for its whole life:
- a regular file: opened O_RDWR and mmap'ed MAP_SHARED, so it shows in /proc/PID/fd and /proc/PID/maps;
- a character node (no driver behind it, a normal open fails with ENXIO): opened with O_PATH, which still
  shows in /proc/PID/fd, fuser and lsof.
"""

from __future__ import annotations

import mmap
import os
import stat

from eagle3.errors import ConfigError

# Held for the process lifetime; never closed explicitly (exit releases them, as with CUDA).
_HELD: list[object] = []


def pick_device(paths: list[str], rank: int) -> str:
    """The stand-in device of a rank: entry rank % len(paths).

    >>> pick_device(["/dev/nvidia0", "/dev/nvidia1"], 3)
    '/dev/nvidia1'
    """
    return paths[rank % len(paths)]


def hold_standin_device(paths: list[str], rank: int) -> str | None:
    """Open and keep this rank's stand-in device; returns the path held, or None when none is configured."""
    if not paths:
        return None
    path = pick_device(paths, rank)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(
            f"standin_gpu_devices entry {path!r} (rank {rank}) cannot be opened: {e.strerror}; "
            "create it (a regular file or `mknod PATH c 195 N`) or remove it from standin_gpu_devices"
        ) from e
    if stat.S_ISCHR(st.st_mode):
        fd = os.open(path, os.O_PATH)
        _HELD.append(fd)
        return path
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"standin_gpu_devices entry {path!r} is neither a regular file nor a character device")
    fd = os.open(path, os.O_RDWR)
    if os.fstat(fd).st_size == 0:
        # mmap needs at least one byte; a fresh empty stand-in file gets one page.
        os.ftruncate(fd, mmap.PAGESIZE)
    mapping = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _HELD.extend([fd, mapping])
    return path
