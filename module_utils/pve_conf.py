"""Raw `lxc.*` lines in a Proxmox CT config file (/etc/pve/lxc/<vmid>.conf), edited as text.

The PVE API cannot write them ("property is not defined in schema"), so the node-side module
pve_lxc_raw edits the file. A CT config is the current config, then one `[name]` section per
snapshot (and `[pve:pending]`); raw lines belong to the current config, so every edit happens
before the first section header. Standard library only: this runs on the PVE node.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time

SECTION = re.compile(r"^\[[^\]]+\]\s*$")
RAW_KEY = re.compile(r"^lxc(\.[A-Za-z0-9_-]+)+$")


# PVE's own lock for a CT config (pve-container PVE::LXC::Config->config_file_lock: flock(LOCK_EX) on
# /run/lock/lxc/pve-config-<vmid>.lock, taken by pct set, the API and every task that edits the config;
# lock_config waits 10 s for it).
LOCK_DIR = "/run/lock/lxc"
LOCK_TIMEOUT = 10


class ConfError(ValueError):
    """A raw line that cannot be written; the message names the line and the fix."""


class ConfLockError(Exception):
    """The CT's config lock could not be taken; the message names the lock, the holder and the wait."""


def config_lock_path(vmid, lock_dir=LOCK_DIR):
    """The file PVE flocks while it changes CT vmid's config.

    >>> config_lock_path(129)
    '/run/lock/lxc/pve-config-129.lock'
    """
    return os.path.join(lock_dir, f"pve-config-{vmid}.lock")


class ConfigLock:
    """Hold PVE's config lock of a CT (exclusive flock), waiting at most timeout seconds.

    with ConfigLock(129): read, edit and write /etc/pve/lxc/129.conf
    """

    def __init__(self, vmid, lock_dir=LOCK_DIR, timeout=LOCK_TIMEOUT, clock=time.monotonic, sleep=time.sleep):
        self.vmid = vmid
        self.path = config_lock_path(vmid, lock_dir)
        self.timeout = timeout
        self.clock, self.sleep = clock, sleep
        self.handle = None

    def __enter__(self):
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # As PVE opens it (">>"): created when missing, never truncated.
            self.handle = open(self.path, "a")
        except OSError as exc:
            raise ConfLockError(f"cannot open the config lock {self.path} of CT {self.vmid}: {exc}") from None
        deadline = self.clock() + self.timeout
        delay = 0.02
        while True:
            try:
                fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EINTR):
                    self.handle.close()
                    raise ConfLockError(f"cannot lock {self.path}: {exc}") from None
            if self.clock() >= deadline:
                holders = name_holders(self.path)
                self.handle.close()
                raise ConfLockError(
                    f"timed out after {self.timeout} s waiting for the config lock of CT {self.vmid} ({self.path}), held by {holders}: another "
                    "change to the CT (pct set, a backup, the API) is under way. Re-run once it is done, or "
                    "raise lock_timeout"
                )
            self.sleep(min(delay, max(0.0, deadline - self.clock())))
            delay = min(delay * 2, 0.25)

    def __exit__(self, *exc):
        self.handle.close()  # closing the only descriptor releases the flock
        self.handle = None
        return False


def lock_holders(path, proc_locks="/proc/locks"):
    """PIDs that took a lock on path, from /proc/locks (waiters left out); [] when unknown.

    A /proc/locks line reads `1: FLOCK  ADVISORY  WRITE 4242 fd:01:1835099 0 EOF` (device as hex
    major:minor, then the inode); a waiting request has `->` after the number. For a flock the pid is the
    process that took the lock: it may have exited since, leaving the lock with a child that inherited the
    open file (see lock_users).
    """
    try:
        st = os.stat(path)
        with open(proc_locks, encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    exact, same_inode = [], []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        pid, where = fields[4], fields[5].split(":")
        if not pid.isdigit() or int(pid) <= 0 or len(where) != 3:  # 0: a holder outside our PID namespace
            continue
        try:
            major, minor, inode = int(where[0], 16), int(where[1], 16), int(where[2])
        except ValueError:
            continue
        if inode != st.st_ino:
            continue
        same_inode.append(int(pid))
        if (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)):
            exact.append(int(pid))
    # An overlay or FUSE file system may show another device number than stat(): fall back to the inode.
    return sorted(set(exact or same_inode))


def lock_users(path, proc="/proc"):
    """PIDs whose open file on path carries a granted lock now: the live holders, whoever took the lock.

    The kernel lists a file's locks in /proc/PID/fdinfo/FD (`lock:` lines, Linux >= 4.1) of every process that
    has that open file, so a child still holding an inherited descriptor is found after its parent exited.
    """
    try:
        st = os.stat(path)
    except OSError:
        return []
    found = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        fd_dir = f"{proc}/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.stat(f"{fd_dir}/{fd}")
                if (target.st_dev, target.st_ino) != (st.st_dev, st.st_ino):
                    continue
                with open(f"{proc}/{entry}/fdinfo/{fd}", encoding="ascii", errors="replace") as handle:
                    info = handle.read()
            except OSError:
                continue
            if any(line.startswith("lock:") and "->" not in line for line in info.splitlines()):
                found.add(int(entry))
    return sorted(found)


def alive(pid, proc="/proc"):
    return os.path.exists(f"{proc}/{pid}")


def name_holders(path, proc="/proc", proc_locks="/proc/locks"):
    """Who holds the lock on path, in words: the live processes that hold it now, and the one that took it
    when that one has exited.

    >>> name_holders("/nonexistent/lock")
    'an unknown process'
    """
    takers = lock_holders(path, proc_locks)
    users = lock_users(path, proc)
    gone = [pid for pid in takers if not alive(pid, proc)]
    if users:
        text = describe_holders(users, proc)
        if gone:
            text += " (it inherited the lock from pid {}, which took it and has exited)".format(
                ", ".join(map(str, gone))
            )
        return text
    if takers and not gone:
        return describe_holders(takers, proc)
    if gone:
        return "a process that cannot be seen from here (pid {} took the lock and has exited)".format(
            ", ".join(map(str, gone))
        )
    return "an unknown process"


def describe_holders(pids, proc="/proc"):
    """'pid 4242 (pct set 129 -memory 4096)' for each pid, with its command line when it can be read.

    >>> describe_holders([])
    ''
    """
    out = []
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as handle:
                cmd = " ".join(handle.read().replace(b"\0", b" ").decode(errors="replace").split())
        except OSError:
            cmd = ""
        if len(cmd) > 120:
            cmd = cmd[:117] + "..."
        out.append(f"pid {pid} ({cmd})" if cmd else f"pid {pid}")
    return ", ".join(out)


def parse_line(text):
    """(key, value) of a raw line written `key: value` or `key = value`.

    >>> parse_line('lxc.cgroup2.devices.allow: c 195:* rwm')
    ('lxc.cgroup2.devices.allow', 'c 195:* rwm')
    >>> parse_line('lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,optional,create=file')
    ('lxc.mount.entry', '/dev/nvidia0 dev/nvidia0 none bind,optional,create=file')
    """
    found = re.match(r"^\s*([^:=\s]+)\s*[:=]\s*(.*?)\s*$", str(text))
    if not found or not RAW_KEY.match(found.group(1)):
        raise ConfError(
            f"{text!r} is not a raw LXC line 'lxc.KEY: VALUE' (for example "
            "'lxc.cgroup2.devices.allow: c 195:* rwm'); PVE options such as devN go through pve_lxc"
        )
    if not found.group(2):
        raise ConfError(f"{text!r} has no value after the key")
    return found.group(1), found.group(2)


def format_line(key, value):
    """PVE's own spelling of a raw line.

    >>> format_line('lxc.hook.pre-start', '/usr/share/lxc/hooks/nvidia')
    'lxc.hook.pre-start: /usr/share/lxc/hooks/nvidia'
    """
    return f"{key}: {value}"


def cgroup_v1_keys(lines):
    """Keys among the lines that PVE 9 (cgroup v2 only) no longer honours.

    >>> cgroup_v1_keys(['lxc.cgroup.devices.allow: c 195:* rwm', 'lxc.cgroup2.devices.allow: c 195:* rwm'])
    ['lxc.cgroup.devices.allow']
    """
    return [key for key, _ in map(parse_line, lines) if key.startswith("lxc.cgroup.")]


def main_section_end(lines):
    """Index of the first section header (snapshot or pending), or len(lines) when there is none.

    >>> main_section_end(['arch: amd64', '', '[snap1]', 'arch: amd64'])
    2
    """
    for n, line in enumerate(lines):
        if SECTION.match(line):
            return n
    return len(lines)


def edit_raw_lines(text, lines, state="present", exclusive=False):
    """The config text with the raw lines present (or absent) in the current config.

    present: a line missing from the current config is added after its last lxc.* line (or at
    the end of the current config, before the blank line that precedes a section). With
    exclusive, other lines with the same keys are removed first, which replaces a value.
    absent: matching lines (same key and value) are removed. Snapshot sections are never touched.
    Returns the new text; equal to text when nothing needs to change.

    >>> conf = 'arch: amd64\\nlxc.mount.entry: /a a none bind\\n\\n[snap]\\nlxc.mount.entry: /a a none bind\\n'
    >>> print(edit_raw_lines(conf, ['lxc.mount.entry: /b b none bind']), end='')
    arch: amd64
    lxc.mount.entry: /a a none bind
    lxc.mount.entry: /b b none bind
    <BLANKLINE>
    [snap]
    lxc.mount.entry: /a a none bind
    >>> edit_raw_lines(conf, ['lxc.mount.entry: /a a none bind']) == conf
    True
    """
    if state not in ("present", "absent"):
        raise ConfError(f"state must be present or absent, not {state!r}")
    wanted = [parse_line(line) for line in lines]
    all_lines = text.splitlines()
    end = main_section_end(all_lines)
    head, tail = all_lines[:end], all_lines[end:]
    current = [(n, file_pair(line)) for n, line in enumerate(head) if is_raw(line)]

    drop = set()
    if state == "absent":
        drop = {n for n, pair in current if pair in wanted}
    elif exclusive:
        keys = {key for key, _ in wanted}
        drop = {n for n, pair in current if pair[0] in keys and pair not in wanted}
    kept = [line for n, line in enumerate(head) if n not in drop]

    if state == "present":
        have = {file_pair(line) for line in kept if is_raw(line)}
        missing = []
        for pair in wanted:
            if pair not in have and pair not in missing:
                missing.append(pair)
        if missing:
            at = insertion_point(kept)
            kept[at:at] = [format_line(*pair) for pair in missing]

    new_lines = kept + tail
    if new_lines == all_lines:
        return text
    return "\n".join(new_lines) + "\n"


def file_pair(line):
    """(key, value) of a raw line already in the file; never fails, so an odd line is kept as it is.

    >>> file_pair('lxc.apparmor.profile:unconfined'), file_pair('lxc.odd')
    (('lxc.apparmor.profile', 'unconfined'), ('lxc.odd', ''))
    """
    found = re.match(r"^\s*([^:=\s]+)\s*[:=]?\s*(.*?)\s*$", line)
    return found.group(1), found.group(2)


def is_raw(line):
    """True for an `lxc.*` line of the current config.

    >>> is_raw('lxc.apparmor.profile: unconfined'), is_raw('arch: amd64'), is_raw('# lxc.x: y')
    (True, False, False)
    """
    return line.lstrip().startswith("lxc.")


def insertion_point(head):
    """Where new raw lines go in the current config: after the last lxc.* line, else before the
    trailing blank lines (the separator PVE writes before a section).

    >>> insertion_point(['arch: amd64', 'lxc.a: 1', 'memory: 512', ''])
    2
    >>> insertion_point(['arch: amd64', 'memory: 512', '', ''])
    2
    """
    raw = [n for n, line in enumerate(head) if is_raw(line)]
    if raw:
        return raw[-1] + 1
    end = len(head)
    while end > 0 and not head[end - 1].strip():
        end -= 1
    return end


def raw_lines_of(text):
    """The (key, value) raw lines of the current config, in file order.

    >>> raw_lines_of('arch: amd64\\nlxc.a.b: 1\\n[snap]\\nlxc.c.d: 2\\n')
    [('lxc.a.b', '1')]
    """
    lines = text.splitlines()
    return [file_pair(line) for line in lines[: main_section_end(lines)] if is_raw(line)]
