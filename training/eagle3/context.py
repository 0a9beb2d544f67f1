"""Context parallelism: one packed row split over `context_parallel` ranks (DeepSpeed-Ulysses, arXiv:2309.14509).

Rank i of a context-parallel group holds the slots [i * S/cp, (i+1) * S/cp) of the row: their aux hidden states,
the drafter's hidden states, the q/k/v projections, the MLP and the loss over them. Only the attention needs the
whole sequence; around it an all-to-all turns the sequence shards into head shards and back:

    q  [heads, S/cp, d]     --all-to-all-->  [heads/cp, S, d]   attention of the whole row, for heads/cp heads
    k  [kv_heads, S/cp, d]  --all-to-all-->  [kv_heads/cp, S, d]  (kv_heads < cp: each head repeated cp/kv_heads times first)
    out [heads/cp, S, d]    --all-to-all-->  [heads, S/cp, d]

The keys and values of every TTT step stay in the head layout (the later steps' cache: the same bytes per rank as
the sequence layout), and the document mask, the diagonal keys of later steps and the attention kernel (exact or
flex) are those of one rank: every rank holds the row's small per-slot vectors (token ids, document ids,
positions, loss mask) whole. The loss of step k at slot j reads the target at slot j+1+k, so a rank also holds
`ttt_steps` slots of target hidden states past its own (the halo). Each rank's loss is its slots' share of the
row's loss (normalised by the row's supervised count), so the row's loss is their sum; the trainer scales it by cp
for backward because data-parallel gradient reduction averages over every rank (eagle3.loop).

Groups are cp consecutive ranks (torchrun numbers ranks node by node: a group stays on one node when cp divides
the ranks per node), the rows of a step go to the data-parallel index rank // cp: a 2-D (dp, cp) device mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextShard:
    """This rank's part of a row: `index` of `size` ranks in `group` (None: no context parallelism)."""

    size: int = 1
    index: int = 0
    group: object = None  # torch.distributed ProcessGroup of the cp ranks

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def bounds(self, seq_len: int) -> tuple[int, int]:
        """The slots [a, b) this rank holds.

        >>> ContextShard(4, 1).bounds(512)
        (128, 256)
        """
        share = seq_len // self.size
        return self.index * share, (self.index + 1) * share

    def held(self, seq_len: int, halo: int) -> tuple[int, int, int]:
        """(a, b, end): own slots [a, b), target hidden states held for [a, end) (the halo of `halo` slots).

        >>> ContextShard(4, 3).held(512, 5), ContextShard(4, 1).held(512, 5)
        ((384, 512, 512), (128, 256, 261))
        """
        a, b = self.bounds(seq_len)
        return a, b, min(b + halo, seq_len)


SINGLE = ContextShard()


def data_parallel_rank(rank: int, cp: int) -> int:
    """The row index of a rank: consecutive groups of cp ranks share a row.

    >>> [data_parallel_rank(r, 2) for r in range(4)]
    [0, 0, 1, 1]
    """
    return rank // cp


def make_shard(rank: int, world_size: int, cp: int, device_type: str) -> ContextShard:
    """The (dp, cp) device mesh (a collective: every rank calls it) and this rank's ContextShard."""
    if cp <= 1:
        return SINGLE
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
    return ContextShard(size=cp, index=rank % cp, group=mesh.get_group("cp"))


def shard_row(row: dict, shard: ContextShard, halo: int) -> dict:
    """This rank's share of a packed row (eagle3.packing.build_row): aux_hidden of its own slots, last_hidden (and
    target_ids) of its slots and the halo; the per-slot id vectors whole. Copies, so the whole row can be freed."""
    if not shard.enabled:
        return row
    a, b, end = shard.held(row["input_ids"].shape[0], halo)

    def copy(t: torch.Tensor) -> torch.Tensor:  # pinned stays pinned: the copy to the GPU stays asynchronous
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_pinned()).copy_(t)

    out = dict(row)
    out["aux_hidden"] = copy(row["aux_hidden"][a:b])
    out["last_hidden"] = copy(row["last_hidden"][a:end])
    if "target_ids" in row:
        out["target_ids"] = copy(row["target_ids"][a:end])
    return out


# --------------------------------------------------------------------------------------------- the all-to-alls


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[n, S/cp, d] on each rank -> [n/cp, S, d]: rank i receives heads [i*n/cp, (i+1)*n/cp) of every slot."""
    n, s, d = x.shape
    recv = _all_to_all(x.reshape(cp, n // cp, s, d).contiguous(), group)  # [source rank, n/cp, S/cp, d]
    return recv.transpose(0, 1).reshape(n // cp, cp * s, d)


def heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[n/cp, S, d] -> [n, S/cp, d], the inverse of seq_to_heads."""
    m, seq, d = x.shape
    send = x.reshape(m, cp, seq // cp, d).transpose(0, 1).contiguous()  # [destination rank, n/cp, S/cp, d]
    return _all_to_all(send, group).reshape(cp * m, seq // cp, d)


class _Relayout(torch.autograd.Function):
    """seq_to_heads (to_heads) or heads_to_seq, whose gradient is the other one."""

    @staticmethod
    def forward(ctx, x, cp, group, to_heads: bool):
        ctx.cp, ctx.group, ctx.to_heads = cp, group, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_seq if ctx.to_heads else seq_to_heads
        return back(grad.contiguous(), ctx.cp, ctx.group), None, None, None


class UlyssesAttention:
    """The TTT attention of one row under context parallelism: the same call as eagle3.attention.TTTAttention
    (built over the whole row's document ids), plus the layout changes the decoder layer makes around it."""

    def __init__(self, inner, shard: ContextShard, kv_heads: int):
        self.inner = inner
        self.shard = shard
        # key/value heads each repeated to reach cp when there are fewer than cp (grouped-query, MLA's one latent)
        self.kv_repeat = shard.size // kv_heads if kv_heads < shard.size else 1

    def to_heads(self, t: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """This step's queries (or keys/values: kv=True) from the sequence layout to the head layout."""
        if kv and self.kv_repeat > 1:
            t = t.repeat_interleave(self.kv_repeat, dim=0)  # its backward sums the copies' gradients
        return _Relayout.apply(t, self.shard.size, self.shard.group, True)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """The attention output from the head layout back to this rank's slots."""
        return _Relayout.apply(t, self.shard.size, self.shard.group, False)

    def __call__(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        return self.inner(q, keys, values)


def row_attention(inner, shard: ContextShard, kv_heads: int):
    """What the decoder layer calls: `inner` itself without context parallelism (its to_heads/to_sequence are the
    identity), wrapped in UlyssesAttention with it."""
    return UlyssesAttention(inner, shard, kv_heads) if shard.enabled else inner
