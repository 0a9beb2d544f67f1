"""Shared pytest setup: import the project's module_utils the way Ansible does at run time.

Modules import ``ansible.module_utils.<name>``; Ansible ships the project's module_utils/ with them
(ansible.cfg: module_utils = module_utils). Under plain pytest the directory is added to that package's
search path, and the repository root is put on sys.path so tests can also ``import module_utils.<name>``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import ansible.module_utils
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))


@pytest.fixture
def fake_systemd(tmp_path, monkeypatch):
    """systemctl/journalctl stand-ins on PATH: `systemctl show` prints the file tmp_path/show (an active, running
    unit until the test writes another), journalctl prints 40 numbered log lines."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "show").write_text(
        "ActiveState=active\nSubState=running\nResult=success\nExecMainStatus=0\n"
        "NRestarts=0\nExecMainStartTimestampMonotonic=0\nInvocationID=\n"
    )
    (bindir / "systemctl").write_text(f"#!/bin/sh\ncat {tmp_path}/show\n")
    (bindir / "journalctl").write_text('#!/bin/sh\nfor i in $(seq 1 40); do echo "log line $i"; done\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return tmp_path
