# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``restart_decision``: whether train.yml (re)starts the unit, and why, or only clears foreign GPU holders.

Documented for ansible-doc in restart_decision.yml beside this file.
"""

from __future__ import annotations

# Deployed inputs, in the order the reasons are listed: (key of `changed`, the reason's words).
CHANGES = (
    ("pkg", "trainer package changed"),
    ("config", "config changed"),
    ("env", "environment changed"),
    ("unit", "unit changed"),
    ("guard", "guard changed"),
)


def restart_decision(
    before: dict, changed: dict, started_with: str = "", fingerprint: str = "", stall_timeout: int = 900
) -> dict:
    """{restart: [reasons], foreign: [pids]}: restart for the reasons listed (empty: leave the run as it is); when
    the run is up and nothing else calls for a restart, foreign holds GPU holders outside the unit, which a cleanup
    that spares the run removes (restarting a healthy run for someone else's process helps nobody).

    `before`: train_report's result; `changed`: which deployed inputs this play changed (CHANGES' keys);
    `started_with` / `fingerprint`: the inputs' checksums the running unit started with / deployed now.

    >>> up = {"unit": {"ActiveState": "active"}, "run": {"state": "running"}, "status_age_s": 3, "foreign_holders": []}
    >>> restart_decision(up, {"config": True})
    {'restart': ['config changed'], 'foreign': []}
    >>> restart_decision({**up, "foreign_holders": [{"pid": 42}]}, {}, "a", "a")
    {'restart': [], 'foreign': [42]}
    >>> restart_decision({**up, "foreign_holders": [{"pid": 42}]}, {"env": True})  # restarts anyway: cleanup takes it
    {'restart': ['environment changed', 'GPU held outside the unit: 42'], 'foreign': []}
    >>> down = {"unit": {"ActiveState": "failed"}, "run": {"state": "failed", "detail": "unit failed", "reason": "oom: x"}}
    >>> restart_decision(down, {})["restart"]
    ['run failed (unit failed); last exit oom: x']
    >>> restart_decision({**up, "status_age_s": 1000}, {}, "a", "a")["restart"]
    ['stuck: no status update for 1000 s']
    >>> restart_decision(up, {}, "old", "new")["restart"]
    ['deployed files differ from those the unit started with']
    """
    run = before.get("run") or {}
    unit_up = (before.get("unit") or {}).get("ActiveState") in ("active", "activating") and run.get(
        "state"
    ) != "crash-looping"
    reasons = [words for key, words in CHANGES if changed.get(key)]
    deployed_changed = any(changed.get(k) for k in ("pkg", "config", "env", "unit"))
    if unit_up and not deployed_changed and (started_with or "").strip() != (fingerprint or "").strip():
        reasons.append("deployed files differ from those the unit started with")
    if not unit_up:
        detail = f" ({run['detail']})" if run.get("detail") else ""
        last = f"; last exit {run['reason']}" if run.get("reason") else ""
        reasons.append(f"run {run.get('state', '?')}{detail}{last}")
    age = before.get("status_age_s")
    if unit_up and age is not None and int(age) > int(stall_timeout):
        reasons.append(f"stuck: no status update for {age} s")
    foreign = [h["pid"] for h in before.get("foreign_holders") or []]
    if foreign and reasons:
        reasons.append("GPU held outside the unit: " + ", ".join(map(str, foreign)))
        foreign = []
    return {"restart": reasons, "foreign": foreign}


class FilterModule:
    def filters(self):
        return {"restart_decision": restart_decision}
