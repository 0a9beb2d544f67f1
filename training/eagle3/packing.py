"""Packing samples into rows of exactly max_seq_len tokens, one row per rank per step.

One global step = one row per rank (batch size 1: the drafter's attention mask is built for a single
packed row). The plan of an epoch is a pure function of (sample lengths, seed, epoch, world size,
max_seq_len, packing), so every rank computes the same plan without communication, and a resumed run
re-creates it and continues at the saved step.

Two packers (config key `packing`):

* `first_fit` (the default): samples are taken in the shuffled order; each goes to the fullest of the
  step's rows that still has room for it (best fit). A sample that fits no row is passed over and leads
  the queue of the next step, and the step closes once PACKING_WINDOW samples have been passed over (or
  its rows are full). Rows come out nearly full (bench/packing.py, one rank: documents of 48-512 tokens
  97.6 % at max_seq_len 1024 and 99.4 % at 4096, next_fit 83.7 % and 95.7 %; a long-tailed lognormal
  97.1-99.8 % from 1024 to 16384, next_fit 78-94 %). The next step always places the first
  sample waiting, so no sample is placed more than PACKING_WINDOW steps after one that came later in the
  shuffle. Short samples are pulled forward to fill rows; when many samples are longer than half a row
  (they cannot share one), those fall back by up to a few dozen steps.
* `next_fit`: the packer of earlier versions, kept so that their runs resume on the same plan. Samples are
  taken from the shuffled order while they fit into world_size rows, then assigned longest first to the
  least-loaded rank that still has room (LPT); samples that fit nowhere go back to the front of the queue.
  At one rank a row closes at the first sample that does not fit.

Samples longer than max_seq_len are truncated (and counted).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field

import torch

from eagle3.options import PACKINGS

# first_fit: samples passed over (they fit no row of the step) before a step closes. 64 brings rows of a
# few documents to within 1-3 % of full (docs/speed.md has the measurement); a wider window gains little.
PACKING_WINDOW = 64


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
    packing: str = "first_fit",
) -> EpochPlan:
    """Pack the samples `ids` (global ids; `lengths` indexed by global id) into steps of world_size rows.

    Every sample appears exactly once. When the last step has fewer samples than ranks, the empty
    ranks get an empty list: the trainer fills such a row with a zero-weight copy to keep DDP in step.

    >>> lengths = [300, 900, 200, 500, 100]
    >>> plan_epoch(range(5), lengths, max_seq_len=1024, world_size=1, seed=0, epoch=0, shuffle=False).steps
    [[[0, 2, 3]], [[1, 4]]]
    >>> plan_epoch(range(5), lengths, max_seq_len=1024, world_size=1, seed=0, epoch=0, shuffle=False,
    ...            packing="next_fit").steps
    [[[0]], [[1]], [[3, 2, 4]]]
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r}: expected one of {', '.join(PACKINGS)}")
    ids = list(ids)
    order = shuffled(ids, seed, epoch) if shuffle else list(ids)
    pack = _first_fit_step if packing == "first_fit" else _next_fit_step
    queue = deque(order)
    steps: list[list[list[int]]] = []
    truncated = sum(1 for i in ids if lengths[i] > max_seq_len)
    while queue:
        steps.append(pack(queue, lengths, max_seq_len, world_size))
    tokens = sum(min(lengths[i], max_seq_len) for i in ids)
    fill = tokens / max(1, len(steps) * world_size * max_seq_len)
    return EpochPlan(epoch=epoch, steps=steps, truncated=truncated, tokens=tokens, fill=fill)


def _first_fit_step(queue: deque, lengths: list[int], max_seq_len: int, world_size: int) -> list[list[int]]:
    """One step of `first_fit`: consumes what it packs from `queue`; what it passes over stays at the front."""
    rows: list[list[int]] = [[] for _ in range(world_size)]
    # (load, -rank), ascending: the fullest row with room for n tokens is the last entry with load <= max_seq_len - n,
    # and among rows of equal load that is the lowest rank. A bisection, not a scan of every row per sample.
    by_load = sorted((0, -r) for r in range(world_size))
    passed: list[int] = []
    room = world_size * max_seq_len
    while queue and room and len(passed) < PACKING_WINDOW:
        sid = queue.popleft()
        n = min(lengths[sid], max_seq_len)
        i = bisect_right(by_load, (max_seq_len - n, 0))
        if i == 0:  # no row has room
            passed.append(sid)
            continue
        load, neg_rank = by_load.pop(i - 1)
        rows[-neg_rank].append(sid)
        insort(by_load, (load + n, neg_rank))
        room -= n
    queue.extendleft(reversed(passed))  # the passed-over samples, in their shuffled order, lead the next step
    return rows


def _next_fit_step(queue: deque, lengths: list[int], max_seq_len: int, world_size: int) -> list[list[int]]:
    """One step of `next_fit` (earlier versions' plans, unchanged)."""
    taken: list[int] = []
    total = 0
    # Take from the front while the total fits into this step's rows.
    while queue and total + min(lengths[queue[0]], max_seq_len) <= world_size * max_seq_len:
        sid = queue.popleft()
        taken.append(sid)
        total += min(lengths[sid], max_seq_len)
    if not taken:  # cannot happen (one sample always fits an empty step), kept as a guard
        taken.append(queue.popleft())
    bins, leftover = lpt_assign([min(lengths[s], max_seq_len) for s in taken], world_size, max_seq_len)
    # Return leftovers to the front in their original order, so the shuffle order is mostly kept.
    for k in sorted(leftover, reverse=True):
        queue.appendleft(taken[k])
    return [[taken[k] for k in b] for b in bins]


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
