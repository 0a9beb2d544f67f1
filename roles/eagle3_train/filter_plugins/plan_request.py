# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What plan.yml asks the memory planner: the memory per worker it assumes (and where that figure comes from), and
the planner's command line.

``plan_memory``: eagle3_train_plan_memory_gb when it is above 0, else the smallest GPU's total memory, else
nothing (the planner then reads the trainer config's memory_limit_gb itself; the source says so). ``plan_argv``:
``python -m eagle3 plan --json`` with the run's layout, margin, memory, context parallelism, and the length to check
(or --probe for auto on a GPU). Each filter is documented in the .yml file of the same name beside this one.
"""

from __future__ import annotations

import math


def _float(value) -> float:
    """Jinja's ``| float``: the number, or 0.0 for what is not one."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _int(value) -> int:
    """Jinja's ``| int``: the whole number (a float's or a numeric string's), or 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return 0


def plan_memory(configured_gb, gpus: list | None, config: dict | None = None, overrides: dict | None = None) -> dict:
    """{gb, source}: the memory per worker (GiB) the planner is told, and where it comes from ('' when nowhere).

    `configured_gb`: eagle3_train_plan_memory_gb (0: not set). `gpus`: gpu_facts' list (memory_total_mib, name).
    `config` + `overrides`: the trainer config, whose memory_limit_gb the planner reads itself (gb stays 0).

    >>> plan_memory("1.6", [{"name": "H100", "memory_total_mib": 81559}])
    {'gb': 1.6, 'source': 'eagle3_train_plan_memory_gb'}
    >>> plan_memory(0, [{"name": "A", "memory_total_mib": 97887}, {"name": "B", "memory_total_mib": 81559}])
    {'gb': 79.64, 'source': 'the smallest GPU (B, 81559 MiB)'}
    >>> plan_memory(0, [], {"memory_limit_gb": 2}, {})
    {'gb': 0, 'source': 'memory_limit_gb of the trainer config'}
    >>> plan_memory(0, [{"memory_total_mib": 0}], {}, {})
    {'gb': 0, 'source': ''}
    """
    if _float(configured_gb) > 0:
        return {"gb": _float(configured_gb), "source": "eagle3_train_plan_memory_gb"}
    with_memory = sorted((g for g in gpus or [] if g.get("memory_total_mib")), key=lambda g: g["memory_total_mib"])
    if with_memory:
        smallest = with_memory[0]
        return {
            "gb": math.floor(smallest["memory_total_mib"] / 1024 * 100) / 100,
            "source": f"the smallest GPU ({smallest.get('name', 'GPU')}, {_int(smallest['memory_total_mib'])} MiB)",
        }
    limit = _float({**(config or {}), **(overrides or {})}.get("memory_limit_gb", 0))
    return {"gb": 0, "source": "memory_limit_gb of the trainer config" if limit > 0 else ""}


def plan_argv(
    python: str,
    world_size,
    nnodes,
    nproc,
    margin,
    memory_gb,
    msl,
    gpus: list | None = None,
    cp=None,
    unplanned: str = "",
    memory_source: str = "",
) -> list:
    """The planner's argv: the trainer config comes on stdin; an explicit length as --max-seq-len (the planner
    decides whether it fits) with its table row (--lengths), or --probe for auto on a GPU. A context_parallel other
    than 1 (a number, or auto for the planner to pick) goes with --context-parallel; 1 (off) adds nothing.
    `unplanned` (plan_unplanned): why the length is not bounded by memory; `memory_source` (plan_memory's source)
    is named in the planner's messages.

    >>> plan_argv("/v/bin/python", 2, 1, 2, 0.1, 1.6, "16384")  # doctest: +NORMALIZE_WHITESPACE
    ['/v/bin/python', '-m', 'eagle3', 'plan', '--json', '--config', '/dev/stdin', '--world-size', '2',
     '--margin', '0.1', '--memory-gb', '1.6', '--max-seq-len', '16384', '--lengths', '16384']
    >>> plan_argv("/v/bin/python", 4, 2, 2, 0.1, 0, "auto", [{"index": 0}])[7:]
    ['--world-size', '4', '--nnodes', '2', '--nproc-per-node', '2', '--margin', '0.1', '--probe']
    >>> plan_argv("/v/bin/python", 8, 1, 8, 0.1, 80, "65536", cp="auto")[9:]  # doctest: +NORMALIZE_WHITESPACE
    ['--margin', '0.1', '--memory-gb', '80', '--context-parallel', 'auto', '--max-seq-len', '65536',
     '--lengths', '65536']
    >>> plan_argv("/v/bin/python", 8, 1, 8, 0.1, 80, "auto", cp=2)[9:]
    ['--margin', '0.1', '--memory-gb', '80', '--context-parallel', '2']
    >>> plan_argv("/v/bin/python", 8, 1, 8, 0.1, 80, "auto", cp="1")[9:]
    ['--margin', '0.1', '--memory-gb', '80']
    >>> plan_argv("/v/bin/python", 2, 1, 2, 0.1, 0, "16384", [], 3, "no GPU", "")[9:]  # doctest: +NORMALIZE_WHITESPACE
    ['--margin', '0.1', '--context-parallel', '3', '--max-seq-len', '16384', '--lengths', '16384',
     '--unplanned', 'no GPU']
    """
    argv = [
        python,
        "-m",
        "eagle3",
        "plan",
        "--json",
        "--config",
        "/dev/stdin",
        "--world-size",
        str(world_size),
    ]
    # Several nodes with the same worker count each: the planner shards as the run does (per node, then across).
    if _int(nnodes) > 1 and _int(world_size) == _int(nnodes) * _int(nproc):
        argv += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    argv += ["--margin", str(margin)]
    if _float(memory_gb) > 0:
        argv += ["--memory-gb", str(memory_gb)]
    if memory_source:
        argv += ["--memory-source", memory_source]
    context_parallel = str(cp if cp is not None else 1).strip().lower()
    if context_parallel != "1":
        argv += ["--context-parallel", context_parallel]
    if msl != "auto":
        argv += ["--max-seq-len", str(msl), "--lengths", str(msl)]
    elif gpus and not unplanned:
        argv += ["--probe"]
    if unplanned:
        argv += ["--unplanned", unplanned]
    return argv


def plan_unplanned(memory: dict, allow_unplanned, msl, host: str, configured_gb=0) -> str:
    """Why the run's length is not bounded by memory ('' when the planner bounds it): the user's
    eagle3_train_allow_unplanned_seq_len (an explicit length only), or no memory figure anywhere (plan_memory).

    >>> plan_unplanned({"gb": 2.5, "source": "eagle3_train_plan_memory_gb"}, False, "16384", "ct")
    ''
    >>> plan_unplanned({"gb": 2.5, "source": "eagle3_train_plan_memory_gb"}, True, "16384", "ct")
    'eagle3_train_allow_unplanned_seq_len is true'
    >>> plan_unplanned({"gb": 0, "source": ""}, False, "auto", "ct")
    'no GPU on ct, eagle3_train_plan_memory_gb is 0 and the trainer config sets no memory_limit_gb'
    """
    if str(allow_unplanned).strip().lower() in ("true", "yes", "1", "on") and str(msl) != "auto":
        return "eagle3_train_allow_unplanned_seq_len is true"
    if not (memory or {}).get("source"):
        return (
            f"no GPU on {host}, eagle3_train_plan_memory_gb is {configured_gb} and the trainer config sets no "
            "memory_limit_gb"
        )
    return ""


class FilterModule:
    def filters(self):
        return {"plan_memory": plan_memory, "plan_argv": plan_argv, "plan_unplanned": plan_unplanned}
