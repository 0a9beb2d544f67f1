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
from ansible.module_utils.pve import (
    AUTH_ARGUMENT_SPEC,
    AUTH_REQUIRED_TOGETHER,
    DEVICE_RULE,
    ROOT_RULES,
    PveError,
    PveTaskError,
    api_error_text,
    assign_devices,
    check_vmid,
    connect,
    desired_config,
    device_rule_message,
    identity_of,
    may_set_devices,
    parse_devices,
    plan_changes,
    predict_pending,
    rights_message,
    rights_needed,
    root_rule_message,
    pve_bool,
    pve_major,
    render_config,
    split_volume,
    tls_warning,
    wait_task,
)

STALE_DIGEST = "detected modified configuration"


class _Everything(frozenset):
    """The privileges of an identity whose permissions could not be read: PVE itself will decide."""

    def __contains__(self, item):
        return True


_ALL = _Everything()


class CtRun:
    """One run of the module against one container: read, plan, change, power."""

    def __init__(self, module, api, version, identity):
        self.module = module
        self.p = module.params
        self.api = api
        self.major = pve_major(version)
        self.identity = identity
        self.node = self.p["node"]
        self.vmid = self.p["vmid"]
        self.result = dict(
            changed=False,
            vmid=self.vmid,
            node=self.node,
            created=False,
            updated=[],
            deleted=[],
            restart_required=False,
            restarted=False,
            pending=[],
            tasks=[],
            pve_version=version,
            identity=identity,
        )
        self.devices = parse_devices(self.p["devices"]) if self.p["devices"] is not None else None
        self.running_config = {}
        self.pool = None
        self.held = {}  # path -> privileges this identity holds there

    # ------------------------------------------------------------ api calls

    def ct(self):
        return self.api.nodes(self.node).lxc(self.vmid)

    def call(self, what, fn, *args, **kwargs):
        """Run one API call; a ResourceException becomes a PveError naming the call."""
        try:
            return fn(*args, **kwargs)
        except PveError:
            raise
        except Exception as exc:
            text = api_error_text(exc)
            if DEVICE_RULE in text:
                raise PveError(device_rule_message(self.identity, ["devN"])) from None
            for rule in ROOT_RULES:
                if rule in text:
                    raise PveError(root_rule_message(self.identity, {rule: [what]})) from None
            raise PveError(f"{what} failed: {text}") from None

    def run_task(self, what, fn, **kwargs):
        upid = self.call(what, fn, **kwargs)
        self.result["tasks"].append(upid)
        try:
            wait_task(self.api, self.node, upid, self.p["task_timeout"])
        except PveTaskError as exc:
            raise PveError(
                "{}: {}\ntask log:\n{}".format(what, exc, "\n".join(exc.log) or "(empty)")
            ) from None

    def read_config(self):
        """The config with pending values applied (what the CT will run with), and the pending keys.

        Also keeps the values the CT runs with now (self.running_config, from GET pending), which is
        what PVE compares a new value with when it decides whether the change stays pending.
        """
        config = self.call(f"GET config of CT {self.vmid}", self.ct().config.get)
        pending = self.call(f"GET pending of CT {self.vmid}", self.ct().pending.get)
        waiting = sorted(item["key"] for item in pending if "pending" in item or item.get("delete"))
        self.running_config = {item["key"]: item["value"] for item in pending if "value" in item}
        return config, waiting

    def status(self):
        return self.call(f"GET status of CT {self.vmid}", self.ct().status.current.get).get("status")

    # ------------------------------------------------------------ preflight

    def locate(self):
        """'here' if the CT exists on node, None if no guest has the id; fails for another node or a VM."""
        nodes = self.call("GET /nodes", self.api.nodes.get)
        names = sorted(n["node"] for n in nodes)
        if self.node not in names:
            raise PveError("node {!r} is not in this cluster; nodes: {}".format(self.node, ", ".join(names)))
        online = {n["node"]: n.get("status") for n in nodes}
        if online.get(self.node) not in (None, "online"):
            raise PveError(f"node {self.node} is {online[self.node]}; bring it back or choose another node")
        for guest in self.call("GET /cluster/resources", self.api.cluster.resources.get, type="vm"):
            if int(guest.get("vmid", -1)) != self.vmid:
                continue
            if guest.get("type") != "lxc":
                raise PveError(
                    "id {} belongs to a QEMU VM ({!r} on {}), not a container; choose another vmid".format(
                        self.vmid, guest.get("name"), guest.get("node")
                    )
                )
            self.pool = guest.get("pool")
            if guest.get("node") != self.node:
                raise PveError(
                    "CT {0} lives on node {1}, not {2}: set node={1} (or migrate it first)".format(
                        self.vmid, guest.get("node"), self.node
                    )
                )
            return "here"
        return None

    def check_template(self):
        template = self.p["template"]
        if not template:
            raise PveError(
                f"CT {self.vmid} does not exist on {self.node} and template is not set: give the OS template to create "
                "it from (STORAGE:vztmpl/FILE)"
            )
        storage, _ = split_volume(template)
        listing = self.call(
            f"list templates on storage {storage}",
            self.api.nodes(self.node).storage(storage).content.get,
            content="vztmpl",
        )
        found = sorted(item["volid"] for item in listing)
        if template not in found:
            raise PveError(
                "template {0} is not on storage {1} of node {2}; available: {3}. Download it with "
                "`pveam download {1} {4}`".format(
                    template, storage, self.node, ", ".join(found) or "none", template.split("/")[-1]
                )
            )

    def check_rights(self, current, updates, deletes, unprivileged, create=False):
        """Fail before any change (and in check mode) when PVE would refuse it to this identity.

        root@pam (password ticket, or pvesh on the node) may do everything. Any other identity, API
        tokens of root@pam included, may not touch devN, hookscript, or feature flags other than nesting
        (none at all on a privileged CT); the rest needs privileges, read from GET /access/permissions.
        """
        if may_set_devices(self.identity):
            return
        root_only, privileges = rights_needed(self.vmid, current, updates, deletes, unprivileged, create)
        if list(root_only) == [DEVICE_RULE]:
            raise PveError(device_rule_message(self.identity, root_only[DEVICE_RULE]))
        if root_only:
            raise PveError(root_rule_message(self.identity, root_only))
        missing = {}
        for (path, privilege), keys in privileges.items():
            if privilege not in self.privileges(path):
                missing[(path, privilege)] = keys
        pool = self.pool
        if pool:
            on_pool = self.privileges(f"/pool/{pool}")
            missing = {
                (path, priv): keys
                for (path, priv), keys in missing.items()
                if not (path.startswith("/vms/") and priv in on_pool)
            }
        if missing:
            raise PveError(rights_message(self.identity, missing, pool))

    def privileges(self, path):
        """The privileges this identity holds on path (GET /access/permissions); everything when unknown."""
        if path not in self.held:
            try:
                answer = self.api.access.permissions.get(path=path) or {}
            except Exception:  # cannot tell: leave the decision to PVE itself
                answer = None
            if answer is None:
                self.held[path] = _ALL
            else:
                self.held[path] = {
                    priv
                    for privs in answer.values()
                    if isinstance(privs, dict)
                    for priv, on in privs.items()
                    if on
                }
        return self.held[path]

    # ------------------------------------------------------------ create

    def wanted(self, current):
        wanted = desired_config(self.p)
        if self.devices is not None:
            wanted.update(assign_devices(self.devices, current))
            self.result["devices"] = {k: v for k, v in wanted.items() if k.startswith("dev")}
        return wanted

    def create(self):
        self.check_template()
        wanted = self.wanted({})
        body = dict(wanted, vmid=self.vmid, ostemplate=self.p["template"])
        if self.p["rootfs"]:
            body["rootfs"] = self.p["rootfs"]
        unprivileged = self.p["unprivileged"] is None or self.p["unprivileged"]  # PVE's default: unprivileged
        options = dict(wanted, rootfs=self.p["rootfs"]) if self.p["rootfs"] else wanted
        self.check_rights({}, options, [], unprivileged, create=True)
        if self.p["unprivileged"] is not None:
            body["unprivileged"] = pve_bool(self.p["unprivileged"])
        self.result.update(changed=True, created=True, updated=sorted(wanted))
        after = dict(body)
        for key in ("vmid", "ostemplate"):
            after.pop(key)
        self.diff("", render_config(after))
        if self.module.check_mode:
            return
        self.run_task(f"create CT {self.vmid} on {self.node}", self.api.nodes(self.node).lxc.post, **body)

    # ------------------------------------------------------------ update

    def update(self, running):
        for attempt in (1, 2):
            current, waiting = self.read_config()
            if current.get("lock"):
                raise PveError(
                    "CT {0} is locked ({1}): another operation (backup, snapshot, migration, ...) holds "
                    "it. Wait for it to finish, or if it was interrupted run `pct unlock {0}` on {2}, then "
                    "re-run".format(self.vmid, current["lock"], self.node)
                )
            if self.p["unprivileged"] is not None and pve_bool(current.get("unprivileged", 0)) != pve_bool(
                self.p["unprivileged"]
            ):
                raise PveError(
                    "CT {} is {}, unprivileged={} asked: PVE cannot change this on an existing CT; "
                    "back it up and restore it with the other setting, or change the "
                    "variable".format(
                        self.vmid,
                        "unprivileged" if pve_bool(current.get("unprivileged", 0)) == "1" else "privileged",
                        self.p["unprivileged"],
                    )
                )
            wanted = self.wanted(current)
            updates, deletes = plan_changes(current, wanted, self.devices is not None)
            self.check_rights(
                self.running_config or current,
                updates,
                deletes,
                pve_bool(current.get("unprivileged", 0)) == "1",
            )
            if self.module.check_mode and running:
                # What will wait for the next start once the change is made: pending changes already
                # on the CT count too, because the real run restarts for them as well.
                self.result["pending"] = predict_pending(
                    self.running_config, waiting, updates, deletes, self.major
                )
            if not updates and not deletes:
                return
            after = {k: v for k, v in current.items() if k not in deletes}
            after.update(updates)
            keys = set(updates) | set(deletes)
            self.diff(render_config(current, keys), render_config(after, keys))
            self.result.update(changed=True, updated=sorted(updates), deleted=sorted(deletes))
            if self.module.check_mode:
                return
            body = dict(updates, digest=current["digest"])
            if deletes:
                body["delete"] = ",".join(deletes)
            try:
                self.ct().config.put(**body)
                return
            except Exception as exc:
                text = api_error_text(exc)
                if STALE_DIGEST in text and attempt == 1:
                    continue
                if STALE_DIGEST in text:
                    raise PveError(
                        f"CT {self.vmid} config changed under us twice (digest mismatch: {text}); something else "
                        "is editing it right now. Re-run once it is done"
                    ) from None
                if DEVICE_RULE in text:
                    raise PveError(device_rule_message(self.identity, sorted(keys))) from None
                raise PveError(f"PUT config of CT {self.vmid} failed: {text}") from None

    def diff(self, before, after):
        header = f"/etc/pve/lxc/{self.vmid}.conf"
        self.result["diff"] = dict(before=before, after=after, before_header=header, after_header=header)

    # ------------------------------------------------------------ power

    def power(self, exists, running):
        """Bring the power state to what state asks, restarting for pending changes when allowed."""
        state = self.p["state"]
        check = self.module.check_mode
        if check and not exists:
            # Nothing exists yet to ask about; say what the run would do.
            self.result["status"] = "running" if state in ("started", "restarted") else "stopped"
            return
        if not check:
            # The API's own view: what still waits for the next start (from this run or an earlier one).
            self.result["pending"] = self.read_config()[1]
        pending = self.result["pending"] if running else []
        self.result["status"] = "running" if running else "stopped"
        if state == "started" and not running:
            self.start()
        elif state == "stopped" and running:
            self.shutdown()
        elif state == "restarted" and not running:
            self.start()
        elif state == "restarted" or (pending and self.p["restart"] == "auto" and state != "stopped"):
            self.reboot()
        if not check:
            self.result["pending"] = self.read_config()[1] if self.result["status"] == "running" else []
        elif self.result["restarted"] or self.result["status"] != "running":
            self.result["pending"] = []
        self.result["restart_required"] = self.result["status"] == "running" and bool(self.result["pending"])

    def start(self):
        self.result.update(changed=True, status="running")
        if not self.module.check_mode:
            self.run_task(f"start CT {self.vmid}", self.ct().status.start.post)

    def shutdown(self):
        self.result.update(changed=True, status="stopped")
        if not self.module.check_mode:
            self.run_task(
                f"shut down CT {self.vmid}",
                self.ct().status.shutdown.post,
                timeout=self.p["shutdown_timeout"],
                forceStop=1,
            )

    def reboot(self):
        self.result.update(changed=True, status="running", restarted=True)
        if not self.module.check_mode:
            self.run_task(
                f"restart CT {self.vmid}", self.ct().status.reboot.post, timeout=self.p["shutdown_timeout"]
            )

    # ------------------------------------------------------------ absent

    def remove(self):
        self.result.update(changed=True, status="absent")
        current, _ = self.read_config()
        if current.get("lock"):
            raise PveError(
                "CT {0} is locked ({1}); not removing it. Wait for the operation to end or `pct unlock "
                "{0}`".format(self.vmid, current["lock"])
            )
        self.diff(render_config(current), "")
        if self.module.check_mode:
            return
        if self.status() == "running":
            self.run_task(f"stop CT {self.vmid}", self.ct().status.stop.post)
        self.run_task(f"destroy CT {self.vmid}", self.ct().delete, purge=1)

    # ------------------------------------------------------------ main

    def execute(self):
        exists = self.locate() == "here"
        if self.p["state"] == "absent":
            if exists:
                self.remove()
            else:
                self.result["status"] = "absent"
            return self.result
        running = exists and self.status() == "running"
        if exists:
            self.update(running)
        else:
            self.create()
        self.power(exists, running)
        if not self.module.check_mode:
            config, _ = self.read_config()
            self.result["config"] = {k: v for k, v in config.items() if k != "digest"}
        return self.result


def argument_spec():
    spec = dict(
        vmid=dict(type="int", required=True),
        node=dict(type="str", required=True),
        state=dict(
            type="str", default="present", choices=["present", "started", "stopped", "restarted", "absent"]
        ),
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
        check_vmid(module.params["vmid"])
        # Validate what needs no API before connecting: bad input fails before any change.
        if module.params["devices"] is not None:
            parse_devices(module.params["devices"])
        identity = identity_of(module.params)
        warning = tls_warning(module.params)
        if warning:
            module.warn(warning)
        api, version = connect(module.params)
        result = CtRun(module, api, version, identity).execute()
    except PveError as exc:
        module.fail_json(msg=str(exc), vmid=module.params["vmid"], node=module.params["node"])
    except Exception as exc:
        module.fail_json(
            msg=f"pve_lxc: unexpected {type(exc).__name__}: {exc}", exception=traceback.format_exc()
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
