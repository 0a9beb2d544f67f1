"""How a run is reported: one state with its reason (module_utils/train_status.run_state), the unit's growing
restart delay and exit record (module_utils/restart_backoff, the unit's ExecStartPre/ExecStopPost), and the
train_report module that puts them together on the target."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_control import run_module

from module_utils import restart_backoff, train_status

ROOT = Path(__file__).resolve().parents[1]
BACKOFF = ROOT / "module_utils" / "restart_backoff.py"


def test_worked_examples_hold():
    assert doctest.testmod(restart_backoff).failed == 0
    assert doctest.testmod(train_status).failed == 0


def post_stop(state: Path, status: Path, **env) -> subprocess.CompletedProcess:
    """Run the script as systemd's ExecStopPost= does: SERVICE_RESULT/EXIT_CODE/EXIT_STATUS in the environment."""
    return subprocess.run(
        [
            sys.executable,
            BACKOFF,
            "post-stop",
            "--state",
            state,
            "--status",
            status,
            "--unit",
            "no-such.service",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_crash_loop_grows_the_delay_and_a_clean_exit_resets_it(tmp_path):
    state, status = tmp_path / "restart-backoff.json", tmp_path / "status.json"
    crash = {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "1"}
    delays = []
    for _ in range(3):
        assert post_stop(state, status, **crash).returncode == 0
        data = json.loads(state.read_text())
        delays.append(restart_backoff.delay_for(data["failures"]))
    assert delays == [10.0, 30.0, 90.0]
    assert data["last_exit"]["reason"] == "crash" and data["last_exit"]["exit_status"] == "1"
    post_stop(state, status, SERVICE_RESULT="success", EXIT_CODE="exited", EXIT_STATUS="0")
    assert json.loads(state.read_text())["failures"] == 0


def test_the_trainers_own_error_names_the_exit(tmp_path):
    state, status = tmp_path / "restart-backoff.json", tmp_path / "status.json"
    restart_backoff.write_state(str(state), {"failures": 0, "started": time.time() - 5})
    status.write_text(json.dumps({"updated": time.time(), "error": {"kind": "oom", "message": "CUDA out of memory"}}))
    post_stop(state, status, SERVICE_RESULT="exit-code", EXIT_CODE="exited", EXIT_STATUS="3")
    last = json.loads(state.read_text())["last_exit"]
    assert (last["reason"], last["message"]) == ("oom", "CUDA out of memory")


def test_a_killed_rank_is_named_by_its_signal(tmp_path):
    state, status = tmp_path / "restart-backoff.json", tmp_path / "status.json"
    post_stop(state, status, SERVICE_RESULT="signal", EXIT_CODE="killed", EXIT_STATUS="KILL")
    assert json.loads(state.read_text())["last_exit"]["message"] == "killed by SIGKILL"


def test_pre_start_waits_only_the_rest_of_the_delay(tmp_path):
    state = tmp_path / "restart-backoff.json"
    # Failure 1 ended 9.5 s ago: 0.5 s of its 10 s delay are left.
    restart_backoff.write_state(
        str(state), {"failures": 1, "last_exit": {"time": time.time() - 9.5, "reason": "crash"}}
    )
    began = time.monotonic()
    out = subprocess.run(
        [sys.executable, BACKOFF, "pre-start", "--state", state], capture_output=True, text=True, timeout=60
    )
    waited = time.monotonic() - began
    assert out.returncode == 0 and "restart back-off: failure 1 in a row" in out.stdout
    assert 0.3 <= waited < 9  # the remaining half second, not the whole 10 s
    assert json.loads(state.read_text())["started"] >= time.time() - 60


def test_reset_forgets_the_failures(tmp_path):
    state = tmp_path / "restart-backoff.json"
    restart_backoff.write_state(str(state), {"failures": 4, "last_exit": {"time": time.time(), "reason": "crash"}})
    subprocess.run([sys.executable, BACKOFF, "reset", "--state", state], check=True, timeout=60)
    assert restart_backoff.remaining_delay(restart_backoff.read_state(str(state)), time.time()) == 0.0


@pytest.mark.parametrize(
    ("unit", "status", "backoff", "state"),
    [
        (
            {"ActiveState": "active", "SubState": "running"},
            {"phase": "training", "updated": 100, "step_time_s": 4.0},
            {},
            "running",
        ),
        (  # resumed, its first step not done yet: no rate to show
            {"ActiveState": "active", "SubState": "running"},
            {"phase": "training", "updated": 100, "step_time_s": 0.0},
            {},
            "starting",
        ),
        (
            {"ActiveState": "active", "SubState": "running"},
            {"phase": "starting", "updated": 100},
            {},
            "starting",
        ),
        ({"ActiveState": "activating", "SubState": "auto-restart"}, None, {"failures": 3}, "crash-looping"),
        ({"ActiveState": "failed", "Result": "start-limit-hit"}, None, {"failures": 8}, "failed"),
        ({"ActiveState": "failed", "Result": "exit-code"}, {"phase": "failed", "updated": 100}, {}, "failed"),
        ({"ActiveState": "inactive", "Result": "success"}, {"phase": "done", "updated": 100}, {}, "finished"),
        (
            {"ActiveState": "inactive", "Result": "success"},
            {"phase": "stopped", "updated": 100},
            {},
            "stopped",
        ),
        ({"ActiveState": "inactive", "Result": "success"}, None, {}, "stopped"),
    ],
)
def test_one_state_per_situation(unit, status, backoff, state):
    assert train_status.run_state(status, unit, backoff, started_at=50.0, now=110.0)["state"] == state


def test_a_stall_shows_before_the_hang_watchdog_ends_the_run():
    """With a 40 s watchdog bound the stall note comes at 20 s (the 120 s floor would come after the restart)."""
    status = {
        "phase": "training",
        "step": 9,
        "updated": 100.0,
        "step_time_s": 1.0,
        "log_every": 1,
        "watchdog_bound_s": 40.0,
    }
    unit = {"ActiveState": "active", "SubState": "running"}
    assert not train_status.run_state(status, unit, {}, started_at=50.0, now=119.0)["stalled"]
    run = train_status.run_state(status, unit, {}, started_at=50.0, now=125.0)
    assert run["stalled"] and run["state"] == "running"
    assert run["detail"] == (
        "stalled: no step for 25 s (expected about 1 s); the hang watchdog ends the run after 40 s"
    )


@pytest.mark.parametrize(("kind", "restarts"), [("hang", True), ("crash", True), ("oom", False)])
def test_a_run_that_reported_its_failure_is_failed_while_the_unit_winds_down(kind, restarts):
    status = {"phase": "failed", "step": 9, "updated": 100.0, "error": {"kind": kind, "message": "m"}}
    run = train_status.run_state(
        status, {"ActiveState": "active", "SubState": "running"}, {}, started_at=50.0, now=110.0
    )
    assert run["state"] == "failed" and run["reason"] == f"{kind}: m"
    assert ("restarts it" in run["detail"]) is restarts


def test_a_failed_unit_after_several_failed_runs_gave_up():
    """systemd leaves the unit failed with result exit-code when the restart would pass StartLimitBurst."""
    run = train_status.run_state(
        None, {"ActiveState": "failed", "Result": "exit-code"}, {"failures": 5}, started_at=0.0, now=1.0
    )
    assert run["state"] == "failed" and run["detail"].startswith("gave up: the unit hit its start limit after 5")


def test_start_limit_says_it_gave_up_and_why():
    run = train_status.run_state(
        None,
        {"ActiveState": "failed", "Result": "start-limit-hit"},
        {"failures": 8, "last_exit": {"reason": "rendezvous", "message": "RendezvousTimeoutError"}},
        started_at=0.0,
        now=1.0,
    )
    assert run["detail"] == "gave up: the unit hit its start limit after 8 failed run(s) in a row"
    assert run["reason"] == "rendezvous: RendezvousTimeoutError"


def test_train_report_puts_unit_status_and_restart_record_together(fake_systemd, tmp_path, capsys):
    (fake_systemd / "show").write_text("ActiveState=failed\nSubState=failed\nResult=start-limit-hit\nNRestarts=7\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"phase": "failed", "step": 12, "updated": time.time()}))
    restart_backoff.write_state(
        str(run_dir / "restart-backoff.json"),
        {"failures": 8, "last_exit": {"time": time.time(), "reason": "nccl", "message": "NCCL error"}},
    )
    res, rc = run_module("train_report", {"run_dir": str(run_dir)}, capsys)
    assert rc == 0 and res["changed"] is False
    assert res["run"]["state"] == "failed" and res["run"]["reason"] == "nccl: NCCL error"
    assert res["status"]["step"] == 12 and res["unit"]["NRestarts"] == "7"
    assert res["foreign_holders"] == [] and res["status_age_s"] <= 5


def test_a_deleted_status_file_during_a_healthy_run_is_not_called_starting(fake_systemd, tmp_path, capsys):
    # status.json deleted again and again while the run trains: metrics.jsonl shows the steps this run made.
    started = int((time.monotonic() - 60) * 1e6)
    (fake_systemd / "show").write_text(
        f"ActiveState=active\nSubState=running\nResult=success\nExecMainStartTimestampMonotonic={started}\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"kind": "train", "step": s, "step_time_s": 2.0, "tokens_per_s": 900.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    res, rc = run_module("train_report", {"run_dir": str(run_dir)}, capsys)
    assert rc == 0 and res["run"]["state"] == "running", res["run"]
    assert res["status"]["step"] == 3 and res["status"]["source"] == "metrics.jsonl"
    assert "status.json is missing" in res["run"]["detail"] and "metrics.jsonl" in res["run"]["detail"]
    # metrics.jsonl from before this start is no evidence of this run: nothing is made up.
    old = time.time() - 3600
    os.utime(run_dir / "metrics.jsonl", (old, old))
    res, rc = run_module("train_report", {"run_dir": str(run_dir)}, capsys)
    assert res["run"]["state"] == "starting" and res["status"] == {}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (
            "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
            "has failed. See inner exception for details.",
            "cannot reach the rendezvous store on node 0",
        ),
        (
            "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
            "not every node joined the rendezvous",
        ),
    ],
)
def test_a_rendezvous_failure_says_what_it_means_for_the_nodes(line, says):
    # As journalctl shows them when a node of a two-node run cannot reach node 0, or node 0 waits in vain.
    env = {"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "1"}
    reason, message = restart_backoff.classify_exit(env, None, 10, ["Traceback (most recent call last):", line])
    assert reason == "rendezvous" and message.startswith(line) and says in message
