"""Run torchrun under systemd so that the unit's exit status means what the trainer meant.

torchrun hides its workers' exit codes (any failed worker -> ChildFailedError -> exit 1) and exits 1 when it
is stopped with SIGTERM, even after every worker checkpointed and exited 0. systemd then marks a graceful stop
``failed`` and cannot tell an out-of-memory (never restart) from a crash (restart with back-off). This wrapper
forwards SIGTERM/SIGINT to torchrun, waits, and derives the exit status from the trainer's own status.json:

    phase stopped or done        -> 0  (clean: the unit ends inactive, not failed)
    error.kind == "config"       -> 2  (RestartPreventExitStatus: a restart cannot help)
    error.kind == "oom"          -> 3  (RestartPreventExitStatus: the planner must choose again)
    anything else                -> torchrun's own status (1 for a crash: restart with back-off)

Usage: python -m eagle3.launch --status RUN_DIR/status.json -- torchrun [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

EXIT_BY_ERROR_KIND = {"config": 2, "oom": 3}


def exit_status(torchrun_rc: int, status: dict | None, started_at: float) -> int:
    """The unit's exit status from torchrun's and the trainer's own account.

    >>> exit_status(1, {"phase": "stopped", "updated": 20}, started_at=10)
    0
    >>> exit_status(1, {"phase": "failed", "error": {"kind": "oom"}, "updated": 20}, started_at=10)
    3
    >>> exit_status(1, {"phase": "stopped", "updated": 5}, started_at=10)  # a previous run's status
    1
    """
    if not status or float(status.get("updated") or 0) < started_at:
        return torchrun_rc
    error = status.get("error") or {}
    if error:
        return EXIT_BY_ERROR_KIND.get(error.get("kind"), torchrun_rc or 1)
    if status.get("phase") in ("stopped", "done"):
        return 0
    return torchrun_rc


def read_status(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--status", required=True, help="the trainer's status.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ARGS...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the torchrun command after --")

    started_at = time.time()
    child = subprocess.Popen(command)

    def forward(signum, _frame):
        # torchrun forwards to its workers' process groups and waits for them (they checkpoint first).
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    rc = 128 - rc if rc < 0 else rc  # killed by signal N: report 128+N, as a shell would
    final = exit_status(rc, read_status(args.status), started_at)
    print(
        f"eagle3.launch: torchrun exited {child.returncode}; unit exit status {final}",
        file=sys.stderr,
        flush=True,
    )
    return final


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
