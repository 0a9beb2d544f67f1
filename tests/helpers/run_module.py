#!/usr/bin/env python3
"""Run a library/ module the way Ansible runs it on a target: ``run_module.py NAME ARGS.json``.

ARGS.json holds {"ANSIBLE_MODULE_ARGS": {...}}; the result JSON goes to stdout.  Used by tests that
need the module in its own process (its own ancestors and process group), e.g. under a marker.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import ansible.module_utils

ROOT = pathlib.Path(__file__).resolve().parents[2]
ansible.module_utils.__path__.append(str(ROOT / "module_utils"))

name = sys.argv.pop(1)
runpy.run_path(str(ROOT / "library" / f"{name}.py"), run_name="__main__")
