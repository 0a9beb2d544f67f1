# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``seq_len_refusal``: the verdict on an explicit max_seq_len from the memory planner's JSON (plan.yml).

The role's variables themselves are checked by the ``inputs`` role against plugins/filter/role_inputs.py. This
file's one filter is documented in seq_len_refusal.yml beside it (ansible-doc reads that file).
"""

from __future__ import annotations


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
    fit = (
        f"The largest max_seq_len that fits is {largest} (predicted {plan.get('predicted_gb', 0):.2f} GiB). "
        f"Use -e max_seq_len={largest} (or -e max_seq_len=auto)"
        if largest
        else "No max_seq_len fits. Turn on activation_checkpointing or fsdp in eagle3_train_config_overrides"
    )
    return (
        f"max_seq_len={n} does not fit: the memory planner {needs} against a budget of {assumed}. {fit}, "
        f"give the planner more memory per worker, or set -e eagle3_train_allow_unplanned_seq_len=true to run "
        f"{n} anyway."
    )


class FilterModule:
    def filters(self):
        return {"seq_len_refusal": seq_len_refusal}
