"""Run torchrun under systemd so that the unit's exit status means what the trainer meant.

torchrun hides its workers' exit codes (any failed worker -> ChildFailedError -> exit 1). Its agent also
turns a SIGTERM into a SignalException: it prints a traceback, gives the workers 30 s (its shutdown timeout)
before SIGKILL, and exits 1 even after every worker checkpointed and exited 0. systemd then marks a graceful
stop ``failed`` and cannot tell an out-of-memory (never restart) from a crash (restart with back-off).

This wrapper therefore sends SIGTERM/SIGINT to torchrun's workers (the agent's children, each the leader of
its own process group) rather than to the agent: the workers agree on a stop at the next step boundary,
checkpoint and exit 0, and the agent, seeing every worker succeed, exits 0 with no traceback and no SIGKILL
deadline. Before the workers exist (rendezvous) and for SIGHUP the signal goes to the agent. The exit status
comes from the trainer's own status.json:

    phase stopped or done        -> 0  (clean: the unit ends inactive, not failed)
    error.kind == "config"       -> 2  (RestartPreventExitStatus: a restart cannot help)
    error.kind == "oom"          -> 3  (RestartPreventExitStatus: the planner must choose again)
    error.kind == "hang"         -> 4  (restart from the last checkpoint)
    disk_full, read_only, no_permission -> 5  (RestartPreventExitStatus: the checkpoint folder needs a person)
    anything else                -> torchrun's own status (1 for a crash: restart with back-off)

Usage: python -m eagle3.launch --status RUN_DIR/status.json -- torchrun [ARGS...]
       (or -- python -m torch.distributed.run [ARGS...])
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from eagle3.errors import ERROR_KINDS, EXIT_CRASH, STATUS_FILE_ENV

# The trainer's error kinds that have an exit status of their own (eagle3/errors.py is the one source); a crash
# keeps torchrun's status.
EXIT_BY_ERROR_KIND = {kind: code for kind, code in ERROR_KINDS.items() if code != EXIT_CRASH}
TO_WORKERS = (signal.SIGTERM, signal.SIGINT)  # the trainer checkpoints on these; SIGHUP goes to the agent
# Beside status.json when a stop had to SIGKILL workers; status.yml and cleanup read it (tests/test_contracts.py).
LAST_STOP_FILE = "last-stop.json"


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


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc/*/stat, which every Linux kernel has)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def signal_workers(agent_pid: int, signum: int) -> list[int]:
    """Send `signum` to each worker of the torchrun agent (to its process group when it leads one, as the
    agent itself would); returns the workers signalled (none before the agent started them)."""
    sent = []
    for pid in children(agent_pid):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
            sent.append(pid)
        except ProcessLookupError:
            continue
    return sent


def outcome_line(rc: int, final: int, stop_signal: str, status: dict | None, agent_signal: str = "") -> str:
    """The one line the launcher logs at the end (``agent_signal``: the signal that killed torchrun's agent).

    >>> outcome_line(0, 0, "SIGTERM", {"phase": "stopped", "step": 7, "last_checkpoint_step": 7})
    'eagle3.launch: stopped on SIGTERM; trainer checkpointed at step 7'
    >>> outcome_line(1, 3, "", {"phase": "failed", "error": {"kind": "oom"}})
    'eagle3.launch: torchrun exited 1; unit exit status 3 (trainer error: oom)'
    >>> outcome_line(137, 137, "", {"phase": "training"}, agent_signal="SIGKILL")
    'eagle3.launch: the torchrun agent was killed by SIGKILL; unit exit status 137'
    """
    status = status or {}
    if agent_signal and not stop_signal:
        return f"eagle3.launch: the torchrun agent was killed by {agent_signal}; unit exit status {final}"
    if stop_signal and final == 0 and status.get("phase") == "stopped":
        step = status.get("last_checkpoint_step", status.get("step"))
        return f"eagle3.launch: stopped on {stop_signal}; trainer checkpointed at step {step}"
    if stop_signal and final == 0 and status.get("phase") == "done":
        return f"eagle3.launch: {stop_signal} received after training finished (step {status.get('step')})"
    kind = (status.get("error") or {}).get("kind")
    suffix = f" (trainer error: {kind})" if kind else ""
    return f"eagle3.launch: torchrun exited {rc}; unit exit status {final}{suffix}"


def worker_rank(pid: int) -> str:
    """RANK from a worker's environment ('?' when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return "?"
    return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "?")


def escalation_report(stop_signal: str, waited: float, killed: dict[int, str], status: dict | None) -> dict:
    """What a stop that had to SIGKILL looked like, for the journal and status.yml.

    status.json's `step` is the last *logged* step, so the real step is at least that: `steps_lost` is a lower
    bound, and 0 when the last checkpoint is at or after the last logged step.

    >>> r = escalation_report("SIGTERM", 30.0, {4242: "1"}, {"step": 57, "last_checkpoint_step": 50})
    >>> r["message"]
    'workers ignored SIGTERM for 30 s: rank 1 (pid 4242) got SIGKILL; at least 7 step(s) since the last checkpoint (step 50) are lost'
    >>> r = escalation_report("SIGTERM", 30.0, {4242: "1"}, {"step": 48, "last_checkpoint_step": 50})
    >>> r["steps_lost"], r["message"].split("SIGKILL; ")[1]
    (0, 'no logged step since the last checkpoint (step 50; last logged step 48)')
    >>> escalation_report("SIGTERM", 30.0, {4242: "1"}, {"step": 3})["message"].split("SIGKILL; ")[1]
    'at least 3 step(s) since the last checkpoint (none yet) are lost'
    """
    status = status or {}
    step, ckpt = status.get("step"), status.get("last_checkpoint_step")
    lost = max(0, int(step) - int(ckpt or 0)) if step is not None else None
    ranks = ", ".join(f"rank {rank} (pid {pid})" for pid, rank in sorted(killed.items()))
    message = f"workers ignored {stop_signal} for {waited:.0f} s: {ranks} got SIGKILL"
    if lost:
        where = f"step {ckpt}" if ckpt is not None else "none yet"
        message += f"; at least {lost} step(s) since the last checkpoint ({where}) are lost"
    elif lost == 0 and ckpt is not None:
        message += f"; no logged step since the last checkpoint (step {ckpt}; last logged step {step})"
    return {
        "time": time.time(),
        "signal": stop_signal,
        "waited_s": round(waited, 1),
        "killed": [{"pid": pid, "rank": rank} for pid, rank in sorted(killed.items())],
        "last_step": step,
        "last_checkpoint_step": ckpt,
        "steps_lost": lost,
        "message": message,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3.launch", description=__doc__.splitlines()[0])
    ap.add_argument("--status", required=True, metavar="PATH", help="the trainer's status.json")
    ap.add_argument(
        "--kill-after",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds the workers get to checkpoint after SIGTERM/SIGINT before SIGKILL (a rank blocked in a "
        "collective never reaches its checkpoint); the escalation is logged and written to last-stop.json "
        "beside status.json (default 60)",
    )
    ap.add_argument(
        "--stop-report",
        metavar="PATH",
        default="",
        help=f"where that report goes (default: {LAST_STOP_FILE} beside status.json; a node of a multi-node run, "
        "whose status.json is on shared storage, keeps its own)",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ARGS... (the torchrun command line)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the torchrun command after --")

    started_at = time.time()
    # The workers inherit where status.json is: a config that cannot be parsed still reports there (exit 2).
    child = subprocess.Popen(command, env={**os.environ, STATUS_FILE_ENV: args.status})
    stop_signal, stop_at, killed = "", 0.0, {}

    def forward(signum, _frame):
        nonlocal stop_signal, stop_at
        name = signal.Signals(signum).name
        if signum in TO_WORKERS and signal_workers(child.pid, signum):
            if not stop_signal:
                stop_signal, stop_at = name, time.monotonic()
            return
        child.send_signal(signum)  # no workers yet (or SIGHUP): the agent shuts down whatever it started

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = child.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if stop_signal and not killed and time.monotonic() - stop_at > args.kill_after:
            # A worker that has not checkpointed and exited by now never will (blocked in a collective whose peer
            # is gone, or stopped): SIGKILL, and say so with what it costs.
            for pid in children(child.pid):
                killed[pid] = worker_rank(pid)
            signal_workers(child.pid, signal.SIGKILL)
            report = escalation_report(stop_signal, time.monotonic() - stop_at, killed, read_status(args.status))
            print(f"eagle3.launch: {report['message']}", file=sys.stderr, flush=True)
            try:
                with open(args.stop_report or os.path.join(os.path.dirname(args.status), LAST_STOP_FILE), "w") as f:
                    json.dump(report, f)
            except OSError:
                pass
    agent_signal = signal.Signals(-rc).name if rc < 0 else ""
    rc = 128 - rc if rc < 0 else rc  # killed by signal N: report 128+N, as a shell would
    status = read_status(args.status)
    final = exit_status(rc, status, started_at)
    print(outcome_line(rc, final, stop_signal, status, agent_signal), file=sys.stderr, flush=True)
    return final


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
