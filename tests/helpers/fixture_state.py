#!/usr/bin/env python3
"""Which recorded helper processes are still running; optionally reap them (molecule verify/destroy, bench).

    fixture_state.py DIR            print {"JOB/ROLE": true|false, ...} for every DIR/*.pids line
    fixture_state.py DIR --reap     SIGKILL the recorded identities still running (start time checked first)

Only processes recorded by holder.py are ever signalled: identity is (pid, start time from /proc/PID/stat).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def running(pid: int, start: int) -> bool:
    """Is the process with this identity (pid, start time in clock ticks) still there and not a zombie?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return False
    return int(fields[19]) == start and fields[0] not in ("Z", "X")


def recorded(directory: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for pidfile in sorted(directory.glob("*.pids")):
        for line in pidfile.read_text().splitlines():
            role, pid, start = line.split()
            found[f"{pidfile.stem}/{role}"] = (int(pid), int(start))
    return found


def main() -> int:
    directory = Path(sys.argv[1])
    procs = recorded(directory) if directory.is_dir() else {}
    if "--reap" in sys.argv[2:]:
        for pid, start in procs.values():
            if running(pid, start):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(running(*i) for i in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    print(json.dumps({name: running(*ident) for name, ident in procs.items()}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
