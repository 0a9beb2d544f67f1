#!/usr/bin/python
"""Ansible module gpu_facts: NVIDIA GPUs of the target as facts."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_facts
short_description: Report NVIDIA GPUs, their memory, utilisation and power as facts
description:
  - Uses NVML through nvidia-ml-py when it is importable on the target, otherwise
    C(nvidia-smi --query-gpu=... --format=csv) with a timeout.
  - Flags a GPU as C(starved) when its utilisation is high while its power draw is far below its limit
    (kernels resident but waiting, e.g. NCCL busy-waiting on a slow all-reduce, the "100 % util at 250 W" case).
  - A machine without NVIDIA GPU or driver gives C(gpus=[]), not an error.
  - GPU process lists are not reported, because inside a container they carry host PIDs.
version_added: "1.0.0"
author: eagle3-pve
options:
  timeout:
    description: Seconds to wait for NVML or nvidia-smi (both can hang after an Xid error).
    type: float
    default: 10
  fail_on_error:
    description: Fail when NVML or nvidia-smi exists but gives no answer (driver/library mismatch, hang).
    type: bool
    default: false
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
    details: Linux with an NVIDIA driver, or without one (then C(gpus=[])).
"""

EXAMPLES = r"""
- name: Read the GPUs
  gpu_facts:

- name: Warn about GPUs that wait instead of computing
  ansible.builtin.debug:
    msg: "GPU {{ item.index }} is starved: {{ item.utilization_pct }} % at {{ item.power_draw_w }} W"
  loop: "{{ ansible_facts.gpus | selectattr('starved') }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts about the GPUs (also returned when O(fail_on_error) fails the task).
  returned: always
  type: dict
  contains:
    gpus:
      description:
        - One entry per GPU, C({index, name, uuid, memory_total_mib, memory_used_mib, utilization_pct,
          power_draw_w, power_limit_w, starved}); C(memory_*) in MiB, power in W, utilisation in %, C(null) when
          not supported.
        - C(starved) is true when the utilisation is high while the power draw is far below the limit.
        - Empty without NVIDIA GPUs or driver, or when neither NVML nor nvidia-smi answered.
      returned: always
      type: list
      elements: dict
      sample: [{"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell", "uuid": "GPU-1a2b", "memory_total_mib": 97887,
                "memory_used_mib": 40754, "utilization_pct": 100, "power_draw_w": 250.1, "power_limit_w": 600,
                "starved": true}]
    nvidia_driver_version:
      description: Userspace driver version, null without a driver.
      returned: always
      type: str
      sample: "580.76.05"
    gpu_query:
      description: How the facts were read.
      returned: always
      type: dict
      contains:
        source:
          description: C(nvml), C(nvidia-smi), or null when neither is available.
          returned: always
          type: str
        error:
          description: Why the GPUs could not be read (a hang, a driver/library mismatch), null when they were.
          returned: always
          type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils import nvml


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "timeout": {"type": "float", "default": 10},
            "fail_on_error": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    if not module.params["timeout"] > 0:
        module.fail_json(
            msg=f"timeout={module.params['timeout']:g} must be a positive number of seconds (for example 10)"
        )
    query = nvml.query_gpus(timeout=module.params["timeout"])
    facts = {
        "gpus": query["gpus"],
        "nvidia_driver_version": query["driver_version"],
        "gpu_query": {"source": query["source"], "error": query["error"]},
    }
    if query["error"] and module.params["fail_on_error"]:
        module.fail_json(msg=f"cannot read the GPUs: {query['error']}", ansible_facts=facts)
    module.exit_json(changed=False, ansible_facts=facts)


if __name__ == "__main__":
    main()
