"""`python -m eagle3 [COMMAND] --help`: exit 0 and describe every option (type, default, allowed values, meaning)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from eagle3 import cli, config, plan, synth
from pipeline_support import TRAINING_ROOT, trainer_env

PARSERS = {
    "synth": synth.build_parser,
    "plan": plan.build_parser,
    "export": cli.export_parser,
    "import": cli.import_parser,
}


def run_cli(argv: list[str]) -> int:
    """cli.main as the console script runs it: argparse's --help ends in SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code or 0


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help_exits_0_and_lists_every_config_key(capsys, flag):
    assert run_cli(["train", flag]) == 0
    out = capsys.readouterr().out
    for spec in config.SPECS.values():
        assert spec.flag in out and spec.help in out
    assert "--config FILE" in out


def test_train_help_wins_over_other_arguments(capsys):
    assert run_cli(["train", "--config", "/nonexistent.yaml", "--max-seq-len", "7", "--help"]) == 0
    assert "--max-seq-len INT" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(PARSERS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_command_help_exits_0_and_describes_every_option(capsys, command, flag):
    assert run_cli([command, flag]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for action in PARSERS[command]()._actions:
        assert action.help, f"{command} {action.option_strings or action.dest}: no help line"
        name = max(action.option_strings, key=len) if action.option_strings else action.dest
        assert name in out, f"{command} --help does not mention {name}"
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in out
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert str(action.default) in out, f"{command} {name}: default {action.default} not shown"
        takes_value = action.nargs != 0
        if action.option_strings and takes_value and not action.choices:
            assert action.metavar, f"{command} {name}: give it a metavar that names its type"


def test_planner_shares_the_trainer_declaration():
    actions = {a.dest: a for a in plan.build_parser()._actions}
    assert tuple(actions["dtype"].choices) == config.choices("dtype")
    assert tuple(actions["attention"].choices) == config.choices("attention")
    assert set(actions["device"].choices) == set(config.choices("device")) - {"auto"}
    assert config.SPECS["activation_checkpointing"].help in actions["activation_checkpointing"].help


def test_top_level_help_names_every_command(capsys):
    assert run_cli(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "synth", "plan", "export", "import"):
        assert f"\n{command} " in out
    assert "COMMAND --help" in out


def test_unknown_command_exits_2(capsys):
    assert run_cli(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


def test_help_through_python_m_exits_0():
    """The bug of the first hour: `python -m eagle3 train --help` said "unknown config key 'help'"."""
    for argv in (["train", "--help"], ["--help"], ["synth", "-h"]):
        run = subprocess.run(
            [sys.executable, "-m", "eagle3", *argv],
            cwd=TRAINING_ROOT,
            env=trainer_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        assert "usage:" in run.stdout and "unknown config key" not in run.stderr
