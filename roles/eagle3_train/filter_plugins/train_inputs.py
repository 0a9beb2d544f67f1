# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``seq_len_refusal``: the verdict on an explicit max_seq_len from the memory planner's JSON (plan.yml);
``context_parallel_refusal``: the verdict on a context_parallel against the run's workers (validate.yml).

The role's variables themselves are checked by the ``inputs`` role against plugins/filter/role_inputs.py. Each
filter here is documented in the .yml file of the same name beside this one (ansible-doc reads that file).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The project's filter plugins (plugins/filter): declared_constants knows where the trainer is.
_FILTERS = str(Path(__file__).resolve().parents[3] / "plugins" / "filter")
if _FILTERS not in sys.path:
    sys.path.insert(0, _FILTERS)

from declared_constants import trainer_module  # noqa: E402


def seq_len_refusal(plan: dict, requested, memory_source: str = "") -> str:
    """Why an explicit max_seq_len cannot run, from `python -m eagle3 plan --json --lengths N` (empty: it fits).

    The planner's max_seq_len is the largest length whose predicted peak fits memory_gb less the margin per
    worker; the table row for the requested length (asked for with --lengths) gives what that length needs.

    >>> plan = {"max_seq_len": 7040, "predicted_gb": 1.437, "memory_gb": 1.6, "margin": 0.1, "budget_gb": 1.44,
    ...         "static_gb": 1.002, "world_size": 2, "source": "analytic",
    ...         "table": [{"max_seq_len": 16384, "predicted_gb": 2.02, "fits": False}]}
    >>> seq_len_refusal(plan, 8192 - 1152)
    ''
    >>> seq_len_refusal({**plan, "max_seq_len": 262144, "table": [{"max_seq_len": 262272, "fits": True}]}, 262272)
    ''
    >>> print(seq_len_refusal(plan, "16384", "eagle3_train_plan_memory_gb"))  # doctest: +NORMALIZE_WHITESPACE
    max_seq_len=16384 does not fit: the memory planner predicts 2.02 GiB per worker at 16384 against a budget of
    1.44 GiB (1.6 GiB per worker from eagle3_train_plan_memory_gb, less the 10% margin of
    eagle3_train_plan_margin; 2 workers; analytic model). The largest max_seq_len that fits is 7040 (predicted
    1.44 GiB). Use -e max_seq_len=7040 (or -e max_seq_len=auto), give the planner more memory per worker, or set
    -e eagle3_train_allow_unplanned_seq_len=true to run 16384 anyway.
    """
    n = int(str(requested).strip())
    largest = plan.get("max_seq_len")
    row = next((r for r in plan.get("table") or [] if r.get("max_seq_len") == n), None)
    if (largest is not None and n <= int(largest)) or (row is not None and row.get("fits")):
        return ""  # (the row decides above the planner's search limit, where `largest` stops)
    needs = f"predicts {row['predicted_gb']:g} GiB per worker at {n}" if row else f"finds that {n} needs more"
    source = f" from {memory_source}" if memory_source else ""
    assumed = (
        f"{float(plan['budget_gb']):g} GiB ({float(plan['memory_gb']):g} GiB per worker{source}, less the "
        f"{float(plan['margin']) * 100:g}% margin of eagle3_train_plan_margin; {plan['world_size']} workers; "
        f"{plan.get('source', 'analytic')} model)"
    )
    cp = int(plan.get("context_parallel") or 1)
    if cp > 1:
        needs += f" with context_parallel={cp}"
    wider = [
        int(r["context_parallel"])
        for r in plan.get("context_parallel_table") or []
        if r.get("max_seq_len") and int(r["max_seq_len"]) >= n and int(r.get("context_parallel") or 1) > cp
    ]
    fit = (
        f"The largest max_seq_len that fits is {largest} (predicted {plan.get('predicted_gb', 0):.2f} GiB). "
        f"Use -e max_seq_len={largest} (or -e max_seq_len=auto)"
        if largest
        else "No max_seq_len fits. Turn on activation_checkpointing or fsdp in eagle3_train_config_overrides"
    )
    if wider:
        fit += f", split each row over more workers (-e context_parallel={min(wider)}, or auto)"
    return (
        f"max_seq_len={n} does not fit: the memory planner {needs} against a budget of {assumed}. {fit}, "
        f"give the planner more memory per worker, or set -e eagle3_train_allow_unplanned_seq_len=true to run "
        f"{n} anyway."
    )


def context_parallel_refusal(cp, world_size, nnodes=1, msl="auto") -> str:
    """Why a context_parallel cannot split the run's rows (empty: it can, or it is auto, which the planner picks):
    the trainer's own check (eagle3.options.check_context_parallel: it must divide the run's workers and an explicit
    max_seq_len), made here before anything changes. Whether the drafter's attention heads split into it is the
    planner's and the trainer's check: they know the drafter's shape.

    >>> context_parallel_refusal("auto", 8, 2), context_parallel_refusal("4", "8", "2", "16384")
    ('', '')
    >>> print(context_parallel_refusal("3", 8, 2))  # doctest: +NORMALIZE_WHITESPACE
    context_parallel=3 does not divide the 8 workers of the run (2 nodes x 4 workers): each group of 3
    consecutive workers shares one row; allowed: a divisor of 8 (1, 2, 4, 8), or auto.
    >>> print(context_parallel_refusal(3, 6, 1, "16384"))  # doctest: +NORMALIZE_WHITESPACE
    context_parallel=3 does not divide max_seq_len=16384: each of the 3 workers of a row holds max_seq_len / 3
    of its positions; allowed: a divisor of the run's 6 workers that divides 16384 (1, 2), or auto.
    """
    text = str(cp).strip().lower()
    if text == "auto":
        return ""
    world, nodes = int(str(world_size).strip()), int(str(nnodes).strip() or 1)
    length = str(msl).strip().lower()
    options, errors = trainer_module("options"), trainer_module("errors")
    try:
        options.check_context_parallel(int(text), world, int(length) if length.isdigit() else None, nodes)
    except errors.ConfigError as e:
        return f"{e}, or auto."
    return ""


class FilterModule:
    def filters(self):
        return {"seq_len_refusal": seq_len_refusal, "context_parallel_refusal": context_parallel_refusal}
