"""What PVE lets an identity change on a container, checked before the change is made.

pve-container reserves some changes to root@pam itself (devN, the hookscript, feature flags other than nesting,
any feature flag of a privileged CT), whatever roles an identity holds; API tokens, even root@pam!name, are
refused them. The rest needs privileges on /vms/<vmid> (or the CT's pool), read from GET /access/permissions.
The rules' texts are PVE's own, so a refusal PVE sends anyway is recognised and worded the same way.
"""

from __future__ import annotations

import re

from .pve_auth import ROOT_IDENTITY
from .pve_errors import PveError
from .pve_spec import DEVICE_KEY, NET_KEY, pve_bool, split_props

DEVICE_RULE = "configuring device passthrough is only allowed for root@pam"
# The other changes pve-container reserves to root@pam itself (PVE::LXC::check_ct_modify_config_perm).
PRIVILEGED_FEATURES_RULE = "changing feature flags for privileged container is only allowed for root@pam"
FEATURES_RULE = "changing feature flags (except nesting) is only allowed for root@pam"
HOOKSCRIPT_RULE = "changing the hookscript is only allowed for root@pam"
ROOT_RULES = (DEVICE_RULE, PRIVILEGED_FEATURES_RULE, FEATURES_RULE, HOOKSCRIPT_RULE)

WAYS_OUT = (
    "Use a root@pam password ticket (api_user=root@pam + api_password, and api_otp if the account has TOTP) "
    "or the node-local backend (api_backend=local, delegated to the PVE node, which runs pvesh as root)."
)


def may_set_devices(identity):
    """True only for root@pam itself (pve-container check_ct_modify_config_perm).

    >>> may_set_devices('root@pam'), may_set_devices('root@pam!ansible'), may_set_devices('admin@pve')
    (True, False, False)
    """
    return identity == ROOT_IDENTITY


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


def rights_message(identity, missing, pool=None):
    """The failure for privileges an identity lacks: {(path, privilege): [keys]}.

    >>> rights_message('ops@pve!ci', {('/vms/129', 'VM.Allocate'): ['features']}).split(':')[0]
    'ops@pve!ci lacks VM.Allocate on /vms/129 (to change features)'
    """
    parts = "; ".join(
        "{} on {} (to change {})".format(privilege, path, ", ".join(keys))
        for (path, privilege), keys in missing.items()
    )
    where = f" (nor on its pool /pool/{pool})" if pool else ""
    return (
        f"{identity} lacks {parts}{where}: grant it a role with these privileges (pveum acl modify PATH --roles ROLE "
        "--users/--tokens ...), or run as root@pam"
    )


def feature_flags(value):
    """A features value as {flag: '1'/'0'}.

    >>> feature_flags('nesting=1,keyctl=1'), feature_flags(None)
    ({'nesting': '1', 'keyctl': '1'}, {})
    """
    return {k: pve_bool(v) for k, v in split_props(value or "")[1].items()}


def config_privilege(key):
    """The privilege on /vms/<vmid> a change to an option needs (None: tags, which have rules of their own).

    >>> config_privilege('memory'), config_privilege('net0'), config_privilege('mp1'), config_privilege('onboot')
    ('VM.Config.Memory', 'VM.Config.Network', 'VM.Config.Disk', 'VM.Config.Options')
    """
    if key in ("cores", "cpuunits", "cpulimit"):
        return "VM.Config.CPU"
    if key in ("memory", "swap"):
        return "VM.Config.Memory"
    if key == "rootfs" or re.fullmatch(r"mp\d+", key):
        return "VM.Config.Disk"
    if NET_KEY.fullmatch(key) or key in ("hostname", "nameserver", "searchdomain"):
        return "VM.Config.Network"
    if key == "tags":  # tag-style privileges; PVE decides
        return None
    return "VM.Config.Options"


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
        if DEVICE_KEY.fullmatch(key):
            root_only.setdefault(DEVICE_RULE, []).append(key)
        elif key == "hookscript":
            root_only.setdefault(HOOKSCRIPT_RULE, []).append(key)
        elif key == "features" and not unprivileged:
            root_only.setdefault(PRIVILEGED_FEATURES_RULE, []).append(key)
        elif key == "features":
            before = feature_flags(current.get("features"))
            after = {} if key in deletes else feature_flags(updates.get("features"))
            changed = {f for f in set(before) | set(after) if before.get(f) != after.get(f)}
            if changed - {"nesting"}:
                root_only.setdefault(FEATURES_RULE, []).append(key)
            elif changed:
                need(vm, "VM.Allocate", key)
        elif config_privilege(key):
            need(vm, config_privilege(key), key)
    return root_only, privileges


class _Everything(frozenset):
    """The privileges of an identity whose permissions could not be read: PVE itself will decide."""

    def __contains__(self, item):
        return True


class Rights:
    """One identity's rights against one cluster: checks a change before it is made, words PVE's refusals."""

    def __init__(self, api, identity):
        self.api = api
        self.identity = identity
        self.held = {}  # path -> privileges this identity holds there

    def check(self, vmid, current, updates, deletes, unprivileged, pool=None, create=False):
        """Fail before any change (and in check mode) when PVE would refuse it to this identity.

        root@pam (password ticket, or pvesh on the node) may do everything. Any other identity, API
        tokens of root@pam included, may not touch devN, hookscript, or feature flags other than nesting
        (none at all on a privileged CT); the rest needs privileges on the CT, or on its pool.
        """
        if may_set_devices(self.identity):
            return
        root_only, privileges = rights_needed(vmid, current, updates, deletes, unprivileged, create)
        if list(root_only) == [DEVICE_RULE]:
            raise PveError(device_rule_message(self.identity, root_only[DEVICE_RULE]))
        if root_only:
            raise PveError(root_rule_message(self.identity, root_only))
        missing = {
            (path, privilege): keys
            for (path, privilege), keys in privileges.items()
            if privilege not in self.privileges(path)
        }
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
                self.held[path] = _Everything()
            else:
                self.held[path] = {
                    priv for privs in answer.values() if isinstance(privs, dict) for priv, on in privs.items() if on
                }
        return self.held[path]

    def refusal(self, text, keys, device_keys=None):
        """The failure for an API answer that quotes one of PVE's root@pam rules; None for any other answer.

        keys names what was being changed; device_keys, when given, what to name for the devN rule instead.
        """
        if DEVICE_RULE in text:
            return device_rule_message(self.identity, keys if device_keys is None else device_keys)
        for rule in ROOT_RULES:
            if rule in text:
                return root_rule_message(self.identity, {rule: keys})
        return None
