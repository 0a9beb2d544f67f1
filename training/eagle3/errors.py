"""Errors and process exit codes of the trainer: the one source of truth for both.

The Ansible `train_health` module and the systemd unit read these exit codes:

    EXIT_OK      0  training finished, or stopped cleanly on SIGTERM/SIGINT after a checkpoint
    EXIT_CRASH   1  anything unexpected (a bug, a lost rank), and a full disk while writing a checkpoint
                    (status.json error kind disk_full; the previous checkpoints are intact): restart with back-off
    EXIT_CONFIG  2  bad configuration or bad data: fix the input, retrying will not help
    EXIT_OOM     3  out of memory at this max_seq_len: lower it or let the planner choose
    EXIT_HANG    4  the hang watchdog fired: no step (or checkpoint) finished within its bound; every thread's
                    stack is in stderr, status.json error kind hang. A restart resumes from the last checkpoint.

status.json `error.kind` is one of: config (exit 2, also bad data), oom (3), hang (4), disk_full (1), crash (1).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_OOM = 3
EXIT_HANG = 4

ERROR_KINDS = ("config", "oom", "hang", "disk_full", "crash")


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


class DiskFullError(Exception):
    """A write failed with ENOSPC/EDQUOT. Checkpoints written before are intact; exit 1, error kind disk_full."""

    exit_code = EXIT_CRASH
    kind = "disk_full"
