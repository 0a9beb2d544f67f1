"""Which changes to a running container wait for its next start (pve_lxc's check mode predicts them).

A real run asks PVE (GET pending) what is left pending after its PUT; check mode changes nothing, so it
predicts the same answer from what PVE applies live and what it leaves pending.
"""

from __future__ import annotations

import re

from .pve_spec import DEVICE_KEY, NET_KEY, value_equal

# What a running CT takes at once (pve-container LXC/Config.pm: fast-plug options, and the hotplug of
# memory, swap, cpu limits and network devices).
LIVE_KEYS = (
    "description",
    "onboot",
    "startup",
    "protection",
    "hostname",
    "hookscript",
    "cores",
    "tags",
    "memory",
    "swap",
    "cpulimit",
    "cpuunits",
)


def needs_restart(key, current, deleting, pve_major):
    """Predict whether a change to key stays pending on a running CT (used in check mode).

    PVE 9 hot-adds a new devN but cannot edit or remove one; earlier releases hot-plug no devices.

    >>> needs_restart('memory', {}, False, 9), needs_restart('dev3', {}, False, 9), needs_restart('dev3', {}, False, 8)
    (False, False, True)
    >>> needs_restart('dev0', {'dev0': '/dev/a'}, False, 9), needs_restart('features', {}, False, 9)
    (True, True)
    """
    if key in LIVE_KEYS:
        return False
    if NET_KEY.fullmatch(key):
        return False
    if DEVICE_KEY.fullmatch(key):
        return deleting or key in current or pve_major < 9
    return True


def predict_pending(running, waiting, updates, deletes, pve_major):
    """The keys that wait for the next start of a running CT once updates and deletes are PUT (check mode).

    running is the config the CT runs with (GET pending's values), waiting the keys already pending.
    Keys the change does not touch stay pending. PVE drops a pending entry that equals the running value
    (cleanup_pending) and a pending delete of a key the CT does not have; what is left of the change
    waits unless it can be applied live (needs_restart).

    >>> running = {'dev0': '/dev/a', 'dev4': '/dev/e', 'memory': '4096'}
    >>> predict_pending(running, ['dev4', 'features'], {'memory': '8192'}, [], 9)
    ['dev4', 'features']
    >>> predict_pending(running, ['dev4'], {'dev4': '/dev/e'}, [], 9)
    []
    >>> predict_pending(running, [], {'dev0': '/dev/a,mode=0666', 'dev7': '/dev/h'}, ['dev9'], 9)
    ['dev0']
    """
    after = set(waiting) - set(updates) - set(deletes)
    for key, value in updates.items():
        if not value_equal(key, running.get(key), value) and needs_restart(key, running, False, pve_major):
            after.add(key)
    for key in deletes:
        if key in running and needs_restart(key, running, True, pve_major):
            after.add(key)
    return sorted(after)


def pve_major(version):
    """The major release of a PVE version string ('9.0.10' -> 9; unknown -> 0).

    >>> pve_major('9.0.10'), pve_major('8.2.4'), pve_major('')
    (9, 8, 0)
    """
    found = re.match(r"(\d+)", str(version or ""))
    return int(found.group(1)) if found else 0
