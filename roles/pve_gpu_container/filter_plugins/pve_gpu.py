"""Filter pve_gpu_devices: the devN device list for a CT from the GPU nodes its Proxmox node has."""

from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError

CONTROL_DEVICES = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def gpu_index(path):
    """The GPU number of /dev/nvidiaN, or None.

    >>> gpu_index('/dev/nvidia12'), gpu_index('/dev/nvidiactl')
    (12, None)
    """
    found = re.fullmatch(r"/dev/nvidia(\d+)", str(path))
    return int(found.group(1)) if found else None


def select_gpus(found, gpus):
    """The GPU node paths a CT gets: every one found ('all'), or the numbered subset in the given order.

    >>> select_gpus(['/dev/nvidia0', '/dev/nvidia1', '/dev/nvidia2'], 'all')
    ['/dev/nvidia0', '/dev/nvidia1', '/dev/nvidia2']
    >>> select_gpus(['/dev/nvidia0', '/dev/nvidia1', '/dev/nvidia2'], [2, 0])
    ['/dev/nvidia2', '/dev/nvidia0']
    """
    by_index = {gpu_index(p): p for p in found if gpu_index(p) is not None}
    if gpus in ("all", None):
        return [by_index[n] for n in sorted(by_index)]
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, (list, tuple)):
        raise AnsibleFilterError(
            f"gpus must be 'all' or a list of GPU numbers such as [0, 1, 2, 3], not {gpus!r}"
        )
    out = []
    for item in gpus:
        try:
            number = int(item)
        except (TypeError, ValueError):
            raise AnsibleFilterError(f"gpus: {item!r} is not a GPU number (0 for /dev/nvidia0)") from None
        if number not in by_index:
            have = ", ".join(str(n) for n in sorted(by_index)) or "none"
            raise AnsibleFilterError(
                f"gpus: GPU {number} (/dev/nvidia{number}) is not on the node; it has GPUs {have}"
            )
        if by_index[number] in out:
            raise AnsibleFilterError(f"gpus: GPU {number} is listed twice")
        out.append(by_index[number])
    return out


def pve_gpu_devices(found, gpus="all", control=None, extra=None, mode=None, gid=None):
    """Device specs for pve_lxc: the chosen GPUs, then the control nodes, then extra devices.

    mode and gid apply to the GPU and control nodes (extra items carry their own options).

    >>> pve_gpu_devices(['/dev/nvidia0', '/dev/nvidia1'], [1], mode='0666')
    [{'path': '/dev/nvidia1', 'mode': '0666'}, {'path': '/dev/nvidiactl', 'mode': '0666'}, {'path': '/dev/nvidia-uvm', 'mode': '0666'}, {'path': '/dev/nvidia-uvm-tools', 'mode': '0666'}]
    """
    paths = select_gpus(list(found or []), gpus) + list(CONTROL_DEVICES if control is None else control)
    devices = []
    for path in paths:
        entry = {"path": path}
        if mode is not None and mode != "":
            entry["mode"] = str(mode)
        if gid is not None and gid != "":
            entry["gid"] = int(gid)
        devices.append(entry)
    for item in extra or []:
        devices.append({"path": item} if isinstance(item, str) else dict(item))
    return devices


class FilterModule:
    def filters(self):
        return {"pve_gpu_devices": pve_gpu_devices}
