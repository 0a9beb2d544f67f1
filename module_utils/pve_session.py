"""The proxmoxer session of the Proxmox modules: log in, prove the identity, fail in words a human can act on.

connect() opens the https API with a password ticket (asking PVE first whether the account needs a TOTP code)
or an API token, or the node-local pvesh backend with every call bounded. proxmoxer and requests are imported
only there, so the rest of the PVE module_utils import without them.
"""

from __future__ import annotations

import json
import os
from urllib.parse import unquote

from .pve_auth import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    ROOT_IDENTITY,
    auth_mode,
    identity_of,
    tls_verify,
    token_identity,
)
from .pve_errors import PveError
from .run_bounded import CommandTimeout, run_bounded


def connect(params):
    """A proxmoxer API object for the module parameters, with its identity proven by GET /version.

    Returns (api, version string). Raises PveError with a message that never contains a secret.
    """
    try:
        import requests
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
        api = open_api(params, mode, where, timeout)
        version = api.version.get()
    except AuthenticationError as exc:
        raise PveError(login_refused(params, mode, where, exc)) from None
    except ResourceException as exc:
        if exc.status_code == 401:
            raise PveError(
                f"{where} rejected {identity_of(params)}: {exc.content}. Check api_token_id / api_token_secret "
                "(and that the token is not expired)"
            ) from None
        raise PveError(f"GET /version at {where} failed: {exc}") from None
    except requests.exceptions.SSLError as exc:
        raise PveError(
            f"TLS verification of {where} failed ({type(exc).__name__}): set ca_path to the cluster CA "
            "(/etc/pve/pve-root-ca.pem on a node) or validate_certs=false"
        ) from None
    except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as exc:
        raise PveError(
            f"cannot reach the Proxmox API at {where} within {timeout}s ({type(exc).__name__}): check "
            "api_host/api_port, the firewall and that pveproxy runs on the node"
        ) from None
    except (OSError, ValueError) as exc:  # the local backend: pvesh missing or not JSON
        raise PveError(f"cannot use {where}: {exc}") from None
    return api, str((version or {}).get("version", ""))


def open_api(params, mode, where, timeout):
    """The ProxmoxAPI object for the selected identity (not yet used: connect() proves it with GET /version)."""
    import requests
    from proxmoxer import ProxmoxAPI

    if mode == "local":
        api = ProxmoxAPI(backend="local", timeout=timeout)
        bound_local_backend(api, timeout, params.get("task_timeout") or timeout)
        return api
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
        user, _, name = token_identity(params.get("api_user"), params["api_token_id"]).partition("!")
        kwargs.update(user=user, token_name=name, token_value=params["api_token_secret"])
    return ProxmoxAPI(params["api_host"], **kwargs)


def login_refused(params, mode, where, exc):
    """The failure for a login proxmoxer's AuthenticationError refused: a wrong TOTP code, or wrong credentials."""
    user = params.get("api_user")
    if mode == "password" and params.get("api_otp") and "TFA" in str(exc):
        return (
            f"authentication at {where} for {user or ROOT_IDENTITY}: the password was accepted but the TOTP code "
            "(api_otp) was refused: it is wrong or expired (a code is valid for 30 s; PVE locks TOTP after "
            "repeated failures)"
        )
    return wrong_password(where, user)


def wrong_password(where, user):
    """The failure for credentials PVE refused.

    >>> wrong_password('https://pve1:8006', 'root')
    'authentication failed at https://pve1:8006 for root: wrong user or password (the realm is part of the user: root@pam)'
    """
    return (
        f"authentication failed at {where} for {user}: wrong user or password (the realm is part of the user: root@pam)"
    )


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
        raise PveError(wrong_password(where, user))
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
