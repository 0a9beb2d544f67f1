"""Command line: `python -m eagle3 {train,synth,plan,export,import,report,...}` (also the `eagle3` console script)."""

from __future__ import annotations

import argparse
import sys

from eagle3.errors import EXIT_CONFIG, EXIT_OK, ConfigError
from eagle3.helptext import HelpFormatter
from eagle3.trained import load_trained

USAGE = """\
usage: python -m eagle3 COMMAND [ARGS...]    (or the `eagle3` console script)

train  --config FILE [--max-seq-len 16384 ...]    train (or resume) a drafter; exit 0/1/2/3
synth  OUT_DIR [--num-samples N ...]              write a learnable synthetic dataset
plan   ...                                        memory planner (eagle3.plan)
export RUN_DIR OUT_DIR [--checkpoint best|latest|PATH]   speculators format for vLLM
import SRC OUT --target-weights PATH [--draft-vocab N]   from the speculators offline layout
report RUN_DIR [RUN_DIR ...] -o report.png|report.html   plots of one run, or several compared
generate OUT_DIR --target DIR --data FILE [...]   training data from a local Hugging Face target (resumable)
evaluate DRAFTER --target DIR --data FILE [--k 3]   real acceptance length (speculative decoding)
tiny-target OUT_DIR [--steps N]                   train the tiny Llama target on the Python stdlib's sources
check-tracker --config FILE | --tracker NAME      can this Python import the config's tracker? exit 0, else 2

`python -m eagle3 COMMAND --help` lists every option of a command with its type, default and meaning.
"""
HELP_FLAGS = ("-h", "--help")


def cmd_synth(argv: list[str]) -> int:
    from eagle3.synth import main as synth_main

    return synth_main(argv)


def cmd_report(argv: list[str]) -> int:
    from eagle3.report import main as report_main  # matplotlib is imported there only

    return report_main(argv)


def cmd_plan(argv: list[str]) -> int:
    from eagle3.plan import main as plan_main

    return plan_main(argv)


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3 export",
        description="Export a trained drafter in the speculators format for vLLM (config.json, model.safetensors).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("run_dir", help="the run directory of `eagle3 train` (its checkpoints and config)")
    p.add_argument("out_dir", help="directory to write config.json and model.safetensors into")
    p.add_argument(
        "--checkpoint",
        default="best",
        metavar="best|latest|PATH",
        help="which checkpoint: best (the newest valid one when no validation ran), latest, or a checkpoint directory",
    )
    p.add_argument(
        "--verifier",
        default=None,
        metavar="NAME",
        help="the target model's name or path, recorded for vLLM (default: the dataset's "
        "index.json `verifier`; one of the two is required)",
    )
    p.add_argument(
        "--verifier-arch",
        action="append",
        default=None,
        metavar="ARCH",
        help="the target's HF architecture, e.g. LlamaForCausalLM (repeatable; default: the "
        "dataset's index.json `verifier`)",
    )
    return p


def export_verifier(args, meta: dict) -> tuple[str, list[str]]:
    """The verifier's name_or_path and architectures: the command line, else the dataset manifest's `verifier`
    ({"name_or_path": ..., "architectures": [...]}); ConfigError when either stays unknown.

    >>> export_verifier(argparse.Namespace(verifier="org/m", verifier_arch=["LlamaForCausalLM"]), {})
    ('org/m', ['LlamaForCausalLM'])
    >>> export_verifier(argparse.Namespace(verifier=None, verifier_arch=None), {})
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: export: the verifier is unknown (name_or_path None, architectures []): the dataset's index.json has no `verifier`; pass --verifier NAME --verifier-arch ARCH (e.g. --verifier meta-llama/Llama-3.1-8B-Instruct --verifier-arch LlamaForCausalLM)
    """
    manifest = meta.get("verifier") or {}
    name = args.verifier or manifest.get("name_or_path")
    archs = list(args.verifier_arch or manifest.get("architectures") or [])
    if not name or not archs:
        raise ConfigError(
            f"export: the verifier is unknown (name_or_path {name!r}, architectures {archs}): the dataset's "
            "index.json has no `verifier`; pass --verifier NAME --verifier-arch ARCH "
            "(e.g. --verifier meta-llama/Llama-3.1-8B-Instruct --verifier-arch LlamaForCausalLM)"
        )
    return name, archs


def cmd_export(argv: list[str]) -> int:
    p = export_parser()
    args = p.parse_args(argv)
    from eagle3.data import read_index
    from eagle3.export import export_speculators
    from eagle3.progress import Progress

    bar = Progress(2, "export: load the checkpoint, write the export")  # a bar on a terminal, else lines
    model, path, cfg = load_trained(args.run_dir, args.checkpoint)
    bar.update()
    name, archs = export_verifier(args, read_index(cfg.data_dir).meta)
    export_speculators(
        model,
        args.out_dir,
        speculative_tokens=cfg.ttt_steps,
        verifier_name_or_path=name,
        verifier_architectures=archs,
    )
    bar.update()
    bar.close()
    print(f"exported {path} -> {args.out_dir}", flush=True)
    from eagle3.trackers import attach_export

    attach_export(args.run_dir, args.out_dir, lambda line: print(line, flush=True))
    return EXIT_OK


def import_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3 import",
        description="Import the speculators offline data layout as a native dataset.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("src", help="directory with hidden_states/hs_{i}.safetensors (and loss_masks.jsonl)")
    p.add_argument("out", help="the new native dataset directory")
    p.add_argument(
        "--target-weights",
        required=True,
        metavar="PATH",
        help="safetensors with embed/final_norm/lm_head (or HF names), or an HF model directory (required)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=32000,
        metavar="INT",
        help="draft vocab size: the most frequent supervised target tokens",
    )
    p.add_argument(
        "--aux-layer-ids",
        required=True,
        metavar="A,B,C",
        help="the three target layers the hidden states came from, e.g. 2,30,58 (required)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the stored hidden states",
    )
    return p


def cmd_import(argv: list[str]) -> int:
    p = import_parser()
    args = p.parse_args(argv)
    import torch

    from eagle3.importer import import_speculators

    try:
        aux = tuple(int(v) for v in args.aux_layer_ids.split(","))
    except ValueError as e:
        raise ConfigError(f"--aux-layer-ids {args.aux_layer_ids!r} must be 3 integers like 2,30,58") from e
    if len(aux) != 3:
        raise ConfigError(f"--aux-layer-ids {args.aux_layer_ids!r} must name exactly 3 layers")
    index = import_speculators(
        args.src,
        args.out,
        target_weights=args.target_weights,
        draft_vocab_size=args.draft_vocab,
        aux_layer_ids=aux,
        dtype=getattr(torch, args.dtype),
        progress=True,
    )
    print(f"imported {args.src} -> {index.parent}", flush=True)
    return EXIT_OK


def cmd_generate(argv: list[str]) -> int:
    from eagle3.generate import main as generate_main

    return generate_main(argv)


def cmd_evaluate(argv: list[str]) -> int:
    from eagle3.evaluate import main as evaluate_main

    return evaluate_main(argv)


def cmd_check_tracker(argv: list[str]) -> int:
    """Import the tracker a trainer config names (its `tracker` key; none when absent), in this Python and without
    torch: the Ansible role asks this in the target's venv before it touches a run. Exit 0 with one line when the
    package imports, 2 (ConfigError, naming the tracker, this Python and the fix) when it does not."""
    p = argparse.ArgumentParser(
        prog="python -m eagle3 check-tracker",
        description="Can this Python import the experiment tracker of a trainer config (mlflow, wandb)? "
        "Exit 0 when it can (or the config names none), 2 when it cannot.",
        formatter_class=HelpFormatter,
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--config", metavar="FILE", help="the trainer config (its tracker key); /dev/stdin reads it from standard input"
    )
    which.add_argument("--tracker", metavar="NAME", help="the tracker itself: none, mlflow or wandb")
    args = p.parse_args(argv)
    from eagle3.config import check_key, coerce_value, load_config_file
    from eagle3.trackers import check_importable

    tracker = args.tracker
    if args.config is not None:
        tracker = load_config_file(args.config).get("tracker", "none")
    tracker = coerce_value("tracker", tracker)
    check_key("tracker", tracker)
    print(check_importable(tracker), flush=True)
    return EXIT_OK


def cmd_tiny_target(argv: list[str]) -> int:
    from eagle3.tiny_target import main as tiny_main

    return tiny_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK if argv else EXIT_CONFIG
    command, rest = argv[0], argv[1:]
    if command == "train":
        if any(arg in HELP_FLAGS for arg in rest):
            from eagle3.config_help import render_help

            print(render_help())
            return EXIT_OK
        from eagle3.train import main as train_main

        return train_main(rest)
    commands = {
        "synth": cmd_synth,
        "plan": cmd_plan,
        "export": cmd_export,
        "import": cmd_import,
        "report": cmd_report,
        "generate": cmd_generate,
        "evaluate": cmd_evaluate,
        "tiny-target": cmd_tiny_target,
        "check-tracker": cmd_check_tracker,
    }
    if command not in commands:
        print(f"unknown command {command!r}; use one of train, {', '.join(commands)}\n{USAGE}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return commands[command](rest)
    except ConfigError as e:
        message = str(e)  # one line, the command's name first (once: many messages name it already)
        print(
            message if message.startswith(f"{command}:") else f"{command}: {message}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CONFIG
