"""Proxmox VE API access shared by the project's PVE modules.

One auth argument spec for every module, one proxmoxer session with errors a human can act on,
task waiting with a deadline, and the pure logic of the pve_lxc module: what a CT config should
contain, how it differs from what PVE holds, and which differences need a restart.

The pure functions need nothing but the standard library, so pytest imports them directly;
proxmoxer and requests are imported lazily, only by connect().
"""

from __future__ import annotations

import os
import posixpath
import re
import time

try:
    from ansible.module_utils.basic import env_fallback
except ImportError:  # plain pytest of the pure functions without Ansible installed

    def env_fallback(*args, **kwargs):
        raise NotImplementedError("env_fallback needs ansible-core")


try:
    from ansible.module_utils.run_bounded import CommandTimeout, run_bounded
except ImportError:  # imported as module_utils.pve outside Ansible
    from module_utils.run_bounded import CommandTimeout, run_bounded


DEFAULT_PORT = 8006
DEFAULT_TIMEOUT = 10
# PVE's own limits (pve-container: dev0..dev255; pve-vmid: 100..999999999).
MAX_DEVICES = 256
VMID_MIN, VMID_MAX = 100, 999_999_999
ROOT_IDENTITY = "root@pam"
DEVICE_RULE = "configuring device passthrough is only allowed for root@pam"
# The other changes pve-container reserves to root@pam itself (PVE::LXC::check_ct_modify_config_perm).
PRIVILEGED_FEATURES_RULE = "changing feature flags for privileged container is only allowed for root@pam"
FEATURES_RULE = "changing feature flags (except nesting) is only allowed for root@pam"
HOOKSCRIPT_RULE = "changing the hookscript is only allowed for root@pam"
ROOT_RULES = (DEVICE_RULE, PRIVILEGED_FEATURES_RULE, FEATURES_RULE, HOOKSCRIPT_RULE)

AUTH_ARGUMENT_SPEC = dict(
    api_host=dict(type="str", fallback=(env_fallback, ["PROXMOX_HOST"])),
    api_port=dict(type="int", default=DEFAULT_PORT, fallback=(env_fallback, ["PROXMOX_PORT"])),
    api_user=dict(type="str", default=ROOT_IDENTITY, fallback=(env_fallback, ["PROXMOX_USER"])),
    api_password=dict(type="str", no_log=True, fallback=(env_fallback, ["PROXMOX_PASSWORD"])),
    api_token_id=dict(type="str", no_log=False, fallback=(env_fallback, ["PROXMOX_TOKEN_ID"])),
    api_token_secret=dict(type="str", no_log=True, fallback=(env_fallback, ["PROXMOX_TOKEN_SECRET"])),
    api_otp=dict(type="str", no_log=True),
    validate_certs=dict(type="bool", default=True, fallback=(env_fallback, ["PROXMOX_VALIDATE_CERTS"])),
    ca_path=dict(type="path", fallback=(env_fallback, ["PROXMOX_CA_PATH"])),
    timeout=dict(type="int", default=DEFAULT_TIMEOUT, fallback=(env_fallback, ["PROXMOX_TIMEOUT"])),
    api_backend=dict(type="str", default="https", choices=["https", "local"]),
)
AUTH_REQUIRED_TOGETHER = [("api_token_id", "api_token_secret")]


class PveError(Exception):
    """A failure worth showing as is: it names what was seen and what to do."""


class PveTaskError(PveError):
    """A PVE task that failed or did not finish in time; carries its UPID and log lines."""

    def __init__(self, message, upid, log):
        super().__init__(message)
        self.upid = upid
        self.log = log


# ---------------------------------------------------------------- identity


def token_identity(api_user, api_token_id):
    """The full token id PVE checks permissions against.

    >>> token_identity('root@pam', 'ansible')
    'root@pam!ansible'
    >>> token_identity('root@pam', 'ops@pve!ci')
    'ops@pve!ci'
    """
    if "!" in api_token_id:
        return api_token_id
    return f"{api_user or ROOT_IDENTITY}!{api_token_id}"


def auth_mode(params):
    """Which identity the parameters select: 'local', 'password' or 'token' (or a PveError).

    A password wins over a token when both are set, because only a root@pam password ticket may
    set devN; the environment fallbacks can easily supply both.
    """
    if params.get("api_backend") == "local":
        return "local"
    if not params.get("api_host"):
        raise PveError(
            "api_host is not set: give the PVE node or cluster address (or PROXMOX_HOST), "
            "or api_backend=local to run pvesh on the node itself"
        )
    if params.get("api_password"):
        return "password"
    if params.get("api_token_id") and params.get("api_token_secret"):
        return "token"
    raise PveError(
        "no credentials: give api_password (root@pam password ticket, needed for devN) or "
        "api_token_id + api_token_secret (or the PROXMOX_PASSWORD / PROXMOX_TOKEN_* variables)"
    )


def identity_of(params):
    """The PVE identity requests run as: 'root@pam', 'root@pam!ansible', ... ('root@pam' for local pvesh)."""
    mode = auth_mode(params)
    if mode == "local":
        return ROOT_IDENTITY
    if mode == "token":
        return token_identity(params.get("api_user"), params["api_token_id"])
    return params.get("api_user") or ROOT_IDENTITY


def may_set_devices(identity):
    """True only for root@pam itself (pve-container check_ct_modify_config_perm).

    >>> may_set_devices('root@pam'), may_set_devices('root@pam!ansible'), may_set_devices('admin@pve')
    (True, False, False)
    """
    return identity == ROOT_IDENTITY


WAYS_OUT = (
    "Use a root@pam password ticket (api_user=root@pam + api_password, and api_otp if the account has TOTP) "
    "or the node-local backend (api_backend=local, delegated to the PVE node, which runs pvesh as root)."
)


def device_rule_message(identity, keys):
    """The failure for an identity that may not touch devN, with the two ways out."""
    return (
        "{} may not change {}: PVE only lets root@pam itself configure device passthrough ({!r}; "
        "API tokens, even root@pam!..., are refused). {}"
    ).format(identity, ", ".join(keys), DEVICE_RULE, WAYS_OUT)


def root_rule_message(identity, refused):
    """The failure for changes only root@pam may make: {rule: [keys]} in PVE's own words, and the ways out."""
    parts = "; ".join("{} ({!r})".format(", ".join(keys), rule) for rule, keys in refused.items())
    return (
        f"{identity} may not change {parts}: PVE only lets root@pam itself make these changes (API tokens, "
        f"even root@pam!..., are refused). {WAYS_OUT}"
    )


def feature_flags(value):
    """A features value as {flag: '1'/'0'}.

    >>> feature_flags('nesting=1,keyctl=1'), feature_flags(None)
    ({'nesting': '1', 'keyctl': '1'}, {})
    """
    return {k: pve_bool(v) for k, v in split_props(value or "")[1].items()}


def rights_needed(vmid, current, updates, deletes, unprivileged, create=False):
    """What PVE asks of an identity other than root@pam for this change (pve-container
    check_ct_modify_config_perm, and the create call's own checks).

    Returns (root_only, privileges): root_only is {rule: [keys]} for changes only root@pam may make;
    privileges is {(path, privilege): [keys]} for the ones a role can grant.

    >>> rights_needed(129, {'features': 'nesting=1'}, {'features': 'nesting=1,keyctl=1', 'dev0': '/dev/a'}, [], True)
    ({'configuring device passthrough is only allowed for root@pam': ['dev0'], 'changing feature flags (except nesting) is only allowed for root@pam': ['features']}, {})
    >>> rights_needed(129, {}, {'features': 'nesting=1', 'memory': '4096'}, [], True)
    ({}, {('/vms/129', 'VM.Allocate'): ['features'], ('/vms/129', 'VM.Config.Memory'): ['memory']})
    >>> rights_needed(129, {'features': 'nesting=1'}, {'features': 'nesting=0'}, [], False)[0]
    {'changing feature flags for privileged container is only allowed for root@pam': ['features']}
    """
    vm = f"/vms/{vmid}"
    root_only, privileges = {}, {}

    def need(path, privilege, key):
        privileges.setdefault((path, privilege), []).append(key)

    if create:
        need(vm, "VM.Allocate", "vmid")
        if not unprivileged:
            need("/", "Sys.Modify", "unprivileged")
    for key in sorted(updates) + sorted(deletes):
        deleting = key in deletes
        if re.fullmatch(r"dev\d+", key):
            root_only.setdefault(DEVICE_RULE, []).append(key)
        elif key == "features":
            if not unprivileged:
                root_only.setdefault(PRIVILEGED_FEATURES_RULE, []).append(key)
                continue
            before = feature_flags(current.get("features"))
            after = {} if deleting else feature_flags(updates.get("features"))
            changed = {f for f in set(before) | set(after) if before.get(f) != after.get(f)}
            if changed - {"nesting"}:
                root_only.setdefault(FEATURES_RULE, []).append(key)
            elif changed:
                need(vm, "VM.Allocate", key)
        elif key == "hookscript":
            root_only.setdefault(HOOKSCRIPT_RULE, []).append(key)
        elif key in ("cores", "cpuunits", "cpulimit"):
            need(vm, "VM.Config.CPU", key)
        elif key in ("memory", "swap"):
            need(vm, "VM.Config.Memory", key)
        elif key in ("rootfs",) or re.fullmatch(r"mp\d+", key):
            need(vm, "VM.Config.Disk", key)
        elif re.fullmatch(r"net\d+", key) or key in ("hostname", "nameserver", "searchdomain"):
            need(vm, "VM.Config.Network", key)
        elif key != "tags":  # tags have their own rules (tag-style privileges); PVE decides
            need(vm, "VM.Config.Options", key)
    return root_only, privileges


def rights_message(identity, missing, pool=None):
    """The failure for privileges an identity lacks: {(path, privilege): [keys]}."""
    parts = "; ".join(
        "{} on {} (to change {})".format(privilege, path, ", ".join(keys))
        for (path, privilege), keys in missing.items()
    )
    where = f" (nor on its pool /pool/{pool})" if pool else ""
    return (
        f"{identity} lacks {parts}{where}: grant it a role with these privileges (pveum acl modify PATH --roles ROLE "
        "--users/--tokens ...), or run as root@pam"
    )


# ---------------------------------------------------------------- session


def connect(params):
    """A proxmoxer API object for the module parameters, with its identity proven by GET /version.

    Returns (api, version string). Raises PveError with a message that never contains a secret.
    """
    try:
        import requests
        from proxmoxer import ProxmoxAPI
        from proxmoxer.core import AuthenticationError, ResourceException
    except ImportError as exc:
        raise PveError(
            "the Proxmox modules need proxmoxer and requests on the controller "
            f"(pip install -r requirements/controller.txt): {exc}"
        ) from None
    mode = auth_mode(params)
    timeout = params.get("timeout") or DEFAULT_TIMEOUT
    if mode != "local" and params.get("ca_path") and not os.path.isfile(params["ca_path"]):
        raise PveError(
            f"ca_path {params['ca_path']} is not a file: copy /etc/pve/pve-root-ca.pem from a PVE node there, "
            "or leave ca_path empty (validate_certs=false only on a trusted network)"
        )
    where = (
        "pvesh on this node"
        if mode == "local"
        else "https://{}:{}".format(params["api_host"], params.get("api_port") or DEFAULT_PORT)
    )
    try:
        if mode == "local":
            api = ProxmoxAPI(backend="local", timeout=timeout)
            bound_local_backend(api, timeout, params.get("task_timeout") or timeout)
        else:
            verify = tls_verify(params)
            kwargs = dict(port=params.get("api_port") or DEFAULT_PORT, verify_ssl=verify, timeout=timeout)
            if mode == "password":
                user = params.get("api_user") or ROOT_IDENTITY
                if not params.get("api_otp"):
                    # Ask PVE first whether the account has a second factor: proxmoxer would answer its
                    # challenge with an empty code, a failed attempt that counts towards PVE's TOTP lockout.
                    first_factor(requests, where, user, params["api_password"], verify, timeout)
                kwargs.update(user=user, password=params["api_password"], otp=params.get("api_otp"))
            else:
                full = token_identity(params.get("api_user"), params["api_token_id"])
                user, _, name = full.partition("!")
                kwargs.update(user=user, token_name=name, token_value=params["api_token_secret"])
            api = ProxmoxAPI(params["api_host"], **kwargs)
        version = api.version.get()
    except AuthenticationError as exc:
        if mode == "password" and params.get("api_otp") and "TFA" in str(exc):
            raise PveError(
                "authentication at {} for {}: the password was accepted but the TOTP code (api_otp) was refused: "
                "it is wrong or expired (a code is valid for 30 s; PVE locks TOTP after repeated "
                "failures)".format(where, params.get("api_user") or ROOT_IDENTITY)
            ) from None
        raise PveError(
            "authentication failed at {} for {}: wrong user or password (the realm is part of the "
            "user: root@pam)".format(where, params.get("api_user"))
        ) from None
    except ResourceException as exc:
        if exc.status_code == 401:
            raise PveError(
                f"{where} rejected {identity_of(params)}: {exc.content}. Check api_token_id / api_token_secret (and that the token "
                "is not expired)"
            ) from None
        raise PveError(f"GET /version at {where} failed: {exc}") from None
    except requests.exceptions.SSLError as exc:
        raise PveError(
            f"TLS verification of {where} failed ({type(exc).__name__}): set ca_path to the cluster CA "
            "(/etc/pve/pve-root-ca.pem on a node) or validate_certs=false"
        ) from None
    except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as exc:
        raise PveError(
            f"cannot reach the Proxmox API at {where} within {timeout}s ({type(exc).__name__}): check api_host/api_port, the "
            "firewall and that pveproxy runs on the node"
        ) from None
    except (OSError, ValueError) as exc:  # the local backend: pvesh missing or not JSON
        raise PveError(f"cannot use {where}: {exc}") from None
    return api, str((version or {}).get("version", ""))


def tls_verify(params):
    """requests' verify= for the parameters, as proxmoxer passes verify_ssl on: the CA file when ca_path is given
    (it is only given to be used), else validate_certs (True: the system's CA store).

    >>> tls_verify({'ca_path': '/ca.pem', 'validate_certs': False}), tls_verify({'validate_certs': False})
    ('/ca.pem', False)
    >>> tls_verify({'validate_certs': None, 'ca_path': None})
    True
    """
    if params.get("ca_path"):
        return params["ca_path"]
    return params.get("validate_certs") is not False


def tls_warning(params):
    """A warning when the https API is not verified, or validate_certs=false is overruled by ca_path; else None.

    >>> tls_warning({'api_backend': 'https', 'validate_certs': False, 'api_host': 'pve1'}).startswith('TLS')
    True
    >>> tls_warning({'api_backend': 'https', 'validate_certs': True, 'api_host': 'pve1'}) is None
    True
    """
    if params.get("api_backend") == "local":
        return None
    if params.get("ca_path") and params.get("validate_certs") is False:
        return (
            "validate_certs=false is ignored: ca_path is given, so the API certificate is verified against "
            f"{params['ca_path']}"
        )
    if tls_verify(params) is False:
        return (
            f"TLS certificate verification is off for {params.get('api_host')} (validate_certs=false): anyone on the "
            "path can read the credentials. Set ca_path to the cluster CA (/etc/pve/pve-root-ca.pem on a node)"
        )
    return None


def first_factor(requests, where, user, password, verify, timeout):
    """Log in with the password only (POST /access/ticket); PveError when PVE asks for a second factor.

    Wrong credentials raise PveError too; otherwise returns None and proxmoxer logs in again for its session.
    """
    answer = requests.post(
        f"{api_base(where)}/access/ticket",
        data={"username": user, "password": password},
        verify=verify,
        timeout=timeout,
    )
    if answer.status_code == 401:
        raise PveError(
            f"authentication failed at {where} for {user}: wrong user or password (the realm is part of the "
            "user: root@pam)"
        )
    if answer.status_code != 200:
        raise PveError(f"POST /access/ticket at {where} failed: {answer.status_code} {answer.reason}")
    data = (answer.json() or {}).get("data") or {}
    if not data.get("NeedTFA"):
        return
    kinds = tfa_kinds(data.get("ticket", ""))
    if kinds and "totp" not in kinds:
        raise PveError(
            "{} has two-factor authentication with {}, which this module cannot answer: use an API token "
            "(api_token_id + api_token_secret) or api_backend=local".format(user, ", ".join(sorted(kinds)))
        )
    raise PveError(
        f"this account needs a TOTP code: {user} has two-factor authentication on at {where}. Give the current "
        "code as api_otp (for example -e pve_api_otp=123456; a code is valid for 30 s), or use an API token "
        "(api_token_id + api_token_secret) or api_backend=local"
    )


def api_base(where):
    """The API root of an https://host:port address (IPv6 hosts in brackets).

    >>> api_base('https://pve1:8006'), api_base('https://fd00::1:8006')
    ('https://pve1:8006/api2/json', 'https://[fd00::1]:8006/api2/json')
    """
    host, _, port = where[len("https://") :].rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"https://{host}:{port}/api2/json"


def tfa_kinds(ticket):
    """The second factors a TFA challenge ticket offers (PVE 7+: '...!tfa!<url-encoded JSON>'); set() if unknown.

    >>> sorted(tfa_kinds('PVE:root@pam:65F0::!tfa!%7B%22totp%22%3Atrue%2C%22recovery%22%3A%22available%22%7D'))
    ['recovery', 'totp']
    >>> tfa_kinds('PVE:!tfa!abc')
    set()
    """
    import json
    from urllib.parse import unquote

    _, marker, challenge = str(ticket).partition("!tfa!")
    if not marker:
        return set()
    try:
        offered = json.loads(unquote(challenge))
    except ValueError:
        return set()
    if not isinstance(offered, dict):
        return set()
    return {kind for kind, value in offered.items() if value}


def bound_local_backend(api, timeout, task_timeout):
    """Make proxmoxer's local backend (pvesh) bounded: its own wait stops at the timeout but leaves pvesh running.

    A read (pvesh get) that overruns timeout is killed; a change (create, set, delete) runs a PVE task in the
    foreground, so it may take task_timeout and is left running when it overruns (cutting a task off halfway
    could leave a half-created CT). Either way the call fails with 'pvesh ... timed out after N s'.
    """
    session = api._backend.session

    def bounded_exec(cmd):
        verb = cmd[cmd.index("pvesh") + 1] if "pvesh" in cmd[:2] else ""
        read = verb in ("get", "ls", "usage")
        limit = timeout if read else max(timeout, task_timeout)
        what = " ".join(cmd[: cmd.index("pvesh") + 3] if "pvesh" in cmd[:2] else cmd[:1])  # never the values
        try:
            done = run_bounded(cmd, limit, what=what, kill=read)
        except CommandTimeout as exc:
            raise PveError(
                f"{exc} (is pve-cluster/pmxcfs hanging? `systemctl status pve-cluster pvedaemon` on the node)"
            ) from None
        return done.stdout, done.stderr, done.returncode

    session._exec = bounded_exec


def api_error_text(exc):
    """The text of a proxmoxer ResourceException (status, message and per-field errors), or str(exc)."""
    content = getattr(exc, "content", None)
    if content is None:
        return str(exc)
    errors = getattr(exc, "errors", None)
    suffix = f" {errors}" if errors else ""
    return f"{exc.status_code} {content}{suffix}"


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
            log = task_log(api, node, upid)
            raise PveTaskError(f"task {upid} failed: {exitstatus}", upid, log)
        if clock() >= deadline:
            if status is None:
                raise PveTaskError(
                    f"no answer about task {upid} for {timeout}s (last error: {last_error}); the link to the node "
                    "is failing: the task may still be running there (see its task log on the node)",
                    upid,
                    [],
                )
            age = task_age(api, node, upid, status)
            raise PveTaskError(
                "task {} still running after {}s{} (raise task_timeout if the node is slow; the task keeps "
                "running on the node)".format(
                    upid,
                    timeout,
                    f", {age} s since it started by the node's clock" if age is not None else "",
                ),
                upid,
                task_log(api, node, upid),
            )
        sleep(min(delay, max(0.0, deadline - clock())))
        delay = min(delay * 2, 1.0)


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


# ------------------------------------------------------- property strings


def split_props(text):
    """('first bare value' or None, {key: value}) of a PVE property string.

    >>> split_props('/dev/nvidia0,gid=44,mode=0666')
    ('/dev/nvidia0', {'gid': '44', 'mode': '0666'})
    >>> split_props('name=eth0,bridge=vmbr0')
    (None, {'name': 'eth0', 'bridge': 'vmbr0'})
    """
    first, props = None, {}
    for n, part in enumerate(str(text).split(",")):
        key, eq, val = part.partition("=")
        if eq:
            props[key.strip()] = val.strip()
        elif part.strip() and n == 0:
            first = part.strip()
    return first, props


def join_props(first, props):
    """Inverse of split_props, keys in the given order.

    >>> join_props('/dev/nvidia0', {'mode': '0666'})
    '/dev/nvidia0,mode=0666'
    """
    parts = [first] if first else []
    parts += [f"{k}={v}" for k, v in props.items()]
    return ",".join(parts)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def pve_bool(value):
    """PVE's spelling of a boolean: '1' or '0'; anything else unchanged as a string.

    >>> pve_bool(True), pve_bool('yes'), pve_bool(0), pve_bool('0666')
    ('1', '1', '0', '0666')
    """
    text = str(value).strip().lower()
    if isinstance(value, bool) or text in _TRUE | _FALSE:
        return "1" if text in _TRUE else "0"
    return str(value).strip()


def norm_mode(mode):
    """A device mode as four octal digits.

    >>> norm_mode('666'), norm_mode('0660'), norm_mode(438)
    ('0666', '0660', '0666')
    """
    if isinstance(mode, int) and not isinstance(mode, bool):
        return f"{mode:04o}"
    text = str(mode).strip()
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise PveError(f"device mode {mode!r} is not an octal mode such as 0666 or 0660")
    return text.rjust(4, "0")


# ----------------------------------------------------------------- devices


def parse_devices(devices):
    """Validated device specs: a list of {'path', 'gid', 'uid', 'mode', 'deny-write'} (unset keys absent).

    Each item is a path string or a dict with path and optional gid, uid, mode, deny_write.
    Bad input raises PveError before anything is changed.

    >>> parse_devices(['/dev/nvidia0', {'path': '/dev/nvidiactl', 'mode': '666'}])
    [{'path': '/dev/nvidia0'}, {'path': '/dev/nvidiactl', 'mode': '0666'}]
    """
    out, seen = [], {}
    if len(devices) > MAX_DEVICES:
        raise PveError(
            f"{len(devices)} devices asked, PVE allows at most {MAX_DEVICES} (dev0..dev{MAX_DEVICES - 1})"
        )
    for n, item in enumerate(devices):
        spec = {"path": item} if isinstance(item, str) else dict(item or {})
        path = str(spec.get("path") or "").strip()
        if not path.startswith("/dev/") or path == "/dev/":
            raise PveError(
                f"devices[{n}]: {path!r} is not a device node path: each must start with /dev/ "
                "(for example /dev/nvidia0)"
            )
        clean = posixpath.normpath(path)
        if not clean.startswith("/dev/"):
            raise PveError(f"devices[{n}]: {path!r} leaves /dev/ once normalised ({clean})")
        if clean in seen:
            raise PveError(
                f"devices[{n}]: {clean} is listed twice (first as devices[{seen[clean]}]); list each node "
                "once"
            )
        seen[clean] = n
        unknown = set(spec) - {"path", "gid", "uid", "mode", "deny_write", "deny-write"}
        if unknown:
            raise PveError(
                f"devices[{n}] ({clean}): unknown keys {sorted(unknown)}; allowed: path, gid, uid, mode, "
                "deny_write"
            )
        entry = {"path": clean}
        for key in ("gid", "uid"):
            if spec.get(key) is not None:
                value = str(spec[key]).strip()
                if not value.isdigit():
                    raise PveError(f"devices[{n}] ({clean}): {key}={spec[key]!r} is not a numeric id")
                entry[key] = value
        if spec.get("mode") is not None:
            entry["mode"] = norm_mode(spec["mode"])
        deny = spec.get("deny_write", spec.get("deny-write"))
        if deny is not None:
            entry["deny-write"] = pve_bool(deny)
        out.append(entry)
    return out


def device_value(entry):
    """The devN value of a parsed device: path then options in PVE's order.

    >>> device_value({'path': '/dev/nvidia0', 'mode': '0666', 'gid': '44'})
    '/dev/nvidia0,gid=44,mode=0666'
    """
    props = {k: entry[k] for k in ("deny-write", "gid", "mode", "uid") if k in entry}
    return join_props(entry["path"], props)


def device_path(value):
    """The host path of a devN value.

    >>> device_path('/dev/nvidia-uvm,mode=0666')
    '/dev/nvidia-uvm'
    """
    first, props = split_props(value)
    return first or props.get("path", "")


def dev_keys(config):
    """The devN keys of a config, by index.

    >>> dev_keys({'dev10': 'a', 'dev2': 'b', 'memory': 1})
    ['dev2', 'dev10']
    """
    return sorted((k for k in config if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:]))


def assign_devices(entries, current):
    """{devN: value} for the wanted devices, keeping the index each path already has.

    A path already passed through keeps its devN (so a re-run never renumbers); new paths take the
    lowest free indices. devN entries for other paths are left out: the caller deletes them.

    >>> assign_devices([{'path': '/dev/a'}, {'path': '/dev/b'}], {'dev0': '/dev/b', 'dev1': '/dev/x'})
    {'dev0': '/dev/b', 'dev2': '/dev/a'}
    """
    by_path = {device_path(current[k]): k for k in dev_keys(current)}
    taken = set(current) & set(by_path.values())
    out = {}
    for entry in entries:
        key = by_path.get(entry["path"])
        if key is not None:
            out[key] = device_value(entry)
    for entry in entries:
        if entry["path"] in by_path:
            continue
        n = 0
        while f"dev{n}" in taken or f"dev{n}" in out:
            n += 1
        out[f"dev{n}"] = device_value(entry)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][3:])))


# ------------------------------------------------------------------ config


def desired_config(spec):
    """The CT config keys the spec manages, as PVE strings (None and empty options are unmanaged).

    >>> desired_config({'hostname': 'ct129', 'cores': 4, 'onboot': True, 'features': {'nesting': True},
    ...                 'net': ['name=eth0,bridge=vmbr0,ip=dhcp'], 'memory': None})
    {'hostname': 'ct129', 'cores': '4', 'onboot': '1', 'features': 'nesting=1', 'net0': 'name=eth0,bridge=vmbr0,ip=dhcp'}
    """
    out = {}
    for key in ("hostname", "cores", "memory", "swap", "onboot", "description"):
        if spec.get(key) is not None:
            out[key] = pve_bool(spec[key]) if key == "onboot" else str(spec[key])
    features = spec.get("features")
    if isinstance(features, dict):
        out["features"] = ",".join(f"{k}={pve_bool(v)}" for k, v in sorted(features.items()))
    elif features:
        out["features"] = str(features)
    for n, net in enumerate(spec.get("net") or []):
        out[f"net{n}"] = str(net)
    return out


def value_equal(key, current, wanted):
    """True if PVE's current value already is the wanted one, for the key's kind of value.

    PVE adds hwaddr and type to netN, sorts feature flags and spells booleans as 1/0.

    >>> value_equal('net0', 'name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=dhcp,type=veth',
    ...             'name=eth0,bridge=vmbr0,ip=dhcp')
    True
    >>> value_equal('features', 'keyctl=1,nesting=1', 'nesting=1,keyctl=1'), value_equal('cores', 4, '4')
    (True, True)
    """
    if current is None:
        return wanted is None
    if wanted is None:
        return False
    if re.fullmatch(r"net\d+", key):
        first_c, cur = split_props(current)
        first_w, want = split_props(wanted)
        return all(pve_bool(cur.get(k, "")) == pve_bool(v) for k, v in want.items())
    if key == "features":
        cur = {k: pve_bool(v) for k, v in split_props(current)[1].items()}
        want = {k: pve_bool(v) for k, v in split_props(wanted)[1].items()}
        return cur == want
    if re.fullmatch(r"dev\d+", key):
        first_c, cur = split_props(current)
        first_w, want = split_props(wanted)
        norm = {"mode": norm_mode, "deny-write": pve_bool}
        cur = {k: norm.get(k, str)(v) for k, v in cur.items()}
        want = {k: norm.get(k, str)(v) for k, v in want.items()}
        return first_c == first_w and cur == want
    return pve_bool(current) == pve_bool(wanted)


def plan_changes(current, wanted, manage_devices):
    """(updates, deletes): the PUT that turns current into wanted.

    wanted holds the managed keys (devN included when manage_devices); with manage_devices every
    devN of current that wanted lacks is deleted, other unmanaged keys are left alone.

    >>> plan_changes({'cores': 2, 'dev0': '/dev/a', 'dev1': '/dev/b'}, {'cores': '4', 'dev0': '/dev/a'}, True)
    ({'cores': '4'}, ['dev1'])
    """
    updates = {k: v for k, v in wanted.items() if not value_equal(k, current.get(k), v)}
    deletes = [k for k in dev_keys(current) if k not in wanted] if manage_devices else []
    return updates, deletes


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
    if re.fullmatch(r"net\d+", key):
        return False
    if re.fullmatch(r"dev\d+", key):
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


def render_config(config, keys=None):
    """A config as the lines of /etc/pve/lxc/<vmid>.conf (sorted; digest and lock left out): for diffs.

    >>> render_config({'memory': 4096, 'cores': 4, 'digest': 'abc'})
    'cores: 4\\nmemory: 4096\\n'
    """
    keys = sorted(config) if keys is None else sorted(keys)
    return "".join(f"{k}: {config[k]}\n" for k in keys if k in config and k != "digest")


def check_vmid(vmid):
    """Raise PveError unless vmid is in PVE's range.

    >>> check_vmid(129)
    129
    """
    if not isinstance(vmid, int) or isinstance(vmid, bool) or not VMID_MIN <= vmid <= VMID_MAX:
        raise PveError(
            f"vmid {vmid!r} is out of range: PVE guest ids are {VMID_MIN}..{VMID_MAX} (CT 129 is the default)"
        )
    return vmid


def split_volume(volid):
    """(storage, volume name) of a volume id such as local:vztmpl/debian-12.tar.zst.

    >>> split_volume('local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst')
    ('local', 'vztmpl/debian-12-standard_12.7-1_amd64.tar.zst')
    """
    storage, colon, name = str(volid).partition(":")
    if not colon or not storage or not name:
        raise PveError(
            f"template {volid!r} is not a volume id STORAGE:vztmpl/FILE, for example "
            "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
        )
    return storage, name
