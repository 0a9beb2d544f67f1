"""module_utils/procs.py against real processes holding stand-in GPU device files."""

from __future__ import annotations

import doctest
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import jobs as job_fixtures

from module_utils import job_files, proc_stop, procs

MARKER = job_fixtures.MARKER
jobs = job_fixtures.jobs  # pytest fixtures: started helpers are reaped by identity
devices = job_fixtures.devices


FAST = proc_stop.Budget(term=3, kill=3, stop=1, total=20)


def test_docstring_examples_hold():
    assert doctest.testmod(procs).failed == 0


def sel(devices=None, **kw) -> procs.Selectors:
    kw.setdefault("protect", ["nvidia-persistenced", "sshd", "systemd*"])
    return procs.Selectors(devices=devices.globs if devices else [], **kw)


def target_pids(selectors) -> dict[int, list[str]]:
    targets, _, _ = procs.select_targets(selectors)
    return {t.proc.pid: t.reasons for t in targets}


def test_device_held_as_fd_or_only_as_map_is_found(jobs, devices):
    by_fd = jobs.start("--hold", devices["nvidia0"], marker=None)
    by_map = jobs.start("--hold", devices["nvidia1"], "--map-only", marker=None)
    canary = jobs.start(marker=None)
    assert procs.device_paths(by_fd.pid(), devices.globs) == [devices["nvidia0"]]
    assert procs.device_paths(by_map.pid(), devices.globs) == [devices["nvidia1"]]
    found = target_pids(sel(devices))
    assert found[by_fd.pid()] == [f"device:{devices['nvidia0']}"]
    assert found[by_map.pid()] == [f"device:{devices['nvidia1']}"]
    assert canary.pid() not in found


def test_marker_selects_only_marked_processes(jobs):
    marked = jobs.start()
    lookalike = jobs.start("--name", "python3", marker="EAGLE3_JOB=something-else")
    found = target_pids(sel(marker=MARKER))
    assert found[marked.pid()] == [f"marker:{MARKER}"]
    assert lookalike.pid() not in found


def test_match_cmdline_is_opt_in(jobs):
    job = jobs.start("--name", "eagle3-unique-token", marker=None)
    assert job.pid() not in target_pids(sel())
    found = target_pids(sel(match_cmdline=[re.compile(r"holder\.py")]))
    assert job.pid() in found


@pytest.mark.parametrize("hierarchy", ["systemd", "unified"])
def test_unit_cgroup_members_v1_and_v2(jobs, hierarchy):
    base = Path("/sys/fs/cgroup") / hierarchy
    if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
        pytest.skip(f"cannot create cgroups under {base}")
    unit = f"eagle3-test-{uuid.uuid4().hex[:8]}.service"
    group = base / "e3test.slice" / unit / "payload"
    group.mkdir(parents=True)
    try:
        # Only the agent is moved into the unit: its workers (own sessions) and their children are
        # found as its descendants, as leftovers of a KillMode=process unit would be.
        tree = jobs.start("--workers", "2", "--grandchild", expect=5, marker=None)
        outsider = jobs.start(marker=None)
        (group / "cgroup.procs").write_text(str(tree.pid("agent")))
        assert procs.in_unit_cgroup(procs.read_cgroup(tree.pid("agent")), unit)
        found = target_pids(sel(unit=unit))
        assert found[tree.pid("agent")] == [f"unit:{unit}"]
        for role in ("worker0", "worker1", "grandchild0", "grandchild1"):
            assert found[tree.pid(role)] == [f"descendant-of:{tree.pid('agent')}"]
        assert outsider.pid() not in found
    finally:
        jobs.reap()
        for d in (group, group.parent, group.parent.parent):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)  # the last member is still being released


def test_descendants_of_a_target_are_targets_but_protected_names_are_not(jobs, devices):
    tree = jobs.start("--workers", "2", "--grandchild", "--agent-name", "pt_elastic", expect=5, marker=None)
    guard = jobs.start("--hold", devices["nvidia0"], "--name", "nvidia-persistenced", marker=None)
    found = target_pids(sel(devices, match_cmdline=[re.compile(r"--agent-name pt_elastic")]))
    assert found[tree.pid("agent")] == ["cmdline:--agent-name pt_elastic"]
    assert {tree.pid(r) for r in ("worker0", "worker1", "grandchild0", "grandchild1")} <= set(found)
    _, protected, _ = procs.select_targets(sel(devices))
    assert guard.pid() not in found
    assert {"pid": guard.pid(), "why": "protected name"}.items() <= next(
        p for p in protected if p["pid"] == guard.pid()
    ).items()


def test_never_touches_self_ancestors_or_own_process_group(jobs):
    same_group = jobs.start(new_session=False)  # in pytest's process group, like the module's own
    procs_now = procs.scan()
    never = procs.untouchable(procs_now)
    assert never[os.getpid()] == "this module"
    assert all(never.get(a) for a in procs.ancestors(os.getpid(), procs_now))
    assert same_group.pid() in never and 1 in never
    targets, protected, _ = procs.select_targets(sel(marker=MARKER))
    assert same_group.pid() not in {t.proc.pid for t in targets}
    assert same_group.pid() in {p["pid"] for p in protected}


def test_send_signal_refuses_a_reused_pid(jobs):
    job = jobs.start(marker=None)
    pid, start = job.roles["main"]
    assert proc_stop.send_signal((pid, start + 1), signal.SIGKILL) == "reused"
    assert job.alive()
    with pytest.raises(ValueError, match="refusing to signal pid 1"):
        proc_stop.send_signal((1, 0), signal.SIGTERM)
    assert proc_stop.send_signal((pid, start), signal.SIGKILL) == "sent"
    job.popen.wait(timeout=5)
    assert proc_stop.send_signal((pid, start), signal.SIGKILL) == "gone"


def test_term_honouring_job_stops_with_term_alone_and_saves(jobs, devices, tmp_path):
    job = jobs.start("--hold", devices["nvidia0"], "--on-term-write", str(tmp_path / "ckpt"))
    started = time.monotonic()
    out = proc_stop.terminate(sel(devices, marker=MARKER), proc_stop.Budget(term=60, kill=3, stop=1, total=120))
    assert time.monotonic() - started < 20  # polled, not slept for the 60 s grace
    assert out["terminated"] == [job.pid()] and out["killed"] == [] and out["unkillable"] == []
    assert (tmp_path / f"ckpt.main.{job.pid()}").read_text() == "checkpoint\n"


def test_term_ignoring_job_is_killed_after_the_grace_period(jobs, devices):
    job = jobs.start("--hold", devices["nvidia1"], "--ignore-term")
    started = time.monotonic()
    out = proc_stop.terminate(sel(devices), proc_stop.Budget(term=1, kill=3, total=20))
    elapsed = time.monotonic() - started
    assert out["killed"] == [job.pid()] and out["terminated"] == []
    assert 1.0 <= elapsed < 15  # KILL after the 1 s grace, long before the 20 s budget
    assert not job.alive()


def test_respawned_workers_are_caught_by_the_rescan(jobs, devices):
    # An agent that ignores TERM and restarts dead workers, like torchrun with --max-restarts.
    tree = jobs.start("--workers", "2", "--respawn", "6", "--ignore-term", "--hold", devices["nvidia0"], expect=3)
    out = proc_stop.terminate(sel(devices, marker=MARKER), proc_stop.Budget(term=0.3, kill=3, total=20))
    assert out["unkillable"] == []
    assert not tree.alive("agent")
    for pid, start in tree.all_identities():
        assert not _running(pid, start)
    assert procs.holders(devices.globs) == []


def _running(pid, start):
    return proc_stop.is_running((pid, start))


def test_zombie_is_reported_without_hanging(jobs, devices):
    job = jobs.start("--hold", devices["nvidia0"], "--zombie", "--ignore-term", expect=2)
    zombie = job.pid("zombie")
    started = time.monotonic()
    out = proc_stop.terminate(sel(devices), proc_stop.Budget(term=0.5, kill=3, total=60))
    assert time.monotonic() - started < 20  # the zombie is not waited for (budget 60 s)
    assert out["killed"] == [job.pid()]
    assert zombie in {z["pid"] for z in out["zombies"]}
    assert zombie not in {t["pid"] for t in out["targets"]}


def test_check_mode_signals_nothing(jobs, devices):
    job = jobs.start("--hold", devices["nvidia0"])
    out = proc_stop.terminate(sel(devices), FAST, check_mode=True)
    assert [t["pid"] for t in out["targets"]] == [job.pid()]
    assert out["terminated"] == out["killed"] == []
    assert job.alive()


def test_sweep_keeps_files_a_live_process_still_uses(jobs, leftovers):
    stale, mapped = leftovers.shm("nccl", "stale"), leftovers.shm("nccl", "mapped")
    stale.write_bytes(b"\0" * 4096)
    mapped.write_bytes(b"\0" * 4096)
    live, old = leftovers.tmp("live"), leftovers.tmp("old")
    (live / "attempt_0").mkdir(parents=True)
    (live / "attempt_0" / "error.json").write_bytes(b"\0" * 4096)
    old.mkdir()
    jobs.start("--hold", str(mapped), "--map-only", marker=None)
    jobs.start("--hold", str(live / "attempt_0" / "error.json"), marker=None)
    free, busy, kept = job_files.candidates(leftovers.globs, proc_stop.referenced_paths(procs.scan()))
    assert free == [str(stale), str(old)] and busy == [str(mapped), str(live)] and kept == []
    assert [job_files.remove(p) for p in free] == [None, None]
    assert not stale.exists() and not old.exists() and mapped.exists() and live.exists()


def test_bad_selectors_are_rejected_with_the_value():
    with pytest.raises(ValueError, match="marker 'EAGLE3_JOB' is not NAME=VALUE"):
        procs.parse_marker("EAGLE3_JOB")
    with pytest.raises(ValueError, match=r"regex '\(' is invalid"):
        procs.compile_patterns(["("])
    with pytest.raises(ValueError, match="term_timeout=-1 must be a positive"):
        proc_stop.check_timeouts({"term_timeout": -1})


FAKE_SYSTEMCTL = """#!/bin/sh
# fake systemctl: state in $STATE; 'stop' sleeps $STOP_DELAY then marks inactive
echo "$@" >> "$LOG"
case "$1" in
  show) echo "LoadState=$(cat "$LOAD")"; echo "ActiveState=$(cat "$STATE")";;
  # exec: a stop that overruns is one process, which subprocess's timeout kills (no orphaned sleep).
  stop) [ "$STOP_DELAY" = 0 ] && echo inactive > "$STATE" || exec sleep "$STOP_DELAY";;
esac
"""


@pytest.mark.parametrize(
    ("load", "state", "delay", "expect_state", "expect_stopped", "stop_called"),
    [
        ("loaded", "active", "0", "active", True, True),
        ("loaded", "inactive", "0", "inactive", False, False),
        ("not-found", "inactive", "0", "not-found", False, False),
        ("loaded", "active", "60", "active", False, True),  # overruns its bound: reported, not waited for
    ],
)
def test_stop_unit_through_systemctl(
    tmp_path, monkeypatch, load, state, delay, expect_state, expect_stopped, stop_called
):
    fake = tmp_path / "systemctl"
    fake.write_text(FAKE_SYSTEMCTL)
    fake.chmod(0o755)
    run_dir = tmp_path / "run-systemd"
    run_dir.mkdir()
    for name, value in (("LOAD", load), ("STATE", state)):
        (tmp_path / name).write_text(value)
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("STOP_DELAY", delay)
    monkeypatch.setenv("LOG", str(tmp_path / "log"))
    started = time.monotonic()
    out = proc_stop.stop_unit("eagle3-train.service", 1.0, systemctl=str(fake), run_dir=str(run_dir))
    assert time.monotonic() - started < 20  # bounded at 1 s, never the 60 s a hung stop takes
    assert (out["state"], out["stopped"]) == (expect_state, expect_stopped)
    assert ("stop eagle3-train.service" in (tmp_path / "log").read_text()) == stop_called
    no_systemd = proc_stop.stop_unit("eagle3-train.service", 1.0, systemctl=str(fake), run_dir=str(tmp_path / "none"))
    assert no_systemd["state"] == "no-systemd"


def run_guard(*args):
    script = Path(procs.__file__)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=30)


def test_prestart_guard_cli(jobs, devices):
    ok = run_guard("holders", "--devices", *devices.globs)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    holder = jobs.start("--hold", devices["nvidia0"], "--name", "pt_data_worker", marker=None)
    busy = run_guard("holders", "--devices", *devices.globs, "--exclude-cgroup-of-unit", "eagle3-train.service")
    assert busy.returncode == 1
    assert f"pid={holder.pid()} name=pt_data_worker paths={devices['nvidia0']}" in busy.stdout
    allowed = run_guard("holders", "--devices", *devices.globs, "--protect", "pt_data_*")
    assert allowed.returncode == 0
    assert run_guard("holders").returncode == 2
