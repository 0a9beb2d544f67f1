"""Raw lxc.* lines in /etc/pve/lxc/<vmid>.conf: the pure editor and the node-side module, on real files."""

from __future__ import annotations

import ctypes
import doctest
import os
import signal
import subprocess
import sys
import time

import ansible.module_utils.pve_auth as pve_auth
import ansible.module_utils.pve_conf as pve_conf
import ansible.module_utils.pve_ct as pve_ct
import ansible.module_utils.pve_errors as pve_errors
import ansible.module_utils.pve_restart as pve_restart
import ansible.module_utils.pve_rights as pve_rights
import ansible.module_utils.pve_session as pve_session
import ansible.module_utils.pve_spec as pve_spec
import ansible.module_utils.pve_tasks as pve_tasks
import pytest
from pve_fixtures import ROOT, load_file_module, run_module

pve_lxc_raw = load_file_module("pve_lxc_raw", ROOT / "library" / "pve_lxc_raw.py")

ALLOW = "lxc.cgroup2.devices.allow: c 195:* rwm"
MOUNT0 = "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"
MOUNT1 = "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file"

PLAIN = """arch: amd64
cores: 8
hostname: train129
memory: 16384
ostype: debian
rootfs: local-lvm:vm-129-disk-0,size=32G
unprivileged: 1
"""

WITH_SNAPSHOTS = """arch: amd64
cores: 8
lxc.cgroup2.devices.allow: c 195:* rwm
memory: 16384
parent: before-driver
rootfs: local-lvm:vm-129-disk-0,size=32G

[before-driver]
arch: amd64
cores: 8
lxc.mount.entry: /dev/nvidia9 dev/nvidia9 none bind,optional,create=file
memory: 8192
snaptime: 1733140000

[pve:pending]
memory: 32768
"""


# The API side of pve_lxc, one concern per file.
PVE_API = (pve_auth, pve_ct, pve_errors, pve_restart, pve_rights, pve_session, pve_spec, pve_tasks)


@pytest.mark.parametrize("modules", [PVE_API, (pve_conf,)], ids=["pve", "pve_conf"])
def test_docstring_examples_hold(modules):
    results = [doctest.testmod(module) for module in modules]
    failures, tried = sum(r.failed for r in results), sum(r.attempted for r in results)
    assert tried > 10 and failures == 0


def test_lines_are_added_to_a_file_without_sections_then_nothing_changes():
    once = pve_conf.edit_raw_lines(PLAIN, [ALLOW, MOUNT0])
    assert once == PLAIN + ALLOW + "\n" + MOUNT0 + "\n"
    assert pve_conf.edit_raw_lines(once, [ALLOW, MOUNT0]) == once


def test_lines_go_before_the_first_snapshot_and_snapshots_stay_as_they_were():
    out = pve_conf.edit_raw_lines(WITH_SNAPSHOTS, [ALLOW, MOUNT0])
    head, _, rest = out.partition("\n[before-driver]\n")
    # ALLOW was already there; MOUNT0 goes right after the last raw line of the current config.
    assert head.splitlines()[2:4] == [ALLOW, MOUNT0]
    assert head.count(ALLOW) == 1
    assert "[before-driver]\n" + rest == WITH_SNAPSHOTS.partition("\n\n")[2]
    assert pve_conf.edit_raw_lines(out, [ALLOW, MOUNT0]) == out


def test_a_line_only_in_a_snapshot_is_still_missing_from_the_current_config():
    snap_line = "lxc.mount.entry: /dev/nvidia9 dev/nvidia9 none bind,optional,create=file"
    out = pve_conf.edit_raw_lines(WITH_SNAPSHOTS, [snap_line])
    assert out.index(snap_line) < out.index("[before-driver]")
    assert out.count(snap_line) == 2


def test_exclusive_replaces_the_value_of_a_key_and_keeps_other_keys():
    conf = PLAIN + "lxc.hook.mount: /usr/share/lxc/hooks/old\n" + ALLOW + "\n"
    out = pve_conf.edit_raw_lines(conf, ["lxc.hook.mount: /usr/share/lxc/hooks/nvidia"], exclusive=True)
    assert "hooks/old" not in out and "lxc.hook.mount: /usr/share/lxc/hooks/nvidia\n" in out and ALLOW in out
    without = pve_conf.edit_raw_lines(conf, ["lxc.hook.mount: /usr/share/lxc/hooks/nvidia"])
    assert "hooks/old" in without, "without exclusive, a second value is added, the first kept"


def test_absent_removes_only_matching_lines_of_the_current_config():
    conf = pve_conf.edit_raw_lines(WITH_SNAPSHOTS, [MOUNT0, MOUNT1])
    out = pve_conf.edit_raw_lines(
        conf,
        [MOUNT0, "lxc.mount.entry: /dev/nvidia9 dev/nvidia9 none bind,optional,create=file"],
        state="absent",
    )
    head = out.partition("[before-driver]")[0]
    assert MOUNT0 not in out and MOUNT1 in head and "nvidia9" in out.partition("[before-driver]")[2]
    assert pve_conf.edit_raw_lines(out, [MOUNT0], state="absent") == out


def test_existing_spellings_are_recognised():
    conf = "arch: amd64\nlxc.cgroup2.devices.allow:c 195:* rwm\nlxc.odd\n"
    assert pve_conf.edit_raw_lines(conf, [ALLOW]) == conf
    assert pve_conf.edit_raw_lines("arch: amd64", [ALLOW]) == "arch: amd64\n" + ALLOW + "\n"


@pytest.mark.parametrize("line", ["memory: 4096", "dev0: /dev/nvidia0", "lxc.mount.entry:", "just text"])
def test_lines_that_are_not_raw_lxc_lines_are_refused(line):
    with pytest.raises(pve_conf.ConfError, match="lxc"):
        pve_conf.edit_raw_lines(PLAIN, [line])


# ----------------------------------------------------------------- the module, on files


def conf_dir(tmp_path, text):
    path = tmp_path / "129.conf"
    path.write_text(text)
    return path


def test_module_writes_in_place_and_is_idempotent(tmp_path, capsys):
    path = conf_dir(tmp_path, WITH_SNAPSHOTS)
    inode = os.stat(path).st_ino
    args = dict(vmid=129, lines=[ALLOW, MOUNT0], config_dir=str(tmp_path), lock_dir=str(tmp_path / "lock"))
    first = run_module(pve_lxc_raw, args, capsys)
    assert first["changed"] and first["raw_lines"] == [ALLOW, MOUNT0]
    assert os.stat(path).st_ino == inode, "pmxcfs refuses renames: the file must be rewritten in place"
    assert MOUNT0 + "\n" in path.read_text().partition("[before-driver]")[0]
    assert first["diff"]["before"] == WITH_SNAPSHOTS and first["diff"]["after"] == path.read_text()
    second = run_module(pve_lxc_raw, args, capsys)
    assert second["changed"] is False and "diff" not in second


def test_module_check_mode_shows_the_diff_and_leaves_the_file(tmp_path, capsys):
    path = conf_dir(tmp_path, PLAIN)
    result = run_module(
        pve_lxc_raw,
        dict(vmid=129, lines=[MOUNT0], config_dir=str(tmp_path), lock_dir=str(tmp_path / "lock")),
        capsys,
        check_mode=True,
    )
    assert result["changed"] and result["diff"]["after"].endswith(MOUNT0 + "\n")
    assert path.read_text() == PLAIN


def test_module_warns_about_cgroup_v1_keys(tmp_path, capsys, monkeypatch):
    # Once any controller-side Ansible code is imported in this pytest process (another test's filter
    # plugin), module warnings go to the controller's display instead of the result: be a target again.
    from ansible.module_utils import _internal

    monkeypatch.setattr(_internal, "is_controller", False)
    conf_dir(tmp_path, PLAIN)
    result = run_module(
        pve_lxc_raw,
        dict(
            vmid=129,
            lines=["lxc.cgroup.devices.allow: c 195:* rwm"],
            config_dir=str(tmp_path),
            lock_dir=str(tmp_path / "lock"),
        ),
        capsys,
    )
    assert "use lxc.cgroup2.devices.allow" in str(result["warnings"])


def test_module_fails_clearly_for_a_ct_that_is_not_on_this_node(tmp_path, capsys):
    result = run_module(
        pve_lxc_raw,
        dict(vmid=130, lines=[ALLOW], config_dir=str(tmp_path), lock_dir=str(tmp_path / "lock")),
        capsys,
    )
    assert (
        result["failed"]
        and "130.conf not found" in result["msg"]
        and "CT 130 does not exist on this node" in result["msg"]
    )


def test_module_refuses_a_bad_line_and_leaves_the_file(tmp_path, capsys):
    path = conf_dir(tmp_path, PLAIN)
    result = run_module(
        pve_lxc_raw,
        dict(
            vmid=129,
            lines=[ALLOW, "dev0: /dev/nvidia0"],
            config_dir=str(tmp_path),
            lock_dir=str(tmp_path / "lock"),
        ),
        capsys,
    )
    assert result["failed"] and "dev0: /dev/nvidia0" in result["msg"] and "pve_lxc" in result["msg"]
    assert path.read_text() == PLAIN


# ----------------------------------------------------------------- PVE's config lock, against a real holder

# A stand-in for `pct set 129 ...`: takes PVE's config lock (flock on pve-config-129.lock), says so, and then
# either reads the config, waits, writes it back with one option changed and releases the lock, or keeps the
# lock until it is killed.
LOCKER = r"""
import fcntl, pathlib, sys, time
lock, conf, ready, mode = sys.argv[1:5]
handle = open(lock, "a")
fcntl.flock(handle, fcntl.LOCK_EX)
text = pathlib.Path(conf).read_text()
pathlib.Path(ready).write_text("locked")
if mode == "hold":
    time.sleep(300)
time.sleep(float(mode))
pathlib.Path(conf).write_text(text.replace("memory: 16384", "memory: 32768"))
"""


@pytest.fixture
def locker(tmp_path):
    """Start LOCKER processes on CT 129's lock in tmp_path/lock; every one is killed (if still running) and reaped."""
    started = []

    def start(mode):
        (tmp_path / "lock").mkdir(exist_ok=True)
        ready = tmp_path / f"ready{len(started)}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOCKER,
                str(tmp_path / "lock" / "pve-config-129.lock"),
                str(tmp_path / "129.conf"),
                str(ready),
                mode,
            ]
        )
        started.append(proc)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the lock holder did not start"
            time.sleep(0.02)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def raw_args(tmp_path, **extra):
    return dict(vmid=129, lines=[ALLOW], config_dir=str(tmp_path), lock_dir=str(tmp_path / "lock"), **extra)


def test_module_waits_for_a_concurrent_pct_set_and_neither_change_is_lost(tmp_path, capsys, locker):
    path = conf_dir(tmp_path, PLAIN)
    holder = locker("0.5")  # read the config, then write memory 32768 half a second later
    result = run_module(pve_lxc_raw, raw_args(tmp_path), capsys)
    assert result["changed"] and not result.get("failed"), result
    assert holder.wait(timeout=30) == 0
    text = path.read_text()
    assert "memory: 32768\n" in text, "the module wrote over the concurrent pct set"
    assert ALLOW + "\n" in text, "the concurrent pct set wrote over the module's line"


def test_module_times_out_on_a_held_lock_naming_the_holder_and_leaves_the_file(tmp_path, capsys, locker):
    path = conf_dir(tmp_path, PLAIN)
    holder = locker("hold")
    began = time.monotonic()
    result = run_module(pve_lxc_raw, raw_args(tmp_path, lock_timeout=1), capsys)
    assert time.monotonic() - began < 15
    msg = result["msg"]
    assert result["failed"] and "timed out after 1 s" in msg and "config lock of CT 129" in msg, msg
    assert "pve-config-129.lock" in msg and f"pid {holder.pid} ({sys.executable} -c import fcntl" in msg, msg
    assert path.read_text() == PLAIN
    holder.kill()
    holder.wait(timeout=30)
    again = run_module(pve_lxc_raw, raw_args(tmp_path, lock_timeout=1), capsys)
    assert again["changed"] and ALLOW in path.read_text()


# The lock is taken by a process that forks and exits: its child, holding the inherited open file, is the holder.
FORKING_LOCKER = r"""
import fcntl, os, sys, time
lock, ready = sys.argv[1:3]
handle = open(lock, "a")
fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
pid = os.fork()
if pid == 0:
    time.sleep(300)
    os._exit(0)
with open(ready + ".tmp", "w") as f:
    f.write(str(pid))
os.rename(ready + ".tmp", ready)
"""


def test_the_lock_message_names_the_live_holder_when_the_process_that_took_it_has_exited(tmp_path, capsys):
    path = conf_dir(tmp_path, PLAIN)
    (tmp_path / "lock").mkdir()
    ready = tmp_path / "child.pid"
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36  # the orphaned child comes to this test, which reaps it by PID
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    child = None
    try:
        taker = subprocess.Popen(
            [sys.executable, "-c", FORKING_LOCKER, str(tmp_path / "lock" / "pve-config-129.lock"), str(ready)]
        )
        assert taker.wait(timeout=30) == 0
        child = int(ready.read_text())
        result = run_module(pve_lxc_raw, raw_args(tmp_path, lock_timeout=1), capsys)
        msg = result["msg"]
        assert result["failed"] and f"held by pid {child} ({sys.executable} -c" in msg, msg
        assert f"it inherited the lock from pid {taker.pid}, which took it and has exited" in msg, msg
        assert path.read_text() == PLAIN
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def test_check_mode_does_not_wait_for_the_lock(tmp_path, capsys, locker):
    conf_dir(tmp_path, PLAIN)
    locker("hold")
    result = run_module(pve_lxc_raw, raw_args(tmp_path, lock_timeout=30), capsys, check_mode=True)
    assert result["changed"] and not result.get("failed")
