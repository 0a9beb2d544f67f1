"""library/local_lxc: removing a container stopped from outside cleans its empty cgroup folders, never busy ones.

Real cgroups under a name no container uses (lxc.payload.<unique>), created and removed by the test; needs root.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from test_train_control import load

ROOT = Path(__file__).resolve().parents[1]
local_lxc = load(ROOT / "library" / "local_lxc.py", "local_lxc_module")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating cgroups needs root")


def hierarchy() -> Path:
    """A cgroup hierarchy we may create folders in: v1 pids, or the v2 root."""
    for candidate in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if (candidate / "cgroup.procs").exists() and os.access(candidate, os.W_OK):
            return candidate
    pytest.skip("no writable cgroup hierarchy")


@pytest.fixture
def name():
    vmid = str(90000 + uuid.uuid4().int % 9999)
    yield vmid
    for top in local_lxc.cgroup_dirs(vmid):  # whatever a failed test left
        for path, _d, _f in os.walk(top, topdown=False):
            try:
                os.rmdir(path)
            except OSError:
                pass


def test_empty_leftovers_with_nested_folders_are_removed(name):
    top = hierarchy() / f"lxc.payload.{name}"
    (top / "system.slice" / "eagle3-train.service").mkdir(parents=True)
    (top / "init.scope").mkdir()
    (hierarchy() / f"lxc.monitor.{name}").mkdir()
    assert local_lxc.remove_empty_cgroups(name) == []
    assert local_lxc.cgroup_dirs(name) == []


def test_a_cgroup_that_holds_a_process_is_kept_and_reported(name):
    busy = hierarchy() / f"lxc.payload.{name}" / "busy"
    busy.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (busy / "cgroup.procs").write_text(str(proc.pid))
        kept = local_lxc.remove_empty_cgroups(name)
        assert str(busy) in kept and busy.is_dir()
        assert any(str(busy.parent) in found for found in local_lxc.leftovers(name, "/nonexistent/ct"))
    finally:
        proc.kill()
        proc.wait()
    assert local_lxc.remove_empty_cgroups(name) == []  # once its process is gone, it goes too
