"""The native dataset format: safetensors shards + `index.json`, and the importer from speculators.

Layout of a dataset directory:

    index.json            format, hidden_size, vocab sizes, aux_layer_ids, dtype, shards with per-sample lengths
    shards/shard_00000.safetensors
                          per sample i: `{i}.input_ids` long[L], `{i}.loss_mask` bool[L],
                          `{i}.aux_hidden` [L, 3H] (three target layers concatenated), `{i}.last_hidden` [L, H]
    vocab.safetensors     t2d bool[V_target], d2t long[V_draft]
    target.safetensors    embed [V_target, H], final_norm [H], lm_head [V_target, H] (frozen target weights)

A sample is addressed by its global id 0..N-1; the shard list maps ids to files. Readers validate all
shard headers up front so that a missing or corrupt shard fails with exit code 2 before training starts.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.errors import DataError

FORMAT_NAME = "eagle3-native"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
VOCAB_FILE = "vocab.safetensors"
TARGET_FILE = "target.safetensors"
SAMPLE_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # 8-bit storage: float8 e4m3 with one float32 scale per token and hidden state (aux layer), read back as bf16.
    "float8_e4m3fn": torch.float8_e4m3fn,
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# A quantized field's per-token scales are stored beside it under this suffix: aux_hidden_scale [S, 3],
# last_hidden_scale [S, 1].
SCALE_SUFFIX = "_scale"
QUANTIZED_KEYS = ("aux_hidden", "last_hidden")


def quantize_fp8(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, parts * H] as float8 e4m3 with a float32 scale per token and part ([S, parts]), each part's
    largest magnitude mapped to 448 (e4m3's largest finite value).

    >>> q, scale = quantize_fp8(torch.tensor([[1.0, -2.0, 0.5, 0.25]]), 2)
    >>> q.dtype, scale.tolist(), dequantize_fp8(q, scale, torch.float32).tolist()
    (torch.float8_e4m3fn, [[0.004464285913854837, 0.0011160714784637094]], [[1.0, -2.0, 0.5, 0.25]])
    """
    s, width = x.shape
    parts_view = x.float().reshape(s, parts, width // parts)
    scale = (parts_view.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)  # [S, parts]
    q = (parts_view / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(s, width), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_fp8, in `dtype`."""
    s, width = q.shape
    parts = scale.shape[1]
    return (q.float().reshape(s, parts, width // parts) * scale[..., None]).reshape(s, width).to(dtype)


def read_dtype(stored: torch.dtype) -> torch.dtype:
    """The dtype rows are read in: the stored one, bf16 for 8-bit storage."""
    return torch.bfloat16 if stored == FP8 else stored


def sample_key(sample_id: int, name: str) -> str:
    """Tensor name of one field of one sample inside a shard.

    >>> sample_key(7, "aux_hidden")
    '7.aux_hidden'
    """
    return f"{sample_id}.{name}"


def build_vocab_mapping(
    token_counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocab = the `draft_vocab_size` most frequent target ids (ties: lower id first), kept in id order.

    Returns (d2t long[V_draft], t2d bool[V_target]) with `target_id = draft_idx + d2t[draft_idx]`.

    >>> d2t, t2d = build_vocab_mapping(torch.tensor([5, 0, 9, 1, 9]), 3)
    >>> d2t.tolist(), t2d.tolist()
    ([0, 1, 2], [True, False, True, False, True])
    """
    counts = token_counts.to(torch.float64).flatten()
    vocab = counts.numel()
    if draft_vocab_size > vocab:
        raise DataError(
            f"draft_vocab_size={draft_vocab_size} is larger than the target vocab ({vocab}); "
            f"use at most {vocab}"
        )
    if draft_vocab_size < 1:
        raise DataError(f"draft_vocab_size={draft_vocab_size} must be at least 1")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    target_ids = torch.sort(order).values  # [V_draft]
    d2t = target_ids - torch.arange(draft_vocab_size)  # [V_draft]
    t2d = torch.zeros(vocab, dtype=torch.bool)  # [V_target]
    t2d[target_ids] = True
    return d2t.to(torch.long), t2d


@dataclass
class DatasetIndex:
    root: Path
    hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    dtype: str
    lengths: list[int]  # per sample id
    shard_of: list[int]  # per sample id: index into shard_files
    shard_files: list[str]
    meta: dict

    @property
    def num_samples(self) -> int:
        return len(self.lengths)


def read_index(root: str | os.PathLike) -> DatasetIndex:
    """Parse and check `index.json`; DataError names the file and what is wrong."""
    root = Path(root)
    path = root / INDEX_FILE
    if not path.is_file():
        raise DataError(
            f"no dataset at {str(root)!r}: {INDEX_FILE} is missing; create one with "
            "`python -m eagle3 synth DIR` or `python -m eagle3 import SRC DIR`"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); regenerate the dataset") from e
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, "
            f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}; regenerate or re-import the dataset"
        )
    for key in (
        "hidden_size",
        "target_vocab_size",
        "draft_vocab_size",
        "aux_layer_ids",
        "num_samples",
        "shards",
    ):
        if key not in meta:
            raise DataError(f"{path} has no {key!r}; regenerate the dataset")
    if meta["draft_vocab_size"] > meta["target_vocab_size"]:
        raise DataError(
            f"{path}: draft_vocab_size={meta['draft_vocab_size']} is larger than "
            f"target_vocab_size={meta['target_vocab_size']}; the draft vocab must be a subset of the target's"
        )
    if meta.get("dtype", "bfloat16") not in DTYPES:
        raise DataError(f"{path}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    lengths: list[int] = []
    shard_of: list[int] = []
    files: list[str] = []
    for n, shard in enumerate(meta["shards"]):
        files.append(shard["file"])
        if shard.get("first_sample") != len(lengths):
            raise DataError(
                f"{path}: shard {shard['file']} starts at sample {shard.get('first_sample')}, expected {len(lengths)}"
            )
        lengths.extend(int(v) for v in shard["lengths"])
        shard_of.extend([n] * len(shard["lengths"]))
    if len(lengths) != meta["num_samples"]:
        raise DataError(
            f"{path}: num_samples={meta['num_samples']} but the shards list {len(lengths)} samples"
        )
    aux = tuple(int(v) for v in meta["aux_layer_ids"])
    if len(aux) != 3:
        raise DataError(f"{path}: aux_layer_ids={list(aux)} must name exactly 3 target layers")
    return DatasetIndex(
        root=root,
        hidden_size=int(meta["hidden_size"]),
        target_vocab_size=int(meta["target_vocab_size"]),
        draft_vocab_size=int(meta["draft_vocab_size"]),
        aux_layer_ids=aux,  # type: ignore[arg-type]
        dtype=meta.get("dtype", "bfloat16"),
        lengths=lengths,
        shard_of=shard_of,
        shard_files=files,
        meta=meta,
    )


class DatasetReader:
    """Random access to samples by id, with a small cache of open shards.

    Samples are read with `os.preadv` straight from each tensor's byte range (from the safetensors header) into
    the destination tensor: one large read per field, no mmap page faults, no intermediate copies. `read_row`
    reads a packed row's samples directly into the row (optionally in pinned memory), the same bytes as
    `build_row(reader.sample(...) ...)`.
    """

    def __init__(self, root: str | os.PathLike, max_open: int = 8):
        self.index = read_index(root)
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._max_open = max_open

    def _shard(self, n: int) -> _Shard:
        handle = self._open.get(n)
        if handle is None:
            handle = _Shard(self.index.root / self.index.shard_files[n])
            self._open[n] = handle
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(n)
        return handle

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()

    def validate(self) -> None:
        """Open every shard header and check each sample's tensors: names, shapes and dtypes."""
        idx = self.index
        h = idx.hidden_size
        for n, name in enumerate(idx.shard_files):
            handle = _open_shard(idx.root / name)
            keys = set(handle.keys())
            shard = idx.meta["shards"][n]
            for i in range(shard["first_sample"], shard["first_sample"] + len(shard["lengths"])):
                length = idx.lengths[i]
                expect = {
                    "input_ids": [length],
                    "loss_mask": [length],
                    "aux_hidden": [length, 3 * h],
                    "last_hidden": [length, h],
                }
                for field_name, shape in expect.items():
                    key = sample_key(i, field_name)
                    if key not in keys:
                        raise DataError(
                            f"shard {name}: tensor {key!r} is missing; the shard is corrupt, regenerate it"
                        )
                    got = list(handle.get_slice(key).get_shape())
                    if got != shape:
                        raise DataError(
                            f"shard {name}: {key} has shape {got}, expected {shape} "
                            f"(hidden_size={h} from index.json); the shard does not match the index"
                        )
        for file_name, keys in (
            (VOCAB_FILE, ("t2d", "d2t")),
            (TARGET_FILE, ("embed", "final_norm", "lm_head")),
        ):
            handle = _open_shard(idx.root / file_name)
            missing = [k for k in keys if k not in set(handle.keys())]
            if missing:
                raise DataError(f"{idx.root / file_name} lacks {missing}; regenerate the dataset")

    def _fields(self, sample_id: int) -> tuple[_Shard, list[tuple[str, _Tensor]]]:
        """The shard of a sample and its four tensors' entries, their shapes checked against the index."""
        n = self.index.shard_of[sample_id]
        shard = self._shard(n)
        length, h = self.index.lengths[sample_id], self.index.hidden_size
        expect = {"input_ids": (length,), "loss_mask": (length,), "aux_hidden": (length, 3 * h)}
        out = []
        for name in SAMPLE_KEYS:
            entry = shard.tensors.get(sample_key(sample_id, name))
            shape = expect.get(name, (length, h))
            if entry is None or entry.shape != shape:
                raise DataError(
                    f"cannot read sample {sample_id} from {self.index.shard_files[n]}: "
                    f"{sample_key(sample_id, name)} is {'missing' if entry is None else list(entry.shape)}, "
                    f"expected {list(shape)} from index.json; the shard does not match the index"
                )
            if name in QUANTIZED_KEYS and entry.dtype == FP8:
                scale = shard.tensors.get(sample_key(sample_id, name + SCALE_SUFFIX))
                parts = 3 if name == "aux_hidden" else 1
                if scale is None or scale.shape != (length, parts) or scale.dtype != torch.float32:
                    raise DataError(
                        f"cannot read sample {sample_id} from {self.index.shard_files[n]}: "
                        f"{sample_key(sample_id, name + SCALE_SUFFIX)} (float32 [{length}, {parts}]) is missing or "
                        "malformed; the 8-bit shard is corrupt, regenerate it"
                    )
                entry = (entry, scale)
            out.append((name, entry))
        return shard, out

    @staticmethod
    def _read_field(shard: _Shard, entry, rows: int, dest: torch.Tensor) -> None:
        """`rows` rows of a field into `dest`, dequantizing an 8-bit one (entry = (values, scales))."""
        if isinstance(entry, tuple):
            values, scales = entry
            q = torch.empty((rows, *values.shape[1:]), dtype=FP8)
            scale = torch.empty((rows, scales.shape[1]), dtype=torch.float32)
            shard.read_rows(values, rows, q)
            shard.read_rows(scales, rows, scale)
            dest.copy_(dequantize_fp8(q, scale, dest.dtype))
            return
        shard.read_rows(entry, rows, dest)

    def sample(self, sample_id: int, max_len: int | None = None) -> dict[str, torch.Tensor]:
        """One sample's tensors, truncated to `max_len` tokens if given (reads only the kept rows)."""
        length = self.index.lengths[sample_id]
        keep = length if max_len is None else min(length, max_len)
        shard, fields = self._fields(sample_id)
        out = {}
        for name, entry in fields:
            values = entry[0] if isinstance(entry, tuple) else entry
            dest = torch.empty((keep, *values.shape[1:]), dtype=read_dtype(values.dtype))
            self._read_field(shard, entry, keep, dest)
            out[name] = dest
        out["loss_mask"] = out["loss_mask"].to(torch.bool)
        return out

    def read_row(
        self,
        sample_ids: list[int],
        max_seq_len: int,
        pin_memory: bool = False,
        out: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """`build_row([self.sample(i, max_seq_len) for i in sample_ids], max_seq_len, hidden_size)`, byte for
        byte, read straight into the row's tensors (pinned when `pin_memory`): no per-sample tensors, no
        second copy, and only the padding is zeroed.

        `out`, a row this method returned before, is overwritten in full and returned when its shapes and
        dtypes fit (a fresh row otherwise): reusing buffers spares the page faults (or pinned allocations) of
        a new row per step, which cost more than the read itself once the files are in the page cache."""
        if not sample_ids:
            raise ValueError("read_row needs at least one sample id")
        s, h = max_seq_len, self.index.hidden_size
        plan = []
        pos = 0
        for i in sample_ids:
            n = min(self.index.lengths[i], s - pos)
            if n <= 0:
                break
            plan.append((i, pos, n, *self._fields(i)))
            pos += n
        fields = dict(plan[0][4])
        aux_entry = fields["aux_hidden"]
        dtype = read_dtype((aux_entry[0] if isinstance(aux_entry, tuple) else aux_entry).dtype)

        def empty(shape, dt):
            return torch.empty(shape, dtype=dt, pin_memory=pin_memory)

        layout = {
            "input_ids": ((s,), torch.long),  # [S]
            "loss_mask": ((s,), torch.bool),  # [S]
            "aux_hidden": ((s, 3 * h), dtype),  # [S, 3H]
            "last_hidden": ((s, h), dtype),  # [S, H]
            "document_ids": ((s,), torch.long),  # [S]
            "position_ids": ((s,), torch.long),  # [S]
        }
        fits = out is not None and all(
            name in out
            and tuple(out[name].shape) == shape
            and out[name].dtype == dt
            and out[name].is_contiguous()
            and out[name].device.type == "cpu"
            for name, (shape, dt) in layout.items()
        )
        row = {name: out[name] for name in layout} if fits else {n: empty(*v) for n, v in layout.items()}
        mask_bytes = row["loss_mask"].view(torch.uint8)
        for doc, (_i, start, n, shard, entries) in enumerate(plan):
            for name, entry in entries:
                dest = mask_bytes if name == "loss_mask" else row[name]
                if isinstance(entry, tuple):  # 8-bit: dequantized into the row
                    self._read_field(shard, entry, n, dest[start : start + n])
                    continue
                if entry.dtype != (torch.uint8 if name == "loss_mask" else dest.dtype):
                    # A field stored in another dtype (never written by DatasetWriter): convert like build_row.
                    tmp = torch.empty((n, *entry.shape[1:]), dtype=entry.dtype)
                    shard.read_rows(entry, n, tmp)
                    row[name][start : start + n] = tmp.to(torch.bool) if name == "loss_mask" else tmp
                    continue
                shard.read_rows(entry, n, dest[start : start + n])
            row["document_ids"][start : start + n] = doc
            torch.arange(n, out=row["position_ids"][start : start + n])
        mask_bytes[:pos].clamp_(max=1)  # any nonzero byte is True, as .to(torch.bool) makes it
        for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "position_ids"):
            row[name][pos:] = 0
        row["document_ids"][pos:] = -1
        return row

    def vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(t2d bool[V_target], d2t long[V_draft])."""
        tensors = load_tensors(self.index.root / VOCAB_FILE)
        t2d, d2t = tensors["t2d"].to(torch.bool), tensors["d2t"].to(torch.long)
        idx = self.index
        if t2d.numel() != idx.target_vocab_size or d2t.numel() != idx.draft_vocab_size:
            raise DataError(
                f"{VOCAB_FILE}: t2d has {t2d.numel()} entries and d2t {d2t.numel()}, index.json says "
                f"target_vocab_size={idx.target_vocab_size}, draft_vocab_size={idx.draft_vocab_size}"
            )
        return t2d, d2t

    def target_weights(self) -> dict[str, torch.Tensor]:
        """Frozen target tensors: embed [V_target, H], final_norm [H], lm_head [V_target, H]."""
        tensors = load_tensors(self.index.root / TARGET_FILE)
        idx = self.index
        expect = {
            "embed": [idx.target_vocab_size, idx.hidden_size],
            "final_norm": [idx.hidden_size],
            "lm_head": [idx.target_vocab_size, idx.hidden_size],
        }
        for key, shape in expect.items():
            if key not in tensors or list(tensors[key].shape) != shape:
                got = list(tensors[key].shape) if key in tensors else "missing"
                raise DataError(f"{TARGET_FILE}: {key} is {got}, expected {shape} from index.json")
        return tensors


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
class _Tensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class _Shard:
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

    def _parse(self, size: int) -> dict[str, _Tensor]:
        def corrupt(why: str) -> DataError:
            return DataError(
                f"dataset file {str(self.path)!r} is corrupt ({why}); regenerate or re-import it"
            )

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
            out[name] = _Tensor(dtype, shape, base + begin, base + end)
        return out

    def read_rows(self, entry: _Tensor, rows: int, dest: torch.Tensor) -> None:
        """The first `rows` rows of `entry` into the contiguous tensor `dest` (same dtype and row size)."""
        want = (entry.end - entry.start) // max(entry.shape[0], 1) * rows
        if dest.numel() * dest.element_size() != want or not dest.is_contiguous():
            raise ValueError(f"destination of {dest.numel() * dest.element_size()} bytes for {want}")
        if want == 0:
            return
        view = memoryview(dest.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < want:
            got = os.preadv(self.fd, [view[done : done + MAX_READ]], entry.start + done)
            if got <= 0:
                raise DataError(
                    f"dataset file {str(self.path)!r} is corrupt (short read at byte {entry.start + done}); "
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


def _open_shard(path: Path):
    if not path.is_file():
        raise DataError(
            f"dataset file {str(path)!r} is missing; the dataset is incomplete, regenerate or re-import it"
        )
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # a truncated or overwritten file fails in the header check
        raise DataError(f"dataset file {str(path)!r} is corrupt ({e}); regenerate or re-import it") from e


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    handle = _open_shard(path)
    return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - safe_open is not iterable


def sample_tensors(
    i: int,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden: torch.Tensor,
    last_hidden: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The tensors of sample `i` as a shard stores them: hidden states in `dtype`, or float8 with their scales."""
    out = {
        sample_key(i, "input_ids"): input_ids.to(torch.long).contiguous(),
        sample_key(i, "loss_mask"): loss_mask.to(torch.uint8).contiguous(),
    }
    for name, value, parts in (("aux_hidden", aux_hidden, 3), ("last_hidden", last_hidden, 1)):
        if dtype == FP8:
            q, scale = quantize_fp8(value, parts)
            out[sample_key(i, name)] = q.contiguous()
            out[sample_key(i, name + SCALE_SUFFIX)] = scale.contiguous()
        else:
            out[sample_key(i, name)] = value.to(dtype).contiguous()
    return out


class DatasetWriter:
    """Append samples, roll shards at `shard_tokens`, then `finish()` writes vocab, target and index.

    The index is written last, so a dataset directory without index.json is an unfinished one.
    """

    def __init__(
        self, root: str | os.PathLike, hidden_size: int, dtype: torch.dtype, shard_tokens: int = 1 << 20
    ):
        self.root = Path(root)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_lengths: list[int] = []
        self._pending_tokens = 0
        self.num_samples = 0
        self.token_counts: torch.Tensor | None = None

    def add(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
    ):
        length = input_ids.numel()
        h = self.hidden_size
        if length == 0:
            raise DataError(f"sample {self.num_samples} is empty; drop empty samples before writing")
        if list(aux_hidden.shape) != [length, 3 * h] or list(last_hidden.shape) != [length, h]:
            raise DataError(
                f"sample {self.num_samples}: aux_hidden {list(aux_hidden.shape)} / last_hidden "
                f"{list(last_hidden.shape)} do not match length {length} and hidden_size {h}"
            )
        if loss_mask.numel() != length:
            raise DataError(
                f"sample {self.num_samples}: loss_mask has {loss_mask.numel()} entries, input_ids {length}"
            )
        self._pending.update(
            sample_tensors(self.num_samples, input_ids, loss_mask, aux_hidden, last_hidden, self.dtype)
        )
        self._pending_lengths.append(length)
        self._pending_tokens += length
        self.num_samples += 1
        if self._pending_tokens >= self.shard_tokens:
            self._flush()

    def adopt_shards(self, shards: list[dict]) -> None:
        """Take shards written elsewhere (eagle3.generate writes its own, resumably): [{file, first_sample,
        lengths}] in sample order, numbered from sample 0 without gaps; `finish` then indexes them."""
        expected = 0
        for shard in shards:
            if shard["first_sample"] != expected or not (self.root / shard["file"]).is_file():
                raise DataError(f"{self.root}: shard {shard['file']} is missing or out of order")
            expected += len(shard["lengths"])
        self.shards = list(shards)
        self.num_samples = expected

    def _flush(self) -> None:
        if not self._pending_lengths:
            return
        name = f"shards/shard_{len(self.shards):05d}.safetensors"
        save_file(self._pending, str(self.root / name))
        first = self.num_samples - len(self._pending_lengths)
        self.shards.append({"file": name, "first_sample": first, "lengths": self._pending_lengths})
        self._pending, self._pending_lengths, self._pending_tokens = {}, [], 0

    def finish(
        self,
        *,
        target_vocab_size: int,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, int, int],
        t2d: torch.Tensor,
        d2t: torch.Tensor,
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        extra: dict | None = None,
    ) -> Path:
        self._flush()
        save_file(
            {"t2d": t2d.to(torch.bool).contiguous(), "d2t": d2t.to(torch.long).contiguous()},
            str(self.root / VOCAB_FILE),
        )
        save_file(
            {
                "embed": embed.contiguous(),
                "final_norm": final_norm.contiguous(),
                "lm_head": lm_head.contiguous(),
            },
            str(self.root / TARGET_FILE),
        )
        dtype_name = next(k for k, v in DTYPES.items() if v == self.dtype)
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "hidden_size": self.hidden_size,
            "target_vocab_size": target_vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "aux_layer_ids": list(aux_layer_ids),
            "dtype": dtype_name,
            "num_samples": self.num_samples,
            "num_tokens": sum(sum(s["lengths"]) for s in self.shards),
            **(extra or {}),
            "shards": self.shards,
        }
        path = self.root / INDEX_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)
        return path


def masked_token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Frequencies of supervised tokens, the statistic the draft vocab is chosen from.

    >>> masked_token_counts(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 1, 1, 1]), 4).tolist()
    [0, 0, 2, 1]
    """
    return torch.bincount(input_ids[loss_mask.to(torch.bool)], minlength=vocab)[:vocab]


# ---------------------------------------------------------------------------------------------------
# Import from the speculators offline layout.


def _read_loss_masks(src: Path) -> dict[int, tuple[list[int], list[int]]]:
    """`loss_masks.jsonl` beside `hidden_states/`: one JSON object per line with
    `index` (optional; the line number otherwise), `input_ids` and `loss_mask` (the prepared dataset's columns)."""
    path = src / "loss_masks.jsonl"
    out: dict[int, tuple[list[int], list[int]]] = {}
    if not path.is_file():
        return out
    with path.open() as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            out[int(rec.get("index", n))] = (rec.get("input_ids", []), rec["loss_mask"])
    return out


def import_speculators(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    target_weights: str | os.PathLike,
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, int, int],
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
) -> Path:
    """Convert `SRC/hidden_states/hs_{i}.safetensors` (`token_ids [S]`, `hidden_states [S, 4, H]`: three aux
    layers then the last layer before the final norm) into the native format.

    Loss masks come from a `loss_mask` tensor inside each hs file if present, else from `SRC/loss_masks.jsonl`
    (export of the prepared dataset's `input_ids`/`loss_mask` columns). `target_weights` is a safetensors file
    with `embed`, `final_norm`, `lm_head` (or HF names `model.embed_tokens.weight`, `model.norm.weight`,
    `lm_head.weight`), or an HF model directory whose `model.safetensors.index.json` locates those tensors.
    """
    src, out = Path(src), Path(out)
    hs_dir = src / "hidden_states"
    files = sorted(hs_dir.glob("hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    if not files:
        raise DataError(
            f"no hidden_states/hs_*.safetensors under {str(src)!r}; point SRC at a speculators data dir"
        )
    masks = _read_loss_masks(src)
    target = load_target_weights(Path(target_weights))
    vocab, hidden = target["embed"].shape
    writer: DatasetWriter | None = None
    counts = torch.zeros(vocab, dtype=torch.long)
    bar = None
    if progress:  # a bar on stderr, plain lines when it is not a terminal
        from eagle3.progress import Progress

        bar = Progress(len(files), "import: files")
    for path in files:
        i = int(path.stem.split("_")[1])
        tensors = load_tensors(path)
        if "token_ids" not in tensors or "hidden_states" not in tensors:
            raise DataError(f"{path} lacks token_ids/hidden_states (has {sorted(tensors)})")
        ids = tensors["token_ids"].to(torch.long).flatten()  # [S]
        hs = tensors["hidden_states"]  # [S, 4, H]
        if hs.dim() != 3 or hs.shape[1] != 4 or hs.shape[0] != ids.numel():
            raise DataError(f"{path}: hidden_states {list(hs.shape)}, expected [{ids.numel()}, 4, H]")
        if hs.shape[2] != hidden:
            raise DataError(
                f"{path}: hidden size {hs.shape[2]} does not match the target weights' {hidden}; "
                "use the target model the hidden states were generated with"
            )
        if "loss_mask" in tensors:
            mask = tensors["loss_mask"].to(torch.bool).flatten()
        elif i in masks:
            mask_ids, mask_list = masks[i]
            mask = torch.tensor(mask_list, dtype=torch.bool)[: ids.numel()]
            if mask_ids and list(mask_ids[: ids.numel()]) != ids.tolist():
                raise DataError(f"loss_masks.jsonl record {i}: input_ids differ from {path.name}'s token_ids")
        else:
            raise DataError(
                f"no loss mask for {path.name}: add a loss_mask tensor or a line {i} to loss_masks.jsonl"
            )
        if mask.numel() != ids.numel():
            raise DataError(f"{path.name}: loss_mask has {mask.numel()} entries, token_ids {ids.numel()}")
        if int(ids.max()) >= vocab:
            raise DataError(f"{path.name}: token id {int(ids.max())} outside the target vocab of {vocab}")
        if writer is None:
            writer = DatasetWriter(out, hidden, dtype)
        aux = hs[:, :3, :].reshape(ids.numel(), 3 * hidden)  # [S, 3H]
        writer.add(ids, mask, aux, hs[:, 3, :])
        counts += masked_token_counts(ids, mask, vocab)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    assert writer is not None
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    return writer.finish(
        target_vocab_size=vocab,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        t2d=t2d,
        d2t=d2t,
        embed=target["embed"],
        final_norm=target["final_norm"],
        lm_head=target["lm_head"],
        extra={"source": f"speculators:{src}"},
    )


HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def load_target_weights(path: Path) -> dict[str, torch.Tensor]:
    """The three frozen target tensors from a safetensors file or an HF model directory."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            out = {}
            for ours, theirs in HF_NAMES.items():
                if theirs not in weight_map:
                    raise DataError(f"{index} does not list {theirs}; is this a causal LM checkpoint?")
                with safe_open(str(path / weight_map[theirs]), framework="pt") as f:
                    out[ours] = f.get_tensor(theirs)
            return out
        path = path / "model.safetensors"
    tensors = load_tensors(path)
    out = {}
    for ours, theirs in HF_NAMES.items():
        if ours in tensors:
            out[ours] = tensors[ours]
        elif theirs in tensors:
            out[ours] = tensors[theirs]
        elif ours == "lm_head" and "embed" in out:
            out[ours] = out["embed"]  # tied embeddings
        else:
            raise DataError(f"{path} has neither {ours!r} nor {theirs!r}")
    return out
