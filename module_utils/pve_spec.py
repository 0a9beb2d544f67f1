"""A container's config as pve_lxc manages it: the wanted keys from the module's spec, and the change to PVE's
config that gives them.

PVE writes options as property strings ('/dev/nvidia0,gid=44,mode=0666'), booleans as 1/0, and adds
properties of its own (hwaddr and type on netN); the comparison here reads through those spellings, so a
re-run with the same spec changes nothing. Devices become devN entries that keep their index across runs.
Pure functions on plain dicts: pytest runs them without an API.
"""

from __future__ import annotations

import posixpath
import re

from .pve_errors import PveError

# PVE's own limits (pve-container: dev0..dev255; pve-vmid: 100..999999999).
MAX_DEVICES = 256
VMID_MIN, VMID_MAX = 100, 999_999_999
# The numbered options: devN (a passed-through device node), netN (a network interface).
DEVICE_KEY = re.compile(r"dev\d+")
NET_KEY = re.compile(r"net\d+")


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
        raise PveError(f"{len(devices)} devices asked, PVE allows at most {MAX_DEVICES} (dev0..dev{MAX_DEVICES - 1})")
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
                f"devices[{n}]: {clean} is listed twice (first as devices[{seen[clean]}]); list each node once"
            )
        seen[clean] = n
        unknown = set(spec) - {"path", "gid", "uid", "mode", "deny_write", "deny-write"}
        if unknown:
            raise PveError(
                f"devices[{n}] ({clean}): unknown keys {sorted(unknown)}; allowed: path, gid, uid, mode, deny_write"
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
    return sorted((k for k in config if DEVICE_KEY.fullmatch(k)), key=lambda k: int(k[3:]))


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
    if NET_KEY.fullmatch(key):
        first_c, cur = split_props(current)
        first_w, want = split_props(wanted)
        return all(pve_bool(cur.get(k, "")) == pve_bool(v) for k, v in want.items())
    if key == "features":
        cur = {k: pve_bool(v) for k, v in split_props(current)[1].items()}
        want = {k: pve_bool(v) for k, v in split_props(wanted)[1].items()}
        return cur == want
    if DEVICE_KEY.fullmatch(key):
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
