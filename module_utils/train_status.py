"""Reading the trainer's health: status.json + the systemd unit's state -> a verdict a human can act on.

Standard library only (runs on the target inside the train_health module). The trainer writes
``<run_dir>/status.json`` atomically; its schema is documented in training/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess

# One source of truth for the trainer's exit codes as the unit sees them (training/eagle3/errors.py mirrors these).
EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_OOM = 0, 1, 2, 3

UNIT_PROPERTIES = (
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "NRestarts",
    "ExecMainStartTimestampMonotonic",
    "InvocationID",
)


def read_status(path: str) -> dict | None:
    """The trainer's status.json, or None when it does not exist (yet) or is being replaced."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def unit_state(unit: str, systemctl: str = "systemctl", timeout: float = 10) -> dict:
    """``systemctl show`` of the properties above, as a dict (strings), {} when systemd is not there."""
    try:
        out = subprocess.run(
            [systemctl, "show", unit, "--property=" + ",".join(UNIT_PROPERTIES)],
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def last_log_lines(unit: str, n: int = 30, invocation: str = "", timeout: float = 10) -> list[str]:
    """The unit's last ``n`` journal lines (this invocation's when known)."""
    cmd = ["journalctl", "--no-pager", "-o", "cat", "-n", str(n)]
    cmd += [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = proc.stdout.splitlines()
    if invocation and not lines:  # older journald without the field: fall back to the unit
        return last_log_lines(unit, n, "", timeout)
    return lines[-n:]


def completed_steps(status: dict) -> int:
    """Steps completed by the current run, not counting those restored from a checkpoint.

    >>> completed_steps({"step": 120, "resumed_from_step": 100})
    20
    >>> completed_steps({"step": 3, "resumed_from_step": None})
    3
    """
    return int(status.get("step") or 0) - int(status.get("resumed_from_step") or 0)


def is_fresh(status: dict, started_at: float) -> bool:
    """A status written by the run that is up now, not one left over from a previous run."""
    return float(status.get("updated") or 0) >= started_at


def verdict(
    status: dict | None, unit: dict, *, min_steps: int, started_at: float, max_seq_len: int | None = None
):
    """Classify what we see. Returns (kind, message), kind one of: healthy, done, waiting, oom, config, crash, stopped.

    >>> verdict({"phase": "training", "step": 5, "resumed_from_step": 0, "updated": 10}, {"ActiveState": "active"},
    ...         min_steps=3, started_at=5)[0]
    'healthy'
    >>> verdict({"phase": "failed", "updated": 10, "error": {"kind": "oom", "message": "CUDA out of memory",
    ...          "max_seq_len": 32768}}, {"ActiveState": "failed"}, min_steps=3, started_at=5)
    ('oom', 'out of memory at max_seq_len=32768: CUDA out of memory')
    """
    fresh = status is not None and is_fresh(status, started_at)
    err = (status or {}).get("error") if fresh else None
    if err:
        kind = err.get("kind", "crash")
        msl = err.get("max_seq_len", max_seq_len)
        if kind == "oom":
            return "oom", f"out of memory at max_seq_len={msl}: {err.get('message', '')}".rstrip(": ")
        if kind == "config":
            return "config", f"the trainer rejected its configuration: {err.get('message', '')}"
        return "crash", f"the trainer crashed: {err.get('message', '')}"
    active = unit.get("ActiveState", "")
    if fresh and status.get("phase") == "done":
        return "done", f"training finished at step {status.get('step')}"
    if (
        fresh
        and completed_steps(status) >= min_steps
        and status.get("phase") in ("training", "validating", "checkpointing")
    ):
        return "healthy", f"{completed_steps(status)} steps completed (step {status.get('step')})"
    if active in ("failed",) or (active == "inactive" and unit.get("Result") not in ("", "success")):
        code = unit.get("ExecMainStatus", "?")
        return "crash", f"the unit is {active} (result {unit.get('Result', '?')}, exit status {code})"
    if active == "inactive":
        if fresh and status.get("phase") == "stopped":
            return "stopped", f"the trainer stopped cleanly at step {status.get('step')}"
        return "crash", "the unit is not running (inactive) and the trainer reported nothing"
    return "waiting", (
        f"phase {status.get('phase')}, step {status.get('step')}" if fresh else "no status from this run yet"
    )


def status_path(run_dir: str) -> str:
    return os.path.join(run_dir, "status.json")
