"""The help format of every `eagle3` subcommand: each option's one line of meaning, with its default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """argparse help that adds each option's default to its one line of meaning (unless the line says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default is not None
            and default is not False
            and default != argparse.SUPPRESS
            and "%(default)" not in text
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text
