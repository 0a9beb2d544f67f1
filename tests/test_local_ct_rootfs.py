"""The local CT's root file system cache is built from any state an earlier run leaves (role local_ct, rootfs.yml).

A stand-in mmdebstrap behaves as the real one does where it matters: it refuses a target whose parent folder does
not exist ("unable to get absolute path of target directory"), and otherwise writes a tree with etc/os-release.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

FAKE_MMDEBSTRAP = """#!/bin/sh
# mmdebstrap [OPTIONS] SUITE TARGET MIRROR: only what the role relies on.
eval target=\\${$(($# - 1))}
[ -n "$FAKE_MMDEBSTRAP_FAIL" ] && { echo "E: $FAKE_MMDEBSTRAP_FAIL" >&2; exit 1; }
[ -d "$(dirname "$target")" ] || { echo "E: unable to get absolute path of target directory $target" >&2; exit 1; }
mkdir -p "$target/etc" && echo 'ID=debian' > "$target/etc/os-release"
"""

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: local_ct
        tasks_from: rootfs.yml
"""


@pytest.fixture
def build(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "mmdebstrap").write_text(FAKE_MMDEBSTRAP)
    (bindir / "mmdebstrap").chmod(0o755)
    (tmp_path / "play.yml").write_text(PLAYBOOK)

    def run(cache: Path, fail: str = "") -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
            "ANSIBLE_NOCOLOR": "1",
            "FAKE_MMDEBSTRAP_FAIL": fail,
        }
        args = [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", "-c", "local", str(tmp_path / "play.yml")]
        args += ["-e", f"ansible_python_interpreter={sys.executable}", "-e", f"local_ct_rootfs_cache={cache}"]
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)

    return run


def test_cache_under_a_folder_that_does_not_exist_yet(build, tmp_path):
    cache = tmp_path / "no" / "such" / "folder" / "rootfs-bookworm"
    result = build(cache)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (cache / "etc" / "os-release").is_file()
    assert not Path(f"{cache}.partial").exists()
    assert "waiting" in result.stdout or "ok:" in result.stdout


def test_half_built_partial_and_empty_cache_folder_are_replaced(build, tmp_path):
    cache = tmp_path / "rootfs-bookworm"
    cache.mkdir()  # an empty folder: a publish that never happened
    partial = Path(f"{cache}.partial")
    (partial / "var").mkdir(parents=True)
    (partial / "var" / "half-written").write_text("interrupted mmdebstrap")
    result = build(cache)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (cache / "etc" / "os-release").is_file() and not partial.exists()


def test_a_folder_that_is_not_a_rootfs_is_never_deleted(build, tmp_path):
    cache = tmp_path / "rootfs-bookworm"
    cache.mkdir()
    (cache / "precious").write_text("somebody else's file")
    result = build(cache)
    assert result.returncode != 0
    assert f"local_ct_rootfs_cache={cache} exists and is not empty" in result.stdout
    assert (cache / "precious").read_text() == "somebody else's file"


def test_a_failed_build_leaves_nothing_and_says_why(build, tmp_path):
    cache = tmp_path / "new" / "rootfs-bookworm"
    result = build(cache, fail="Temporary failure resolving 'deb.debian.org'")
    assert result.returncode != 0
    assert "Could not build the CT root file system" in result.stdout
    assert "Temporary failure resolving" in result.stdout and "Nothing was created" in result.stdout
    assert not cache.exists() and not Path(f"{cache}.partial").exists()
