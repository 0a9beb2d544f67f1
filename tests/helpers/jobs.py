"""Pytest fixtures that start stand-in GPU job processes and reap every one of them by identity.

Tests never signal a process they did not start: every helper process records ``ROLE PID START_TIME``,
and teardown sends SIGKILL only to those identities, then reaps them.  While a test runs, the pytest
process is a child subreaper, so double-forked orphans become its children and can be reaped too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The test's own, independent identity check (not the code under test): one copy, shared with molecule's helper.
from .fixture_state import running as identity_alive

HOLDER = Path(__file__).resolve().parent / "holder.py"
MARKER = "EAGLE3_JOB=eagle3-test"
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Job:
    popen: subprocess.Popen
    pidfile: Path
    roles: dict[str, tuple[int, int]] = field(default_factory=dict)

    def pid(self, role: str = "main") -> int:
        return self.roles[role][0]

    def alive(self, role: str = "main") -> bool:
        return identity_alive(*self.roles[role])

    def read_roles(self) -> dict[str, tuple[int, int]]:
        roles = {}
        for line in self.pidfile.read_text().splitlines():
            role, pid, start = line.split()
            roles[role] = (int(pid), int(start))  # a respawned worker replaces its predecessor
        self.roles.update(roles)
        return roles

    def all_identities(self) -> list[tuple[int, int]]:
        out = []
        if self.pidfile.exists():
            for line in self.pidfile.read_text().splitlines():
                _, pid, start = line.split()
                out.append((int(pid), int(start)))
        return out


class Jobs:
    """Starts helpers (each in its own session, like torchrun workers) and reaps them at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: list[Job] = []
        self.count = 0

    def start(self, *args: str, marker: str | None = MARKER, expect: int = 1, new_session: bool = True) -> Job:
        """Run holder.py with ``args``; wait until ``expect`` processes have recorded themselves."""
        self.count += 1
        pidfile = self.tmp / f"job{self.count}.pids"
        ready = self.tmp / f"job{self.count}.ready"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
        if marker:
            name, value = marker.split("=", 1)
            env[name] = value
        popen = subprocess.Popen(
            [sys.executable, str(HOLDER), *args, "--pidfile", str(pidfile), "--ready", str(ready)],
            env=env,
            start_new_session=new_session,
        )
        job = Job(popen, pidfile)
        self.started.append(job)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if ready.exists() and pidfile.exists() and len(pidfile.read_text().splitlines()) >= expect:
                job.read_roles()
                return job
            if popen.poll() not in (None, 0):
                raise RuntimeError(f"holder.py {args} exited with {popen.returncode}")
            time.sleep(0.01)
        raise RuntimeError(f"holder.py {args} not ready after 15 s")

    def reap(self) -> None:
        for job in self.started:
            for pid, start in job.all_identities():
                if identity_alive(pid, start):
                    try:
                        os.kill(pid, signal.SIGKILL)  # ours: identity checked just above
                    except ProcessLookupError:
                        pass
            if job.popen.poll() is None:
                try:
                    job.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    job.popen.kill()
                    job.popen.wait(timeout=10)
            deadline = time.monotonic() + 10
            for pid, _ in job.all_identities():
                while time.monotonic() < deadline:
                    try:
                        done, _ = os.waitpid(pid, os.WNOHANG)  # orphans re-parented to us (subreaper)
                    except ChildProcessError:
                        break  # not our child (its own parent reaps it) or already reaped
                    if done:
                        break
                    time.sleep(0.01)


def set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0)


@pytest.fixture
def jobs(tmp_path):
    set_subreaper(True)
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.reap()
        set_subreaper(False)


@dataclass
class StandIns:
    """Stand-in GPU device files: nvidia0 a char node (195, 0), nvidia1 a regular file, nvidiactl a char node."""

    root: Path

    @property
    def globs(self) -> list[str]:
        return [f"{self.root}/nvidia[0-9]*", f"{self.root}/nvidiactl", f"{self.root}/nvidia-uvm"]

    def __getitem__(self, name: str) -> str:
        return str(self.root / name)


@pytest.fixture
def devices(tmp_path) -> StandIns:
    root = tmp_path / "dev"
    root.mkdir()
    os.mknod(root / "nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
    (root / "nvidia1").write_bytes(b"\0" * 4096)
    os.mknod(root / "nvidiactl", 0o666 | 0o020000, os.makedev(195, 255))
    (root / "nvidia-uvm").write_bytes(b"\0" * 4096)
    return StandIns(root)
