"""Shared pytest setup: import the project's module_utils the way Ansible does at run time.

Modules import ``ansible.module_utils.<name>``; Ansible ships the project's module_utils/ with them
(ansible.cfg: module_utils = module_utils). Under plain pytest the directory is added to that package's
search path, and the repository root is put on sys.path so tests can also ``import module_utils.<name>``.
"""

from __future__ import annotations

import pathlib
import sys

import ansible.module_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
