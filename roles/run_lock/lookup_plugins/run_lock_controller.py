# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of the run lock: who this ansible-playbook run is, and whether a holder's run is gone.

Lookups run on the controller, inside ansible-playbook's own process tree (the main process, or a worker forked
from it), which is what lets them name the run's ansible-playbook process and check another run's.
"""

from __future__ import annotations

import os
import pwd
import secrets
import socket

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: run_lock_controller
author: eagle3-pve contributors
version_added: "0.1.0"
short_description: This run's identity on the controller, or whether a run lock holder's run is gone
description:
  - C(identity) (the default term) returns who this run is - C(user) (the effective user, as C(id -un)),
    C(host) (the controller's hostname), C(pid) of the C(ansible-playbook) process running this play and
    C(pid_start) (its start in clock ticks since boot, from C(/proc/PID/stat)), C(started) (the same, seconds since
    the epoch), C(boot_id), C(pidns) (the pid namespace), C(playbook) (the playbook files on its command line) and
    a fresh C(token) unique to the run.
  - The C(ansible-playbook) process is found by walking up from the process evaluating the lookup to the topmost
    process with the same command line (workers are forked from the main process, so they share it; a nested
    ansible-playbook started by a task has a different parent).
  - C(gone) with O(holder) (a lock record) decides whether the holder's run is provably gone - same controller
    host, boot and pid namespace as this one, and its pid has exited, is a zombie, or belongs to a process
    started at another time (pid reused). It returns C(gone), C(alive) (seen running) and C(reason). A holder from
    another controller, boot or namespace can be neither (C(gone=false), C(alive=false)); only its lease decides.
options:
  _terms:
    description: C(identity) or C(gone).
    type: list
    elements: str
  holder:
    description: The lock record to check (term C(gone)).
    type: dict
"""

EXAMPLES = r"""
- name: Who this run is
  ansible.builtin.set_fact:
    me: "{{ query('run_lock_controller', 'identity') | first }}"

- name: Is the holder's run gone?
  ansible.builtin.set_fact:
    verdict: "{{ query('run_lock_controller', 'gone', holder=lock.holder) | first }}"
"""

RETURN = r"""
_raw:
  description: One dict - the identity, or C(gone), C(alive) and C(reason).
  type: list
  elements: dict
"""


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def proc_stat(pid: int, proc: str = "/proc") -> dict | None:
    """ppid, state and start (clock ticks since boot) of a process; None when there is none."""
    raw = _read(f"{proc}/{pid}/stat")
    if not raw or ")" not in raw:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    try:
        return {"state": fields[0], "ppid": int(fields[1]), "start": int(fields[19])}
    except (IndexError, ValueError):
        return None


def cmdline(pid: int, proc: str = "/proc") -> list[str] | None:
    raw = _read(f"{proc}/{pid}/cmdline")
    return raw.rstrip("\0").split("\0") if raw else None


def playbook_process(pid: int | None = None, proc: str = "/proc") -> int:
    """The topmost ancestor of ``pid`` (default: this process) that shares its command line: ansible-playbook."""
    pid = os.getpid() if pid is None else pid
    mine = cmdline(pid, proc)
    while True:
        st = proc_stat(pid, proc)
        if not st or st["ppid"] <= 1 or cmdline(st["ppid"], proc) != mine:
            return pid
        pid = st["ppid"]


def playbooks_in(argv: list[str]) -> str:
    """The playbook files on an ansible-playbook command line (not the values of -i, -e, ...)."""
    takes_value = {
        "-i",
        "--inventory",
        "--inventory-file",
        "-e",
        "--extra-vars",
        "--vault-password-file",
        "--vault-id",
        "-l",
        "--limit",
        "-t",
        "--tags",
        "--skip-tags",
        "-u",
        "--user",
        "-c",
        "--connection",
        "-f",
        "--forks",
        "-M",
        "--module-path",
        "--private-key",
        "--key-file",
        "--start-at-task",
        "-T",
        "--timeout",
        "--become-method",
        "--become-user",
    }
    found, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg in takes_value:
            skip = True
            continue
        if not arg.startswith("-") and arg.endswith((".yml", ".yaml")):
            found.append(os.path.basename(arg))
    return " ".join(found)


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid{os.geteuid()}"


def boot_time(proc: str = "/proc") -> float:
    for line in (_read(f"{proc}/stat") or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def identity(proc: str = "/proc") -> dict:
    pid = playbook_process(proc=proc)
    st = proc_stat(pid, proc) or {}
    start = st.get("start")
    btime = boot_time(proc)
    user, host = user_name(), socket.gethostname()
    return {
        "user": user,
        "host": host,
        "pid": pid,
        "pid_start": start,
        "started": round(btime + start / os.sysconf("SC_CLK_TCK"), 2) if start is not None and btime else None,
        "boot_id": (_read(f"{proc}/sys/kernel/random/boot_id") or "").strip(),
        "pidns": pid_namespace(),
        "playbook": playbooks_in(cmdline(pid, proc) or []),
        "token": f"{user}@{host}:{pid}:{secrets.token_hex(6)}",
    }


def holder_gone(holder: dict | None, me: dict | None = None, proc: str = "/proc") -> dict:
    """Whether a lock holder's run is provably gone, checked on this controller."""
    me = identity(proc) if me is None else me

    def verdict(gone: bool, alive: bool, reason: str) -> dict:
        return {"gone": gone, "alive": alive, "reason": reason}

    if not holder:
        return verdict(False, False, "no holder")
    who = f"{holder.get('user') or '?'}@{holder.get('host') or '?'}"
    pid = holder.get("pid")
    if not pid or holder.get("pid_start") is None or not holder.get("host"):
        return verdict(False, False, "the holder names no controller process; only its lease can end it")
    if holder.get("host") != me["host"]:
        return verdict(False, False, f"held from another controller ({who}); only its lease can end it")
    if not holder.get("boot_id") or holder.get("boot_id") != me["boot_id"]:
        return verdict(
            False,
            False,
            f"held from {who} in another boot (or another machine with its name); only its lease can end it",
        )
    if holder.get("pidns") != me["pidns"]:
        return verdict(False, False, f"held from {who} in another pid namespace; only its lease can end it")
    st = proc_stat(int(pid), proc)
    if st is None:
        return verdict(True, False, f"its ansible-playbook (pid {pid} on {holder['host']}) is gone")
    if st["state"] in ("Z", "X"):
        return verdict(True, False, f"its ansible-playbook (pid {pid} on {holder['host']}) has exited")
    if st["start"] != int(holder["pid_start"]):
        return verdict(True, False, f"pid {pid} on {holder['host']} is now another process (its run is gone)")
    return verdict(False, True, f"its ansible-playbook (pid {pid} on {holder['host']}) is running")


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        what = terms[0] if terms else "identity"
        if what == "identity":
            return [identity()]
        if what == "gone":
            return [holder_gone(self.get_option("holder"))]
        raise AnsibleError(f"run_lock_controller: unknown term {what!r} (identity or gone)")
