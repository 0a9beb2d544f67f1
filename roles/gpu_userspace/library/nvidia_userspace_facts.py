#!/usr/bin/python
"""Ansible module nvidia_userspace_facts: which NVIDIA userspace driver a container has, and what nvidia-smi says."""

DOCUMENTATION = r"""
---
module: nvidia_userspace_facts
short_description: NVIDIA userspace driver version(s) installed in a container, and nvidia-smi's view
description:
  - Lists the versions of C(libnvidia-ml.so.VERSION) in the library directories (what the C(.run)
    installer or the packages installed) and asks C(nvidia-smi) for the driver version, with a timeout.
  - In a container the kernel module is the host's; the userspace must be exactly its version, or NVML
    fails with "Driver/library version mismatch".
version_added: "0.1.0"
author: eagle3-pve
options:
  nvidia_smi:
    description: nvidia-smi command (name on PATH or path).
    type: str
    default: nvidia-smi
  timeout:
    description: Seconds nvidia-smi may take (it can hang after a GPU error).
    type: int
    default: 20
  lib_dirs:
    description: Directories searched for libnvidia-ml.so.VERSION.
    type: list
    elements: path
    default: [/usr/lib/x86_64-linux-gnu, /usr/lib64, /usr/lib, /usr/local/lib, /lib/x86_64-linux-gnu]
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
    details: Linux, inside the container (or on any host); without nvidia-smi the error fact says so.
notes:
  - Supports check mode (reads only). Standard library only.
"""

EXAMPLES = r"""
- name: What userspace driver the CT has
  nvidia_userspace_facts:
"""

RETURN = r"""
ansible_facts:
  description: Facts for the version check.
  returned: always
  type: dict
  contains:
    gpu_userspace_installed_versions:
      description: Versions of libnvidia-ml.so found, sorted.
      type: list
      elements: str
      sample: ["570.144"]
    gpu_userspace_smi_version:
      description: Driver version nvidia-smi reports, or an empty string.
      type: str
      sample: "570.144"
    gpu_userspace_smi_error:
      description: Why nvidia-smi gave no version (missing, timeout, its message), or an empty string.
      type: str
"""

import os
import re
import shutil

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.run_bounded import CommandTimeout, run_bounded

LIB = re.compile(r"^libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$")


def library_versions(names):
    """Versions in libnvidia-ml.so.* file names (the bare .so and .so.1 links carry none).

    >>> library_versions(['libnvidia-ml.so', 'libnvidia-ml.so.1', 'libnvidia-ml.so.570.144', 'libc.so.6'])
    ['570.144']
    """
    return sorted({m.group(1) for m in map(LIB.match, names) if m})


def installed_versions(lib_dirs):
    names = []
    for directory in lib_dirs:
        try:
            names += os.listdir(directory)
        except OSError:
            continue
    return library_versions(names)


def smi_driver_version(command, timeout):
    """(version, error): nvidia-smi's driver version of the first GPU, or why there is none."""
    binary = shutil.which(command)
    if binary is None:
        return "", f"{command} not found (the userspace driver is not installed)"
    try:
        proc = run_bounded([binary, "--query-gpu=driver_version", "--format=csv,noheader"], timeout, what=command)
    except CommandTimeout as exc:
        return "", f"{exc}: it did not answer (a GPU error, see dmesg on the host)"
    except OSError as exc:
        return "", f"{command} could not run: {exc}"
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        text = (proc.stdout + proc.stderr).strip().splitlines()
        return "", f"{command} exited {proc.returncode}: {' '.join(text[-3:]) or 'no output'}"
    return lines[0], ""


def main():
    module = AnsibleModule(
        argument_spec=dict(
            nvidia_smi=dict(type="str", default="nvidia-smi"),
            timeout=dict(type="int", default=20),
            lib_dirs=dict(
                type="list",
                elements="path",
                default=[
                    "/usr/lib/x86_64-linux-gnu",
                    "/usr/lib64",
                    "/usr/lib",
                    "/usr/local/lib",
                    "/lib/x86_64-linux-gnu",
                ],
            ),
        ),
        supports_check_mode=True,
    )
    version, error = smi_driver_version(module.params["nvidia_smi"], module.params["timeout"])
    facts = dict(
        gpu_userspace_installed_versions=installed_versions(module.params["lib_dirs"]),
        gpu_userspace_smi_version=version,
        gpu_userspace_smi_error=error,
    )
    module.exit_json(changed=False, ansible_facts=facts)


if __name__ == "__main__":
    main()
