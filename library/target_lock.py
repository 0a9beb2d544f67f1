#!/usr/bin/python
# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A lease lock on the target, held across the tasks of one playbook run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: target_lock
short_description: Hold a lease lock on the target across the tasks of one playbook run
description:
  - C(train.yml) and C(cleanup.yml) both stop, kill and start things on the same CT; two runs must never
    interleave. A file lock (C(flock)) lives only as long as one process, and a playbook is many, so this
    module keeps a lock file created with C(O_EXCL) that names its owner, and removes it on release.
  - A second run waits up to C(wait) seconds, then fails naming the holder (who, since when, which play).
  - A lock older than C(stale_after) seconds is taken over, with a warning (its run died without releasing).
version_added: "0.1.0"
author: eagle3-pve contributors
options:
  path:
    description: Lock file on the target.
    type: path
    default: /run/lock/eagle3-pve.lock
  state:
    description: C(acquired) takes the lock (waiting if needed); C(released) drops it if this owner holds it.
    type: str
    choices: [acquired, released]
    default: acquired
  owner:
    description: A token unique to this playbook run; the same token must be given to release.
    type: str
    required: true
  purpose:
    description: What the holder is doing, shown to whoever waits.
    type: str
    default: ""
  wait:
    description: Seconds to wait for another holder before failing.
    type: int
    default: 30
  stale_after:
    description: Seconds after which a lock is considered abandoned and taken over.
    type: int
    default: 1800
"""

EXAMPLES = r"""
- name: Take the CT's lock
  target_lock:
    owner: "{{ eagle3_run_token }}"
    purpose: train.yml max_seq_len=16384
"""

RETURN = r"""
holder:
  description: The lock file's content when the lock was held by someone else (or taken over).
  type: dict
  returned: when another holder was seen
waited:
  description: Seconds spent waiting for another holder.
  type: float
  returned: always
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule


def read_holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"owner": "?", "since": os.path.getmtime(path) if os.path.exists(path) else 0}


def try_create(path: str, record: dict) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", default="/run/lock/eagle3-pve.lock"),
            state=dict(type="str", choices=["acquired", "released"], default="acquired"),
            owner=dict(type="str", required=True),
            purpose=dict(type="str", default=""),
            wait=dict(type="int", default=30),
            stale_after=dict(type="int", default=1800),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["wait"] < 0 or p["stale_after"] <= 0:
        module.fail_json(
            msg=f"wait must be >= 0 and stale_after > 0, got wait={p['wait']} stale_after={p['stale_after']}"
        )
    path = p["path"]
    start = time.monotonic()

    if p["state"] == "released":
        holder = read_holder(path)
        if holder and holder.get("owner") == p["owner"]:
            if not module.check_mode:
                os.unlink(path)
            module.exit_json(changed=True, waited=0.0)
        module.exit_json(changed=False, waited=0.0, holder=holder or {})

    # Locks are operational state: check mode still takes it, or a check run could interleave with a real one.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    record = {"owner": p["owner"], "purpose": p["purpose"], "since": time.time(), "pid": os.getppid()}
    seen = None
    while True:
        if try_create(path, record):
            result = {"changed": True, "waited": round(time.monotonic() - start, 2)}
            if seen:
                result["holder"] = seen
            module.exit_json(**result)
        seen = read_holder(path)
        if seen is None:
            continue  # released between our two calls
        if seen.get("owner") == p["owner"]:
            module.exit_json(changed=False, waited=0.0, holder=seen)
        age = time.time() - float(seen.get("since", 0))
        if age > p["stale_after"]:
            module.warn(f"taking over a stale lock {path} held for {age:.0f}s by {seen}")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue
        if time.monotonic() - start >= p["wait"]:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(seen.get("since", 0))))
            module.fail_json(
                msg=(
                    f"another eagle3-pve run holds {path} since {since} ({seen.get('purpose') or 'no purpose given'}, "
                    f"owner {seen.get('owner')}); waited {p['wait']}s. Let it finish, or if it died, remove the "
                    f"file (it is taken over automatically after {p['stale_after']}s)."
                ),
                holder=seen,
                waited=round(time.monotonic() - start, 2),
            )
        time.sleep(0.5)


if __name__ == "__main__":
    main()
