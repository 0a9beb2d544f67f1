"""pve_lxc's run against one container: find it, plan the change, check the rights, change it, set its power.

ensure_ct() is the whole module behind its argument spec: it validates what needs no API, connects, and hands
over to CtRun, which reads the CT, plans one PUT from pve_spec, checks it with pve_rights, makes it (once more
if another editor changed the config meanwhile), and brings the power state to what state asks, restarting for
changes that stay pending. In check mode it reads everything and predicts the rest (pve_restart).
"""

from __future__ import annotations

from .pve_auth import identity_of, tls_warning
from .pve_errors import PveError, api_error_text
from .pve_restart import predict_pending, pve_major
from .pve_rights import Rights
from .pve_session import connect
from .pve_spec import (
    DEVICE_KEY,
    assign_devices,
    check_vmid,
    desired_config,
    parse_devices,
    plan_changes,
    pve_bool,
    render_config,
    split_volume,
)
from .pve_tasks import PveTaskError, wait_task

# PVE's answer to a PUT whose digest no longer matches the config: someone else changed it meanwhile.
STALE_DIGEST = "detected modified configuration"


def ensure_ct(params, check_mode, warn):
    """The pve_lxc module's result for its parameters; PveError for anything the user must fix.

    warn(text) reports a warning (AnsibleModule.warn). Bad input fails before the API is contacted.
    """
    check_vmid(params["vmid"])
    if params["devices"] is not None:
        parse_devices(params["devices"])
    identity = identity_of(params)
    warning = tls_warning(params)
    if warning:
        warn(warning)
    api, version = connect(params)
    return CtRun(params, check_mode, api, version, identity).execute()


class CtRun:
    """One run of the module against one container: read, plan, change, power."""

    def __init__(self, params, check_mode, api, version, identity):
        self.p = params
        self.check_mode = check_mode
        self.api = api
        self.major = pve_major(version)
        self.identity = identity
        self.rights = Rights(api, identity)
        self.node = params["node"]
        self.vmid = params["vmid"]
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
        self.devices = parse_devices(params["devices"]) if params["devices"] is not None else None
        self.running_config = {}
        self.pool = None

    def execute(self):
        """The whole run; returns the module's result."""
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
        if not self.check_mode:
            config, _ = self.read_config()
            self.result["config"] = {k: v for k, v in config.items() if k != "digest"}
        return self.result

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
            refused = self.rights.refusal(text, [what], device_keys=["devN"])
            raise PveError(refused or f"{what} failed: {text}") from None

    def run_task(self, what, fn, **kwargs):
        """Start a PVE task and wait for it; a failure comes with the end of the task's log."""
        upid = self.call(what, fn, **kwargs)
        self.result["tasks"].append(upid)
        try:
            wait_task(self.api, self.node, upid, self.p["task_timeout"])
        except PveTaskError as exc:
            raise PveError("{}: {}\ntask log:\n{}".format(what, exc, "\n".join(exc.log) or "(empty)")) from None

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
                f"CT {self.vmid} does not exist on {self.node} and template is not set: give the OS template to "
                "create it from (STORAGE:vztmpl/FILE)"
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

    def check_existing(self, current):
        """Fail when the existing CT cannot take the spec: a config lock, or the other privilege level."""
        if current.get("lock"):
            raise PveError(
                "CT {0} is locked ({1}): another operation (backup, snapshot, migration, ...) holds "
                "it. Wait for it to finish, or if it was interrupted run `pct unlock {0}` on {2}, then "
                "re-run".format(self.vmid, current["lock"], self.node)
            )
        unprivileged = pve_bool(current.get("unprivileged", 0))
        if self.p["unprivileged"] is not None and unprivileged != pve_bool(self.p["unprivileged"]):
            raise PveError(
                "CT {} is {}, unprivileged={} asked: PVE cannot change this on an existing CT; "
                "back it up and restore it with the other setting, or change the variable".format(
                    self.vmid,
                    "unprivileged" if unprivileged == "1" else "privileged",
                    self.p["unprivileged"],
                )
            )

    # ------------------------------------------------------------ create and update

    def wanted(self, current):
        wanted = desired_config(self.p)
        if self.devices is not None:
            wanted.update(assign_devices(self.devices, current))
            self.result["devices"] = {k: v for k, v in wanted.items() if DEVICE_KEY.fullmatch(k)}
        return wanted

    def create(self):
        self.check_template()
        wanted = self.wanted({})
        body = dict(wanted, vmid=self.vmid, ostemplate=self.p["template"])
        if self.p["rootfs"]:
            body["rootfs"] = self.p["rootfs"]
        unprivileged = self.p["unprivileged"] is None or self.p["unprivileged"]  # PVE's default: unprivileged
        options = dict(wanted, rootfs=self.p["rootfs"]) if self.p["rootfs"] else wanted
        self.rights.check(self.vmid, {}, options, [], unprivileged, self.pool, create=True)
        if self.p["unprivileged"] is not None:
            body["unprivileged"] = pve_bool(self.p["unprivileged"])
        self.result.update(changed=True, created=True, updated=sorted(wanted))
        after = {k: v for k, v in body.items() if k not in ("vmid", "ostemplate")}
        self.diff("", render_config(after))
        if self.check_mode:
            return
        self.run_task(f"create CT {self.vmid} on {self.node}", self.api.nodes(self.node).lxc.post, **body)

    def update(self, running):
        """Change what differs in one PUT guarded by the config's digest; re-read and re-plan once if it went stale."""
        for attempt in (1, 2):
            current, waiting = self.read_config()
            self.check_existing(current)
            wanted = self.wanted(current)
            updates, deletes = plan_changes(current, wanted, self.devices is not None)
            unprivileged = pve_bool(current.get("unprivileged", 0)) == "1"
            self.rights.check(self.vmid, self.running_config or current, updates, deletes, unprivileged, self.pool)
            if self.check_mode and running:
                # What will wait for the next start once the change is made: pending changes already
                # on the CT count too, because the real run restarts for them as well.
                self.result["pending"] = predict_pending(self.running_config, waiting, updates, deletes, self.major)
            if not updates and not deletes:
                return
            after = {k: v for k, v in current.items() if k not in deletes}
            after.update(updates)
            keys = set(updates) | set(deletes)
            self.diff(render_config(current, keys), render_config(after, keys))
            self.result.update(changed=True, updated=sorted(updates), deleted=sorted(deletes))
            if self.check_mode or self.put_config(current, updates, deletes, last_try=attempt == 2):
                return

    def put_config(self, current, updates, deletes, last_try):
        """PUT the change against the digest it was planned from: True when made, False when the digest went stale
        and another try may re-plan; any other refusal (or a second stale digest) is a PveError."""
        body = dict(updates, digest=current["digest"])
        if deletes:
            body["delete"] = ",".join(deletes)
        try:
            self.ct().config.put(**body)
            return True
        except Exception as exc:
            text = api_error_text(exc)
            if STALE_DIGEST in text and not last_try:
                return False
            if STALE_DIGEST in text:
                raise PveError(
                    f"CT {self.vmid} config changed under us twice (digest mismatch: {text}); something else "
                    "is editing it right now. Re-run once it is done"
                ) from None
            refused = self.rights.refusal(text, sorted(set(updates) | set(deletes)))
            raise PveError(refused or f"PUT config of CT {self.vmid} failed: {text}") from None

    def diff(self, before, after):
        header = f"/etc/pve/lxc/{self.vmid}.conf"
        self.result["diff"] = dict(before=before, after=after, before_header=header, after_header=header)

    # ------------------------------------------------------------ power

    def power(self, exists, running):
        """Bring the power state to what state asks, restarting for pending changes when allowed."""
        state = self.p["state"]
        if self.check_mode and not exists:
            # Nothing exists yet to ask about; say what the run would do.
            self.result["status"] = "running" if state in ("started", "restarted") else "stopped"
            return
        if not self.check_mode:
            # The API's own view: what still waits for the next start (from this run or an earlier one).
            self.result["pending"] = self.read_config()[1]
        pending = self.result["pending"] if running else []
        self.result["status"] = "running" if running else "stopped"
        if state in ("started", "restarted") and not running:
            self.start()
        elif state == "stopped" and running:
            self.shutdown()
        elif state == "restarted" or (pending and self.p["restart"] == "auto" and state != "stopped"):
            self.reboot()
        if not self.check_mode:
            self.result["pending"] = self.read_config()[1] if self.result["status"] == "running" else []
        elif self.result["restarted"] or self.result["status"] != "running":
            self.result["pending"] = []
        self.result["restart_required"] = self.result["status"] == "running" and bool(self.result["pending"])

    def start(self):
        self.result.update(changed=True, status="running")
        if not self.check_mode:
            self.run_task(f"start CT {self.vmid}", self.ct().status.start.post)

    def shutdown(self):
        self.result.update(changed=True, status="stopped")
        if not self.check_mode:
            self.run_task(
                f"shut down CT {self.vmid}",
                self.ct().status.shutdown.post,
                timeout=self.p["shutdown_timeout"],
                forceStop=1,
            )

    def reboot(self):
        self.result.update(changed=True, status="running", restarted=True)
        if not self.check_mode:
            self.run_task(f"restart CT {self.vmid}", self.ct().status.reboot.post, timeout=self.p["shutdown_timeout"])

    # ------------------------------------------------------------ absent

    def remove(self):
        self.result.update(changed=True, status="absent")
        current, _ = self.read_config()
        if current.get("lock"):
            raise PveError(
                "CT {0} is locked ({1}); not removing it. Wait for the operation to end or `pct unlock {0}`".format(
                    self.vmid, current["lock"]
                )
            )
        self.diff(render_config(current), "")
        if self.check_mode:
            return
        if self.status() == "running":
            self.run_task(f"stop CT {self.vmid}", self.ct().status.stop.post)
        self.run_task(f"destroy CT {self.vmid}", self.ct().delete, purge=1)
