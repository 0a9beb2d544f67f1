"""Packing samples into rows of exactly max_seq_len tokens, balanced across ranks.

One global step = one row per rank (batch size 1: the drafter's attention mask is built for a single
packed row). The plan of an epoch is a pure function of (sample lengths, seed, epoch, world size,
max_seq_len), so every rank computes the same plan without communication, and a resumed run re-creates
it and continues at the saved step.

Per step, samples are taken from the shuffled order while they fit into world_size rows, then assigned
longest first to the least-loaded rank that still has room (LPT). Samples that fit nowhere go back to the
front of the queue for the next step. Samples longer than max_seq_len are truncated (and counted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class EpochPlan:
    """`steps[s][r]` is the list of sample ids rank r packs at step s of the epoch."""

    epoch: int
    steps: list[list[list[int]]]
    truncated: int  # samples longer than max_seq_len in this split
    tokens: int  # tokens kept after truncation
    fill: float = field(default=0.0)  # kept tokens / (steps * world_size * max_seq_len)

    def __len__(self) -> int:
        return len(self.steps)


def split_train_val(num_samples: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """The last `val_fraction` of sample ids is held out (at least one sample when the fraction is > 0).

    >>> split_train_val(10, 0.2)
    ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    >>> split_train_val(3, 0.0)
    ([0, 1, 2], [])
    """
    n_val = 0 if val_fraction <= 0 else max(1, round(num_samples * val_fraction))
    n_val = min(n_val, max(0, num_samples - 1))
    cut = num_samples - n_val
    return list(range(cut)), list(range(cut, num_samples))


def shuffled(ids: list[int], seed: int, epoch: int) -> list[int]:
    """A permutation of `ids` that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(ids), generator=g).tolist()
    return [ids[i] for i in order]


def lpt_assign(lengths: list[int], world_size: int, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Assign items (by index) longest first to the least-loaded bin with room.

    Returns (bins of item indices, indices that fit nowhere). Ties go to the lower bin index.

    >>> lpt_assign([5, 3, 4, 2], world_size=2, capacity=8)
    ([[0, 3], [2, 1]], [])
    >>> lpt_assign([6, 6, 6], world_size=2, capacity=8)
    ([[0], [1]], [2])
    """
    loads = [0] * world_size
    bins: list[list[int]] = [[] for _ in range(world_size)]
    leftover: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        best = None
        for r in range(world_size):
            if loads[r] + lengths[i] <= capacity and (best is None or loads[r] < loads[best]):
                best = r
        if best is None:
            leftover.append(i)
        else:
            bins[best].append(i)
            loads[best] += lengths[i]
    return bins, leftover


def plan_epoch(
    ids: list[int],
    lengths: list[int],
    *,
    max_seq_len: int,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> EpochPlan:
    """Pack the samples `ids` (global ids; `lengths` indexed by global id) into steps of world_size rows.

    Every sample appears exactly once. When the last step has fewer samples than ranks, the empty
    ranks get an empty list: the trainer fills such a row with a zero-weight copy to keep DDP in step.
    """
    order = shuffled(ids, seed, epoch) if shuffle else list(ids)
    queue = deque(order)
    steps: list[list[list[int]]] = []
    truncated = sum(1 for i in ids if lengths[i] > max_seq_len)
    budget = world_size * max_seq_len
    while queue:
        taken: list[int] = []
        total = 0
        # Take from the front while the total fits into this step's rows.
        while queue and total + min(lengths[queue[0]], max_seq_len) <= budget:
            sid = queue.popleft()
            taken.append(sid)
            total += min(lengths[sid], max_seq_len)
        if not taken:  # cannot happen (one sample always fits an empty step), kept as a guard
            taken.append(queue.popleft())
        bins, leftover = lpt_assign([min(lengths[s], max_seq_len) for s in taken], world_size, max_seq_len)
        steps.append([[taken[k] for k in b] for b in bins])
        # Return leftovers to the front in their original order, so the shuffle order is mostly kept.
        for k in sorted(leftover, reverse=True):
            queue.appendleft(taken[k])
    tokens = sum(min(lengths[i], max_seq_len) for i in ids)
    fill = tokens / max(1, len(steps) * budget)
    return EpochPlan(epoch=epoch, steps=steps, truncated=truncated, tokens=tokens, fill=fill)


def build_row(samples: list[dict], max_seq_len: int, hidden_size: int, aux_dtype=torch.bfloat16) -> dict:
    """Concatenate samples into one row of exactly max_seq_len tokens.

    Padding: input_ids 0, zero hidden states, loss_mask False, document_ids -1, position_ids 0.

    >>> s = lambda n: {"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
    ...                "aux_hidden": torch.zeros(n, 6), "last_hidden": torch.zeros(n, 2)}
    >>> row = build_row([s(3), s(2)], 8, 2)
    >>> row["document_ids"].tolist(), row["position_ids"].tolist()
    ([0, 0, 0, 1, 1, -1, -1, -1], [0, 1, 2, 0, 1, 0, 0, 0])
    """
    s, h = max_seq_len, hidden_size
    dtype = samples[0]["aux_hidden"].dtype if samples else aux_dtype
    row = {
        "input_ids": torch.zeros(s, dtype=torch.long),  # [S]
        "loss_mask": torch.zeros(s, dtype=torch.bool),  # [S]
        "aux_hidden": torch.zeros(s, 3 * h, dtype=dtype),  # [S, 3H]
        "last_hidden": torch.zeros(s, h, dtype=dtype),  # [S, H]
        "document_ids": torch.full((s,), -1, dtype=torch.long),  # [S]
        "position_ids": torch.zeros(s, dtype=torch.long),  # [S]
    }
    pos = 0
    for doc, sample in enumerate(samples):
        n = min(sample["input_ids"].numel(), s - pos)
        if n <= 0:
            break
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            row[key][pos : pos + n] = sample[key][:n]
        row["document_ids"][pos : pos + n] = doc
        row["position_ids"][pos : pos + n] = torch.arange(n)
        pos += n
    return row
