"""Per-node figures of a run across several nodes: which ranks each node holds, its tokens/s and how long its ranks
were busy per step, so that status can name the slowest node (the others wait for it in every collective).

Each rank fills its own column of a small [3, world_size] table (node, tokens, busy seconds) that rides on the
log step's all-reduce; rank 0 folds it into one entry per node. Node numbers are torchrun's GROUP_RANK (c10d
assigns them); host names come from one all_gather_object at start.
"""

from __future__ import annotations

import os
import socket

import torch

NODE_ROWS = 3  # node (GROUP_RANK), tokens in the window, busy seconds in the window (fetch + fwd + bwd + opt)


def node_index() -> int:
    """This rank's node: torchrun's GROUP_RANK (0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", 0))


def gather_hosts(info) -> list[str]:
    """Every rank's host name, by rank (one collective; only at start)."""
    if not info.enabled:
        return [socket.gethostname()]
    import torch.distributed as dist

    hosts: list = [None] * info.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return [str(h) for h in hosts]


def own_column(world_size: int, rank: int, tokens: float, busy_s: float) -> torch.Tensor:
    """This rank's share of the table (zeros elsewhere, so a SUM all-reduce assembles it)."""
    table = torch.zeros(NODE_ROWS, world_size, dtype=torch.float64)
    table[:, rank] = torch.tensor([float(node_index()), tokens, busy_s], dtype=torch.float64)
    return table


def node_fields(table: list[list[float]], hosts: list[str], wall_s: float, steps: float) -> list[dict]:
    """One entry per node, by node number: its host, ranks, tokens/s, busy seconds per step (the slowest rank's).

    >>> node_fields([[0, 0, 1, 1], [100, 100, 50, 50], [4.0, 3.0, 8.0, 7.5]], ["a", "a", "b", "b"], 2.0, 4)
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'node': 0, 'host': 'a', 'ranks': [0, 1], 'tokens_per_s': 100.0, 'busy_s_per_step': 1.0},
     {'node': 1, 'host': 'b', 'ranks': [2, 3], 'tokens_per_s': 50.0, 'busy_s_per_step': 2.0}]
    """
    nodes: dict[int, dict] = {}
    for rank, (node, tokens, busy) in enumerate(zip(*table, strict=True)):
        entry = nodes.setdefault(
            int(node),
            {
                "node": int(node),
                "host": hosts[rank] if rank < len(hosts) else "?",
                "ranks": [],
                "tokens": 0.0,
                "busy": 0.0,
            },
        )
        entry["ranks"].append(rank)
        entry["tokens"] += tokens
        entry["busy"] = max(entry["busy"], busy)
    steps = max(1.0, steps)
    return [
        {
            "node": e["node"],
            "host": e["host"],
            "ranks": e["ranks"],
            "tokens_per_s": e["tokens"] / max(wall_s, 1e-9),
            "busy_s_per_step": e["busy"] / steps,
        }
        for _, e in sorted(nodes.items())
    ]
