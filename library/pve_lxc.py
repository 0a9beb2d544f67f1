#!/usr/bin/python
"""Ansible module pve_lxc: a Proxmox VE LXC container with GPU passthrough as devN entries."""

DOCUMENTATION = r"""
---
module: pve_lxc
short_description: Ensure a Proxmox VE LXC container exists with a spec and devN device passthrough
description:
  - Creates, updates, starts, stops, restarts or removes an LXC container through the Proxmox VE API
    (proxmoxer), idempotently.
  - Compares the wanted spec with the config PVE holds (pending changes included) and changes only what
    differs, in one C(PUT /nodes/{node}/lxc/{vmid}/config) guarded by the config digest. A digest that went
    stale meanwhile is re-read and the change re-planned once; a second conflict fails.
  - GPU passthrough uses PVE's C(devN) options (PVE 8.1+), one per device node path. PVE only lets
    C(root@pam) itself set C(devN); an API token asked to change one fails before anything is changed.
  - A running container whose change stays pending (edited or removed devices, feature flags, ...) is
    restarted when I(restart=auto); with I(restart=never) the module reports C(restart_required=true).
  - Raw C(lxc.*) lines are not part of the API; see the C(pve_lxc_raw) module.
  - Runs on the controller (delegated to localhost) with the https backend, or on the PVE node with
    I(api_backend=local) (pvesh as root, which may set devN without a password).
version_added: "0.1.0"
author: eagle3-pve
requirements:
  - proxmoxer >= 2.0 and requests (controller side, or on the node for api_backend=local)
options:
  vmid:
    description: Container id, 100 to 999999999.
    type: int
    required: true
  node:
    description: Cluster node that holds (or will hold) the container.
    type: str
    required: true
  state:
    description:
      - C(present) ensures the config and leaves the power state alone; C(started) and C(stopped)
        ensure the config and the power state; C(restarted) ensures the config and restarts a running
        container (or starts a stopped one) every time; C(absent) stops and removes the container.
    type: str
    choices: [present, started, stopped, restarted, absent]
    default: present
  template:
    description:
      - OS template volume, C(STORAGE:vztmpl/FILE). Needed to create the container; checked on the
        storage before anything is created. Ignored once the container exists.
    type: str
  hostname:
    description: Container hostname.
    type: str
  cores:
    description: CPU cores.
    type: int
  memory:
    description: Memory in MiB.
    type: int
  swap:
    description: Swap in MiB.
    type: int
  rootfs:
    description:
      - Root filesystem at creation, C(STORAGE:SIZE_IN_GiB) (for example C(local-lvm:64)). Ignored once the
        container exists (resize it with C(pct resize)).
    type: str
  net:
    description:
      - Network interfaces, item N becomes C(netN) (for example C(name=eth0,bridge=vmbr0,ip=dhcp)).
        Only the properties given are compared; PVE adds C(hwaddr) and C(type).
    type: list
    elements: str
  features:
    description: Feature flags as a dict, for example C(nesting=true) (PVE's C(features) option).
    type: dict
  onboot:
    description: Start the container when the node boots.
    type: bool
  unprivileged:
    description:
      - Create an unprivileged container (PVE's default). Read-only after creation; a mismatch with an
        existing container fails.
    type: bool
  devices:
    description:
      - Device nodes passed through as C(devN). Each item is a path that starts with C(/dev/), or a dict with
        C(path) and optional C(gid), C(uid), C(mode) (octal string such as C("0666")) and C(deny_write).
      - The module then owns every C(devN) of the container; C(devN) entries for other paths are removed.
        A path already passed through keeps its index. Omit the option to leave C(devN) alone; give
        C([]) to remove every device.
    type: list
    elements: raw
  restart:
    description:
      - C(auto) restarts a running container when a change stays pending until its next start;
        C(never) leaves it running and reports C(restart_required=true).
    type: str
    choices: [auto, never]
    default: auto
  task_timeout:
    description: Seconds to wait for each PVE task (create, start, reboot, shutdown, destroy).
    type: int
    default: 300
  shutdown_timeout:
    description: Seconds a clean shutdown (for a stop or a restart) may take before PVE stops the container hard.
    type: int
    default: 60
  api_host:
    description: PVE API host. Falls back to C(PROXMOX_HOST).
    type: str
  api_port:
    description: PVE API port. Falls back to C(PROXMOX_PORT).
    type: int
    default: 8006
  api_user:
    description: User, with realm. Falls back to C(PROXMOX_USER).
    type: str
    default: root@pam
  api_password:
    description: Password for a ticket (the only API identity that may set devN is C(root@pam)). Falls back to C(PROXMOX_PASSWORD).
    type: str
  api_otp:
    description: Current TOTP code, for an account with two-factor authentication (valid for 30 s).
    type: str
  api_token_id:
    description: API token name (C(ansible)) or full id (C(root@pam!ansible)). Falls back to C(PROXMOX_TOKEN_ID).
    type: str
  api_token_secret:
    description: API token secret. Falls back to C(PROXMOX_TOKEN_SECRET).
    type: str
  validate_certs:
    description: Verify the API's TLS certificate. Falls back to C(PROXMOX_VALIDATE_CERTS).
    type: bool
    default: true
  ca_path:
    description: CA bundle to verify the API with (C(/etc/pve/pve-root-ca.pem) from a node). Falls back to C(PROXMOX_CA_PATH).
    type: path
  timeout:
    description: Seconds each API request may take (an unreachable API fails after this). Falls back to C(PROXMOX_TIMEOUT).
    type: int
    default: 10
  api_backend:
    description:
      - C(https) talks to I(api_host); C(local) runs C(pvesh) on the machine the module runs on (a PVE node,
        as root).
    type: str
    choices: [https, local]
    default: https
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - Reads the cluster and the container and reports the change, the power state and the pending keys a real
        run would leave. Whether a change needs a restart is predicted (PVE 9 hot-adds new devices; edits and
        removals, and devices on PVE 8, need a restart). RV(config) is not returned.
  diff_mode:
    support: partial
    details:
      - The config keys that change, as lines of C(/etc/pve/lxc/<vmid>.conf) (the whole config when the container
        is created or removed). Power changes (start, stop, restart) are not in the diff; RV(status) and
        RV(restarted) report them.
  platform:
    platforms: posix
    details:
      - The controller (delegated to localhost) with the https backend, or a Proxmox VE node as root with
        O(api_backend=local).
notes:
  - A container with a config lock (backup, snapshot, migrate, ...) fails before any change.
seealso:
  - module: pve_lxc_raw
"""

EXAMPLES = r"""
- name: CT 129 with four GPUs, started
  pve_lxc:
    api_host: pve1.example.com
    api_password: "{{ vault_pve_root_password }}"
    ca_path: files/pve-root-ca.pem
    node: pve1
    vmid: 129
    state: started
    template: local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst
    hostname: train129
    cores: 32
    memory: 262144
    swap: 0
    rootfs: local-lvm:200
    net: ["name=eth0,bridge=vmbr0,ip=dhcp"]
    features: {nesting: true}
    onboot: true
    devices:
      - /dev/nvidia0
      - /dev/nvidia1
      - /dev/nvidiactl
      - {path: /dev/nvidia-uvm, mode: "0666"}
      - /dev/nvidia-uvm-tools
  delegate_to: localhost

- name: Same change on the node itself (pvesh as root; no password on the controller)
  pve_lxc:
    api_backend: local
    node: pve1
    vmid: 129
    devices: [/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools]
    restart: never
  delegate_to: pve1
"""

RETURN = r"""
vmid:
  description: Container id.
  returned: always
  type: int
  sample: 129
node:
  description: Node of the container.
  returned: always
  type: str
  sample: pve1
status:
  description: Power state after the run (C(running), C(stopped), or C(absent)); in check mode the state a real run would leave.
  returned: always
  type: str
  sample: running
created:
  description: Whether the container was created.
  returned: always
  type: bool
updated:
  description: Config keys set or changed.
  returned: always
  type: list
  elements: str
  sample: [dev2, memory]
deleted:
  description: Config keys removed.
  returned: always
  type: list
  elements: str
  sample: [dev5]
devices:
  description: The devN entries wanted, by key.
  returned: when O(devices) is given and O(state) is not C(absent)
  type: dict
  sample: {dev0: /dev/nvidia0, dev1: /dev/nvidiactl}
restart_required:
  description: A running container has changes that wait for its next start.
  returned: always
  type: bool
restarted:
  description: The container was restarted to apply pending changes (or because state=restarted).
  returned: always
  type: bool
pending:
  description: Keys whose change waits for the next start.
  returned: always
  type: list
  elements: str
config:
  description: The container config after the run as GET config returns it (digest left out).
  returned: when O(state) is not C(absent), except in check mode
  type: dict
tasks:
  description: UPIDs of the PVE tasks the run started, in order.
  returned: always
  type: list
  elements: str
pve_version:
  description: PVE version reported by the API.
  returned: always
  type: str
  sample: 9.0.10
identity:
  description: The PVE identity the requests ran as (never a secret).
  returned: always
  type: str
  sample: root@pam
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.pve_auth import AUTH_ARGUMENT_SPEC, AUTH_REQUIRED_TOGETHER
from ansible.module_utils.pve_ct import ensure_ct
from ansible.module_utils.pve_errors import PveError


def argument_spec():
    spec = dict(
        vmid=dict(type="int", required=True),
        node=dict(type="str", required=True),
        state=dict(type="str", default="present", choices=["present", "started", "stopped", "restarted", "absent"]),
        template=dict(type="str"),
        hostname=dict(type="str"),
        cores=dict(type="int"),
        memory=dict(type="int"),
        swap=dict(type="int"),
        rootfs=dict(type="str"),
        net=dict(type="list", elements="str"),
        features=dict(type="dict"),
        onboot=dict(type="bool"),
        unprivileged=dict(type="bool"),
        devices=dict(type="list", elements="raw"),
        restart=dict(type="str", default="auto", choices=["auto", "never"]),
        task_timeout=dict(type="int", default=300),
        shutdown_timeout=dict(type="int", default=60),
    )
    spec.update(AUTH_ARGUMENT_SPEC)
    return spec


def main():
    module = AnsibleModule(
        argument_spec=argument_spec(), required_together=AUTH_REQUIRED_TOGETHER, supports_check_mode=True
    )
    try:
        result = ensure_ct(module.params, module.check_mode, module.warn)
    except PveError as exc:
        module.fail_json(msg=str(exc), vmid=module.params["vmid"], node=module.params["node"])
    except Exception as exc:
        module.fail_json(msg=f"pve_lxc: unexpected {type(exc).__name__}: {exc}", exception=traceback.format_exc())
    module.exit_json(**result)


if __name__ == "__main__":
    main()
