"""The native dataset format: safetensors shards + `index.json`, its reader and its writer.

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
from safetensors.torch import save_file

from eagle3.errors import DataError
from eagle3.files import atomic_write_text
from eagle3.shardfile import ShardFile, TensorEntry, load_tensors, open_shard

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


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            f"draft_vocab_size={draft_vocab_size} is larger than the target vocab ({vocab}); use at most {vocab}"
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
        raise DataError(f"{path}: num_samples={meta['num_samples']} but the shards list {len(lengths)} samples")
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
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._max_open = max_open

    def _shard(self, n: int) -> ShardFile:
        handle = self._open.get(n)
        if handle is None:
            handle = ShardFile(self.index.root / self.index.shard_files[n])
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
            handle = open_shard(idx.root / name)
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
                        raise DataError(f"shard {name}: tensor {key!r} is missing; the shard is corrupt, regenerate it")
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
            handle = open_shard(idx.root / file_name)
            missing = [k for k in keys if k not in set(handle.keys())]
            if missing:
                raise DataError(f"{idx.root / file_name} lacks {missing}; regenerate the dataset")

    def _fields(self, sample_id: int) -> tuple[ShardFile, list[tuple[str, TensorEntry]]]:
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
    def _read_field(shard: ShardFile, entry, rows: int, dest: torch.Tensor, first: int = 0) -> None:
        """Rows first .. first + rows - 1 of a field into `dest`, dequantizing an 8-bit one (entry = (values,
        scales)) and converting one stored in another dtype (never written by DatasetWriter) as build_row does."""
        if isinstance(entry, tuple):
            values, scales = entry
            q = torch.empty((rows, *values.shape[1:]), dtype=FP8)
            scale = torch.empty((rows, scales.shape[1]), dtype=torch.float32)
            shard.read_rows(values, rows, q, first)
            shard.read_rows(scales, rows, scale, first)
            dest.copy_(dequantize_fp8(q, scale, dest.dtype))
        elif entry.dtype != dest.dtype:
            tmp = torch.empty((rows, *entry.shape[1:]), dtype=entry.dtype)
            shard.read_rows(entry, rows, tmp, first)
            dest.copy_(tmp.to(torch.bool) if dest.dtype == torch.bool else tmp)
        else:
            shard.read_rows(entry, rows, dest, first)

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
        held: tuple[int, int, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """`build_row([self.sample(i, max_seq_len) for i in sample_ids], max_seq_len, hidden_size)`, byte for
        byte, read straight into the row's tensors (pinned when `pin_memory`): no per-sample tensors, no
        second copy, and only the padding is zeroed.

        `held` = (a, b, end), a context-parallel rank's share (eagle3.context.ContextShard.held): aux_hidden of the
        slots [a, b) and last_hidden of [a, end) only, read from the files (eagle3.context.shard_row of the whole
        row, byte for byte); the per-slot id vectors whole.

        `out`, a row this method returned before, is overwritten in full and returned when its shapes and
        dtypes fit (a fresh row otherwise): reusing buffers spares the page faults (or pinned allocations) of
        a new row per step, which cost more than the read itself once the files are in the page cache."""
        if not sample_ids:
            raise ValueError("read_row needs at least one sample id")
        s, h = max_seq_len, self.index.hidden_size
        a, b, end = held or (0, s, s)
        # the slots of the row each hidden field holds
        spans = {"aux_hidden": (a, b), "last_hidden": (a, end)}
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
            "aux_hidden": ((b - a, 3 * h), dtype),  # [S, 3H] (held: [b - a, 3H])
            "last_hidden": ((end - a, h), dtype),  # [S, H] (held: [end - a, H])
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
                base, stop = spans.get(name, (0, s))  # the slots of the row this field holds
                lo, hi = max(base, start), min(stop, start + n)  # this document's among them
                if hi <= lo:
                    continue
                dest = row[name]
                if name == "loss_mask" and not isinstance(entry, tuple) and entry.dtype == torch.uint8:
                    dest = mask_bytes  # stored as bytes: read into the bool mask's bytes, no conversion
                self._read_field(shard, entry, hi - lo, dest[lo - base : hi - base], lo - start)
            row["document_ids"][start : start + n] = doc
            torch.arange(n, out=row["position_ids"][start : start + n])
        mask_bytes[:pos].clamp_(max=1)  # any nonzero byte is True, as .to(torch.bool) makes it
        for name in ("input_ids", "loss_mask", "position_ids"):
            row[name][pos:] = 0
        for name, (lo, _) in spans.items():
            row[name][max(pos - lo, 0) :] = 0
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

    def __init__(self, root: str | os.PathLike, hidden_size: int, dtype: torch.dtype, shard_tokens: int = 1 << 20):
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
            raise DataError(f"sample {self.num_samples}: loss_mask has {loss_mask.numel()} entries, input_ids {length}")
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
        atomic_write_text(path, json.dumps(meta, indent=1) + "\n")
        return path


def masked_token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Frequencies of supervised tokens, the statistic the draft vocab is chosen from.

    >>> masked_token_counts(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 1, 1, 1]), 4).tolist()
    [0, 0, 2, 1]
    """
    return torch.bincount(input_ids[loss_mask.to(torch.bool)], minlength=vocab)[:vocab]
