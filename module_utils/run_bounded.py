"""Run an external command with a bound on every wait, the kill included (standard library only).

subprocess.run(timeout=...) bounds the read, but after the timeout it SIGKILLs the child and then waits for it
without a bound: a child stuck in the kernel (nvidia-smi in the driver after an Xid, pvesh on a hung
/etc/pve) does not die on SIGKILL, and the module would hang there forever. It also kills only the child, so
a helper the child started keeps running and keeps the output pipes open.

run_bounded starts the command in its own process group (so only what it started is signalled), waits at
most ``timeout`` seconds for it, then SIGKILLs the whole group and waits at most ``kill_grace`` seconds more.
A command that is still there then is left behind, and the error names its pid; the caller never blocks.
"""

from __future__ import annotations

import os
import signal
import subprocess

KILL_GRACE = 5.0


class CommandTimeout(Exception):
    """A command that did not finish in time: '<what> timed out after N s' (and whether it survived SIGKILL)."""

    def __init__(self, message, pid, survived):
        super().__init__(message)
        self.pid = pid
        self.survived = survived


def _seconds(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_bounded(cmd, timeout, what=None, kill_grace=KILL_GRACE, input=None, env=None, cwd=None, kill=True):
    """subprocess.CompletedProcess (text output) of cmd, or CommandTimeout after timeout (+ kill_grace) seconds.

    With kill=False a command that overruns is left running (for one that must not be cut off halfway, such
    as a PVE task) and CommandTimeout says so. OSError (command missing, not executable) is raised as
    subprocess raises it.

    >>> run_bounded(["sh", "-c", "echo hi"], 5).stdout
    'hi\\n'
    >>> try:
    ...     run_bounded(["sleep", "30"], 0.2, what="sleep 30")
    ... except CommandTimeout as exc:
    ...     print(exc)
    sleep 30 timed out after 0.2 s
    """
    what = what or " ".join(str(part) for part in cmd)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group: the kill reaches its helpers and nothing else
    )
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        message = f"{what} timed out after {_seconds(timeout)} s"
        if not kill:
            raise CommandTimeout(f"{message}; left running (pid {proc.pid})", proc.pid, True) from None
        survived = _kill_group(proc, kill_grace)
        if survived:
            message += (
                f" and was still there {_seconds(kill_grace)} s after SIGKILL (pid {proc.pid}, stuck in the "
                "kernel: see dmesg); it was left behind"
            )
        raise CommandTimeout(message, proc.pid, survived) from None
    except BaseException:
        _kill_group(proc, kill_grace)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _kill_group(proc, grace):
    """SIGKILL the process group proc leads; True if proc is still not gone after grace seconds."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
            break
        except (ProcessLookupError, PermissionError):
            continue
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        return True  # subprocess reaps it later (Popen.__del__), if it ever dies
    return False
