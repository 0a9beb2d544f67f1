# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run lock on the target: one lease record that names its owner, changed only under flock().

train.yml and cleanup.yml stop, kill and start things on the same CT, so two runs must never interleave. A run is
many processes (one per task), so the lock is a record in a file (``path``), not a held file descriptor:

- Every read-check-write of the record happens under ``flock(LOCK_EX)`` of a guard file next to it
  (``path + ".guard"``). All contenders run on the same target, so the flock makes each decision atomic: taking a
  free lock, taking over a stale one, breaking a dead owner's, renewing and releasing never race. The record is
  replaced by write-temp + ``rename``, so a reader never sees half a record.
- The guard is removed on release (while still locked); a contender that locked a guard which was unlinked or
  replaced meanwhile sees that its inode is no longer the path's and opens the new one.
- The record is a lease: ``renewed`` (the target's clock) + ``ttl`` seconds. Its owner renews it; a lease not
  renewed within its ttl is stale and is taken over. The controller adds the second staleness test (the holder's
  ansible-playbook process is gone on this controller) with ``break_owner``, and vouches for a live holder with
  ``live_owner`` (never taken over, even past its ttl).

Only the standard library: this runs on the target.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import time

RECORD_VERSION = 2
DEFAULT_TTL = 300
# A record of the first version (O_EXCL lock file, no lease) counted as abandoned after this many seconds.
LEGACY_TTL = 1800
# Who the run is, as the run_lock role's lookup reports it; copied into the record.
CONTROLLER_KEYS = ("user", "host", "pid", "pid_start", "started", "boot_id", "pidns")
# How long one contender waits for another's flock (held only for a read and a rename, never for a task).
GUARD_TIMEOUT = 30.0


class LockError(Exception):
    """The lock could not be used (lost, guard stuck); the message says why."""


class GuardTimeout(LockError):
    pass


def guard_path(path: str) -> str:
    return path + ".guard"


@contextlib.contextmanager
def guarded(path: str, timeout: float = GUARD_TIMEOUT):
    """Hold flock(LOCK_EX) of the guard next to ``path`` for one read-check-write.

    The guard's inode is checked after locking: a releaser unlinks the guard while holding it, so a contender that
    locked the old inode retries on the current one. The flock is released when the descriptor is closed.
    """
    guard = guard_path(path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(guard, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except PermissionError:
            fd = os.open(guard, os.O_RDONLY | os.O_CLOEXEC)  # another user's guard: flock needs no write access
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                    if time.monotonic() >= deadline:
                        raise GuardTimeout(
                            f"{guard} stayed locked for {timeout:.0f}s (a process of another run is stopped or "
                            "stuck inside the lock; see `fuser -v` on it)"
                        ) from None
                    time.sleep(0.005)
            try:
                current = os.stat(guard)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # unlinked or replaced while we waited: lock the one that is there now
    try:
        yield guard
    finally:
        os.close(fd)


class ForeignFile(LockError):
    """The lock's path (or its guard) is an existing file that is not a lock record of this project."""


def is_lock_record(rec) -> bool:
    """A record this project wrote (either version): a JSON object naming its owner and when it was taken.

    >>> is_lock_record({"version": 2, "owner": "t", "since": 1.5, "renewed": 2, "ttl": 300})
    True
    >>> is_lock_record({"owner": "old-run", "since": 10, "pid": 1}), is_lock_record({"hostname": "x"})
    (True, False)
    """
    return (
        isinstance(rec, dict)
        and isinstance(rec.get("owner"), str)
        and bool(rec["owner"])
        and isinstance(rec.get("since"), (int, float))
        and not isinstance(rec.get("since"), bool)
    )


def _foreign(path: str, why: str) -> ForeignFile:
    return ForeignFile(
        f"{path} exists and {why}, so it is not a lock record of eagle3-pve; it was left untouched. The lock is a "
        "file of its own: point run_lock_path at a path no other program uses (default /run/lock/eagle3-pve.lock)"
    )


def check_guard(path: str) -> None:
    """The guard next to the record is ours only while it is an empty regular file (release unlinks it)."""
    guard = guard_path(path)
    try:
        st = os.lstat(guard)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_size:
        raise _foreign(guard, "is not the empty file the lock's guard is")


def check_path(path: str) -> None:
    """Raise ForeignFile when the record's path or its guard is somebody else's file (before the guard is made)."""
    check_guard(path)
    read_record(path)


def read_record(path: str) -> dict | None:
    """The record, None when there is none. Any other file at ``path`` raises ForeignFile: never read as a holder,
    never taken over, overwritten or removed (the lock once took over, then deleted, a user's file named by mistake).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _foreign(path, "is not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None  # released between the lstat and the open
    except UnicodeDecodeError:
        raise _foreign(path, "is not text") from None
    except ValueError:
        raise _foreign(path, "is not JSON") from None
    except OSError as exc:
        raise _foreign(path, f"cannot be read ({exc.strerror})") from None
    if not is_lock_record(rec):
        raise _foreign(path, "is JSON without a lock's owner and start time")
    return rec


def write_record(path: str, rec: dict) -> None:
    """Replace the record atomically (write a temporary file next to it, then rename it over the record)."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def renewed_at(rec: dict) -> float:
    try:
        return float(rec.get("renewed", rec.get("since", 0)) or 0)
    except (TypeError, ValueError):
        return 0.0


def lease_ttl(rec: dict) -> float:
    try:
        return float(rec.get("ttl", LEGACY_TTL))
    except (TypeError, ValueError):
        return float(LEGACY_TTL)


def ttl_expired(rec: dict, now: float | None = None) -> bool:
    """Not renewed within its ttl (the target's clock, which stamped ``renewed``)."""
    now = time.time() if now is None else now
    return now - renewed_at(rec) > lease_ttl(rec)


def new_record(
    owner: str, ttl: float, purpose: str = "", playbook: str = "", controller: dict | None = None, now=None
) -> dict:
    now = time.time() if now is None else now
    rec = {
        "version": RECORD_VERSION,
        "owner": owner,
        "playbook": playbook,
        "purpose": purpose,
        "since": now,
        "renewed": now,
        "ttl": ttl,
    }
    for key in CONTROLLER_KEYS:
        rec[key] = (controller or {}).get(key)
    return rec


def decide(
    cur: dict | None,
    owner: str,
    break_owner: str | None,
    live_owner: str | None,
    now: float,
    take_stale: bool = True,
):
    """What acquiring means against the current record: (outcome, holder).

    taken (free), held (already ours: renewed), broken (break_owner still held it), stale (lease ran out, and the
    controller did not vouch for the holder with live_owner; only with take_stale) or busy.
    """
    if cur is None:
        return "taken", None
    if cur.get("owner") == owner:
        return "held", cur
    if break_owner and cur.get("owner") == break_owner:
        return "broken", cur
    if take_stale and not (live_owner and cur.get("owner") == live_owner) and ttl_expired(cur, now):
        return "stale", cur
    return "busy", cur


def acquire_once(
    path: str,
    owner: str,
    ttl: float = DEFAULT_TTL,
    purpose: str = "",
    playbook: str = "",
    controller: dict | None = None,
    break_owner: str | None = None,
    live_owner: str | None = None,
    take_stale: bool = True,
    dry_run: bool = False,
) -> tuple[str, dict | None]:
    """One atomic attempt. With dry_run, only say what a real attempt would do (no file is created or changed)."""
    check_path(path)  # a foreign file is refused before a guard is created next to it
    if dry_run:
        return decide(read_record(path), owner, break_owner, live_owner, time.time(), take_stale)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with guarded(path):
        now = time.time()
        cur = read_record(path)
        outcome, holder = decide(cur, owner, break_owner, live_owner, now, take_stale)
        if outcome == "held":
            rec = dict(cur, renewed=now, ttl=ttl)
            write_record(path, rec)
        elif outcome != "busy":
            write_record(path, new_record(owner, ttl, purpose, playbook, controller, now))
        return outcome, holder


def acquire(path: str, owner: str, wait: float = 0, poll: float = 0.5, **kw) -> tuple[str, dict | None, float]:
    """Attempt until not busy or ``wait`` seconds passed: (outcome, holder, seconds waited)."""
    start = time.monotonic()
    while True:
        outcome, holder = acquire_once(path, owner, **kw)
        waited = time.monotonic() - start
        if outcome != "busy" or kw.get("dry_run") or waited >= wait:
            return outcome, holder, waited
        time.sleep(min(poll, max(wait - waited, 0.01)))


def renew(path: str, owner: str, ttl: float | None = None) -> tuple[dict, float]:
    """Renew the owner's lease (optionally with a new ttl): (record, seconds it was overdue, 0 when in time).

    Raises LockError when the lock is no longer this owner's: another run may have acted on the target since.
    """
    if not os.path.exists(path):
        raise LockError(f"the lock {path} is no longer held by this run ({owner}): it was released or broken meanwhile")
    check_path(path)
    with guarded(path):
        now = time.time()
        cur = read_record(path)
        if cur is None:
            raise LockError(
                f"the lock {path} is no longer held by this run ({owner}): it was released or broken meanwhile"
            )
        if cur.get("owner") != owner:
            raise LockError(
                f"the lock {path} is no longer held by this run ({owner}): now held by {describe(cur, now)}"
            )
        overdue = max(now - renewed_at(cur) - lease_ttl(cur), 0.0)
        rec = dict(cur, renewed=now)
        if ttl is not None:
            rec["ttl"] = ttl
        write_record(path, rec)
        return rec, overdue


def release(path: str, owner: str) -> tuple[bool, dict | None]:
    """Remove the record (and the guard) if this owner holds it: (released, the record seen)."""
    if not os.path.exists(path):
        return False, None
    check_path(path)
    with guarded(path) as guard:
        cur = read_record(path)
        if cur is None or cur.get("owner") != owner:
            return False, cur
        os.unlink(path)
        os.unlink(guard)  # still locked by us: contenders waiting on it see the inode change and retry
        return True, cur


def _when(ts, now: float) -> str:
    try:
        ts = float(ts)
    except (TypeError, ValueError):
        return "an unknown time"
    if ts <= 0:
        return "an unknown time"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))
    delta = now - ts
    return f"{stamp} ({delta:.0f} s ago)" if delta >= 0 else f"{stamp} (in {-delta:.0f} s)"


def controller_of(rec: dict) -> str:
    user, host = rec.get("user"), rec.get("host")
    if host:
        return f"{user or '?'}@{host}"
    owner = str(rec.get("owner") or "?")
    return owner.split(":", 1)[0]  # tokens start with user@host


def describe(rec: dict, now: float | None = None) -> str:
    """One line naming a holder: user@host, pid, playbook, purpose, since, last renewal, lease.

    >>> describe({"owner": "t", "user": "root", "host": "ctl", "pid": 41, "playbook": "train.yml",
    ...           "purpose": "train.yml max_seq_len=16384", "since": 0, "renewed": 0, "ttl": 300}, now=10)
    "root@ctl (ansible-playbook pid 41), playbook train.yml, purpose 'train.yml max_seq_len=16384', since an unknown time, last renewed an unknown time, lease 300 s (owner t)"
    """
    now = time.time() if now is None else now
    pid = rec.get("pid")
    parts = [f"{controller_of(rec)} (ansible-playbook pid {pid})" if pid else controller_of(rec)]
    parts.append(f"playbook {rec.get('playbook') or '?'}")
    parts.append(f"purpose {rec.get('purpose')!r}" if rec.get("purpose") else "no purpose given")
    parts.append(f"since {_when(rec.get('since'), now)}")
    parts.append(f"last renewed {_when(renewed_at(rec), now)}")
    parts.append(f"lease {lease_ttl(rec):.0f} s (owner {rec.get('owner')})")
    return ", ".join(parts)


def busy_message(path: str, rec: dict, waited: float, now: float | None = None, why_alive: str = "") -> str:
    """The failure when another run holds the lock: who, and how to proceed."""
    now = time.time() if now is None else now
    host = rec.get("host") or "its controller"
    pid = rec.get("pid")
    runs_out = renewed_at(rec) + lease_ttl(rec)
    stop = f"stop it (ansible-playbook pid {pid} on {host}, as {rec.get('user') or '?'})" if pid else "stop it"
    return (
        f"another eagle3-pve run holds the lock {path}: {describe(rec, now)}. Waited {waited:.0f} s."
        + (f" {why_alive}." if why_alive else "")
        + f" Let it finish, or {stop}, then run again. If that run is gone, its lock is taken over once its lease"
        f" runs out ({_when(runs_out, now)}, unless it is renewed), and at once by a run started on {host}, which"
        f" sees that the pid is gone. To break it now, when you are sure that run is gone: -e run_lock_break="
        f"{rec.get('owner')} (module option break_owner)."
    )
