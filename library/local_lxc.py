#!/usr/bin/python
# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lifecycle of the embedded default: a local LXC container with systemd inside, standing in for a PVE CT."""

from __future__ import annotations

DOCUMENTATION = r"""
module: local_lxc
short_description: Start, stop or remove a local LXC container that stands in for a Proxmox VE CT
description:
  - Drives the C(lxc-*) tools for a container kept under its own lxcpath (the embedded default CT 129).
  - C(started) boots the container and waits until systemd inside reports C(running) or C(degraded).
  - C(absent) stops the container and removes its directory and its empty cgroup directories (a container
    stopped from outside leaves them), then verifies that no process, cgroup directory or mount of it is left
    behind, and fails listing them when any is (a cgroup that still holds a process is never removed).
  - The container's configuration and root file system are written by the C(local_ct) role, not here.
version_added: "0.1.0"
author: eagle3-pve contributors
options:
  name:
    description: Container name (the VMID).
    type: str
    required: true
  lxcpath:
    description: Directory that holds the container (C(lxc-* -P)).
    type: path
    required: true
  state:
    description: Wanted state.
    type: str
    choices: [started, stopped, absent]
    default: started
  restart:
    description: Restart a running container (its configuration changed; LXC reads it only at start).
    type: bool
    default: false
  boot_timeout:
    description: Seconds to wait for systemd inside to finish booting.
    type: int
    default: 60
  stop_timeout:
    description: Seconds a clean shutdown may take before the container is killed.
    type: int
    default: 30
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - Reports whether a start, restart, stop or removal would happen and does none of them. A running container
        is still asked whether systemd finished booting; removal leftovers are not looked for.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Linux with the LXC tools (C(lxc-start), C(lxc-stop), C(lxc-attach), C(lxc-info)), as root.
"""

EXAMPLES = r"""
- name: Boot the local CT 129
  local_lxc:
    name: "129"
    lxcpath: /var/lib/eagle3-pve/lxc

- name: Remove it, verifying nothing is left behind
  local_lxc:
    name: "129"
    lxcpath: /var/lib/eagle3-pve/lxc
    state: absent
"""

RETURN = r"""
state:
  description:
    - State of the container afterwards (C(RUNNING), C(STOPPED) or C(ABSENT)).
    - In check mode, C(STOPPED) and C(ABSENT) are the states a real run would leave; a start or restart that would
      happen returns the state before it.
  type: str
  returned: always
  sample: RUNNING
system_state:
  description: What C(systemctl is-system-running) said inside the container once booted (C(running) or C(degraded)).
  type: str
  returned: when O(state=started), except in check mode when a start or restart would happen
  sample: running
init_pid:
  description: Host PID of the container's init.
  type: int
  returned: when O(state=started), except in check mode when a start or restart would happen
leftovers:
  description:
    - Processes, cgroup directories and mounts of the container found after removal (empty on success; the task
      fails when it is not). Not looked for in check mode ([]).
  type: list
  elements: str
  returned: when O(state=absent)
  sample: ["/sys/fs/cgroup/lxc.payload.129", "process 4242 with root /var/lib/eagle3-pve/lxc/129/rootfs"]
"""

import glob
import os
import shutil
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.run_bounded import CommandTimeout, run_bounded


def lxc(module, *args, check=True, timeout=120):
    cmd = [args[0], "-P", module.params["lxcpath"], "-n", module.params["name"], *args[1:]]
    try:
        proc = run_bounded(cmd, timeout)
    except CommandTimeout as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"cannot run {cmd[0]}: {exc} (is the lxc package installed?)")
    if check and proc.returncode != 0:
        module.fail_json(
            msg=f"{' '.join(cmd)} failed (rc={proc.returncode}): {proc.stderr.strip()}",
            stdout=proc.stdout,
            stderr=proc.stderr,
        )
    return proc


def state_of(module) -> str:
    if not os.path.exists(os.path.join(module.params["lxcpath"], module.params["name"], "config")):
        return "ABSENT"
    proc = lxc(module, "lxc-info", "-sH", check=False)
    return proc.stdout.strip() or "STOPPED"


def wait_booted(module) -> str:
    """Poll systemd inside the container until it has finished booting (running or degraded)."""
    deadline = time.monotonic() + module.params["boot_timeout"]
    seen = ""
    while time.monotonic() < deadline:
        proc = lxc(
            module,
            "lxc-attach",
            "--clear-env",
            "--",
            "systemctl",
            "is-system-running",
            check=False,
            timeout=10,
        )
        seen = proc.stdout.strip()
        if seen in ("running", "degraded"):
            return seen
        time.sleep(0.25)
    module.fail_json(
        msg=f"CT {module.params['name']}: systemd did not finish booting within "
        f"{module.params['boot_timeout']}s (last state: {seen or 'no answer'})"
    )


def stop(module):
    proc = lxc(
        module,
        "lxc-stop",
        "-t",
        str(module.params["stop_timeout"]),
        check=False,
        timeout=module.params["stop_timeout"] + 30,
    )
    if state_of(module) == "RUNNING":
        lxc(module, "lxc-stop", "-k", check=False)
    if state_of(module) == "RUNNING":
        module.fail_json(msg=f"CT {module.params['name']} is still running after lxc-stop -k: {proc.stderr}")


def cgroup_dirs(name: str) -> list[str]:
    """The container's cgroup directories: v2 unified, or one per v1 controller hierarchy."""
    bases = ["/sys/fs/cgroup", *glob.glob("/sys/fs/cgroup/*/")]
    return [
        path
        for base in bases
        for kind in ("payload", "monitor", "pivot")
        if os.path.isdir(path := os.path.join(base, f"lxc.{kind}.{name}"))
    ]


def remove_empty_cgroups(name: str) -> list[str]:
    """Remove the container's cgroup directories that hold no process, deepest first.

    A container stopped from outside (lxc-stop, a crash of its monitor) can leave them behind, with the nested
    folders systemd made inside. Empty ones are removed here; one that still holds a process is kept and returned.
    """
    kept = []
    for top in cgroup_dirs(name):
        for path, _dirs, _files in os.walk(top, topdown=False):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    busy = bool(f.read().strip())
            except OSError:
                busy = False
            if busy:
                kept.append(path)
                continue
            try:
                os.rmdir(path)
            except OSError:
                kept.append(path)
    return kept


def leftovers(name: str, ct_dir: str) -> list[str]:
    """What a removed container may leave behind: cgroup directories, mounts, processes rooted in it."""
    found = cgroup_dirs(name)
    with open("/proc/self/mountinfo") as f:
        found += [
            f"mount {line.split()[4]}"
            for line in f
            if line.split()[4].startswith(ct_dir + "/") or line.split()[4] == ct_dir
        ]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            root = os.readlink(f"/proc/{pid}/root")
        except OSError:
            continue
        if root.startswith(ct_dir + "/"):
            found.append(f"process {pid} with root {root}")
    return sorted(set(found))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            lxcpath=dict(type="path", required=True),
            state=dict(type="str", choices=["started", "stopped", "absent"], default="started"),
            restart=dict(type="bool", default=False),
            boot_timeout=dict(type="int", default=60),
            stop_timeout=dict(type="int", default=30),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not p["name"].isdigit():
        module.fail_json(msg=f"name must be the container's VMID (an integer), got {p['name']!r}")
    ct_dir = os.path.join(p["lxcpath"], p["name"])
    before = state_of(module)
    result = {"changed": False, "state": before}

    if p["state"] == "absent":
        if before != "ABSENT" or os.path.exists(ct_dir):
            result["changed"] = True
            if not module.check_mode:
                if before == "RUNNING":
                    lxc(module, "lxc-stop", "-k", check=False)
                if os.path.exists(ct_dir):
                    shutil.rmtree(ct_dir)
        # Empty cgroup folders a stop from outside left behind are removed; busy ones are reported below.
        if cgroup_dirs(p["name"]):
            result["changed"] = True
            if not module.check_mode:
                remove_empty_cgroups(p["name"])
        result["state"] = "ABSENT"
        result["leftovers"] = [] if module.check_mode else leftovers(p["name"], ct_dir)
        if result["leftovers"]:
            module.fail_json(msg=f"CT {p['name']} removed but left behind: {', '.join(result['leftovers'])}", **result)
        module.exit_json(**result)

    if before == "ABSENT":
        module.fail_json(msg=f"CT {p['name']} has no configuration at {ct_dir}/config: the local_ct role writes it")

    if p["state"] == "stopped":
        if before == "RUNNING":
            result["changed"] = True
            if not module.check_mode:
                stop(module)
        result["state"] = "STOPPED"
        module.exit_json(**result)

    # started
    if before == "RUNNING" and p["restart"]:
        result["changed"] = True
        if module.check_mode:
            module.exit_json(**result)
        stop(module)
        before = "STOPPED"
    if before != "RUNNING":
        result["changed"] = True
        if module.check_mode:
            module.exit_json(**result)
        lxc(module, "lxc-start", "-d")
    result["system_state"] = wait_booted(module)
    result["state"] = "RUNNING"
    result["init_pid"] = int(lxc(module, "lxc-info", "-pH").stdout.strip() or 0)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
