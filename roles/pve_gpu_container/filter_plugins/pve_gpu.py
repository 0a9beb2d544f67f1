"""Filter pve_gpu_devices: the devN device list for a CT from the GPU nodes its Proxmox node has."""

from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError

DOCUMENTATION = r"""
name: pve_gpu_devices
short_description: The device list for pve_lxc's devices option, from the GPU nodes a Proxmox VE node has
description:
  - Chooses the GPU device nodes a container gets (every one found, or the numbered GPUs in the given order), then
    adds the NVIDIA control nodes, then any extra devices, each as a C({path, mode, gid}) entry for the C(devices)
    option of the C(pve_lxc) module (C(devN) passthrough).
  - Fails naming the problem when a GPU number is not on the node, is listed twice, or is not a number.
author: eagle3-pve contributors
version_added: "0.1.0"
positional: _input, gpus, control, extra, mode, gid
options:
  _input:
    description: The GPU device nodes the node has (C(/dev/nvidiaN); other paths are ignored), in any order.
    type: list
    elements: str
    required: true
  gpus:
    description: C(all), or the GPU numbers to pass through (C(0) for C(/dev/nvidia0)), in the order wanted.
    type: raw
    default: all
  control:
    description: The control nodes added after the GPUs; null means C(/dev/nvidiactl), C(/dev/nvidia-uvm), C(/dev/nvidia-uvm-tools).
    type: list
    elements: str
  extra:
    description: Further devices, added as they are; a path, or a dict with C(path) and C(pve_lxc)'s device options.
    type: list
    elements: raw
  mode:
    description: Octal mode (such as C("0666")) for the GPU and control nodes; null or empty sets none.
    type: str
  gid:
    description: Group id inside the container for the GPU and control nodes; null or empty sets none.
    type: int
"""

EXAMPLES = r"""
- name: GPUs 1 and 0 of the node, then the control nodes, readable by everyone in the CT
  ansible.builtin.set_fact:
    ct_devices: "{{ ['/dev/nvidia0', '/dev/nvidia1', '/dev/nvidia2'] | pve_gpu_devices([1, 0], mode='0666') }}"
    # [{path: /dev/nvidia1, mode: '0666'}, {path: /dev/nvidia0, mode: '0666'}, {path: /dev/nvidiactl, mode: '0666'},
    #  {path: /dev/nvidia-uvm, mode: '0666'}, {path: /dev/nvidia-uvm-tools, mode: '0666'}]

- name: Every GPU found, no control nodes, plus a DRI render node
  ansible.builtin.set_fact:
    ct_devices: "{{ host_gpu_devices | pve_gpu_devices(control=[], extra=['/dev/dri/renderD128']) }}"
"""

RETURN = r"""
_value:
  description: Device entries in order (chosen GPUs, control nodes, extra devices), each with C(path) and, when given, C(mode) and C(gid).
  type: list
  elements: dict
"""

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
        raise AnsibleFilterError(f"gpus must be 'all' or a list of GPU numbers such as [0, 1, 2, 3], not {gpus!r}")
    out = []
    for item in gpus:
        try:
            number = int(item)
        except (TypeError, ValueError):
            raise AnsibleFilterError(f"gpus: {item!r} is not a GPU number (0 for /dev/nvidia0)") from None
        if number not in by_index:
            have = ", ".join(str(n) for n in sorted(by_index)) or "none"
            raise AnsibleFilterError(f"gpus: GPU {number} (/dev/nvidia{number}) is not on the node; it has GPUs {have}")
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
