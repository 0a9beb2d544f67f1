"""`python -m eagle3 plan`: the command line, the table and the JSON object the Ansible role parses
(roles/eagle3_train/tasks/plan.yml reads max_seq_len, predicted_gb, memory_gb, static_gb, table, source ...).

    python -m eagle3 plan --shape kimi-k2.5 --world-size 8 --memory-gb 96 --activation-checkpointing
    python -m eagle3 plan --config train.yaml --world-size 8 --memory-gb 96 --json     # what max_seq_len=auto runs
    python -m eagle3 plan --shape kimi-k2.5 --nnodes 2 --nproc-per-node 4 --fsdp --shard-layout hsdp --memory-gb 96
    python -m eagle3 plan --shape kimi-k2.5 --world-size 8 --memory-gb 96 --activation-checkpointing --fsdp \
        --context-parallel auto --max-seq-len 131072      # the smallest context-parallel size that fits 131072

Ranks: --world-size alone (one node, as before), or --nnodes with --nproc-per-node (world size = their product;
a --world-size given too must equal it). --shard-layout hsdp on several nodes shards the FSDP state over the ranks
of one node only, so each GPU holds larger shards than under full.

--context-parallel N splits each row over N ranks (eagle3.context); auto picks the smallest size whose largest
fitting length reaches the length asked for: --max-seq-len, else a single --lengths, else the config's max_seq_len,
else (max_seq_len: auto) the longest document of the data set; without any, 1. The JSON then carries the table of
every size the run can form (context_parallel_table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from eagle3.bounds import SEQ_BLOCK, SEQ_MULTIPLE, seq_len_for
from eagle3.errors import EXIT_CONFIG, EXIT_OK, ConfigError
from eagle3.options import TTT_STEPS
from eagle3.plan.decision import decide
from eagle3.plan.fit import Plan, budget_bytes, context_parallel_choice, cpu_heap_chunk, make_plan
from eagle3.plan.gpu_probe import ProbeUnavailable, probe
from eagle3.plan.model import DEFAULT_LENGTHS, GIB
from eagle3.spec import SHAPE_KEYS, SHAPES, RunSpec, data_bytes_of, drafter_config, spec_of

# --unplanned: a budget no length reaches, so only the run's rules (heads, divisors) can refuse it.
UNBOUNDED_GB = 1048576.0
# The options the command line shares with the trainer config: given, they replace the config's.
SHARED_KEYS = (
    "dtype",
    "attention",
    "activation_checkpointing",
    "fsdp",
    "loss_chunk_size",
    "shard_layout",
    "ttt_steps",
    "context_parallel",
)


def load_trainer_config(path: str):
    """The trainer's config file, `max_seq_len: auto` allowed (the planner is what resolves it): (config, whether
    max_seq_len was auto)."""
    from eagle3.config import build_config, load_config_file

    values = load_config_file(path)
    auto = str(values.get("max_seq_len", "")).lower() == "auto"
    if auto:
        values["max_seq_len"] = SEQ_BLOCK
    return build_config(values, {}), auto


def parse_lengths(text: str) -> list[int]:
    """'8192,16384' -> [8192, 16384]; each a positive multiple of 128.

    >>> parse_lengths("8192, 16384")
    [8192, 16384]
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--lengths {text!r} is not a comma-separated list of integers, e.g. 8192,16384") from e
    bad = [v for v in values if not SEQ_MULTIPLE.holds(v)]
    if bad or not values:
        raise ConfigError(f"--lengths {text!r}: {bad or 'nothing'} {SEQ_MULTIPLE.says}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from eagle3.helptext import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m eagle3 plan",
        description="Predict peak GPU memory per max_seq_len and choose the largest length that fits.",
        formatter_class=HelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--config",
        metavar="FILE",
        help="trainer config (YAML; max_seq_len: auto allowed); its dataset index gives the shape",
    )
    src.add_argument("--shape", choices=sorted(SHAPES), help="a named drafter shape")
    _run_arguments(p)
    _trainer_arguments(p)
    _output_arguments(p)
    return p


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """The drafter's shape, the ranks and the memory the plan is for."""
    for name in (
        "hidden-size",
        "num-heads",
        "head-dim",
        "intermediate-size",
        "draft-vocab-size",
        "target-vocab-size",
    ):
        p.add_argument(f"--{name}", type=int, metavar="INT", help="override one dimension of --shape (or give all six)")
    p.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        metavar="INT",
        help="key/value heads, grouped-query attention (default: the config's, else num-heads)",
    )
    p.add_argument(
        "--ttt-steps",
        type=int,
        default=None,
        metavar="INT",
        help=f"TTT steps (default: the config's, else {TTT_STEPS})",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="INT",
        help="ranks (GPUs) in the run (default: nnodes x nproc-per-node, else 1)",
    )
    p.add_argument("--nnodes", type=int, default=1, metavar="INT", help="nodes (torchrun agents) in the run")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="INT",
        help="ranks (GPUs) per node (default: world-size / nnodes)",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        metavar="GIB",
        help="memory per GPU in GiB (default: the config's memory_limit_gb)",
    )
    p.add_argument("--margin", type=float, default=0.1, metavar="FRACTION", help="fraction of memory kept free")


def _trainer_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with the trainer: their meaning and choices come from the config declaration."""
    from eagle3 import config

    shared = "(default: the config's, else the trainer default)"
    p.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const=True,
        default=None,
        metavar="MODE",
        type=lambda v: config.coerce_value("activation_checkpointing", v),
        help=f"{config.SPECS['activation_checkpointing'].help}; alone: true {shared}",
    )
    p.add_argument("--fsdp", action="store_true", default=None, help=f"{config.SPECS['fsdp'].help} {shared}")
    p.add_argument(
        "--device",
        choices=[c for c in config.choices("device") if c != "auto"],
        default=None,
        help="where the trainer runs (default: the config's, resolved on this machine; else cuda)",
    )
    for key in ("dtype", "attention", "shard_layout"):
        p.add_argument(
            "--" + key.replace("_", "-"),
            choices=config.choices(key),
            default=None,
            help=f"{config.SPECS[key].help} {shared}",
        )
    p.add_argument(
        "--context-parallel",
        type=context_parallel_arg,
        default=None,
        metavar="N|auto",
        help=f"{config.SPECS['context_parallel'].help}; auto: the smallest that fits the length asked for {shared}",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="INT",
        help='the run\'s length: the decision ("run" with --json) says whether it fits, and --context-parallel '
        "auto must fit it (default: auto, the largest that fits)",
    )
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=None,
        metavar="INT",
        help=f"{config.SPECS['loss_chunk_size'].help} {shared}",
    )


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """What the plan reserves, which lengths it tabulates, the GPU probe and the output format."""
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=None,
        metavar="GIB",
        help="memory torch does not count, GiB (default: 1.0 on cuda, 1 + 1/16 per thread on cpu)",
    )
    p.add_argument(
        "--lengths",
        default=None,
        metavar="N,N,...",
        help=f"lengths for the table, e.g. 8192,16384,32768 (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    p.add_argument("--probe", action="store_true", help="confirm with real steps on this GPU (skipped without CUDA)")
    p.add_argument("--probe-lengths", default="4096,8192", metavar="N,N", help="the two probe lengths")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="probe cache (default: ~/.cache/eagle3/plan)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the Ansible role parses it)")
    p.add_argument(
        "--unplanned",
        default="",
        metavar="REASON",
        help="do not bound the length by memory (only the run's rules are checked); REASON is said in the decision",
    )
    p.add_argument(
        "--memory-source", default="", metavar="TEXT", help="where --memory-gb comes from, named in the decision"
    )


def context_parallel_arg(text: str) -> int | str:
    """--context-parallel: a positive integer or auto.

    >>> context_parallel_arg("4"), context_parallel_arg("AUTO")
    (4, 'auto')
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or auto")
    return value


def resolve_ranks(world_size: int | None, nnodes: int, nproc_per_node: int | None) -> tuple[int, int]:
    """(world size, nodes) from --world-size, --nnodes and --nproc-per-node.

    >>> resolve_ranks(8, 1, None), resolve_ranks(None, 2, 4), resolve_ranks(8, 2, None), resolve_ranks(None, 1, None)
    ((8, 1), (8, 2), (8, 2), (1, 1))
    >>> resolve_ranks(6, 2, 4)
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: --world-size 6 is not --nnodes 2 x --nproc-per-node 4 = 8; give one or make them agree
    """
    if nnodes < 1 or (nproc_per_node is not None and nproc_per_node < 1) or (world_size is not None and world_size < 1):
        raise ConfigError(
            f"--nnodes {nnodes}, --nproc-per-node {nproc_per_node}, --world-size {world_size}: each must be at least 1"
        )
    if nproc_per_node is not None:
        if world_size is not None and world_size != nnodes * nproc_per_node:
            raise ConfigError(
                f"--world-size {world_size} is not --nnodes {nnodes} x --nproc-per-node {nproc_per_node} = "
                f"{nnodes * nproc_per_node}; give one or make them agree"
            )
        return nnodes * nproc_per_node, nnodes
    world = world_size if world_size is not None else nnodes
    if world % nnodes:
        raise ConfigError(
            f"--world-size {world} does not split evenly over --nnodes {nnodes}; give --nproc-per-node instead"
        )
    return world, nnodes


def spec_from_args(args) -> tuple[RunSpec, float]:
    """The run the command line describes, resolved as the trainer resolves it (eagle3.spec), and the memory per
    GPU: the trainer config's (its data set gives the drafter's shape), or the trainer's defaults with a named or
    given shape; the command line's options on top of either."""
    from eagle3.config import TrainConfig, validate
    from eagle3.data import read_index

    device = args.device or "cuda"
    longest, msl_auto = None, False
    if args.config:
        cfg, msl_auto = load_trainer_config(args.config)
        index = read_index(cfg.data_dir)
        drafter, data_bytes = drafter_config(cfg, index), data_bytes_of(index)
        longest = max(index.lengths, default=0)
        memory = cfg.memory_limit_gb or None
        if args.device is None:
            device = cfg.device  # auto: resolved on this machine (the plan runs where the trainer will)
    else:
        cfg = TrainConfig(data_dir="-", run_dir="-")  # the trainer's defaults, from its declaration
        drafter, data_bytes, memory = _named_or_given_shape(args), 2, None
    dims = {d: getattr(args, d) for d in (*SHAPE_KEYS, "num_kv_heads") if getattr(args, d)}
    if dims:
        drafter = dataclasses.replace(drafter, **dims)
    drafter.validate()  # e.g. num_kv_heads must divide num_heads
    cfg = dataclasses.replace(
        cfg, **{k: getattr(args, k) for k in SHARED_KEYS if getattr(args, k) not in (None, "auto")}
    )
    if args.context_parallel == "auto":
        cfg = dataclasses.replace(cfg, context_parallel=1)  # chosen once the budget is known (main)
        args.asked_len = args.max_seq_len or _asked_length(args, cfg if args.config and not msl_auto else None, longest)
    validate(cfg)  # the trainer's own checks of what the command line changed (ttt_steps >= 1, ...)
    spec = spec_of(drafter, cfg, device, args.world_size, args.nnodes, data_bytes)
    if args.reserve_gb is not None:
        spec = dataclasses.replace(spec, reserve_gib=args.reserve_gb)
    memory = args.memory_gb if args.memory_gb is not None else memory
    if memory is None:
        raise ConfigError("no memory budget: pass --memory-gb (GiB per GPU) or set memory_limit_gb in the config")
    return spec, memory


def _asked_length(args, cfg, longest: int | None) -> int | None:
    """The length --context-parallel auto must fit when --max-seq-len is not given: one --lengths, the max_seq_len
    of `cfg` (a config whose max_seq_len is not auto), the longest document (rounded up to the row block), or None."""
    if args.lengths and len(parse_lengths(args.lengths)) == 1:
        return parse_lengths(args.lengths)[0]
    if cfg is not None:  # a config whose max_seq_len is a number
        return cfg.max_seq_len
    if longest:
        return seq_len_for(longest)
    return None


def _named_or_given_shape(args):
    if args.shape:
        return SHAPES[args.shape]
    if all(getattr(args, d) for d in SHAPE_KEYS):
        return SHAPES["tiny"]  # every dimension is replaced by the command line's
    raise ConfigError(
        "give --config FILE, --shape NAME, or all six of --" + ", --".join(d.replace("_", "-") for d in SHAPE_KEYS)
    )


def format_table(plan: Plan) -> str:
    budget = budget_bytes(plan.memory_gb, plan.margin) / GIB
    d, run = plan.spec.drafter, plan.spec.run
    lines = [
        f"drafter: hidden {d.hidden_size}, {d.num_heads} heads x {d.head_dim} ({d.num_kv_heads} kv), "
        f"mlp {d.intermediate_size}, vocab {d.draft_vocab_size}/{d.target_vocab_size}; "
        f"ttt_steps {run.ttt_steps}, world size {run.world_size}"
        + (f" ({run.nodes} nodes x {run.world_size // run.nodes})" if run.nodes > 1 else ""),
        "options: "
        + ", ".join(
            f"{k}={v}"
            for k, v in plan.describe_options().items()
            if k in ("activation_checkpointing", "fsdp", "autocast", "attention")
        ),
        f"sharding: {plan.shard_layout}"
        + (f", weights/gradients/AdamW state sharded over {plan.shard_ranks} ranks" if run.sharded else "")
        + (
            f"; context parallel {run.context_parallel} (each row over {run.context_parallel} ranks, "
            f"{run.data_parallel} row{'s' if run.data_parallel > 1 else ''} per step)"
            if run.context_parallel > 1
            else ""
        ),
        f"static {plan.static_gb:.2f} GiB (reserve included); budget {budget:.2f} GiB "
        f"({plan.memory_gb:g} GiB less {plan.margin:.0%})",
        f"{'max_seq_len':>12}  {'predicted GiB':>13}  fits",
    ]
    for row in plan.table:
        lines.append(f"{row['max_seq_len']:>12}  {row['predicted_gb']:>13.1f}  {'yes' if row['fits'] else 'no'}")
    lines.append(
        f"largest fitting: max_seq_len={plan.max_seq_len} ({plan.predicted_gb:.2f} GiB predicted, {plan.source})"
    )
    for row in plan.context_parallel_table or []:
        target = f", {row['target_gb']:.1f} GiB at the length asked for" if "target_gb" in row else ""
        lines.append(
            f"context_parallel {row['context_parallel']}: largest fitting {row['max_seq_len']}{target}"
            + (" <- chosen" if row["context_parallel"] == run.context_parallel else "")
        )
    if plan.loss_chunk_size is not None:
        lines.append(
            f"loss: loss_chunk_size={plan.loss_chunk_size} fits at that length"
            + (
                " (one pass, the fastest)"
                if plan.loss_chunk_size == 0
                else " (on CPU faster than one pass: its tensors stay in malloc's heap)"
                if run.device == "cpu" and plan.loss_chunk_size == cpu_heap_chunk(d, plan.max_seq_len)
                else " (memory needs the chunked loss)"
            )
            + (f"; the config has {run.loss_chunk_size}" if run.loss_chunk_size != plan.loss_chunk_size else "")
        )
    return "\n".join(lines)


def choose(plan: Plan, probe_result: dict) -> tuple[str, int, float]:
    """(source, max_seq_len, predicted GiB) from the analytic plan and the probe: the smaller length wins, so a
    probe can only lower the analytic choice (the analytic terms are the ones checked for every option).

    >>> from eagle3.plan.model import on_cuda
    >>> plan = Plan(on_cuda(SHAPES["tiny"]), 8.0, 0.1, 4096, 5.0, 1.0, [])
    >>> choose(plan, {"max_seq_len": 2048, "predicted_gb": 7.0})
    ('probe', 2048, 7.0)
    >>> choose(plan, {"max_seq_len": 8192, "predicted_gb": 7.0})
    ('analytic (the probe allows 8192)', 4096, 5.0)
    """
    if probe_result["max_seq_len"] <= plan.max_seq_len:
        return "probe", probe_result["max_seq_len"], probe_result["predicted_gb"]
    return f"analytic (the probe allows {probe_result['max_seq_len']})", plan.max_seq_len, plan.predicted_gb


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else sys.argv[1:])
    asked_cp = args.context_parallel
    try:
        args.world_size, args.nnodes = resolve_ranks(args.world_size, args.nnodes, args.nproc_per_node)
        if args.unplanned:
            args.memory_gb, args.probe = UNBOUNDED_GB, False  # the rules (heads, divisors) still checked
        spec, memory = spec_from_args(args)
        lengths = parse_lengths(args.lengths) if args.lengths else list(DEFAULT_LENGTHS)
        if args.max_seq_len and args.max_seq_len not in lengths:
            lengths.append(args.max_seq_len)  # the row the decision reads
        cp_table = None
        if args.context_parallel == "auto":
            cp, cp_table = context_parallel_choice(spec, budget_bytes(memory, args.margin), args.asked_len)
            spec = spec.with_run(context_parallel=cp)
        plan = make_plan(spec, memory_gb=memory, margin=args.margin, lengths=lengths)
        plan.context_parallel_table = cp_table
        if args.probe and spec.run.context_parallel > 1:
            print("probe skipped: it runs one rank, and a context-parallel row needs its group", file=sys.stderr)
        elif args.probe:
            try:
                result = probe(
                    spec,
                    memory_gb=memory,
                    margin=args.margin,
                    lengths=parse_lengths(args.probe_lengths),
                    cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                )
            except ProbeUnavailable as e:
                print(f"probe skipped: {e}", file=sys.stderr)
            else:
                if result["max_seq_len"] is None:
                    raise ConfigError(
                        f"the probe on {result['gpu']} finds no length that fits {memory} GiB "
                        f"(measured {result['measured']}); turn on activation_checkpointing or fsdp"
                    )
                plan.probe = result
                plan.source, plan.max_seq_len, plan.predicted_gb = choose(plan, result)
    except ConfigError as e:
        print(f"eagle3 plan: {e}", file=sys.stderr)
        return EXIT_CONFIG
    result = plan.to_json()
    result["run"] = decide(
        result,
        args.max_seq_len,
        asked_cp if asked_cp is not None else result["context_parallel"],
        unplanned=args.unplanned,
        memory_source=args.memory_source,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(plan))
        print(result["run"]["refusal"] or result["run"]["summary"])
    return EXIT_OK
