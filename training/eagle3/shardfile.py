"""Reading safetensors files of a native dataset: a byte-range reader for shards and whole-file loading.

A shard is read with `os.preadv` from the byte ranges its header gives, so a training step's rows land straight in
their destination tensors. Every failure (a missing file, a header that does not parse, a tensor whose bytes do not
fit the file) is a DataError that names the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.errors import DataError

ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_READ = 1 << 30  # bytes per preadv call (Linux caps one read near 2 GiB)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a shard lies in its file, from the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class ShardFile:
    """One open safetensors file read with preadv: the header parsed once (name -> dtype, shape, byte range),
    checked against the file's size so that a truncated shard fails here with DataError."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise DataError(
                f"dataset file {str(path)!r} is missing; the dataset is incomplete, regenerate or re-import it"
            )
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.tensors = self._parse(os.fstat(self.fd).st_size)
        except BaseException:
            self.close()
            raise

    def _parse(self, size: int) -> dict[str, TensorEntry]:
        def corrupt(why: str) -> DataError:
            return DataError(f"dataset file {str(self.path)!r} is corrupt ({why}); regenerate or re-import it")

        head = os.pread(self.fd, 8, 0)
        if len(head) != 8:
            raise corrupt("no safetensors header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise corrupt(f"header of {n} bytes in a file of {size}")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except ValueError as e:
            raise corrupt(f"header is not JSON: {e}") from e
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = ST_DTYPES[info["dtype"]]
                begin, end = (int(v) for v in info["data_offsets"])
                shape = tuple(int(v) for v in info["shape"])
            except (KeyError, TypeError, ValueError) as e:
                raise corrupt(f"tensor {name!r}: {e!r}") from e
            count = 1
            for d in shape:
                count *= d
            if end - begin != count * dtype.itemsize or base + end > size:
                raise corrupt(f"tensor {name!r} bytes {begin}..{end} do not fit the file of {size} bytes")
            out[name] = TensorEntry(dtype, shape, base + begin, base + end)
        return out

    def read_rows(self, entry: TensorEntry, rows: int, dest: torch.Tensor, first: int = 0) -> None:
        """Rows first .. first + rows - 1 of `entry` into the contiguous tensor `dest` (same dtype and row size)."""
        row_bytes = (entry.end - entry.start) // max(entry.shape[0], 1)
        want, offset = row_bytes * rows, entry.start + row_bytes * first
        if dest.numel() * dest.element_size() != want or not dest.is_contiguous():
            raise ValueError(f"destination of {dest.numel() * dest.element_size()} bytes for {want}")
        if want == 0:
            return
        view = memoryview(dest.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < want:
            got = os.preadv(self.fd, [view[done : done + MAX_READ]], offset + done)
            if got <= 0:
                raise DataError(
                    f"dataset file {str(self.path)!r} is corrupt (short read at byte {offset + done}); "
                    "regenerate or re-import it"
                )
            done += got

    def keys(self):
        return self.tensors.keys()

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        self.close()


def open_shard(path: Path):
    """A lazy safetensors handle on `path` (tensors are read on request); DataError when it is missing or corrupt."""
    if not path.is_file():
        raise DataError(f"dataset file {str(path)!r} is missing; the dataset is incomplete, regenerate or re-import it")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # a truncated or overwritten file fails in the header check
        raise DataError(f"dataset file {str(path)!r} is corrupt ({e}); regenerate or re-import it") from e


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a small safetensors file (vocab map, target weights, one speculators sample)."""
    handle = open_shard(path)
    return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - safe_open is not iterable
