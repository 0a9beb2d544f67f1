#!/usr/bin/env python3
"""Benchmark gpu_cleanup: time to verified release, and the cost of a no-op cleanup.yml run.

    .venv/bin/python bench/cleanup.py [--runs 5] [--term-timeout 2] [--skip-ansible]

(a) N holders that honour SIGTERM (N = 1, 8, 64 workers of one agent, each holding a stand-in device):
    seconds from the start of the cleanup to "no holder left" verified by a fresh /proc scan.
(b) the same when every process ignores SIGTERM: expect about --term-timeout more.
(c) wall time of an idempotent no-op `ansible-playbook cleanup.yml` against the manual one-liner, both
    through Ansible's local connection, as a ratio.  The one-liner is run in a harmless form: `kill -9`
    becomes `echo`, and `fuser -k` only looks at this run's stand-in device files.

Prints medians over --runs; never asserts on time.  Stand-in devices live in a temporary directory;
only processes this script started are ever signalled (the module is pointed at their marker and
stand-ins, and leftovers are reaped by recorded pid and start time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ansible.module_utils

ROOT = Path(__file__).resolve().parent.parent
HOLDER = ROOT / "tests" / "helpers" / "holder.py"
VENV_BIN = Path(sys.executable).parent
MARKER = ("EAGLE3_JOB", "eagle3-bench")
ansible.module_utils.__path__.append(str(ROOT / "module_utils"))


def load_cleanup_module():
    spec = importlib.util.spec_from_file_location("gpu_cleanup_bench", ROOT / "library" / "gpu_cleanup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_job(tmp: Path, n: int, ignore_term: bool, run: int) -> tuple[subprocess.Popen, Path]:
    """An agent with ``n`` workers (own sessions), each holding the stand-in device; ready when all recorded."""
    name = f"n{n}-{'ignore' if ignore_term else 'honour'}-{run}"
    pidfile, ready = tmp / f"{name}.pids", tmp / f"{name}.ready"
    args = [sys.executable, str(HOLDER), "--workers", str(n), "--hold", str(tmp / "dev" / "nvidia0")]
    if ignore_term:
        args.append("--ignore-term")
    env = dict(os.environ, **{MARKER[0]: MARKER[1]})
    popen = subprocess.Popen([*args, "--pidfile", str(pidfile), "--ready", str(ready)], env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if time.monotonic() > deadline or popen.poll() not in (None, 0):
            raise RuntimeError(f"holder job with {n} workers did not start")
        time.sleep(0.01)
    return popen, pidfile


def reap(popen: subprocess.Popen, pidfile: Path) -> None:
    for line in pidfile.read_text().splitlines():
        _, pid, start = line.split()
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[19]) == int(start):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    popen.wait(timeout=30)
    for line in pidfile.read_text().splitlines():
        try:
            os.waitpid(int(line.split()[1]), os.WNOHANG)  # orphans re-parented to us as subreaper
        except ChildProcessError:
            pass


def release_times(module, tmp: Path, n: int, ignore_term: bool, runs: int, term_timeout: float) -> list[float]:
    params = {
        "unit": None,
        "marker": "=".join(MARKER),
        "devices": [f"{tmp}/dev/nvidia[0-9]*"],
        "match_cmdline": [],
        "protect": ["nvidia-persistenced", "sshd", "systemd*"],
        "sweep": [f"{tmp}/shm/nccl-*"],
        "stop_timeout": 10,
        "term_timeout": term_timeout,
        "kill_timeout": 10,
        "timeout": 60,
        "gpu_memory_tolerance_mib": 1024,
    }
    times = []
    for run in range(runs):
        popen, pidfile = start_job(tmp, n, ignore_term, run)
        try:
            started = time.monotonic()
            result, failed = module.run(params, check_mode=False, self_pid=os.getpid())
            assert not failed and result["holders_after"] == [], failed
            times.append(time.monotonic() - started)
            expected = n + 1
            if len(result["targets"]) != expected:
                raise RuntimeError(f"expected {expected} targets, got {len(result['targets'])}")
        finally:
            reap(popen, pidfile)
    return times


def write_ansible_fixture(tmp: Path) -> tuple[Path, Path]:
    inventory = tmp / "inventory.yml"
    inventory.write_text(
        json.dumps(
            {
                "training": {
                    "hosts": {
                        "localhost": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                        }
                    }
                }
            }
        )
    )
    extra = tmp / "vars.json"
    extra.write_text(
        json.dumps(
            {
                "gpu_cleanup_unit": "eagle3-bench.service",
                "gpu_cleanup_marker": "=".join(MARKER),
                "gpu_cleanup_devices": [f"{tmp}/dev/nvidia[0-9]*"],
                "gpu_cleanup_sweep": [f"{tmp}/shm/nccl-*"],
            }
        )
    )
    return inventory, extra


def timed(cmd: list[str], env: dict) -> tuple[float, int]:
    started = time.monotonic()
    rc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300).returncode
    return time.monotonic() - started, rc


def ansible_times(tmp: Path, runs: int) -> tuple[list[float], list[float], set[int], set[int]]:
    inventory, extra = write_ansible_fixture(tmp)
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", ANSIBLE_FORCE_COLOR="false")
    playbook = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), "-e", f"@{extra}", "cleanup.yml"]
    # The story's one-liner with its teeth pulled: `kill -9` -> `echo`, fuser only on this run's stand-ins.
    one_liner = (
        'ps aux | grep python3 | grep -v grep | awk "{print \\$2}" | xargs -r echo kill -9 > /dev/null; '
        f"sleep 2; fuser -k {tmp}/dev/nvidia* || true"
    )
    adhoc = [
        str(VENV_BIN / "ansible"),
        "training",
        "-i",
        str(inventory),
        "-m",
        "ansible.builtin.shell",
        "-a",
        one_liner,
    ]
    ours, theirs, rc_ours, rc_theirs = [], [], set(), set()
    for _ in range(runs):
        t, rc = timed(playbook, env)
        ours.append(t)
        rc_ours.add(rc)
        t, rc = timed(adhoc, env)
        theirs.append(t)
        rc_theirs.add(rc)
    return ours, theirs, rc_ours, rc_theirs


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times):7.3f} s  (min {min(times):.3f}, max {max(times):.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--term-timeout", type=float, default=2.0)
    ap.add_argument("--skip-ansible", action="store_true")
    args = ap.parse_args()

    import ctypes

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned workers come back to us to reap
    module = load_cleanup_module()
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}")
    print(f"# python {platform.python_version()}, runs per cell: {args.runs}, term_timeout {args.term_timeout:g} s")
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "dev").mkdir()
        (tmp / "shm").mkdir()
        (tmp / "dev" / "nvidia0").write_bytes(b"\0" * 4096)
        print(f"\n{'holders':>8} | {'honour SIGTERM (median)':<38} | {'ignore SIGTERM (median)':<38}")
        for n in args.sizes:
            honour = release_times(module, tmp, n, False, args.runs, args.term_timeout)
            ignore = release_times(module, tmp, n, True, args.runs, args.term_timeout)
            print(f"{n:>8} | {fmt(honour):<38} | {fmt(ignore):<38}", flush=True)
        if not args.skip_ansible:
            ours, theirs, rc_ours, rc_theirs = ansible_times(tmp, max(3, args.runs // 2))
            print("\nno-op cleanup through `ansible -c local` (localhost):")
            print(f"  ansible-playbook cleanup.yml : {fmt(ours)}  rc={sorted(rc_ours)}")
            print(f"  one-liner (ansible -m shell) : {fmt(theirs)}  rc={sorted(rc_theirs)}")
            print(f"  ratio ours/one-liner         : {statistics.median(ours) / statistics.median(theirs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
