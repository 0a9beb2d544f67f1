"""The run's decision: the length and context parallelism a run trains at, or why it cannot, from the memory plan.

`eagle3 plan --json` prints it as "run" beside the plan; the Ansible role asks for it and takes it as it is
(roles/eagle3_train/tasks/plan.yml): it fails with `refusal` (adding the variables a user would change) or writes
`max_seq_len` and `context_parallel` into the trainer config, and prints `summary`. A run of several nodes trains
at one length and one context-parallel size: `combine` of the nodes' decisions.

The inputs are what the run asks for (a length or auto, a context-parallel size or auto) and, when the length is
not to be bounded by memory, why (`unplanned`: the user said so, or no memory figure exists).
"""

from __future__ import annotations

# refusal kinds: what the user can change (the role words each one)
TOO_LONG = "too_long"  # an explicit length above the largest that fits
NOTHING_FITS = "nothing_fits"  # no length fits at all
NEEDS_MEMORY = "needs_memory"  # max_seq_len=auto without a memory figure
CP_NEEDS_PLAN = "context_parallel_needs_plan"  # context_parallel=auto without a memory plan


def decide(
    plan: dict,
    max_seq_len: int | None,
    context_parallel: int | str,
    *,
    unplanned: str = "",
    memory_source: str = "",
) -> dict:
    """The decision for one node: {max_seq_len, context_parallel, data_parallel, checked, largest,
    wider_context_parallel, refusal, refusal_kind, summary}. `plan`: the plan's JSON (Plan.to_json); `max_seq_len`:
    the run's length (None: auto); `context_parallel`: a size or "auto"; `unplanned`: why the length is not bounded
    by memory ('' when it is); `memory_source`: where the memory per worker comes from, for the messages.

    >>> plan = {"max_seq_len": 20096, "predicted_gb": 2.249, "memory_gb": 2.5, "margin": 0.1, "budget_gb": 2.25,
    ...         "static_gb": 1.0, "world_size": 2, "nnodes": 1, "source": "analytic", "context_parallel": 1,
    ...         "table": [{"max_seq_len": 32768, "predicted_gb": 3.5, "fits": False}]}
    >>> run = decide(plan, None, 1, memory_source="the smallest GPU")
    >>> run["max_seq_len"], run["context_parallel"], run["data_parallel"], run["refusal"]
    (20096, 1, 2, '')
    >>> run["summary"]
    'max_seq_len=auto -> 20096: predicted peak 2.249 GiB of 2.5 GiB per worker (the smallest GPU), static 1.0 GiB, analytic'
    >>> print(decide(plan, 32768, 1)["refusal"])  # doctest: +NORMALIZE_WHITESPACE
    max_seq_len=32768 does not fit: the memory planner predicts 3.5 GiB per worker at 32768 against a budget of
    2.25 GiB (2.5 GiB per worker, less the 10% margin; 2 workers; analytic model). The largest max_seq_len that fits
    is 20096 (predicted 2.25 GiB).
    >>> run = decide(plan, 65536, 2, unplanned="the user said so")
    >>> run["max_seq_len"], run["context_parallel"], run["checked"], run["summary"]
    (65536, 2, False, 'max_seq_len=65536 is not checked against memory: the user said so, context_parallel=2 (data_parallel 1)')
    """
    world = int(plan["world_size"])
    if unplanned:
        return _unplanned(world, max_seq_len, context_parallel, unplanned)
    cp = int(plan.get("context_parallel") or (1 if context_parallel == "auto" else context_parallel))
    largest = plan.get("max_seq_len")
    run = _run(largest if max_seq_len is None else max_seq_len, cp, world, checked=True)
    run["largest"] = largest
    if max_seq_len is None:
        if not largest:
            return _refused(run, NOTHING_FITS, "max_seq_len=auto: no length fits the memory per worker.")
        peak = plan["predicted_gb"]
        head = f"max_seq_len=auto -> {largest}"
    else:
        row = next((r for r in plan.get("table") or [] if r.get("max_seq_len") == max_seq_len), None)
        # (the row decides above the planner's search limit, where `largest` stops)
        if not ((largest is not None and max_seq_len <= int(largest)) or (row is not None and row.get("fits"))):
            return _too_long(run, plan, max_seq_len, row, memory_source)
        peak = row["predicted_gb"] if row else plan["predicted_gb"]
        head = f"max_seq_len={max_seq_len} fits (the largest that fits: {largest})"
    if context_parallel != 1 and str(context_parallel) != "1":
        auto = "auto -> " if context_parallel == "auto" else ""
        head += f", context_parallel={auto}{cp} (data_parallel {world // cp})"
    run["summary"] = head + ": " + _memory_line(plan, peak, memory_source, context_parallel == "auto")
    return run


def combine(runs: list[dict]) -> dict:
    """The run's decision from its nodes' (whose GPUs may differ): every rank trains at one length, the smallest any
    node chose, with one context-parallel size, the largest any chose (less memory per worker, so the lengths the
    others chose at a smaller one still fit).

    >>> run = combine([{"max_seq_len": 32768, "context_parallel": 1, "data_parallel": 4},
    ...                {"max_seq_len": 16384, "context_parallel": 4, "data_parallel": 1}])
    >>> run["max_seq_len"], run["context_parallel"], run["data_parallel"]
    (16384, 4, 1)
    >>> run["summary"]
    'the run (2 nodes): max_seq_len=16384 (the smallest any node chose), context_parallel=4 (the largest; data_parallel 1)'
    """
    cp = max(int(r["context_parallel"]) for r in runs)
    world = int(runs[0]["data_parallel"]) * int(runs[0]["context_parallel"])
    msl = min(int(r["max_seq_len"]) for r in runs)
    return {
        "max_seq_len": msl,
        "context_parallel": cp,
        "data_parallel": world // cp,
        "summary": f"the run ({len(runs)} nodes): max_seq_len={msl} (the smallest any node chose), "
        f"context_parallel={cp} (the largest; data_parallel {world // cp})",
    }


def _run(max_seq_len, cp: int, world: int, *, checked: bool) -> dict:
    return {
        "max_seq_len": max_seq_len,
        "context_parallel": cp,
        "data_parallel": world // cp,
        "checked": checked,
        "largest": None,
        "wider_context_parallel": None,
        "refusal": "",
        "refusal_kind": "",
        "summary": "",
    }


def _refused(run: dict, kind: str, text: str) -> dict:
    return {**run, "refusal": text, "refusal_kind": kind}


def _unplanned(world: int, max_seq_len: int | None, context_parallel, reason: str) -> dict:
    cp = 1 if context_parallel == "auto" else int(context_parallel)
    run = _run(max_seq_len, cp, world, checked=False)
    if max_seq_len is None:
        return _refused(run, NEEDS_MEMORY, f"max_seq_len=auto needs the memory per worker: {reason}.")
    if context_parallel == "auto":
        return _refused(
            run,
            CP_NEEDS_PLAN,
            f"context_parallel=auto needs the memory planner to pick it, and max_seq_len={max_seq_len} is not "
            f"planned: {reason}.",
        )
    run["summary"] = f"max_seq_len={max_seq_len} is not checked against memory: {reason}"
    if cp != 1:
        run["summary"] += f", context_parallel={cp} (data_parallel {world // cp})"
    return run


def _too_long(run: dict, plan: dict, n: int, row: dict | None, memory_source: str) -> dict:
    cp = run["context_parallel"]
    needs = f"predicts {row['predicted_gb']:g} GiB per worker at {n}" if row else f"finds that {n} needs more"
    if cp > 1:
        needs += f" with context_parallel={cp}"
    source = f" from {memory_source}" if memory_source else ""
    assumed = (
        f"{float(plan['budget_gb']):g} GiB ({float(plan['memory_gb']):g} GiB per worker{source}, less the "
        f"{float(plan['margin']) * 100:g}% margin; {plan['world_size']} workers; {plan.get('source', 'analytic')} model)"
    )
    largest = plan.get("max_seq_len")
    fit = (
        f"The largest max_seq_len that fits is {largest} (predicted {plan.get('predicted_gb', 0):.2f} GiB)."
        if largest
        else "No max_seq_len fits."
    )
    wider = [
        int(r["context_parallel"])
        for r in plan.get("context_parallel_table") or []
        if r.get("max_seq_len") and int(r["max_seq_len"]) >= n and int(r.get("context_parallel") or 1) > cp
    ]
    run = {**run, "wider_context_parallel": min(wider) if wider else None}
    kind = TOO_LONG if largest else NOTHING_FITS
    return _refused(
        run, kind, f"max_seq_len={n} does not fit: the memory planner {needs} against a budget of {assumed}. {fit}"
    )


def _memory_line(plan: dict, peak, memory_source: str, cp_auto: bool) -> str:
    source = f" ({memory_source})" if memory_source else ""
    line = (
        f"predicted peak {peak} GiB of {plan['memory_gb']} GiB per worker{source}, static {plan['static_gb']} GiB, "
        f"{plan['source']}"
    )
    if plan.get("shard_ranks") is not None:
        line += (
            f", {plan['world_size']} workers on {plan.get('nnodes', 1)} node(s), weights sharded over "
            f"{plan['shard_ranks']} ({plan.get('shard_layout')})"
        )
    if cp_auto and plan.get("context_parallel_table"):
        rows = ", ".join(
            f"{r['context_parallel']} -> {'none' if r['max_seq_len'] is None else r['max_seq_len']}"
            for r in plan["context_parallel_table"]
        )
        line += f". The largest max_seq_len per context_parallel: {rows}"
    return line
