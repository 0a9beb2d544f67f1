"""Shared pytest setup: import the project's module_utils the way Ansible does at run time.

Modules import ``ansible.module_utils.<name>``; Ansible ships the project's module_utils/ with them
(ansible.cfg: module_utils = module_utils), and the module_utils files import each other relatively. Under plain
pytest the directory is added to that package's search path, and the repository root is put on sys.path so tests
can also ``import module_utils.<name>``.

Modules run in-process here (their main()), and Ansible keeps the warnings a module emits in a process-wide
store that exit_json reports: each test starts with it empty, so no test sees another's warnings.
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


@pytest.fixture(autouse=True)
def _no_warnings_from_other_tests():
    from ansible.module_utils.common import warnings

    warnings._global_warnings.clear()  # private: the store exit_json reads (ansible-core 2.21)
    warnings._global_deprecations.clear()


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


class Leftovers:
    """Files named like a GPU job's leftovers, in the real /dev/shm and /tmp (the only folders the sweep works in),
    each name carrying a token of this test so that no glob of the test reaches anybody else's file."""

    def __init__(self):
        import secrets

        self.token = f"e3t{os.getpid()}x{secrets.token_hex(3)}"
        self.globs = [
            f"/dev/shm/nccl-{self.token}-*",
            f"/dev/shm/torch_{self.token}-*",
            f"/tmp/torchelastic_{self.token}_*",
        ]

    def shm(self, kind: str, name: str) -> pathlib.Path:
        """/dev/shm/nccl-TOKEN-NAME (kind "nccl") or /dev/shm/torch_TOKEN-NAME (kind "torch")."""
        return pathlib.Path(f"/dev/shm/{kind}{'-' if kind == 'nccl' else '_'}{self.token}-{name}")

    def tmp(self, name: str) -> pathlib.Path:
        """/tmp/torchelastic_TOKEN_NAME: torchrun's log folder form."""
        return pathlib.Path(f"/tmp/torchelastic_{self.token}_{name}")

    def remove_all(self) -> None:
        import shutil

        for root in ("/dev/shm", "/tmp"):
            for path in pathlib.Path(root).glob(f"*{self.token}*"):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


@pytest.fixture
def leftovers():
    found = Leftovers()
    yield found
    found.remove_all()
