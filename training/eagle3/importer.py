"""The importer from speculators' offline layout (hidden states generated with vLLM) into the native format.

speculators writes `hidden_states/hs_{i}.safetensors` per sample; the loss masks live in each file or in a
`loss_masks.jsonl` beside them, and the frozen target weights come from the target model's checkpoint. See
docs/facts.md#training-time-test ("Offline data") for the layout's source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.data import DatasetWriter, build_vocab_mapping, masked_token_counts
from eagle3.errors import DataError
from eagle3.shardfile import load_tensors


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


def _sample_mask(path: Path, i: int, tensors: dict, ids: torch.Tensor, masks: dict) -> torch.Tensor:
    """The loss mask of hs file `i`: its own `loss_mask` tensor, else line `i` of loss_masks.jsonl."""
    if "loss_mask" in tensors:
        return tensors["loss_mask"].to(torch.bool).flatten()
    if i not in masks:
        raise DataError(f"no loss mask for {path.name}: add a loss_mask tensor or a line {i} to loss_masks.jsonl")
    mask_ids, mask_list = masks[i]
    mask = torch.tensor(mask_list, dtype=torch.bool)[: ids.numel()]
    if mask_ids and list(mask_ids[: ids.numel()]) != ids.tolist():
        raise DataError(f"loss_masks.jsonl record {i}: input_ids differ from {path.name}'s token_ids")
    return mask


def _read_sample(path: Path, masks: dict, vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hs file as (token ids long[S], loss mask bool[S], hidden states [S, 4, H]), checked against the
    target's vocab and hidden size."""
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
    mask = _sample_mask(path, i, tensors, ids, masks)
    if mask.numel() != ids.numel():
        raise DataError(f"{path.name}: loss_mask has {mask.numel()} entries, token_ids {ids.numel()}")
    if int(ids.max()) >= vocab:
        raise DataError(f"{path.name}: token id {int(ids.max())} outside the target vocab of {vocab}")
    return ids, mask, hs


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
        raise DataError(f"no hidden_states/hs_*.safetensors under {str(src)!r}; point SRC at a speculators data dir")
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
        ids, mask, hs = _read_sample(path, masks, vocab, hidden)
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
