"""An inventory whose one training host, ct-local, is this machine (local connection): the role's tests run
train.yml, status.yml and their task files against it with every path they pass under a test's tmp_path."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def local_training_inventory(path: Path, **host_vars) -> Path:
    """Write the inventory to `path` (YAML) with ct-local's `host_vars` (eagle3_train_prefix, _run_dir, ...)."""
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **host_vars}
    inventory = {"all": {"vars": {"eagle3_root": str(ROOT)}, "children": {"training": {"hosts": {"ct-local": host}}}}}
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path
