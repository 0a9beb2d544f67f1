#!/usr/bin/python
"""Ansible module pve_gpu_host_facts: NVIDIA driver version and GPU device nodes of a Proxmox node."""

DOCUMENTATION = r"""
---
module: pve_gpu_host_facts
short_description: NVIDIA driver version and GPU device nodes of a Proxmox VE node
description:
  - Reads the loaded NVIDIA kernel module's version from C(/sys/module/nvidia/version) and lists the device
    nodes a container needs for CUDA, the GPUs C(/dev/nvidiaN) (in numeric order) and the control nodes
    C(/dev/nvidiactl), C(/dev/nvidia-uvm), C(/dev/nvidia-uvm-tools), plus C(/dev/nvidia-caps/*) (MIG only), and
    the RDMA nodes of InfiniBand/RoCE adapters (C(/dev/infiniband/uverbsN), C(rdma_cm)) for NCCL across nodes.
  - Also reports where C(nvidia-modprobe) and C(nvidia-persistenced) are installed and whether a
    C(nvidia-persistenced.service) unit exists.
  - Reads files only; it never opens a device, loads a module or signals a process.
version_added: "0.1.0"
author: eagle3-pve
options:
  root:
    description: Prefix of every path read (tests point it at a fake tree). Paths reported never carry it.
    type: path
    default: /
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: It only reads, the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: A Proxmox VE node (Linux); without an NVIDIA driver the version is empty and no device is listed.
notes:
  - Supports check mode (it changes nothing).
  - Standard library only.
"""

EXAMPLES = r"""
- name: NVIDIA facts of the node
  pve_gpu_host_facts:
"""

RETURN = r"""
ansible_facts:
  description: Facts for the next roles.
  returned: always
  type: dict
  contains:
    pve_gpu_host_driver_version:
      description: Version of the loaded nvidia kernel module.
      type: str
      sample: 570.144
    pve_gpu_host_gpu_devices:
      description: GPU device nodes, by number.
      type: list
      elements: str
      sample: [/dev/nvidia0, /dev/nvidia1]
    pve_gpu_host_control_devices:
      description: Control nodes present, in the order CUDA needs them.
      type: list
      elements: str
      sample: [/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools]
    pve_gpu_host_missing_control_devices:
      description: Control nodes absent (nvidia-uvm ones appear once nvidia-modprobe -u -c=0 ran).
      type: list
      elements: str
    pve_gpu_host_cap_devices:
      description: MIG capability nodes under /dev/nvidia-caps.
      type: list
      elements: str
    pve_gpu_host_rdma_devices:
      description:
        - RDMA nodes of InfiniBand/RoCE adapters (C(/dev/infiniband/uverbsN) by number, then
          C(/dev/infiniband/rdma_cm)), which NCCL needs inside a CT to use them; empty on a node without any.
      type: list
      elements: str
      sample: [/dev/infiniband/uverbs0, /dev/infiniband/uverbs1, /dev/infiniband/rdma_cm]
    pve_gpu_host_nvidia_modprobe_path:
      description: Path of nvidia-modprobe, or an empty string.
      type: str
    pve_gpu_host_persistenced_path:
      description: Path of nvidia-persistenced, or an empty string.
      type: str
    pve_gpu_host_persistenced_unit_path:
      description: Path of an installed nvidia-persistenced.service, or an empty string.
      type: str
"""

import os
import re

from ansible.module_utils.basic import AnsibleModule

CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
BIN_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin")
UNIT_DIRS = (
    "/etc/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
    "/usr/local/lib/systemd/system",
)


def under(root, path):
    """The path as seen under root.

    >>> under('/tmp/fake', '/sys/module/nvidia/version')
    '/tmp/fake/sys/module/nvidia/version'
    """
    return os.path.join(root, path.lstrip("/"))


def driver_version(root):
    """Version of the loaded nvidia module, or None when it is not loaded."""
    try:
        with open(under(root, "/sys/module/nvidia/version"), encoding="ascii") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return text or None


def gpu_devices(names):
    """The GPU node paths among /dev entry names, by number.

    >>> gpu_devices(['nvidia10', 'nvidiactl', 'nvidia2', 'nvidia-uvm', 'nvidia0', 'null'])
    ['/dev/nvidia0', '/dev/nvidia2', '/dev/nvidia10']
    """
    numbered = [name for name in names if re.fullmatch(r"nvidia\d+", name)]
    return ["/dev/" + name for name in sorted(numbered, key=lambda n: int(n[6:]))]


def rdma_devices(names):
    """The RDMA node paths among /dev/infiniband entry names: verbs devices by number, then the connection manager.

    >>> rdma_devices(['uverbs10', 'rdma_cm', 'uverbs2', 'umad0', 'issm0'])
    ['/dev/infiniband/uverbs2', '/dev/infiniband/uverbs10', '/dev/infiniband/rdma_cm']
    """
    verbs = sorted((n for n in names if re.fullmatch(r"uverbs\d+", n)), key=lambda n: int(n[6:]))
    return ["/dev/infiniband/" + n for n in verbs] + (["/dev/infiniband/rdma_cm"] if "rdma_cm" in names else [])


def find_first(root, dirs, name):
    """The first dir/name that exists under root, as a real path, or ''."""
    for directory in dirs:
        path = os.path.join(directory, name)
        if os.path.exists(under(root, path)):
            return path
    return ""


def host_facts(root):
    """The facts dict for a node tree at root (see RETURN)."""
    dev = under(root, "/dev")
    names = os.listdir(dev) if os.path.isdir(dev) else []
    caps_dir = under(root, "/dev/nvidia-caps")
    caps = sorted("/dev/nvidia-caps/" + n for n in os.listdir(caps_dir)) if os.path.isdir(caps_dir) else []
    control = [p for p in CONTROL_DEVICES if os.path.exists(under(root, p))]
    ib_dir = under(root, "/dev/infiniband")
    ib = os.listdir(ib_dir) if os.path.isdir(ib_dir) else []
    return dict(
        pve_gpu_host_driver_version=driver_version(root) or "",
        pve_gpu_host_gpu_devices=gpu_devices(names),
        pve_gpu_host_control_devices=control,
        pve_gpu_host_missing_control_devices=[p for p in CONTROL_DEVICES if p not in control],
        pve_gpu_host_cap_devices=caps,
        pve_gpu_host_rdma_devices=rdma_devices(ib),
        pve_gpu_host_nvidia_modprobe_path=find_first(root, BIN_DIRS, "nvidia-modprobe"),
        pve_gpu_host_persistenced_path=find_first(root, BIN_DIRS, "nvidia-persistenced"),
        pve_gpu_host_persistenced_unit_path=find_first(root, UNIT_DIRS, "nvidia-persistenced.service"),
    )


def main():
    module = AnsibleModule(argument_spec=dict(root=dict(type="path", default="/")), supports_check_mode=True)
    facts = host_facts(module.params["root"])
    if not facts["pve_gpu_host_driver_version"]:
        module.fail_json(
            msg="{} is missing: the NVIDIA kernel module is not loaded on this node. Install the driver on "
            "the Proxmox host (the .run installer with the kernel module, or the packaged driver with "
            "pve-headers) and reboot or `modprobe nvidia`, then re-run".format(
                under(module.params["root"], "/sys/module/nvidia/version")
            ),
            ansible_facts=facts,
        )
    module.exit_json(changed=False, ansible_facts=facts)


if __name__ == "__main__":
    main()
