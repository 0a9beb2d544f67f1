"""Errors and process exit codes of the trainer: the one source of truth for both.

The Ansible `train_health` module and the systemd unit read these exit codes:

    EXIT_OK      0  training finished, or stopped cleanly on SIGTERM/SIGINT after a checkpoint
    EXIT_CRASH   1  anything unexpected (a bug, a lost rank): restart with back-off
    EXIT_CONFIG  2  bad configuration or bad data: fix the input, retrying will not help
    EXIT_OOM     3  out of memory at this max_seq_len: lower it or let the planner choose
    EXIT_HANG    4  the hang watchdog fired: no step (or checkpoint) finished within its bound; every thread's
                    stack is in stderr, status.json error kind hang. A restart resumes from the last checkpoint.
    EXIT_STORAGE 5  the checkpoint folder cannot be written: full (ENOSPC, EDQUOT: error kind disk_full),
                    read-only (EROFS: read_only) or not ours to write (EACCES, EPERM: no_permission). The
                    previous checkpoints are intact. A restart would train to the next save and lose that work
                    again, so the run stops until someone fixes the folder.

status.json `error.kind` is one of: config (exit 2, also bad data), oom (3), hang (4), disk_full, read_only,
no_permission (5), crash (1).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_OOM = 3
EXIT_HANG = 4
EXIT_STORAGE = 5

# eagle3.launch tells the workers where its status.json is, so that a config file that cannot even be parsed (no
# run_dir to read) still reports there: the unit then ends with exit 2 (no restart), not torchrun's 1.
STATUS_FILE_ENV = "EAGLE3_STATUS_FILE"

# errno name -> the error kind a checkpoint folder that refuses a write gets (exit EXIT_STORAGE).
STORAGE_KINDS = {
    "ENOSPC": "disk_full",
    "EDQUOT": "disk_full",
    "EROFS": "read_only",
    "EACCES": "no_permission",
    "EPERM": "no_permission",
}


# status.json error.kind -> the trainer's exit code with it: every kind there is, in the order the docs list them
# (tests/test_contracts.py holds every list of them in the docs and the modules to this one).
ERROR_KINDS = {
    "config": EXIT_CONFIG,
    "oom": EXIT_OOM,
    "hang": EXIT_HANG,
    **{kind: EXIT_STORAGE for kind in dict.fromkeys(STORAGE_KINDS.values())},
    "crash": EXIT_CRASH,
}


class ConfigError(Exception):
    """A configuration value is wrong. The message names the key, the value seen and the fix.

    >>> raise ConfigError("max_seq_len=24000 is not a multiple of 128; try 23936 or 24064")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: max_seq_len=24000 is not a multiple of 128; try 23936 or 24064
    """


class DataError(ConfigError):
    """The dataset (or a batch made from it) does not match the configuration; same exit code 2."""


class StorageError(Exception):
    """A checkpoint folder refused a write (see STORAGE_KINDS). Checkpoints written before are intact.

    >>> e = StorageError("checkpoint at step 50 not written", errno_name="EROFS", path="/run/checkpoints")
    >>> e.kind, e.errno_name, e.path
    ('read_only', 'EROFS', '/run/checkpoints')
    """

    def __init__(self, message: str, *, errno_name: str, path: str = ""):
        super().__init__(message)
        self.errno_name = errno_name
        self.path = path
        self.kind = STORAGE_KINDS.get(errno_name, "disk_full")
