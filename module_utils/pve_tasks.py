"""Waiting for a PVE task (create, start, reboot, shutdown, destroy) by its UPID, with a deadline.

A changing API call returns a UPID at once; the work runs on the node and its status is polled at
GET /nodes/{node}/tasks/{upid}/status until it stops. A failed task comes back with the end of its log.
"""

from __future__ import annotations

import time

from .pve_errors import PveError, api_error_text


class PveTaskError(PveError):
    """A PVE task that failed or did not finish in time; carries its UPID and log lines."""

    def __init__(self, message, upid, log):
        super().__init__(message)
        self.upid = upid
        self.log = log


def wait_task(api, node, upid, timeout, clock=time.monotonic, sleep=time.sleep):
    """Poll a task until it stops; returns its exit status or raises PveTaskError with the task log.

    PVE ends a task with 'OK', 'WARNINGS: n' (success) or the error text. A poll that fails on the way (a
    dropped connection, a timeout, a 5xx from a proxy or a busy pveproxy) is tried again until the deadline;
    one PVE refuses (4xx) ends the wait at once. Every failure is a PveTaskError, never a raw exception. A task
    still running at the deadline is reported with its age by the node's clock (its starttime against GET
    /nodes/{node}/time), not the controller's.
    """
    deadline = clock() + timeout
    delay = 0.05
    last_error = None
    while True:
        try:
            status = api.nodes(node).tasks(upid).status.get()
        except Exception as exc:
            text = api_error_text(exc)
            if not transient(exc):
                raise PveTaskError(
                    f"polling task {upid} failed: {text} (the task may still be running on the node)",
                    upid,
                    [],
                ) from None
            last_error, status = text, None
        if status is not None and status.get("status") == "stopped":
            exitstatus = str(status.get("exitstatus", ""))
            if exitstatus == "OK" or exitstatus.startswith("WARNINGS"):
                return exitstatus
            raise PveTaskError(f"task {upid} failed: {exitstatus}", upid, task_log(api, node, upid))
        if clock() >= deadline:
            raise overrun(api, node, upid, timeout, status, last_error)
        sleep(min(delay, max(0.0, deadline - clock())))
        delay = min(delay * 2, 1.0)


def overrun(api, node, upid, timeout, status, last_error):
    """The PveTaskError for a task not seen stopped by the deadline: unreachable, or still running (with its age)."""
    if status is None:
        return PveTaskError(
            f"no answer about task {upid} for {timeout}s (last error: {last_error}); the link to the node "
            "is failing: the task may still be running there (see its task log on the node)",
            upid,
            [],
        )
    age = task_age(api, node, upid, status)
    return PveTaskError(
        "task {} still running after {}s{} (raise task_timeout if the node is slow; the task keeps "
        "running on the node)".format(
            upid,
            timeout,
            f", {age} s since it started by the node's clock" if age is not None else "",
        ),
        upid,
        task_log(api, node, upid),
    )


def transient(exc):
    """True for a failure worth polling again: no HTTP status (connection reset, timeout) or a 5xx.

    >>> class Refused(Exception): status_code = 403
    >>> transient(ConnectionResetError()), transient(Refused())
    (True, False)
    """
    status = getattr(exc, "status_code", None)
    return status is None or int(status) >= 500


def upid_starttime(upid):
    """The start time (epoch seconds, node clock) a UPID carries: UPID:node:pid:pstart:starttime:...

    >>> upid_starttime('UPID:pve1:00001234:0000ABCD:65F00000:vzstart:129:root@pam:')
    1710227456
    >>> upid_starttime('not a upid') is None
    True
    """
    parts = str(upid).split(":")
    if len(parts) < 5 or parts[0] != "UPID":
        return None
    try:
        return int(parts[4], 16)
    except ValueError:
        return None


def task_age(api, node, upid, status):
    """Seconds since the task started, both ends read on the node (its starttime, GET /nodes/{node}/time).

    None when the node's time cannot be read: the controller's clock may be off, so it is never used.
    """
    started = status.get("starttime") or upid_starttime(upid)
    try:
        age = int(api.nodes(node).time.get().get("time")) - int(started)
    except Exception:
        return None
    return age if age >= 0 else None  # a node clock behind the task's start: no age to trust


def task_log(api, node, upid, limit=50):
    """The last lines of a task's log, best effort (a failure to read it must not hide the task's error)."""
    try:
        lines = api.nodes(node).tasks(upid).log.get(limit=500)
    except Exception:
        return []
    return [str(item.get("t", "")) for item in lines][-limit:]
