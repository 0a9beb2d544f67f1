# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The nodes of one torchrun run, as every node of it sees them (filter ``run_nodes``; docs in run_nodes.yml).

Each host of the play reports what it believes about the run (the node list, its rank setting, its address,
its run and state folders, rendezvous port and id); this filter, run on every host over all of those reports,
returns the same answer everywhere: each node's rank (``auto`` = its position in the node list), the node that
hosts the rendezvous (rank 0) and its endpoint, and every inconsistency, one line each, naming the node, the
variable and the value. One node is simply N=1: rendezvous on 127.0.0.1, no cross-node checks.
"""

from __future__ import annotations

import ipaddress

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(addr: str) -> bool:
    """Whether an address (or name) can only be reached from the node itself.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("10.0.0.2")
    (True, True, True, False)
    """
    if str(addr).strip().lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(str(addr).strip()).is_loopback
    except ValueError:
        return False


def _rank(setting, nodes: list[str], host: str) -> int | None:
    if str(setting).strip().lower() == "auto":
        return nodes.index(host) if host in nodes else None
    try:
        return int(str(setting).strip())
    except ValueError:
        return None


def _multinode_problems(nodes: list[str], reports: dict) -> list[str]:
    """Per node of a run of several: its own reachable address and state folder, the run's shared settings."""
    n = len(nodes)
    problems: list[str] = []
    seen: dict[str, str] = {}
    for h in nodes:
        rep = reports.get(h)
        if rep is None:
            continue
        addr = str(rep.get("addr", "")).strip()
        if not addr or is_loopback(addr):
            problems.append(
                f"{h}: eagle3_train_node_addr={addr or '(empty)'} is a loopback address; with {n} nodes each needs "
                "an address the others reach"
            )
        elif addr in seen:
            problems.append(f"{h}: eagle3_train_node_addr={addr} is also {seen[addr]}'s; each node needs its own")
        else:
            seen[addr] = h
        if rep.get("state_dir") == rep.get("run_dir"):
            problems.append(
                f"{h}: eagle3_train_state_dir={rep.get('state_dir')} is the shared run folder (eagle3_train_run_dir); "
                f"with {n} nodes each needs a folder of its own"
            )
        for key, var in (
            ("run_dir", "eagle3_train_run_dir"),
            ("port", "eagle3_train_rdzv_port"),
            ("run_id", "eagle3_train_run_id"),
            ("context_parallel", "eagle3_train_context_parallel"),
        ):
            first = reports.get(nodes[0], {}).get(key)
            if h != nodes[0] and nodes[0] in reports and str(rep.get(key)) != str(first):
                problems.append(
                    f"{h}: {var}={rep.get(key)} differs from {nodes[0]}'s {first}; every node of a run needs the same"
                )
    return problems


def run_nodes(nodes: list, play_hosts: list, reports: dict, host: str) -> dict:
    """The run as `host` must see it: ranks, rendezvous node and endpoint, and every problem.

    `reports`: play host -> {nodes, rank, addr, run_dir, state_dir, port, run_id, context_parallel} (each host's own
    variables).

    >>> r = {"a": {"nodes": ["a", "b"], "rank": "auto", "addr": "10.0.0.1", "run_dir": "/s", "state_dir": "/n",
    ...            "port": 29400, "run_id": "x"}}
    >>> r["b"] = dict(r["a"], addr="10.0.0.2")
    >>> out = run_nodes(["a", "b"], ["a", "b"], r, "b")
    >>> out["nnodes"], out["rank"], out["ranks"], out["rdzv_node"], out["endpoint"], out["errors"]
    (2, 1, {'a': 0, 'b': 1}, 'a', '10.0.0.1:29400', [])
    >>> run_nodes(["a", "b"], ["a"], {"a": r["a"]}, "a")["errors"]  # doctest: +NORMALIZE_WHITESPACE
    ['the run has 2 nodes (eagle3_train_nodes) and train.yml must reach every one of them at once;
      not in this play: b (was it left out by --limit, or is it unreachable?)']
    >>> r["b"]["addr"] = "127.0.0.1"; r["b"]["state_dir"] = "/s"
    >>> for line in run_nodes(["a", "b"], ["a", "b"], r, "a")["errors"]: print(line)
    b: eagle3_train_node_addr=127.0.0.1 is a loopback address; with 2 nodes each needs an address the others reach
    b: eagle3_train_state_dir=/s is the shared run folder (eagle3_train_run_dir); with 2 nodes each needs a folder of its own
    """
    nodes = [str(n) for n in (nodes or [])]
    errors: list[str] = []
    n = len(nodes)
    if n == 0:
        errors.append("eagle3_train_nodes is empty; allowed: the inventory names of the run's nodes")
        return {"nnodes": 0, "rank": None, "ranks": {}, "rdzv_node": None, "endpoint": "", "errors": errors}
    if host not in nodes:
        errors.append(
            f"{host} is not one of the run's nodes (eagle3_train_nodes={nodes}); add it, or leave it out of the group training"
        )
    missing = [h for h in nodes if h not in play_hosts or h not in reports]
    if missing:
        errors.append(
            f"the run has {n} nodes (eagle3_train_nodes) and train.yml must reach every one of them at once; "
            f"not in this play: {', '.join(missing)} (was it left out by --limit, or is it unreachable?)"
        )
    ranks: dict[str, int] = {}
    for h in nodes:
        if h not in reports:
            continue
        rep = reports[h]
        if [str(x) for x in rep.get("nodes") or []] != nodes:
            errors.append(
                f"{h}: eagle3_train_nodes={rep.get('nodes')} differs from {host}'s {nodes}; set it once for the group"
            )
        rank = _rank(rep.get("rank", "auto"), nodes, h)
        if rank is None or not 0 <= rank < n:
            errors.append(f"{h}: eagle3_train_node_rank={rep.get('rank')} is out of range; allowed: auto or 0..{n - 1}")
            continue
        ranks[h] = rank
    by_rank: dict[int, list[str]] = {}
    for h, rank in ranks.items():
        by_rank.setdefault(rank, []).append(h)
    for rank, hosts in sorted(by_rank.items()):
        if len(hosts) > 1:
            errors.append(
                f"node rank {rank} is taken by {', '.join(hosts)}; each node needs its own (eagle3_train_node_rank)"
            )
    rdzv_node = next((h for h, r in ranks.items() if r == 0), None)
    if n > 1:
        errors += _multinode_problems(nodes, reports)
    if n == 1:
        endpoint = f"127.0.0.1:{(reports.get(nodes[0]) or {}).get('port', 29400)}"
    elif rdzv_node is not None:
        rep = reports[rdzv_node]
        endpoint = f"{rep.get('addr')}:{rep.get('port')}"
    else:
        endpoint = ""
    return {
        "nnodes": n,
        "rank": ranks.get(host),
        "ranks": ranks,
        "rdzv_node": rdzv_node,
        "endpoint": endpoint,
        "errors": errors,
    }


class FilterModule:
    def filters(self):
        return {"run_nodes": run_nodes}
