"""Who the Proxmox modules talk to the API as, and how they trust it.

One auth argument spec for every PVE module (each option falls back to its PROXMOX_* variable), which identity
the parameters select (password ticket, API token, or pvesh as root on the node), and what TLS verification
they ask for. Nothing here touches the network: pve_session opens the session.
"""

from __future__ import annotations

try:
    from ansible.module_utils.basic import env_fallback
except ImportError:  # plain pytest of the pure functions without Ansible installed

    def env_fallback(*args, **kwargs):
        raise NotImplementedError("env_fallback needs ansible-core")


from .pve_errors import PveError

DEFAULT_PORT = 8006
DEFAULT_TIMEOUT = 10
# The one identity PVE lets configure devices, hookscripts and most feature flags (see pve_rights).
ROOT_IDENTITY = "root@pam"

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

    >>> auth_mode({'api_host': 'pve1', 'api_password': 'x', 'api_token_id': 'ci', 'api_token_secret': 'y'})
    'password'
    >>> auth_mode({'api_backend': 'local'})
    'local'
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
    """The PVE identity requests run as: 'root@pam', 'root@pam!ansible', ... ('root@pam' for local pvesh).

    >>> identity_of({'api_host': 'pve1', 'api_user': 'root@pam', 'api_token_id': 'ci', 'api_token_secret': 'y'})
    'root@pam!ci'
    """
    mode = auth_mode(params)
    if mode == "local":
        return ROOT_IDENTITY
    if mode == "token":
        return token_identity(params.get("api_user"), params["api_token_id"])
    return params.get("api_user") or ROOT_IDENTITY


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
