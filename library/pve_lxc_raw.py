#!/usr/bin/python
"""Ansible module pve_lxc_raw: raw lxc.* lines in /etc/pve/lxc/<vmid>.conf, edited in place on the node."""

DOCUMENTATION = r"""
---
module: pve_lxc_raw
short_description: Ensure raw lxc.* lines in a Proxmox VE container config
description:
  - Adds or removes raw C(lxc.*) lines (legacy device passthrough, NVIDIA container-toolkit hooks, mount
    entries) in C(/etc/pve/lxc/<vmid>.conf). The PVE API refuses these keys, so the module edits the file
    on the node that holds the container.
  - Lines go in the container's current config, before the first C([snapshot]) or C([pve:pending])
    section; snapshot sections are never changed.
  - The file is rewritten in place, without a temporary file and rename, because C(/etc/pve) is pmxcfs,
    which refuses renames into it.
  - Raw lines take effect at the next container start; the module reports C(changed) and leaves
    restarting to the caller (C(pve_lxc) with C(state=restarted)).
version_added: "0.1.0"
author: eagle3-pve
options:
  vmid:
    description: Container id; the file is C(<config_dir>/<vmid>.conf).
    type: int
    required: true
  lines:
    description:
      - 'Raw lines as C(lxc.KEY: VALUE), for example C(lxc.cgroup2.devices.allow: c 195:* rwm).'
    type: list
    elements: str
    required: true
  state:
    description: C(present) adds missing lines; C(absent) removes matching lines (same key and value).
    type: str
    choices: [present, absent]
    default: present
  exclusive:
    description:
      - With I(state=present), remove other lines with the same keys, so that the listed values are the only
        ones (replaces a single-valued key such as C(lxc.hook.pre-start)).
    type: bool
    default: false
  config_dir:
    description: Directory of the container configs of this node.
    type: path
    default: /etc/pve/lxc
  lock_timeout:
    description: Seconds to wait for PVE's config lock of the container (C(pct set) and the API take it too).
    type: int
    default: 10
  lock_dir:
    description: Directory of PVE's container config locks (C(pve-config-<vmid>.lock)).
    type: path
    default: /run/lock/lxc
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
    details: The whole config file before and after.
  platform:
    platforms: posix
    details: A Proxmox VE node that holds the container, as root; standard library only.
notes:
  - C(lxc.cgroup.*) keys (cgroup v1) are ignored by PVE 9; the module warns and suggests C(lxc.cgroup2.*).
seealso:
  - module: pve_lxc
"""

EXAMPLES = r"""
- name: Legacy passthrough of /dev/nvidia0 for a CT on a host without devN support
  pve_lxc_raw:
    vmid: 129
    lines:
      - "lxc.cgroup2.devices.allow: c 195:* rwm"
      - "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"
  delegate_to: pve1

- name: NVIDIA container-toolkit hook, one value only
  pve_lxc_raw:
    vmid: 129
    exclusive: true
    lines:
      - "lxc.hook.mount: /usr/share/lxc/hooks/nvidia"
  delegate_to: pve1
"""

RETURN = r"""
path:
  description: The config file edited.
  returned: always
  type: str
  sample: /etc/pve/lxc/129.conf
raw_lines:
  description: 'The raw lines of the current config after the run (in check mode, after a real run), as C(key: value).'
  returned: always
  type: list
  elements: str
  sample: ["lxc.cgroup2.devices.allow: c 195:* rwm"]
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.pve_conf import (
    LOCK_DIR,
    LOCK_TIMEOUT,
    ConfError,
    ConfigLock,
    ConfLockError,
    cgroup_v1_keys,
    edit_raw_lines,
    format_line,
    raw_lines_of,
)


def write_in_place(path, text):
    """Overwrite the file's content without replacing the file (pmxcfs refuses a rename into /etc/pve)."""
    with open(path, "r+", encoding="utf-8") as handle:
        handle.seek(0)
        handle.write(text)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


def edit(module, path):
    """(before, after) of the config file; outside check mode the edit is written under PVE's config lock.

    The lock is taken before the file is read, so a concurrent `pct set` (which holds the same lock while
    it reads and writes the file) is either fully before or fully after this edit, never lost.
    """
    p = module.params

    def read_edit_write():
        with open(path, encoding="utf-8") as handle:
            before = handle.read()
        after = edit_raw_lines(before, p["lines"], state=p["state"], exclusive=p["exclusive"])
        if after != before and not module.check_mode:
            try:
                write_in_place(path, after)
            except OSError as exc:
                module.fail_json(msg=f"cannot write {path} in place: {exc}", path=path)
        return before, after

    if module.check_mode:  # nothing is written: read the file the way `pct config` does, without the lock
        return read_edit_write()
    with ConfigLock(p["vmid"], lock_dir=p["lock_dir"], timeout=p["lock_timeout"]):
        return read_edit_write()


def main():
    module = AnsibleModule(
        argument_spec=dict(
            vmid=dict(type="int", required=True),
            lines=dict(type="list", elements="str", required=True),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            exclusive=dict(type="bool", default=False),
            config_dir=dict(type="path", default="/etc/pve/lxc"),
            lock_timeout=dict(type="int", default=LOCK_TIMEOUT),
            lock_dir=dict(type="path", default=LOCK_DIR),
        ),
        supports_check_mode=True,
    )
    p = module.params
    path = os.path.join(p["config_dir"], "{}.conf".format(p["vmid"]))
    try:
        old_keys = cgroup_v1_keys(p["lines"])
        if not os.path.isfile(path):
            module.fail_json(
                msg="{} not found: CT {} does not exist on this node (run this on the node that holds it, "
                "after pve_lxc created it)".format(path, p["vmid"]),
                path=path,
            )
        before, after = edit(module, path)
    except ConfError as exc:
        module.fail_json(msg=str(exc), path=path)
    except ConfLockError as exc:
        module.fail_json(msg=str(exc), path=path)
    except OSError as exc:
        module.fail_json(msg=f"cannot read {path}: {exc} (the module must run as root on the PVE node)")
    for key in old_keys:
        module.warn(
            "{} is a cgroup v1 key, ignored by PVE 9 (cgroup v2 only): use {}".format(
                key, key.replace("lxc.cgroup.", "lxc.cgroup2.", 1)
            )
        )
    changed = after != before
    result = dict(changed=changed, path=path, raw_lines=[format_line(*pair) for pair in raw_lines_of(after)])
    if changed:
        result["diff"] = dict(before=before, after=after, before_header=path, after_header=path)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
