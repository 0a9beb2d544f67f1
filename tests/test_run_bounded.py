"""Every external call of the modules is bounded: a hanging stand-in binary is cut off with 'timed out after N s'.

The stand-ins are shell scripts in tmp_path that record their pid (and their helper's) and then hang. Each test
reaps what its stand-ins started: only those identities (pid + start time) are ever signalled, and only when a
check failed and left them running.
"""

from __future__ import annotations

import doctest
import os
import signal
import stat
import time

import pytest
from helpers.fixture_state import running
from pve_fixtures import ROOT, load_file_module, run_module

from module_utils import nvml, pve_session, run_bounded

userspace = load_file_module(
    "nvidia_userspace_facts_bounded", ROOT / "roles/gpu_userspace/library/nvidia_userspace_facts.py"
)
local_lxc = load_file_module("local_lxc_bounded", ROOT / "library" / "local_lxc.py")


def start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


@pytest.fixture
def hanging(tmp_path):
    """hanging(name) -> path of a stand-in `name` that records its pid and its helper's, then hangs.

    The stand-in starts a helper (`sleep 300`) that holds its output pipes, as a wrapper script or a forked
    tool would, and waits for it. Teardown SIGKILLs whichever recorded identity is still running, and reaps.
    """
    recorded = []
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def make(name, sleep=300):
        pids = tmp_path / f"{name}.pids"
        path = bindir / name
        path.write_text(f"#!/bin/sh\necho $$ >> {pids}\nsleep {sleep} &\necho $! >> {pids}\nwait\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        recorded.append(pids)
        return str(path)

    make.bindir = bindir
    make.pids = lambda name: [int(p) for p in (tmp_path / f"{name}.pids").read_text().split()]
    yield make
    for pids in recorded:
        if not pids.exists():
            continue
        for pid in map(int, pids.read_text().split()):
            try:
                ident = start_time(pid)
            except OSError:
                continue
            if running(pid, ident):
                os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)  # our child (the stand-in itself): reap it
            except ChildProcessError:
                pass  # the helper: init (or the subreaper) reaps it


def wait_for_pids(hanging, name, count=2):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if len(hanging.pids(name)) >= count:
                return hanging.pids(name)
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"the {name} stand-in never started")


def gone(pid, timeout=5.0):
    """True once pid is no longer a running process (exited, zombie or reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_docstring_examples_hold():
    assert doctest.testmod(run_bounded).failed == 0


# ----------------------------------------------------------------- nvidia-smi (module_utils/nvml)


def test_hanging_nvidia_smi_times_out_and_leaves_no_process_behind(hanging):
    smi = hanging("nvidia-smi")
    began = time.monotonic()
    out = nvml.query_gpus(timeout=0.5, smi=smi, pynvml=None)
    assert time.monotonic() - began < 15
    assert out["gpus"] == [] and f"{smi} timed out after 0.5 s" in out["error"], out
    stand_in, helper = hanging.pids("nvidia-smi")
    # subprocess.run's timeout killed only the script; its helper kept running (and holding the pipes).
    assert gone(stand_in) and gone(helper), "the hung nvidia-smi (or what it started) was left running"


@pytest.mark.slow
def test_nvidia_smi_that_survives_sigkill_is_left_behind_within_a_bound(hanging, monkeypatch):
    """A tool stuck in the kernel (D state after an Xid) does not die on SIGKILL: the wait for it must end too.

    SIGKILL cannot be ignored, so the stand-in 'survives' it by the signal never being sent.
    """
    smi = hanging("nvidia-smi", sleep=40)
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    began = time.monotonic()
    out = nvml.query_gpus(timeout=0.5, smi=smi, pynvml=None)
    elapsed = time.monotonic() - began
    monkeypatch.undo()
    assert elapsed < 20, f"waited {elapsed:.0f} s for a process that cannot die"
    stand_in, _ = hanging.pids("nvidia-smi")
    assert "timed out after 0.5 s" in out["error"] and "after SIGKILL" in out["error"], out
    assert f"pid {stand_in}" in out["error"]


# ----------------------------------------------------------------- nvidia-smi (gpu_userspace facts)


def test_userspace_facts_cut_off_a_hanging_nvidia_smi(hanging, capsys):
    smi = hanging("nvidia-smi")
    began = time.monotonic()
    facts = run_module(userspace, dict(nvidia_smi=smi, timeout=1, lib_dirs=[]), capsys)["ansible_facts"]
    assert time.monotonic() - began < 15
    assert "nvidia-smi timed out after 1 s" in facts["gpu_userspace_smi_error"]
    assert all(gone(pid) for pid in hanging.pids("nvidia-smi"))


# ----------------------------------------------------------------- lxc-* (library/local_lxc)


class FailJson(Exception):
    pass


class FakeModule:
    params = {"lxcpath": "/nonexistent", "name": "129"}

    def fail_json(self, msg, **kwargs):
        raise FailJson(msg)


def test_local_lxc_cuts_off_a_hanging_lxc_command(hanging, monkeypatch):
    hanging("lxc-info")
    monkeypatch.setenv("PATH", f"{hanging.bindir}:{os.environ['PATH']}")
    began = time.monotonic()
    with pytest.raises(FailJson, match=r"lxc-info -P /nonexistent -n 129 -sH timed out after 1 s"):
        local_lxc.lxc(FakeModule(), "lxc-info", "-sH", timeout=1)
    assert time.monotonic() - began < 15
    assert all(gone(pid) for pid in hanging.pids("lxc-info"))


# ----------------------------------------------------------------- pvesh (proxmoxer's local backend)


def test_hanging_pvesh_read_fails_as_a_pve_error_and_is_killed(hanging, monkeypatch):
    hanging("pvesh")
    monkeypatch.setenv("PATH", f"{hanging.bindir}:{os.environ['PATH']}")
    began = time.monotonic()
    with pytest.raises(pve_session.PveError, match=r"pvesh get /version timed out after 1 s"):
        pve_session.connect({"api_backend": "local", "timeout": 1})
    assert time.monotonic() - began < 15
    assert all(gone(pid) for pid in hanging.pids("pvesh"))


def test_a_pvesh_task_that_overruns_is_left_running_not_cut_off(hanging, monkeypatch, tmp_path):
    # GET /version answers at once; the create (a PVE task pvesh runs in the foreground) hangs.
    pvesh = hanging.bindir / "pvesh"
    hanging("pvesh-task")
    pvesh.write_text(
        '#!/bin/sh\nif [ "$1" = get ]; then echo \'{"version": "9.0.10"}\'; exit 0; fi\n'
        f"exec {hanging.bindir / 'pvesh-task'}\n"
    )
    pvesh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{hanging.bindir}:{os.environ['PATH']}")
    api, version = pve_session.connect({"api_backend": "local", "timeout": 1, "task_timeout": 1})
    assert version == "9.0.10"
    with pytest.raises(pve_session.PveError, match=r"pvesh create /nodes/pve1/lxc timed out after 1 s; left") as exc:
        api.nodes("pve1").lxc.post(vmid=129, ostemplate="local:vztmpl/x.tar.zst", password="never-shown")
    assert "never-shown" not in str(exc.value)
    stand_in, helper = wait_for_pids(hanging, "pvesh-task")
    assert not gone(stand_in, timeout=0.2) and not gone(helper, timeout=0.2), "a running PVE task was cut off"
