"""library/gpu_cleanup.py main(), the ansible-core way, against real processes and stand-in devices.

Each failure mode of the manual one-liner (`ps aux | grep python3 | ... | xargs kill -9; fuser -k /dev/nvidia*`)
has a story here: an unrelated python3 survives, the module's own python3 survives, a job that honours
SIGTERM stops with TERM alone, and orphaned workers that hold devices are found.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible.module_utils import proc_stop as module_proc_stop
from ansible.module_utils.testing import patch_module_args
from helpers import jobs as job_fixtures

MARKER = job_fixtures.MARKER
jobs = job_fixtures.jobs  # pytest fixtures: started helpers are reaped by identity
devices = job_fixtures.devices


ROOT = Path(__file__).resolve().parent.parent
FAKEBIN = Path(__file__).resolve().parent / "fakebin"
RESULT_KEYS = {
    "changed",
    "targets",
    "protected",
    "terminated",
    "killed",
    "unkillable",
    "zombies",
    "rounds",
    "holders_after",
    "protected_holders_after",
    "respawned",
    "respawn_window",
    "removed",
    "sweep_in_use",
    "sweep_kept",
    "sweep_errors",
    "unit",
    "gpu_memory",
    "elapsed",
    "msg",
}


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_cleanup_module", ROOT / "library" / "gpu_cleanup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_cleanup = load_module()


@pytest.fixture
def args(devices, leftovers):
    """Options that point only at this test's stand-ins (never the real /dev/nvidia*; in /dev/shm only names that
    carry this test's token)."""
    return {
        "marker": MARKER,
        "devices": devices.globs,
        "sweep": leftovers.globs,
        "term_timeout": 3,
        "kill_timeout": 3,
        "timeout": 20,
        "respawn_window": 1,  # the default 5 s, shorter: these helpers come back at once or never
    }


def run(args: dict, capsys, check_mode: bool = False) -> dict:
    with patch_module_args(dict(args, _ansible_check_mode=check_mode)), pytest.raises(SystemExit):
        gpu_cleanup.main()
    return json.loads(capsys.readouterr().out)


def pids(entries) -> set[int]:
    return {e["pid"] if isinstance(e, dict) else e for e in entries}


def test_clean_system_twice_is_unchanged_with_the_same_keys(args, capsys):
    first = run(args, capsys)
    second = run(args, capsys)
    assert first["changed"] is False and second["changed"] is False
    assert set(first) == set(second) == RESULT_KEYS
    assert first["targets"] == [] and first["holders_after"] == []
    assert first["gpu_memory"]["status"] == "unverified"  # no NVML, no nvidia-smi here: never "ok"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"no_such_option": 1}, "no_such_option"),
        ({"term_timeout": 0}, "term_timeout=0 must be a positive number"),
        ({"kill_timeout": -5}, "kill_timeout=-5 must be a positive number"),
        ({"timeout": -1}, "timeout=-1 must be a positive number"),
        ({"marker": "EAGLE3_JOB"}, "marker 'EAGLE3_JOB' is not NAME=VALUE"),
        ({"marker": "=x"}, "marker '=x' is not NAME=VALUE"),
        ({"match_cmdline": ["train("]}, "match_cmdline regex 'train(' is invalid"),
        ({"devices": ["dev/nvidia0"]}, "'dev/nvidia0' must be absolute"),
    ],
)
def test_bad_input_fails_before_any_signal(jobs, devices, args, capsys, bad, message):
    job = jobs.start("--hold", devices["nvidia0"])
    out = run(dict(args, **bad), capsys)
    assert out["failed"] is True
    assert message in out["msg"]
    assert job.alive()


def test_unrelated_python3_and_lookalike_survive(jobs, devices, args, capsys):
    job = jobs.start("--hold", devices["nvidia0"])
    unrelated = jobs.start(marker=None)  # a python3 the one-liner would have killed
    lookalike = jobs.start("--name", "python3", marker="EAGLE3_JOB=other-job")
    out = run(args, capsys)
    assert out["changed"] is True and not out.get("failed")
    assert pids(out["targets"]) == {job.pid()}
    assert not job.alive()
    assert unrelated.alive() and lookalike.alive()


def test_module_own_python3_its_ancestors_and_process_group_survive(jobs, devices, args, tmp_path):
    # The module runs under the marker, holds a device, and shares its process group with a marked
    # sibling; its parent shell carries the marker too.  A separate job is the only thing to stop.
    job = jobs.start("--hold", devices["nvidia1"])
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    sibling_pids = tmp_path / "sibling.pids"
    script = (
        f"{sys.executable} {ROOT}/tests/helpers/holder.py --hold {devices['nvidia0']} --pidfile {sibling_pids}"
        f" --ready {tmp_path}/sibling.ready & "
        f"while [ ! -e {tmp_path}/sibling.ready ]; do sleep 0.01; done; "
        f"exec 7<>{devices['nvidia1']}; "  # the shell (the module's parent) holds a device as well
        f"{sys.executable} {ROOT}/tests/helpers/run_module.py gpu_cleanup {args_file}; "
        f"kill $!; wait"
    )
    env = dict(os.environ, EAGLE3_JOB=MARKER.split("=")[1])
    shell = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    out = json.loads(shell.stdout)
    sibling = int(sibling_pids.read_text().split()[1])
    assert pids(out["targets"]) == {job.pid()}
    assert not job.alive()
    why = {p["pid"]: p["why"] for p in out["protected"]}
    assert why[sibling] == "in this module's process group"
    assert "ancestor of this module" in why.values()
    assert "this module" in why.values()
    # The module's process group was protected, so its own holders remain: reported, and the task fails.
    assert out["failed"] is True and sibling in pids(out["holders_after"])


def test_term_honouring_job_stops_with_term_alone(jobs, devices, args, capsys, tmp_path):
    job = jobs.start("--hold", devices["nvidia0"], "--on-term-write", str(tmp_path / "ckpt"))
    out = run(dict(args, term_timeout=60, timeout=120), capsys)
    assert out["terminated"] == [job.pid()] and out["killed"] == []
    assert (tmp_path / f"ckpt.main.{job.pid()}").exists()
    assert out["elapsed"] < 20  # polled, not slept for term_timeout (60 s)


def test_torchrun_like_tree_stops_through_the_agent(jobs, devices, args, capsys, tmp_path):
    tree = jobs.start(
        "--workers",
        "2",
        "--grandchild",
        "--forward-term",
        "--agent-name",
        "pt_elastic",
        "--hold",
        devices["nvidia0"],
        "--on-term-write",
        str(tmp_path / "ckpt"),
        expect=5,
    )
    out = run(args, capsys)
    assert not out.get("failed"), out["msg"]
    assert pids(out["targets"]) == {tree.pid(r) for r in tree.roles}
    for role in ("worker0", "worker1"):
        assert (tmp_path / f"ckpt.{role}.{tree.pid(role)}").exists()
    assert not any(tree.alive(r) for r in tree.roles)
    assert out["holders_after"] == []


def test_orphaned_workers_holding_devices_are_found(jobs, devices, args, capsys):
    # The agent was SIGKILLed: workers are orphans in their own sessions, found by the devices they hold
    # (no marker given: parent-tree walking from the agent would find nothing).
    tree = jobs.start("--workers", "2", "--hold", devices["nvidia1"], "--map-only", expect=3, marker=None)
    os.kill(tree.pid("agent"), signal.SIGKILL)
    tree.popen.wait(timeout=5)
    out = run(dict(args, marker=None), capsys)
    assert pids(out["targets"]) == {tree.pid("worker0"), tree.pid("worker1")}
    assert all(r == [f"device:{devices['nvidia1']}"] for r in (t["reasons"] for t in out["targets"]))
    assert not tree.alive("worker0") and not tree.alive("worker1")


def test_double_forked_orphan_with_marker_and_renamed_worker(jobs, devices, args, capsys):
    orphan = jobs.start("--double-fork", "--name", "pt_data_worker", expect=2)
    out = run(dict(args, devices=[]), capsys)
    assert pids(out["targets"]) == {orphan.pid("main")}
    assert out["targets"][0]["name"] == "pt_data_worker"
    assert not orphan.alive("main")


def test_term_ignoring_job_is_killed_after_term_timeout(jobs, devices, args, capsys):
    job = jobs.start("--hold", devices["nvidia0"], "--ignore-term")
    out = run(dict(args, term_timeout=1, timeout=60), capsys)
    assert out["killed"] == [job.pid()] and out["terminated"] == []
    assert 1.0 <= out["elapsed"] < 20  # KILL after the 1 s grace, long before the 60 s budget


def test_protected_holder_is_never_signalled(jobs, devices, args, capsys):
    guard = jobs.start("--hold", devices["nvidia0"], "--name", "nvidia-persistenced", marker=None)
    out = run(args, capsys)
    assert guard.alive()
    assert out["targets"] == [] and out["changed"] is False and not out.get("failed")
    assert pids(out["protected"]) == {guard.pid()}
    # It still holds the device: reported as a protected holder, never as "0 held".
    assert out["holders_after"] == [] and pids(out["protected_holders_after"]) == {guard.pid()}
    assert out["protected_holders_after"][0]["paths"] == [devices["nvidia0"]]
    assert "still held by protected: pid" in out["msg"]


def test_zombie_is_reported_and_does_not_hang(jobs, devices, args, capsys):
    job = jobs.start("--hold", devices["nvidia0"], "--zombie", "--ignore-term", expect=2)
    out = run(dict(args, term_timeout=0.5, timeout=60), capsys)
    assert out["elapsed"] < 20  # a zombie never counts as a survivor to wait for (budget 60 s)
    assert job.pid("zombie") in pids(out["zombies"])
    assert not out.get("failed")


def test_check_mode_touches_nothing(jobs, devices, args, capsys, leftovers):
    job = jobs.start("--hold", devices["nvidia0"])
    stale = leftovers.shm("nccl", "stale")
    stale.write_text("x")
    out = run(args, capsys, check_mode=True)
    assert out["changed"] is True
    assert pids(out["targets"]) == {job.pid()} and out["removed"] == [str(stale)]
    assert job.alive() and stale.exists()


def test_sweep_removes_only_unreferenced_files(jobs, devices, args, capsys, leftovers):
    stale, inuse = leftovers.shm("nccl", "stale"), leftovers.shm("torch", "inuse")
    stale.write_bytes(b"\0" * 4096)
    inuse.write_bytes(b"\0" * 4096)
    canary = jobs.start("--hold", str(inuse), "--map-only", marker=None)
    out = run(args, capsys)
    assert out["removed"] == [str(stale)] and out["sweep_in_use"] == [str(inuse)]
    assert out["changed"] is True and canary.alive()
    assert run(args, capsys)["changed"] is False


def test_total_budget_is_respected(jobs, devices, args, capsys):
    job = jobs.start("--hold", devices["nvidia0"], "--ignore-term")
    out = run(dict(args, term_timeout=60, kill_timeout=30, timeout=2), capsys)
    assert out["elapsed"] < 15  # the 2 s budget cut the 60 s grace short
    assert out["killed"] == [job.pid()]


def test_unkillable_process_fails_with_list_and_hint(jobs, devices, args, capsys, monkeypatch):
    # Stand-in for a process in D state: SIGKILL never reaches it (dropped here), and its state reads D.
    job = jobs.start("--hold", devices["nvidia0"], "--ignore-term", "--name", "pt_stuck")
    stuck = job.roles["main"]
    real_send, real_describe = module_proc_stop.send_signal, module_proc_stop.describe

    def send(identity, sig, proc="/proc"):
        return "sent" if identity == stuck and sig == signal.SIGKILL else real_send(identity, sig, proc)

    def describe(identity, proc="/proc"):
        return dict(real_describe(identity, proc), state="D", wchan="nv_wait_event")

    monkeypatch.setattr(module_proc_stop, "send_signal", send)
    monkeypatch.setattr(module_proc_stop, "describe", describe)
    out = run(dict(args, term_timeout=0.3, kill_timeout=0.3, timeout=5), capsys)
    assert out["failed"] is True and out["elapsed"] < 30  # gives up at the budget, never hangs
    assert out["unkillable"] == [{"pid": job.pid(), "name": "pt_stuck", "state": "D", "wchan": "nv_wait_event"}]
    assert f"pid={job.pid()} name=pt_stuck state=D wchan=nv_wait_event" in out["msg"]
    assert "no signal from inside the container helps" in out["msg"] and "Proxmox node" in out["msg"]
    assert job.alive()  # reported, not hidden


@pytest.fixture
def fake_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{FAKEBIN}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_STATE", str(tmp_path / "smi.calls"))

    def mode(value: str) -> None:
        monkeypatch.setenv("FAKE_SMI_MODE", value)

    return mode


def test_gpu_memory_released_slowly_is_polled_until_free(jobs, devices, args, capsys, fake_smi, tmp_path):
    fake_smi("release:3")  # before + two readings still high, then released
    jobs.start("--hold", devices["nvidia0"])
    out = run(args, capsys)
    assert not out.get("failed"), out["msg"]
    assert out["gpu_memory"]["status"] == "ok"
    assert out["gpu_memory"]["before"] == [{"index": 0, "used_mib": 3.0}, {"index": 1, "used_mib": 40754.0}]
    assert out["gpu_memory"]["after"] == [{"index": 0, "used_mib": 3.0}, {"index": 1, "used_mib": 3.0}]
    assert int((tmp_path / "smi.calls").read_text()) >= 4


def test_gpu_memory_that_stays_high_fails(jobs, devices, args, capsys, fake_smi):
    fake_smi("busy")
    jobs.start("--hold", devices["nvidia0"])
    out = run(dict(args, kill_timeout=1), capsys)
    assert out.get("failed") is True and out["gpu_memory"]["status"] == "failed", out["gpu_memory"]["message"]
    assert "GPU 1: 40754.0 MiB" in out["msg"]


def test_hanging_nvidia_smi_is_unverified_not_success(jobs, devices, args, capsys, fake_smi):
    fake_smi("hang")
    job = jobs.start("--hold", devices["nvidia0"])
    started = time.monotonic()
    out = run(dict(args, timeout=10), capsys)
    assert time.monotonic() - started < 30  # the fake nvidia-smi never answers: cut off, not waited for
    assert not job.alive() and not out.get("failed")
    assert out["gpu_memory"]["status"] == "unverified"
    assert "timed out after 1 s" in out["gpu_memory"]["message"]


def test_doctests():
    import doctest

    assert doctest.testmod(gpu_cleanup).failed == 0


@pytest.mark.parametrize("written_during_the_stop", [True, False])
def test_a_stop_that_escalated_is_named_in_the_summary(args, capsys, tmp_path, monkeypatch, written_during_the_stop):
    """The job's launcher writes last-stop.json when it had to SIGKILL a worker; a report from an earlier stop is
    not news."""
    report = tmp_path / "last-stop.json"
    message = "workers ignored SIGTERM for 60 s: rank 1 (pid 4242) got SIGKILL; 3 step(s) since the last checkpoint"

    def stop_unit(unit, timeout):
        when = time.time() if written_during_the_stop else time.time() - 3600
        report.write_text(json.dumps({"message": message, "time": when}))
        return {"state": "active", "stopped": True, "message": f"stopped {unit} (was active)"}

    monkeypatch.setattr(gpu_cleanup.proc_stop, "stop_unit", stop_unit)
    out = run(dict(args, unit="eagle3-test.service", stop_report=str(report)), capsys)
    assert "failed" not in out, out["msg"]
    if written_during_the_stop:
        assert out["unit"]["escalation"]["message"] == message
        assert f"(the stop escalated: {message})" in out["msg"]
    else:
        assert out["unit"]["escalation"] is None and "escalated" not in out["msg"]


def test_a_holder_that_comes_back_is_named_with_what_starts_it_and_the_cleanup_fails(jobs, devices, args, capsys):
    # A supervisor (not part of the job: no marker, holds nothing) restarts its GPU-holding worker a second after
    # each kill, as a `while true` loop or a Restart=always service would.
    job = jobs.start(
        "--workers",
        "1",
        "--hold",
        devices["nvidia0"],
        "--respawn",
        "50",
        "--respawn-delay",
        "1",
        "--agent-name",
        "gpu-hogd",
        marker=None,
        expect=1,
    )
    first = job.pid("worker0")
    out = run({**args, "respawn_window": 4}, capsys)
    assert out["failed"], out
    assert first in pids(out["targets"])
    (back,) = out["respawned"]
    assert back["pid"] != first and back["paths"] == [devices["nvidia0"]]
    assert back["parents"][0]["pid"] == job.pid("agent") and back["parents"][0]["name"] == "gpu-hogd"
    msg = out["msg"]
    assert "a GPU holder came back within 4 s of the cleanup" in msg
    assert f"started by its parent pid {job.pid('agent')} gpu-hogd" in msg and "the GPUs were not called free" in msg
    assert job.alive("agent")  # what starts it is named, never signalled: it is not the job's


def test_a_holder_that_stays_dead_passes_the_respawn_watch(jobs, devices, args, capsys):
    job = jobs.start("--hold", devices["nvidia0"], marker=None)
    out = run({**args, "respawn_window": 1}, capsys)
    assert not out.get("failed"), out["msg"]
    assert out["respawned"] == [] and pids(out["killed"]) | pids(out["terminated"]) == {job.pid()}
