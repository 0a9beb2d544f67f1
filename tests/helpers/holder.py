#!/usr/bin/env python3
"""A stand-in for a GPU job process, for tests and benchmarks (standard library only).

It holds stand-in device files the way CUDA holds /dev/nvidia*, and behaves like the processes a
cleanup meets in the field: torchrun agents that forward SIGTERM to workers in their own sessions,
workers that save a checkpoint on SIGTERM, DataLoader workers renamed with prctl, processes that
ignore SIGTERM, double-forked orphans, unreaped zombies, agents that respawn killed workers.

Every process it creates appends ``ROLE PID START_TIME`` to --pidfile (START_TIME is field 22 of
/proc/PID/stat, so the test can reap by identity), and --ready is created once the whole tree is set up.

    holder.py --hold /tmp/x/nvidia0 --ignore-term --pidfile P --ready R
    holder.py --workers 2 --grandchild --forward-term --hold DEV --on-term-write DIR/ckpt --pidfile P --ready R
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import mmap
import os
import signal
import stat
import sys
import time

PR_SET_NAME = 15
held = []  # keep fds and maps alive for the life of the process


def start_time(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


def record(args, role: str) -> None:
    if not args.pidfile:
        return
    with open(args.pidfile, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{role} {os.getpid()} {start_time()}\n")


def rename(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def hold(path: str, map_only: bool) -> None:
    """Hold ``path`` like CUDA holds a device: O_PATH for a char node, fd + MAP_SHARED map for a file."""
    if stat.S_ISCHR(os.stat(path).st_mode):
        held.append(os.open(path, os.O_PATH))  # a real open fails with ENXIO without a driver
        return
    fd = os.open(path, os.O_RDWR)
    if os.fstat(fd).st_size == 0:
        os.ftruncate(fd, mmap.PAGESIZE)
    held.append(mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED))
    if map_only:
        os.close(fd)  # the mapping alone still pins the file
    else:
        held.append(fd)


def set_up(args, role: str) -> None:
    if args.name:
        rename(args.name)
    for path in args.hold:
        hold(path, args.map_only)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.on_term_write:
        target = f"{args.on_term_write}.{role}.{os.getpid()}"

        def save(signum, frame):
            with open(target, "w") as f:
                f.write("checkpoint\n")
            os._exit(0)

        signal.signal(signal.SIGTERM, save)
    record(args, role)


def spawn_worker(args, index: int) -> int:
    """Fork a worker in its own session (torchrun's start_new_session=True); returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    set_up(args, f"worker{index}")
    if args.grandchild and os.fork() == 0:
        rename("pt_data_worker")
        record(args, f"grandchild{index}")
        idle()
    idle()
    return 0  # not reached


def wait_recorded(args, count: int) -> None:
    """Wait (at most 10 s) until ``count`` workers and grandchildren have recorded themselves."""
    deadline = time.monotonic() + 10
    while args.pidfile and time.monotonic() < deadline:
        with open(args.pidfile) as f:
            if sum(line.startswith(("worker", "grandchild")) for line in f) >= count:
                return
        time.sleep(0.01)


def idle() -> None:
    while True:
        signal.pause()


def agent(args) -> None:
    """Parent of the workers: forwards SIGTERM to each worker's process group like torchrun's agent."""
    workers = {spawn_worker(args, i): i for i in range(args.workers)}
    restarts = args.respawn

    def forward(signum, frame):
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while workers and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG) if workers else (0, 0)
            workers.pop(pid, None)
            time.sleep(0.01)
        os._exit(1)  # torchrun exits rc=1 on SIGTERM

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.forward_term:
        signal.signal(signal.SIGTERM, forward)
    if args.agent_name:
        rename(args.agent_name)
    record(args, "agent")
    wait_recorded(args, args.workers * (2 if args.grandchild else 1))
    touch(args.ready)
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(0.05)
            continue
        index = workers.pop(pid, None)
        if index is not None and restarts > 0:
            restarts -= 1
            time.sleep(args.respawn_delay)  # a supervisor's restart delay (the cleanup's re-scan misses it)
            workers[spawn_worker(args, index)] = index


def touch(path: str | None) -> None:
    if path:
        with open(path + ".tmp", "w"):
            pass
        os.rename(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", action="append", default=[], help="stand-in device file to hold")
    ap.add_argument("--map-only", action="store_true", help="keep only the memory map, close the fd")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--on-term-write", help="on SIGTERM write PREFIX.ROLE.PID and exit 0")
    ap.add_argument("--name", help="rename (prctl PR_SET_NAME) after start")
    ap.add_argument("--double-fork", action="store_true", help="detach: the real process is a grandchild")
    ap.add_argument("--zombie", action="store_true", help="fork a child that exits and is never reaped")
    ap.add_argument("--workers", type=int, default=0, help="act as an agent with N workers in own sessions")
    ap.add_argument("--grandchild", action="store_true", help="each worker forks a renamed child")
    ap.add_argument("--forward-term", action="store_true", help="agent forwards SIGTERM to workers")
    ap.add_argument("--respawn", type=int, default=0, help="agent restarts a dead worker up to N times")
    ap.add_argument("--respawn-delay", type=float, default=0.0, help="seconds before a respawn")
    ap.add_argument("--agent-name", help="rename the agent")
    ap.add_argument("--pidfile")
    ap.add_argument("--ready")
    args = ap.parse_args()

    if args.double_fork:
        if os.fork():
            os._exit(0)  # the launcher exits at once: the worker ends up orphaned
        os.setsid()
        if os.fork():
            record(args, "mid")  # recorded so that the test can reap it
            os._exit(0)
        # Let go of the launcher's stdio (an Ansible command task waits for its pipes to close).
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    if args.workers:
        agent(args)
    set_up(args, "main")
    if args.zombie:
        child = os.fork()
        if child == 0:
            os._exit(0)
        with open(args.pidfile, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            while True:  # wait until the child has exited (never reaped, so it stays a zombie)
                with open(f"/proc/{child}/stat") as s:
                    if s.read().rpartition(")")[2].split()[0] == "Z":
                        break
                time.sleep(0.005)
            f.write(f"zombie {child} {start_time(child)}\n")
    touch(args.ready)
    idle()


if __name__ == "__main__":
    sys.exit(main())
