"""Errors and process exit codes of the trainer: the one source of truth for both.

The Ansible `train_health` module and the systemd unit read these exit codes:

    EXIT_OK      0  training finished, or stopped cleanly on SIGTERM/SIGINT after a checkpoint
    EXIT_CRASH   1  anything unexpected (a bug, a lost rank, a full disk)
    EXIT_CONFIG  2  bad configuration or bad data: fix the input, retrying will not help
    EXIT_OOM     3  out of memory at this max_seq_len: lower it or let the planner choose
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_OOM = 3


class ConfigError(Exception):
    """A configuration value is wrong. The message names the key, the value seen and the fix.

    >>> raise ConfigError("max_seq_len=24000 is not a multiple of 128; try 23936 or 24064")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: max_seq_len=24000 is not a multiple of 128; try 23936 or 24064
    """

    exit_code = EXIT_CONFIG


class DataError(ConfigError):
    """The dataset (or a batch made from it) does not match the configuration; same exit code 2."""
