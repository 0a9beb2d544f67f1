"""The pieces train.yml relies on around the trainer: the health verdicts, the unit's exit
status (eagle3.launch), and the reproducible trainer package."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args

from module_utils import train_status

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_module(name: str, args: dict, capsys) -> tuple[dict, int]:
    mod = load(ROOT / "library" / f"{name}.py", f"lib_{name}")
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        mod.main()
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    # Module warnings land in the result, or on the display once controller-side Ansible code was imported.
    result["_warnings_text"] = json.dumps(result.get("warnings", [])) + captured.err
    return result, exc.value.code


# --- health verdicts ---------------------------------------------------------------------------------------

STARTED = 1000.0


def status(**kw):
    return {
        "phase": "training",
        "step": 0,
        "resumed_from_step": 0,
        "updated": STARTED + 5,
        "error": None,
        **kw,
    }


@pytest.mark.parametrize(
    ("st", "unit", "kind"),
    [
        (None, {"ActiveState": "activating"}, "waiting"),
        (status(step=2), {"ActiveState": "active"}, "waiting"),
        (status(step=3), {"ActiveState": "active"}, "healthy"),
        # resumed at 100: 3 steps of this run are needed, not step >= 3
        (status(step=102, resumed_from_step=100), {"ActiveState": "active"}, "waiting"),
        (status(step=103, resumed_from_step=100), {"ActiveState": "active"}, "healthy"),
        # a previous run's healthy status does not count for this one
        (status(step=500, updated=STARTED - 60), {"ActiveState": "active"}, "waiting"),
        (status(phase="done", step=40), {"ActiveState": "inactive", "Result": "success"}, "done"),
        (
            status(phase="failed", error={"kind": "oom", "message": "x", "max_seq_len": 32768}),
            {"ActiveState": "failed"},
            "oom",
        ),
        (
            status(phase="failed", error={"kind": "config", "message": "bad key"}),
            {"ActiveState": "failed"},
            "config",
        ),
        (
            status(phase="failed", error={"kind": "crash", "message": "boom"}),
            {"ActiveState": "activating"},
            "crash",
        ),
        (None, {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "1"}, "crash"),
        (status(phase="stopped", step=7), {"ActiveState": "inactive", "Result": "success"}, "stopped"),
    ],
)
def test_verdicts(st, unit, kind):
    assert train_status.verdict(st, unit, min_steps=3, started_at=STARTED)[0] == kind


def test_oom_message_names_the_length_that_failed():
    st = status(phase="failed", error={"kind": "oom", "message": "CUDA out of memory", "max_seq_len": 24576})
    _kind, msg = train_status.verdict(st, {"ActiveState": "failed"}, min_steps=3, started_at=STARTED)
    assert "max_seq_len=24576" in msg


def test_train_health_returns_when_steps_are_done(fake_systemd, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps(status(step=4, updated=time.time() + 1, tokens_per_s=123.0)))
    res, rc = run_module(
        "train_health", {"run_dir": str(run_dir), "min_steps": 3, "timeout": 5, "poll_interval": 0.1}, capsys
    )
    assert rc == 0 and res["verdict"] == "healthy" and res["status"]["tokens_per_s"] == 123.0


def test_train_health_fails_on_crash_with_the_last_log_lines(fake_systemd, tmp_path, capsys):
    (fake_systemd / "show").write_text("ActiveState=failed\nSubState=failed\nResult=exit-code\nExecMainStatus=1\n")
    res, rc = run_module(
        "train_health",
        {"run_dir": str(tmp_path), "timeout": 5, "poll_interval": 0.1, "log_lines": 30},
        capsys,
    )
    assert rc == 1 and res["verdict"] == "crash"
    assert len(res["log"]) == 30 and res["log"][-1] == "log line 40"


def test_train_health_times_out_saying_what_it_saw(fake_systemd, tmp_path, capsys):
    (tmp_path / "status.json").write_text(json.dumps(status(step=1, updated=time.time() + 1)))
    res, rc = run_module("train_health", {"run_dir": str(tmp_path), "timeout": 1, "poll_interval": 0.2}, capsys)
    assert rc == 1 and res["verdict"] == "timeout"
    assert "not healthy after 1s" in res["msg"] and "step 1" in res["msg"]


def test_train_health_polls_return_progress_until_the_run_is_healthy(fake_systemd, tmp_path, capsys):
    """poll_for: each call returns `waiting` with a progress line; the wait's start and baseline carry over."""
    (tmp_path / "status.json").write_text(json.dumps(status(step=1, updated=time.time() + 1, tokens_per_s=5207.3)))
    args = {"run_dir": str(tmp_path), "min_steps": 3, "timeout": 60, "poll_interval": 0.05}
    first, rc = run_module("train_health", {**args, "poll_for": 0}, capsys)
    assert rc == 0 and first["verdict"] == "waiting" and first["baseline_step"] == 1
    assert first["progress"] == "step 1 (1/3 steps this run), 5,207 tok/s, phase training"
    nxt = {**args, "poll_for": 0.2, "wait_started": first["wait_started"], "baseline_step": 1}
    res, rc = run_module("train_health", nxt, capsys)
    assert rc == 0 and res["verdict"] == "waiting" and res["wait_started"] == first["wait_started"]
    (tmp_path / "status.json").write_text(json.dumps(status(step=4, updated=time.time() + 1)))
    res, rc = run_module("train_health", nxt, capsys)
    assert rc == 0 and res["verdict"] == "healthy"


def test_train_health_polls_end_at_the_timeout_of_the_whole_wait(fake_systemd, tmp_path, capsys):
    (tmp_path / "status.json").write_text(json.dumps(status(step=1, updated=time.time() + 1)))
    args = {"run_dir": str(tmp_path), "timeout": 30, "poll_for": 0.1, "wait_started": time.time() - 31}
    res, rc = run_module("train_health", args, capsys)
    assert rc == 1 and res["verdict"] == "timeout" and "not healthy after 30s" in res["msg"]


@pytest.mark.parametrize(
    "path", ["library/train_health.py", "plugins/callback/eagle3.py"], ids=["train_health", "callback"]
)
def test_progress_lines_read_as_documented(path):
    """The worked examples in the progress-line docstrings hold."""
    mod = load(ROOT / path, "doctest_" + Path(path).stem)
    assert doctest.testmod(mod).failed == 0


def test_train_health_names_a_crash_loop_at_once(fake_systemd, tmp_path, capsys):
    """A unit restarting after failures fails the wait now, with the last exit's reason (not at the timeout)."""
    (fake_systemd / "show").write_text("ActiveState=activating\nSubState=auto-restart\nResult=exit-code\n")
    (tmp_path / "restart-backoff.json").write_text(
        json.dumps({"failures": 2, "last_exit": {"reason": "crash", "message": "No module named 'eagle3'"}})
    )
    res, rc = run_module("train_health", {"run_dir": str(tmp_path), "timeout": 600, "poll_interval": 0.1}, capsys)
    assert rc == 1 and res["verdict"] == "crash" and res["elapsed"] < 60
    assert "crash loop: 2 failed run(s) in a row" in res["msg"] and "No module named 'eagle3'" in res["msg"]


def test_train_health_rejects_nonpositive_timeout(tmp_path, capsys):
    res, rc = run_module("train_health", {"run_dir": str(tmp_path), "timeout": 0}, capsys)
    assert rc == 1 and "timeout must be positive" in res["msg"]


# --- eagle3.launch: the unit's exit status -----------------------------------------------------------------


def run_launch(tmp_path, child_body: str, signal_after: float | None = None, launch_args=()):
    """Run eagle3.launch around a fake torchrun that writes status.json like the trainer does."""
    child = tmp_path / "fake_torchrun.py"
    child.write_text(textwrap.dedent(child_body))
    cmd = [
        sys.executable,
        "-m",
        "eagle3.launch",
        "--status",
        str(tmp_path / "status.json"),
        *launch_args,
        "--",
        sys.executable,
        str(child),
        str(tmp_path / "status.json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "training")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_after is not None:
        # SIGTERM only once the child is up with its handler (it writes status.json after installing it): a
        # fixed sleep loses that race on a loaded machine.
        deadline = time.monotonic() + 60
        while not (tmp_path / "status.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(signal_after)
        proc.terminate()
    try:
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


WRITE = """
import json, signal, sys, time
def write(**kw):
    json.dump({"updated": time.time(), **kw}, open(sys.argv[1], "w"))
"""


def test_launch_turns_a_graceful_sigterm_into_exit_0(tmp_path):
    # torchrun exits 1 after SIGTERM even when every worker checkpointed: the trainer's "stopped" wins.
    body = (
        WRITE
        + """
def on_term(*_):
    write(phase="stopped", step=7)
    sys.exit(1)
signal.signal(signal.SIGTERM, on_term)
write(phase="training", step=1)
time.sleep(30)
"""
    )
    rc, err = run_launch(tmp_path, body, signal_after=0.2)
    assert rc == 0, err


def test_launch_kills_a_worker_that_ignores_sigterm_and_says_what_was_lost(tmp_path):
    """A rank blocked in a collective never checkpoints: after --kill-after it gets SIGKILL, and the launcher says
    which rank, after how long, and how many steps since the last checkpoint are lost (journal + last-stop.json)."""
    body = (
        WRITE
        + """
import subprocess
worker = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"],
    env={"RANK": "1"}, start_new_session=True)
write(phase="training", step=57, last_checkpoint_step=50)
worker.wait()
sys.exit(1)
"""
    )
    rc, err = run_launch(tmp_path, body, signal_after=0.5, launch_args=["--kill-after", "1"])
    report = json.loads((tmp_path / "last-stop.json").read_text())
    assert report["signal"] == "SIGTERM" and report["killed"][0]["rank"] == "1" and report["steps_lost"] == 7
    assert "workers ignored SIGTERM for" in err and "rank 1 (pid" in err and "7 step(s)" in err
    assert rc != 0  # not a clean stop: the unit says so


@pytest.mark.parametrize(("kind", "want"), [("oom", 3), ("config", 2), ("crash", 1)])
def test_launch_maps_trainer_errors_to_exit_codes(tmp_path, kind, want):
    body = (
        WRITE
        + f"""
write(phase="failed", error={{"kind": "{kind}", "message": "x"}})
sys.exit(1)
"""
    )
    rc, _ = run_launch(tmp_path, body)
    assert rc == want


def test_launch_ignores_a_previous_runs_status(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"phase": "stopped", "updated": 1.0}))
    rc, _ = run_launch(tmp_path, "import sys; sys.exit(1)\n")
    assert rc == 1


# --- the trainer package ---------------------------------------------------------------------------------


def test_trainer_package_is_reproducible(tmp_path):
    pack = load(ROOT / "roles" / "eagle3_train" / "files" / "pack_trainer.py", "pack_trainer")
    a = pack.pack(str(ROOT / "training"), str(tmp_path / "a.tar"))
    time.sleep(0.01)
    b = pack.pack(str(ROOT / "training"), str(tmp_path / "b.tar"))
    assert a == b and (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    with tarfile.open(tmp_path / "a.tar") as tar:
        names = tar.getnames()
    assert "eagle3/__main__.py" in names and not any("__pycache__" in n for n in names)


def test_a_run_started_before_the_check_must_advance_to_count_as_healthy(fake_systemd, tmp_path, capsys):
    # The unit started 1 s after boot, long before this check; its status shows many steps already done.
    show = (
        (fake_systemd / "show")
        .read_text()
        .replace("ExecMainStartTimestampMonotonic=0", "ExecMainStartTimestampMonotonic=1000000")
    )
    (fake_systemd / "show").write_text(show)
    (tmp_path / "status.json").write_text(json.dumps(status(step=500, updated=time.time())))
    res, rc = run_module("train_health", {"run_dir": str(tmp_path), "timeout": 2, "poll_interval": 0.2}, capsys)
    assert rc == 1 and res["verdict"] == "timeout" and "waiting to see it pass step 500" in res["msg"]

    # The same run, seen to complete a step during the wait: healthy.
    def advance():
        time.sleep(0.6)
        (tmp_path / "status.json").write_text(json.dumps(status(step=501, updated=time.time())))

    threading.Thread(target=advance).start()
    (tmp_path / "status.json").write_text(json.dumps(status(step=500, updated=time.time())))
    res, rc = run_module("train_health", {"run_dir": str(tmp_path), "timeout": 10, "poll_interval": 0.2}, capsys)
    assert rc == 0 and res["verdict"] == "healthy" and res["status"]["step"] == 501


@pytest.mark.slow
def test_a_rescue_that_fails_again_with_the_same_message_does_not_print_it_twice(tmp_path):
    """The eagle3 callback: train.yml's rescue re-fails with the refusal it caught (adding the multi-node note);
    the message shows once, the second failure says `the error above` and what it adds."""
    play = tmp_path / "play.yml"
    play.write_text(
        """
- hosts: localhost
  gather_facts: false
  tasks:
    - block:
        - ansible.builtin.fail:
            msg: max_seq_len=32768 does not fit in 2.25 GiB; Nothing was changed.
      rescue:
        - ansible.builtin.fail:
            msg: "{{ ansible_failed_result.msg }} (this node was stopped)"
"""
    )
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "false"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", str(play)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count("does not fit") == 1, proc.stdout
    assert "the error above (this node was stopped)" in proc.stdout, proc.stdout
