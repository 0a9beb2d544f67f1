"""Reading the trainer's health: status.json + the systemd unit's state -> a verdict a human can act on.

Standard library only (runs on the target inside the train_health module). The trainer writes
``<run_dir>/status.json`` atomically; its schema is documented in training/README.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

# The trainer's exit codes as the unit sees them. training/eagle3/errors.py is the source; this copy (the target
# side is stdlib only) and the unit's RestartPreventExitStatus= are held to it by tests/test_contracts.py.
EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_OOM, EXIT_HANG, EXIT_STORAGE = 0, 1, 2, 3, 4, 5
# Exits a restart cannot fix (the unit's RestartPreventExitStatus=): bad config/data, out of memory, a checkpoint
# folder that refuses writes.
NO_RESTART_EXITS = (EXIT_CONFIG, EXIT_OOM, EXIT_STORAGE)
# The trainer's error kinds for a checkpoint folder that refuses writes (eagle3.errors.STORAGE_KINDS' values).
STORAGE_ERROR_KINDS = ("disk_full", "read_only", "no_permission")
# The exits the unit never restarts (RestartPreventExitStatus): a restart would fail the same way.
NO_RESTART_KINDS = ("config", "oom", *STORAGE_ERROR_KINDS)

UNIT_PROPERTIES = (
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "NRestarts",
    "ExecMainStartTimestampMonotonic",
    "InvocationID",
    "ExecStart",
)


def unit_workers(unit: dict) -> int | None:
    """The run's worker count as the unit starts it: torchrun's --nproc-per-node times --nnodes (None: unknown).

    >>> unit_workers({"ExecStart": "{ path=/v/bin/python ; argv[]=/v/bin/python -m torch.distributed.run --nnodes=2 "
    ...                             "--nproc-per-node=8 -m eagle3 train ; ignore_errors=no }"})
    16
    >>> unit_workers({"ExecStart": ""}) is None
    True
    """
    text = unit.get("ExecStart") or ""
    per_node = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", text)
    nodes = re.search(r"--nnodes[= ](\d+)", text)
    if not per_node:
        return None
    return int(per_node.group(1)) * (int(nodes.group(1)) if nodes else 1)


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


def verdict(status: dict | None, unit: dict, *, min_steps: int, started_at: float, max_seq_len: int | None = None):
    """Classify what we see. Returns (kind, message), kind one of: healthy, done, waiting, oom, config, hang,
    disk_full, read_only, no_permission, crash, stopped.

    >>> verdict({"phase": "training", "step": 5, "resumed_from_step": 0, "updated": 10}, {"ActiveState": "active"},
    ...         min_steps=3, started_at=5)[0]
    'healthy'
    >>> verdict({"phase": "failed", "updated": 10, "error": {"kind": "oom", "message": "CUDA out of memory",
    ...          "max_seq_len": 32768}}, {"ActiveState": "failed"}, min_steps=3, started_at=5)
    ('oom', 'out of memory at max_seq_len=32768: CUDA out of memory')
    >>> verdict({"phase": "failed", "updated": 10, "error": {"kind": "oom", "max_seq_len": 16384,
    ...          "message": "out of memory at max_seq_len=16384: CUDA out of memory"}}, {}, min_steps=3, started_at=5)
    ('oom', 'out of memory at max_seq_len=16384: CUDA out of memory')
    """
    fresh = status is not None and is_fresh(status, started_at)
    err = (status or {}).get("error") if fresh else None
    if err:
        kind = err.get("kind", "crash")
        msl = err.get("max_seq_len", max_seq_len)
        if kind == "oom":
            message = err.get("message", "")
            if message.startswith("out of memory"):  # the trainer's own message already names the length
                return "oom", message
            return "oom", f"out of memory at max_seq_len={msl}: {message}".rstrip(": ")
        if kind == "config":
            return "config", f"the trainer rejected its configuration: {err.get('message', '')}"
        if kind == "hang":
            return (
                "hang",
                f"the trainer hung (its watchdog ended it; it restarts from the last checkpoint): {err.get('message', '')}",
            )
        if kind in STORAGE_ERROR_KINDS:
            where = f" ({err['errno']} on {err['path']})" if err.get("errno") and err.get("path") else ""
            return kind, (
                f"the checkpoint folder refuses writes{where}, so the run stopped and is not restarted: "
                f"{err.get('message', '')}"
            )
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


# The status.json fields a metrics.jsonl train record carries too (the trainer writes both from the same record).
STAND_IN_FIELDS = (
    "step",
    "epoch",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "step_time_s",
    "peak_mem_gb",
    "eta_s",
)


def metrics_stand_in(run_dir: str, started_at: float, tail_bytes: int = 65536) -> dict | None:
    """When status.json is missing: the last train record of metrics.jsonl as the run's status, if this run (the
    unit's process, started at ``started_at``) appended it; None when there is no such evidence.

    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    ...     _ = f.write(json.dumps({"kind": "train", "step": 7, "step_time_s": 2.0}) + "\\n")
    ...     _ = f.write(json.dumps({"kind": "val", "step": 7, "loss": 1.0}) + "\\n")
    >>> r = metrics_stand_in(d, started_at=1)
    >>> r["step"], r["phase"], r["source"]
    (7, 'training', 'metrics.jsonl')
    >>> metrics_stand_in(d, started_at=os.path.getmtime(os.path.join(d, "metrics.jsonl")) + 60) is None
    True
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            if not started_at or mtime < started_at:
                return None  # written before this run started: no evidence of this run
            f.seek(max(os.fstat(f.fileno()).st_size - tail_bytes, 0))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind", "train") == "train" and "step" in record:
            found = {k: record[k] for k in STAND_IN_FIELDS if k in record}
            return {**found, "phase": "training", "updated": mtime, "source": "metrics.jsonl"}
    return None


# --- one state for the whole run -------------------------------------------------------------------------

RUN_STATES = ("running", "starting", "stopped", "finished", "failed", "crash-looping")
# A stalled run is "running" with a stall note: no status update for this many expected intervals (and a floor,
# lowered to half the trainer's hang-watchdog bound so that a stall shows before the watchdog ends the run).
STALL_FACTOR, STALL_FLOOR_S = 3.0, 120.0


# A trainer writes its first status.json within seconds of its start (phase starting): past this, its absence is news.
STATUS_EXPECTED_WITHIN_S = 120.0


def missing_status(status: dict | None, path: str, started_at: float, now: float) -> str:
    """What the lack of a fresh status.json means, from the evidence: none yet, none at all, or an old one.

    >>> missing_status(None, "/r/status.json", 100, 130)
    'no status from this run yet (started 30 s ago)'
    >>> missing_status({"updated": 50}, "/r/status.json", 100, 400)
    '/r/status.json was last written 50 s before this start (the unit has run for 300 s without updating it)'
    """
    ran = max(now - started_at, 0.0) if started_at else 0.0
    where = path or "status.json"
    if status is not None and status.get("updated"):
        before = max(started_at - float(status["updated"]), 0.0)
        if ran > STATUS_EXPECTED_WITHIN_S:
            return f"{where} was last written {before:.0f} s before this start (the unit has run for {ran:.0f} s without updating it)"
        return f"no status from this run yet (started {ran:.0f} s ago; {where} is from the run before)"
    if ran > STATUS_EXPECTED_WITHIN_S:
        return (
            f"no {where} although the unit has run for {ran:.0f} s (the trainer writes it at every logged step: was "
            "the run folder removed or replaced?)"
        )
    return f"no status from this run yet (started {ran:.0f} s ago)"


def stall_after(status: dict) -> float | None:
    """Seconds without a status update after which a running trainer counts as stalled (None: no step time yet).

    >>> stall_after({"step_time_s": 4.0, "log_every": 1})  # the floor
    120.0
    >>> stall_after({"step_time_s": 4.0, "log_every": 10})  # three update intervals
    120.0
    >>> stall_after({"step_time_s": 1.0, "log_every": 1, "watchdog_bound_s": 40})  # before the watchdog fires
    20.0
    """
    interval = expected_update_interval(status)
    if interval is None:
        return None
    floor = STALL_FLOOR_S
    bound = float(status.get("watchdog_bound_s") or 0)
    if bound > 0:
        floor = min(floor, bound / 2)
    return max(floor, STALL_FACTOR * interval)


def expected_update_interval(status: dict) -> float | None:
    """Seconds between two status updates of a healthy run: one per logged step (log_every steps).

    >>> expected_update_interval({"step_time_s": 4.0, "log_every": 10})
    40.0
    >>> expected_update_interval({"step_time_s": 0}) is None
    True
    """
    step = float(status.get("step_time_s") or 0)
    if step <= 0:
        return None
    return step * max(int(status.get("log_every") or 1), 1)


def run_state(
    status: dict | None,
    unit: dict,
    backoff: dict | None,
    started_at: float,
    now: float,
    status_file: str = "",
) -> dict:
    """The run as one state, with the reason and what a person should look at.

    ``unit`` is ``systemctl show`` (ActiveState, SubState, Result, NRestarts); ``backoff`` the unit's restart
    state (module_utils/restart_backoff.py); ``started_at`` the wall-clock start of the unit's main process.
    Returns {state, reason, detail, stalled}; rates and ETA belong only to ``running``.

    >>> run_state({"phase": "training", "step": 9, "updated": 100, "step_time_s": 4, "log_every": 1},
    ...           {"ActiveState": "active", "SubState": "running"}, {}, started_at=50, now=110)["state"]
    'running'
    >>> run_state({"phase": "training", "step": 9, "resumed_from_step": 9, "updated": 100, "step_time_s": 0},
    ...           {"ActiveState": "active", "SubState": "running"}, {}, started_at=50, now=110)["detail"]
    'resumed from step 9, first step of this run in progress'
    >>> r = run_state({"phase": "training", "step": 9, "updated": 100, "step_time_s": 4, "log_every": 1},
    ...               {"ActiveState": "active", "SubState": "running"}, {}, started_at=50, now=700)
    >>> r["state"], r["stalled"], r["detail"]
    ('running', True, 'stalled: no step for 600 s (expected about 4 s)')
    >>> run_state(None, {"ActiveState": "activating", "SubState": "start-pre"},
    ...           {"failures": 2, "last_exit": {"reason": "oom", "message": "CUDA out of memory"}}, 0, 1)["state"]
    'crash-looping'
    >>> r = run_state(None, {"ActiveState": "activating", "SubState": "auto-restart"},
    ...               {"failures": 1, "last_exit": {"reason": "hang", "message": "no step for 90 s"}}, 0, 1)
    >>> r["state"], r["detail"]  # one failed run is not a loop
    ('starting', 'restarting after one failed run (hang: no step for 90 s), with its back-off delay')
    >>> run_state(None, {"ActiveState": "active", "SubState": "running"}, {}, started_at=50, now=650,
    ...           status_file="/run/status.json")["detail"]
    'no /run/status.json although the unit has run for 600 s (the trainer writes it at every logged step: was the run folder removed or replaced?)'
    >>> run_state({"phase": "stopped", "step": 30, "updated": 90}, {"ActiveState": "inactive", "Result": "success"},
    ...           {}, started_at=50, now=100)["state"]
    'stopped'
    >>> r = run_state(None, {"ActiveState": "failed", "Result": "exit-code", "NRestarts": "0"},
    ...               {"failures": 2, "last_exit": {"reason": "read_only", "message": "... read-only (EROFS ..."}}, 0, 1)
    >>> r["state"], r["detail"]  # two failures in a row, but the unit stopped at a no-restart exit: no start limit
    ('failed', 'stopped without a restart: a restart cannot fix read_only')
    >>> run_state(None, {"ActiveState": "failed", "Result": "exit-code"},
    ...           {"failures": 3, "last_exit": {"reason": "crash", "message": "exit status 1"}}, 0, 1)["detail"]
    'gave up: the unit hit its start limit after 3 failed run(s) in a row'
    """
    active, sub = unit.get("ActiveState", ""), unit.get("SubState", "")
    result = unit.get("Result", "")
    last = (backoff or {}).get("last_exit") or {}
    failures = int((backoff or {}).get("failures") or 0)
    fresh = status is not None and is_fresh(status, started_at - 1.0)
    s = status or {}
    err = s.get("error") if fresh else None
    reason = _failure_reason(err, last)
    out = {"state": "", "reason": reason, "detail": "", "stalled": False}

    restarting = (
        active in ("activating", "active") and failures > 0 and (sub in ("auto-restart", "start-pre") or not fresh)
    )
    if restarting and failures >= 2:
        out["state"] = "crash-looping"
        out["detail"] = f"{failures} failed runs in a row; restarting with a growing delay"
        return out
    if restarting:
        out["state"] = "starting"
        out["detail"] = f"restarting after one failed run ({reason or 'reason unknown'}), with its back-off delay"
        return out
    if active in ("active", "deactivating") and err:
        # The trainer has reported its failure; the launcher is still collecting the other ranks.
        out["state"] = "failed"
        out["detail"] = "the run is ending" + (
            "; the unit restarts it from the last checkpoint"
            if err.get("kind") not in NO_RESTART_KINDS
            else "; the unit does not restart it"
        )
        return out
    if active == "active" and not (fresh and s.get("phase") in ("training", "validating", "checkpointing")):
        out["state"] = "starting"
        out["detail"] = f"phase {s.get('phase')}" if fresh else missing_status(status, status_file, started_at, now)
        return out
    if active == "active" and not s.get("step_time_s"):
        out["state"] = "starting"
        resumed = s.get("resumed_from_step")
        out["detail"] = f"resumed from step {resumed}, " if resumed else ""
        out["detail"] += "first step of this run in progress"
        return out
    if active == "active":
        out["state"] = "running"
        out["detail"] = _stall(s, now)
        out["stalled"] = bool(out["detail"])
        return out
    if active == "activating":
        out["state"] = "starting"
        out["detail"] = f"unit {sub or 'activating'}"
        return out
    if active == "failed" or (active == "inactive" and result not in ("", "success")):
        out["state"] = "failed"
        out["detail"] = _failed_detail((err or {}).get("kind") or last.get("reason"), active, result, failures)
        return out
    if s.get("phase") == "done":
        out["state"] = "finished"
        out["detail"] = f"training finished at step {s.get('step')}"
        return out
    out["state"] = "stopped"
    out["detail"] = f"unit {active or 'unknown'}" + (
        f", last step {s.get('step')}" if s.get("step") is not None else ""
    )
    return out


def _failure_reason(err: dict | None, last: dict) -> str:
    """'KIND: MESSAGE' of this run's reported error, else of the last exit the restart record holds ('' if clean)."""
    if err:
        return f"{err.get('kind', 'crash')}: {err.get('message', '')}".rstrip(": ")
    if last and last.get("reason") not in (None, "clean"):
        return f"{last.get('reason')}: {last.get('message', '')}".rstrip(": ")
    return ""


def _stall(s: dict, now: float) -> str:
    """Why a running run counts as stalled (no step for longer than its bound), or '' when it is not."""
    interval, after = expected_update_interval(s), stall_after(s)
    silent = now - float(s.get("updated") or now)
    if after is None or silent <= after:
        return ""
    detail = f"stalled: no step for {silent:.0f} s (expected about {interval:.0f} s)"
    if s.get("watchdog_bound_s"):
        detail += f"; the hang watchdog ends the run after {float(s['watchdog_bound_s']):.0f} s"
    return detail


def _failed_detail(kind: str | None, active: str, result: str, failures: int) -> str:
    """What a failed unit's state means: stopped at a no-restart exit, gave up, or the unit's own result."""
    if kind in NO_RESTART_KINDS and result != "start-limit-hit":
        # RestartPreventExitStatus: the unit stopped at the first such exit, whatever failed before it.
        return f"stopped without a restart: a restart cannot fix {kind}"
    if result == "start-limit-hit" or failures > 1:
        # systemd stops restarting at StartLimitBurst=; the unit then reads failed (result exit-code or
        # start-limit-hit) after several failed runs in a row.
        return f"gave up: the unit hit its start limit after {failures} failed run(s) in a row"
    return f"unit {active} (result {result or '?'})"
