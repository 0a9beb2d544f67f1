"""Growing restart delay and the last exit reason for the training unit, on any systemd.

systemd 252 (Debian 12, the CT template) has no RestartSteps=/RestartMaxDelaySec=, so the unit restarts after a
short fixed RestartSec= and this script, its ExecStartPre=, waits out the rest of the back-off. Its
ExecStopPost= records how the run ended. One small JSON file holds the state:

    {"failures": 2, "started": 1733212800.0, "last_exit": {"time": ..., "reason": "oom", "message": "...",
     "service_result": "exit-code", "exit_code": "exited", "exit_status": "3", "ran_s": 41.2}}

    failures   consecutive failed runs; a clean exit (SERVICE_RESULT=success) resets it, and so does a run that
               lasted longer than --reset-after (it was healthy: a later failure starts a new series)
    delay      delays[failures - 1] (the last one repeats), minus the time already passed since that exit

Standard library only: it is copied to the target as the unit's helper and imported by module_utils too.

    python3 restart_backoff.py pre-start  --state FILE [--delays 10,30,90,270,600]
    python3 restart_backoff.py post-stop  --state FILE --status RUN_DIR/status.json [--unit NAME] [--reset-after 1800]
    python3 restart_backoff.py reset      --state FILE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

DEFAULT_DELAYS = (10.0, 30.0, 90.0, 270.0, 600.0)
# Its name in the trainer's run directory (the unit template passes the path; tests/test_contracts.py checks it).
STATE_FILE = "restart-backoff.json"
# The training job's systemd unit, when none is named: the one declaration. This file is deployed alone (the unit
# runs it), so the name lives here; train_report, train_health and the gpu_cleanup role's default read it
# (tests/test_contracts.py holds them to it).
DEFAULT_UNIT = "eagle3-train.service"

# What the journal says when the trainer's own status.json could not (a rank killed, rendezvous, NCCL).
# The launcher's own line about a killed agent comes first: it names the cause, the workers' errors follow from it.
JOURNAL_REASONS = (
    ("signal", re.compile(r"eagle3\.launch: the torchrun agent was killed by SIG\w+")),
    (
        "rendezvous",
        re.compile(r"Rendezvous\w*(Error|Timeout)|rendezvous .*(timed out|closed)|RendezvousTimeoutError"),
    ),
    (
        "nccl",
        re.compile(r"NCCL (error|WARN)|ncclInternalError|ncclSystemError|ProcessGroupNCCL.*(timeout|Watchdog)"),
    ),
    ("collective timeout", re.compile(r"(Gloo|gloo).*(timed out|Timed out)")),
    ("lost peer", re.compile(r"Connection (closed|reset) by peer")),
    ("oom", re.compile(r"OutOfMemoryError|CUDA out of memory|Cannot allocate memory")),
)


# What a rendezvous failure means for a run of several nodes, added to the journal line that shows it.
RENDEZVOUS_HINTS = (
    (
        re.compile(r"RendezvousConnectionError|connection to the C10d store|DistNetworkError"),
        "this node cannot reach the rendezvous store on node 0 (its address and port unreachable, or nothing "
        "listening there)",
    ),
    (
        re.compile(r"RendezvousTimeoutError|rendezvous .*timed out"),
        "not every node joined the rendezvous within its join timeout (a node down, unreachable or not started)",
    ),
)

# The first words of this script's own journal lines (pre-start and post-stop below).
OWN_LINES = ("restart back-off:", "run ended:")


def delay_for(failures: int, delays: tuple[float, ...] = DEFAULT_DELAYS) -> float:
    """Seconds to wait before the next start after ``failures`` consecutive failures.

    >>> [delay_for(n) for n in range(7)]
    [0.0, 10.0, 30.0, 90.0, 270.0, 600.0, 600.0]
    """
    if failures <= 0 or not delays:
        return 0.0
    return float(delays[min(failures, len(delays)) - 1])


def remaining_delay(state: dict, now: float, delays: tuple[float, ...] = DEFAULT_DELAYS) -> float:
    """The part of the back-off not yet spent since the last exit.

    >>> remaining_delay({"failures": 2, "last_exit": {"time": 100.0}}, now=110.0)
    20.0
    >>> remaining_delay({"failures": 0}, now=110.0)
    0.0
    """
    wait = delay_for(int(state.get("failures") or 0), delays)
    since = now - float((state.get("last_exit") or {}).get("time") or now)
    return max(wait - max(since, 0.0), 0.0)


def signal_name(number: str) -> str:
    """'9' or 'KILL' -> 'SIGKILL' (systemd gives the name for killed processes).

    >>> signal_name("KILL"), signal_name("15")
    ('SIGKILL', 'SIGTERM')
    """
    import signal

    if number.isdigit():
        try:
            return signal.Signals(int(number)).name
        except ValueError:
            return f"signal {number}"
    return number if number.startswith("SIG") else f"SIG{number}"


def classify_exit(env: dict, status: dict | None, started: float, journal: list[str]) -> tuple[str, str]:
    """(reason, message) for one ended run, from the trainer's status.json first, then systemd and the journal.

    ``env`` holds systemd's SERVICE_RESULT, EXIT_CODE and EXIT_STATUS for ExecStopPost=.

    >>> classify_exit({"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "3"},
    ...               {"updated": 20, "error": {"kind": "oom", "message": "CUDA out of memory"}}, 10, [])
    ('oom', 'CUDA out of memory')
    >>> classify_exit({"SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}, None, 10, [])
    ('signal', 'killed by SIGKILL')
    >>> classify_exit({"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "1"}, None, 10,
    ...               ["torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"])
    ... # doctest: +NORMALIZE_WHITESPACE
    ('rendezvous', 'torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError (not every node joined the
      rendezvous within its join timeout (a node down, unreachable or not started))')
    >>> classify_exit({"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "137"}, None, 10,
    ...               ["RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:21417",
    ...                "eagle3.launch: the torchrun agent was killed by SIGKILL; unit exit status 137",
    ...                "restart back-off: failure 1 in a row (last: crash: Connection closed by peer)"])
    ('signal', 'eagle3.launch: the torchrun agent was killed by SIGKILL; unit exit status 137')
    """
    result = env.get("SERVICE_RESULT", "")
    if result == "success":
        return "clean", "exited 0"
    fresh = status is not None and float(status.get("updated") or 0) >= started
    error = (status or {}).get("error") if fresh else None
    if error:
        return str(error.get("kind") or "crash"), str(error.get("message") or "")
    code, value = env.get("EXIT_CODE", ""), env.get("EXIT_STATUS", "")
    # This script's own lines quote earlier runs' messages: they say nothing about this run.
    journal = [line for line in journal if not line.startswith(OWN_LINES)]
    for reason, pattern in JOURNAL_REASONS:
        hit = next((line for line in reversed(journal) if pattern.search(line)), None)
        if hit:
            hint = next((h for p, h in RENDEZVOUS_HINTS if p.search(hit)), "") if reason == "rendezvous" else ""
            return reason, hit.strip()[-300:] + (f" ({hint})" if hint else "")
    if code in ("killed", "dumped"):
        return "signal", f"killed by {signal_name(value)}"
    if result == "timeout":
        return "timeout", "systemd timed out starting or stopping the unit"
    if result == "start-limit-hit":
        return "start-limit", "too many restarts"
    last = next((line.strip() for line in reversed(journal) if line.strip()), "")
    return "crash", f"exit status {value or '?'}{': ' + last[-300:] if last else ''}"


def read_state(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(path: str, state: dict) -> None:
    """Atomic replace, so a reader (status.yml) never sees half a file."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".restart-backoff.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def record_exit(
    state: dict, env: dict, status: dict | None, journal: list[str], now: float, reset_after: float
) -> dict:
    """The state after one run ended: failures counted or reset, the exit recorded.

    >>> s = record_exit({"failures": 1, "started": 0}, {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited",
    ...                  "EXIT_STATUS": "1"}, None, [], now=60, reset_after=1800)
    >>> s["failures"], s["last_exit"]["reason"]
    (2, 'crash')
    >>> record_exit(s, {"SERVICE_RESULT": "success"}, None, [], now=90, reset_after=1800)["failures"]
    0
    """
    started = float(state.get("started") or now)
    reason, message = classify_exit(env, status, started, journal)
    ran = max(now - started, 0.0)
    failures = int(state.get("failures") or 0)
    # A clean exit ends the series; a failure after a long healthy run starts a new one.
    failures = 0 if reason == "clean" else 1 if ran > reset_after else failures + 1
    return {
        **state,
        "failures": failures,
        "last_exit": {
            "time": now,
            "reason": reason,
            "message": message,
            "service_result": env.get("SERVICE_RESULT", ""),
            "exit_code": env.get("EXIT_CODE", ""),
            "exit_status": env.get("EXIT_STATUS", ""),
            "ran_s": round(ran, 1),
        },
    }


def journal_tail(unit: str, invocation: str, lines: int = 200, timeout: float = 10) -> list[str]:
    cmd = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines)]
    cmd += [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="restart_backoff.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("pre-start", help="wait out the back-off, then note the start")
    pre.add_argument("--state", required=True)
    pre.add_argument("--delays", default=",".join(f"{d:g}" for d in DEFAULT_DELAYS))
    post = sub.add_parser("post-stop", help="record how the run ended (systemd's ExecStopPost=)")
    post.add_argument("--state", required=True)
    post.add_argument("--status", required=True, help="the trainer's status.json")
    post.add_argument("--unit", default=DEFAULT_UNIT)
    post.add_argument("--reset-after", type=float, default=1800.0)
    reset = sub.add_parser("reset", help="forget earlier failures (a deliberate new start)")
    reset.add_argument("--state", required=True)
    args = ap.parse_args(argv)

    state = read_state(args.state)
    if args.command == "reset":
        write_state(args.state, {**state, "failures": 0})
        return 0
    if args.command == "pre-start":
        try:
            delays = tuple(float(d) for d in args.delays.split(",") if d.strip())
        except ValueError:
            ap.error(f"--delays {args.delays!r} must be seconds separated by commas, e.g. 10,30,90")
        wait = remaining_delay(state, time.time(), delays)
        if wait > 0:
            last = state.get("last_exit") or {}
            print(
                f"restart back-off: failure {state.get('failures')} in a row (last: {last.get('reason')}: "
                f"{last.get('message', '')[:200]}); starting again in {wait:.0f} s",
                flush=True,
            )
            time.sleep(wait)
        write_state(args.state, {**state, "started": time.time()})
        return 0
    status = None
    try:
        with open(args.status) as f:
            status = json.load(f)
    except (OSError, ValueError):
        pass
    env = {k: os.environ.get(k, "") for k in ("SERVICE_RESULT", "EXIT_CODE", "EXIT_STATUS")}
    journal = journal_tail(args.unit, os.environ.get("INVOCATION_ID", ""))
    new = record_exit(state, env, status, journal, time.time(), args.reset_after)
    write_state(args.state, new)
    last = new["last_exit"]
    if last["reason"] != "clean":
        print(
            f"run ended: {last['reason']}: {last['message'][:300]} (failure {new['failures']} in a row)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
