#!/usr/bin/python
"""Ansible module owned_paths: refuse folders and units that belong to something else, before anything changes."""

from __future__ import annotations

DOCUMENTATION = r"""
module: owned_paths
short_description: Refuse managed folders and systemd units that are not the project's, before anything changes
description:
  - Read-only. For each folder a role is about to create, re-mode or fill, and each systemd unit it is about to write,
    start or stop, checks on the target that it is the project's to manage.
  - A folder is refused when it is a system folder (C(/), C(/etc), C(/usr), C(/var/lib), ...) or lies in a tree only the
    system's packages own (C(/usr/lib), C(/proc), ...), or when it exists, holds files, and none of them is a file the
    role writes there (O(dirs[].marks)).
  - A unit is refused when it is installed and its unit file was not written by eagle3-pve (the project's unit files
    carry the line C(# eagle3-pve:)).
  - Fails with every problem at once, each naming the variable and the value; succeeds with changed=false otherwise.
version_added: "1.1.0"
author: eagle3-pve
extends_documentation_fragment:
  - action_common_attributes
options:
  dirs:
    description: Folders to check, each C({var, path, marks}).
    type: list
    elements: dict
    default: []
  units:
    description: Units to check, each C({var, unit}).
    type: list
    elements: dict
    default: []
attributes:
  check_mode:
    support: full
    details: Read-only; the same checks run in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: Any Linux target; units are asked of C(systemctl show) (none installed without systemd).
"""

EXAMPLES = r"""
- name: The folders and the unit are the project's to manage
  owned_paths:
    dirs:
      - {var: eagle3_train_config_dir, path: /etc/eagle3, marks: [train.yaml, eagle3-train.env]}
    units:
      - {var: gpu_cleanup_unit, unit: eagle3-train.service}
"""

RETURN = r"""
problems:
  description: One line per refused folder or unit (empty on success).
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils import owned


def problems(dirs: list[dict], units: list[dict]) -> list[str]:
    """Every refusal, one line each, naming the variable and its value."""
    found = []
    for d in dirs:
        problem = owned.dir_problem(d["path"], list(d.get("marks") or []))
        if problem:
            found.append(f"{d['var']}={d['path']} {problem}")
    for u in units:
        problem = owned.unit_problem(u["unit"])
        if problem:
            found.append(f"{u['var']}={u['unit']} {problem}")
    return found


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dirs": {"type": "list", "elements": "dict", "default": []},
            "units": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    found = problems(module.params["dirs"], module.params["units"])
    if found:
        module.fail_json(msg=" | ".join(found) + ". Nothing was changed.", problems=found)
    module.exit_json(changed=False, problems=[])


if __name__ == "__main__":
    main()
