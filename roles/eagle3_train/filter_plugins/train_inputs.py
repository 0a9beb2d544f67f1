# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``plan_refusal``: why the run cannot start, from the memory planner's answer (plan.yml: the planner decides,
this adds the variables to change); ``run_choice``: the run's length and context_parallel from its nodes' decisions;
``context_parallel_refusal``: the verdict on a context_parallel against the run's workers (validate.yml, before the
lock).

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


def plan_refusal(result: dict, msl, cp, unplanned: str = "") -> str:
    """Why the run cannot start, from the planner's answer to plan.yml (empty: it can): the planner's own words (its
    error, or the refusal in its decision: training/eagle3/plan/decision.py), then what to change here.

    >>> ok = {"rc": 0, "stdout": '{"run": {"refusal": "", "refusal_kind": ""}}'}
    >>> plan_refusal(ok, "16384", 1)
    ''
    >>> too_long = {"rc": 0, "stdout": '{"run": {"refusal": "max_seq_len=32768 does not fit: (...).", '
    ...             '"refusal_kind": "too_long", "largest": 20096, "wider_context_parallel": 2}}'}
    >>> print(plan_refusal(too_long, "32768", "auto"))  # doctest: +NORMALIZE_WHITESPACE
    max_seq_len=32768 does not fit: (...). Use -e max_seq_len=20096 (or -e max_seq_len=auto), split each row over
    more workers (-e context_parallel=2, or auto), give the planner more memory per worker
    (eagle3_train_plan_memory_gb, less eagle3_train_plan_margin), or set -e eagle3_train_allow_unplanned_seq_len=true
    to run 32768 anyway.
    >>> print(plan_refusal({"rc": 2, "stderr": "eagle3 plan: context_parallel=3 does not divide --world-size 2"},
    ...                    "16384", "3"))  # doctest: +NORMALIZE_WHITESPACE
    max_seq_len=16384, context_parallel=3: the memory planner refuses the run (exit 2): eagle3 plan:
    context_parallel=3 does not divide --world-size 2 -e context_parallel=auto picks a valid one,
    -e context_parallel=1 turns it off.
    """
    import json

    cp, msl = str(cp).strip().lower(), str(msl).strip().lower()
    unbound = "-e eagle3_train_allow_unplanned_seq_len=true"
    if int(result.get("rc", 1)) != 0:
        said = " ".join(f"{result.get('stderr') or ''} {result.get('stdout') or ''}".split())
        text = f"max_seq_len={msl}{'' if cp == '1' else f', context_parallel={cp}'}: the memory planner refuses "
        text += f"the run (exit {result.get('rc')}): {said}"
        if cp != "1":
            text += " -e context_parallel=auto picks a valid one, -e context_parallel=1 turns it off."
        elif msl != "auto" and not unplanned:
            text += f" Fix that, or set {unbound} to run {msl} without the memory check."
        return text
    run = json.loads(result["stdout"])["run"]
    kind, text = run.get("refusal_kind"), run.get("refusal", "")
    if not kind:
        return ""
    if kind == "too_long":
        text += f" Use -e max_seq_len={run['largest']} (or -e max_seq_len=auto)"
        if run.get("wider_context_parallel"):
            text += f", split each row over more workers (-e context_parallel={run['wider_context_parallel']}, or auto)"
        text += ", give the planner more memory per worker (eagle3_train_plan_memory_gb, less eagle3_train_plan_margin)"
        return text + f", or set {unbound} to run {msl} anyway."
    if kind == "nothing_fits":
        text += " Turn on activation_checkpointing or fsdp in eagle3_train_config_overrides, or give the planner more"
        text += " memory per worker (eagle3_train_plan_memory_gb)"
        return text + (f"; or set {unbound} to run {msl} anyway." if msl != "auto" else ".")
    if kind == "needs_memory":
        return text + " Set eagle3_train_plan_memory_gb (GiB per worker), or give a length (-e max_seq_len=16384)."
    return text + (
        " Give a number that divides the run's workers (-e context_parallel=2), or let the planner plan the length:"
        " set eagle3_train_plan_memory_gb (GiB per worker) and leave eagle3_train_allow_unplanned_seq_len false."
    )


def run_choice(run: dict, runs: list | None = None, nnodes=1) -> dict:
    """The run's length and context_parallel: this node's decision, or with several nodes (`runs`: each node's
    decision) the trainer's combination of them (eagle3.plan.decision.combine: one length and one size for all).

    >>> run_choice({"max_seq_len": 32768, "context_parallel": 1, "data_parallel": 2, "summary": "s"})["max_seq_len"]
    32768
    >>> run_choice({}, [{"max_seq_len": 32768, "context_parallel": 1, "data_parallel": 4},
    ...                 {"max_seq_len": 16384, "context_parallel": 4, "data_parallel": 1}], 2)["context_parallel"]
    4
    """
    if int(nnodes or 1) < 2 or not runs:
        return run
    return trainer_module("plan.decision").combine(list(runs))


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
        return {
            "plan_refusal": plan_refusal,
            "run_choice": run_choice,
            "context_parallel_refusal": context_parallel_refusal,
        }
