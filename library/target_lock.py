#!/usr/bin/python
# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A lease lock on the target, held (and renewed) across the tasks of one playbook run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: target_lock
short_description: Hold a renewed lease lock on the target across the tasks of one playbook run
description:
  - C(train.yml) and C(cleanup.yml) both stop, kill and start things on the same CT; two runs must never
    interleave. A playbook run is many processes, so the lock is a record in a file (O(path)) naming its owner
    (a token unique to the run), the controller's user@host, its C(ansible-playbook) pid and that process's start
    time, the playbook, the purpose, since when it is held, when it was last renewed and its lease (C(ttl)).
  - Every read-check-write of the record happens under C(flock) of a guard file next to it (O(path) + C(.guard)),
    and the record is replaced by write-temp + rename, so taking a free lock, taking over a stale one, breaking a
    gone owner's, renewing and releasing are atomic. No two runs ever hold it, even when both find it stale.
  - The lock is a lease. Its owner renews it (O(state=renewed), or M(train_health) with its C(lock_*) options
    while it waits). A lease not renewed within its C(ttl) is stale and is taken over, with a warning.
  - The target cannot see the controller's processes. The C(run_lock) role checks on the controller whether a
    holder's C(ansible-playbook) is gone (same controller host, pid gone or reused) and then passes
    O(break_owner); for a holder it saw alive it passes O(live_owner), which is never taken over.
  - Another holder makes O(state=acquired) wait up to O(wait) seconds, then fail naming the holder
    (user@host, pid, playbook, purpose, since, last renewal) and how to proceed.
  - In check mode nothing is taken, renewed, released or created; O(state=acquired) reports who holds the lock
    and what a real run would do.
version_added: "0.1.0"
author: eagle3-pve contributors
options:
  path:
    description: The lock record on the target; the guard file is this path + C(.guard) (removed on release).
    type: path
    default: /run/lock/eagle3-pve.lock
  state:
    description:
      - C(acquired) takes the lock (waiting if needed; renews it when this owner holds it already).
      - C(renewed) renews this owner's lease; fails when the lock is no longer this owner's.
      - C(released) drops it if this owner holds it (another owner's lock is left alone).
      - C(query) only reads the record (no O(owner) needed).
    type: str
    choices: [acquired, renewed, released, query]
    default: acquired
  owner:
    description: A token unique to this playbook run; the same token must be given to renew and release.
    type: str
  purpose:
    description: What the holder is doing, shown to whoever waits.
    type: str
    default: ""
  playbook:
    description: The holder's playbook, shown to whoever waits.
    type: str
    default: ""
  controller:
    description:
      - Who the run is, from the C(run_lock) role's C(run_lock_controller) lookup, copied into the record.
      - Keys C(user), C(host) (the controller's hostname), C(pid) and C(pid_start) (the C(ansible-playbook) process
        and its start time in clock ticks since boot), C(started) (that start, seconds since the epoch),
        C(boot_id) and C(pidns) (the controller's boot and pid namespace, to know when a pid can be checked).
    type: dict
  wait:
    description: Seconds to wait for another holder before failing (O(state=acquired)).
    type: int
    default: 30
  ttl:
    description:
      - Seconds the lease lasts after each renewal. O(state=acquired) defaults to 300. O(state=renewed) keeps the
        lease's ttl unless given, so a renewal before a long step can cover it (e.g. the GPU cleanup's budget).
    type: int
  break_owner:
    description:
      - A token whose lock is removed and taken if, under the flock, the record still holds exactly that token
        (the controller found that run gone, or the user asked to break it).
    type: str
  live_owner:
    description:
      - A token the controller saw alive (its C(ansible-playbook) runs); its lock is not taken over even past its
        ttl.
    type: str
  take_stale:
    description:
      - With false, a lease that ran out is reported as C(busy) (with C(expired=true)) rather than taken over, so
        that the controller can first check whether its run is alive (the C(run_lock) role's first try).
    type: bool
    default: true
  fail_on_busy:
    description: With false, a lock still held by another run after O(wait) returns C(busy=true) instead of failing.
    type: bool
    default: true
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: partial
    details:
      - Nothing is taken, renewed, released or created, and nobody is waited for. O(state=acquired) reports who
        holds the lock and, in RV(outcome) and RV(msg), what a real run would do; C(changed) stays false even
        when a real run would take the lock.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Any POSIX target with C(flock) (Linux in this project).
"""

EXAMPLES = r"""
- name: Take the CT's lock (the run_lock role does this, with the controller's identity)
  target_lock:
    owner: "{{ run_lock_token }}"
    purpose: train.yml max_seq_len=16384
    playbook: train.yml
    ttl: 300
    wait: 30

- name: Keep it through a long step (up to 200 s) plus the usual lease
  target_lock:
    owner: "{{ run_lock_token }}"
    state: renewed
    ttl: 500

- name: Release it
  target_lock:
    owner: "{{ run_lock_token }}"
    state: released
"""

RETURN = r"""
acquired:
  description: The lock is this owner's now (always false in check mode).
  type: bool
  returned: when O(state=acquired)
outcome:
  description:
    - C(taken) (it was free), C(held) (already ours, renewed), C(stale) (taken over, its lease ran out),
      C(broken) (taken from O(break_owner)) or C(busy) (another run holds it).
    - In check mode, what a real run would do now.
  type: str
  returned: when O(state=acquired)
busy:
  description: Another run holds the lock (in check mode, or with O(fail_on_busy=false); otherwise the task fails).
  type: bool
  returned: when O(state=acquired)
expired:
  description: The other holder's lease ran out (not renewed within its ttl).
  type: bool
  returned: when O(state=acquired)
held:
  description: A lock record exists (someone holds the lock).
  type: bool
  returned: when O(state=query)
holder:
  description:
    - The other holder's record (busy, taken over or broken), or the record seen on release (when it was not this
      owner's, or in check mode) or query.
    - Keys C(version), C(owner), C(playbook), C(purpose), C(since), C(renewed) (seconds since the epoch),
      C(ttl), and the O(controller) keys (C(user), C(host), C(pid), ...) at the top level.
  type: dict
  returned: when there was one
described:
  description: The holder in one line (user@host, pid, playbook, purpose, since, last renewal, lease).
  type: str
  returned: when RV(holder) is returned
lock:
  description: This owner's record once taken or renewed, with the same keys as RV(holder).
  type: dict
  returned: when O(state=acquired) took or kept the lock, or O(state=renewed); not in check mode
overdue:
  description: Seconds past the lease's end at which it was renewed (0 when in time, and in check mode).
  type: float
  returned: when O(state=renewed)
waited:
  description: Seconds spent waiting for another holder.
  type: float
  returned: always
msg:
  description:
    - In check mode with O(state=acquired) or O(state=renewed), what a real run would do; with
      O(fail_on_busy=false), who holds the lock and how to proceed.
  type: str
  returned: in check mode (O(state=acquired), O(state=renewed)), or when busy with O(fail_on_busy=false)
"""

import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.run_lock import (
    DEFAULT_TTL,
    LockError,
    acquire,
    busy_message,
    describe,
    read_record,
    release,
    renew,
    ttl_expired,
)


# How a real run would take the lock, for check mode's message.
CHECK_HOW = {
    "held": " (this run holds it already)",
    "stale": " over (its lease ran out)",
    "broken": " (break_owner names its holder)",
}


ARGUMENT_SPEC = dict(
    path=dict(type="path", default="/run/lock/eagle3-pve.lock"),
    state=dict(type="str", choices=["acquired", "renewed", "released", "query"], default="acquired"),
    owner=dict(type="str"),
    purpose=dict(type="str", default=""),
    playbook=dict(type="str", default=""),
    controller=dict(type="dict"),
    wait=dict(type="int", default=30),
    ttl=dict(type="int"),
    break_owner=dict(type="str"),
    live_owner=dict(type="str"),
    take_stale=dict(type="bool", default=True),
    fail_on_busy=dict(type="bool", default=True),
)


def with_holder(result: dict, rec: dict | None) -> dict:
    if rec:
        result.update(holder=rec, described=describe(rec))
    return result


def state_query(module: AnsibleModule, path: str) -> None:
    try:
        rec = read_record(path)
    except LockError as exc:
        module.fail_json(msg=f"cannot use the lock {path}: {exc}", waited=0.0)
    module.exit_json(**with_holder({"changed": False, "waited": 0.0, "held": rec is not None}, rec))


def state_released(module: AnsibleModule, path: str, owner: str) -> None:
    try:
        if module.check_mode:
            module.exit_json(**with_holder({"changed": False, "waited": 0.0}, read_record(path)))
        released, seen = release(path, owner)
    except LockError as exc:
        module.fail_json(msg=str(exc), waited=0.0)
    result = {"changed": released, "waited": 0.0}
    if not released:
        with_holder(result, seen)
    module.exit_json(**result)


def state_renewed(module: AnsibleModule, path: str, owner: str, ttl: int | None) -> None:
    if module.check_mode:
        module.exit_json(changed=False, waited=0.0, overdue=0.0, msg="check mode: nothing held, nothing renewed")
    try:
        rec, overdue = renew(path, owner, ttl)
    except LockError as exc:
        module.fail_json(msg=str(exc), waited=0.0)
    if overdue > 0:
        module.warn(
            f"renewed the lock {path} {overdue:.0f} s after its lease ran out (nobody took it meanwhile); "
            "renew it more often or give the step before a longer ttl"
        )
    module.exit_json(changed=False, waited=0.0, overdue=round(overdue, 1), lock=rec)


def state_acquired(module: AnsibleModule, p: dict) -> None:
    path = p["path"]
    try:
        outcome, holder, waited = acquire(
            path,
            p["owner"],
            wait=0 if module.check_mode else p["wait"],
            ttl=p["ttl"] or DEFAULT_TTL,
            purpose=p["purpose"],
            playbook=p["playbook"],
            controller=p["controller"],
            break_owner=p["break_owner"],
            live_owner=p["live_owner"],
            take_stale=p["take_stale"],
            dry_run=module.check_mode,
        )
    except (LockError, OSError) as exc:
        module.fail_json(msg=f"cannot use the lock {path}: {exc}", waited=0.0)
    busy = outcome == "busy"
    result = with_holder(
        {
            "changed": outcome in ("taken", "stale", "broken") and not module.check_mode,
            "acquired": not busy and not module.check_mode,
            "outcome": outcome,
            "busy": busy,
            "expired": bool(holder) and outcome != "held" and ttl_expired(holder),
            "waited": round(waited, 2),
        },
        holder if outcome != "held" else None,
    )
    if module.check_mode:
        if busy:
            how = f"it is held by {describe(holder)}"
        else:
            how = "a real run would take it" + CHECK_HOW.get(outcome, "")
            if holder and outcome != "held":
                how += f" from {describe(holder)}"
        result["msg"] = f"check mode: the lock {path} is not taken; {how}"
        module.exit_json(**result)
    if busy:
        msg = busy_message(path, holder, waited, time.time())
        if p["fail_on_busy"]:
            module.fail_json(msg=msg, **result)
        module.exit_json(msg=msg, **result)
    result["lock"] = read_record(path)
    if outcome == "stale":
        module.warn(f"took over the stale lock {path} (its lease ran out without renewal): {describe(holder)}")
    elif outcome == "broken":
        module.warn(f"broke the lock {path} of a run that is gone (break_owner): {describe(holder)}")
    module.exit_json(**result)


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("state", s, ["owner"]) for s in ("acquired", "renewed", "released")],
        supports_check_mode=True,
    )
    p = module.params
    if p["wait"] < 0 or (p["ttl"] is not None and p["ttl"] <= 0):
        module.fail_json(msg=f"wait must be >= 0 and ttl > 0, got wait={p['wait']} ttl={p['ttl']}")
    if p["state"] == "query":
        state_query(module, p["path"])
    elif p["state"] == "released":
        state_released(module, p["path"], p["owner"])
    elif p["state"] == "renewed":
        state_renewed(module, p["path"], p["owner"], p["ttl"])
    else:
        state_acquired(module, p)


if __name__ == "__main__":
    main()
