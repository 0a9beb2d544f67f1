# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A value declared once in code, read where YAML needs it, so a role's default or argument is that declaration
and not a copy of it.

``target_constant``: a constant of module_utils/MODULE.py (the code the modules run on the target, standard library
only), e.g. ``'procs.DEVICE_GLOBS' | target_constant`` in roles/gpu_cleanup/defaults/main.yml.
``trainer_constant``: a constant of the trainer's torch-free modules (training/eagle3/MODULE.py), e.g.
``'config.SEQ_BLOCK' | trainer_constant`` in roles/eagle3_train/tasks/plan.yml.

Both are documented in the .yml file of the same name beside this one (ansible-doc reads those).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"([a-z_][a-z0-9_]*)\.([A-Z][A-Z0-9_]*)")


def _split(name, example: str) -> tuple[str, str]:
    match = _NAME.fullmatch(str(name))
    if not match:
        raise ValueError(f"{name!r} is not MODULE.NAME (e.g. {example})")
    return match.group(1), match.group(2)


def target_constant(name: str):
    """The value module_utils/MODULE.py declares as NAME, for ``MODULE.NAME`` (a copy: the caller may change it).

    >>> target_constant("restart_backoff.DEFAULT_UNIT")
    'eagle3-train.service'
    >>> target_constant("procs.DEVICE_GLOBS")[0]
    '/dev/nvidia[0-9]*'
    """
    module_name, attr = _split(name, "procs.DEVICE_GLOBS")
    return copy.deepcopy(getattr(target_module(module_name), attr))


def target_module(module_name: str):
    """module_utils/MODULE.py loaded on the controller (standard library only), for a check it declares once.

    >>> target_module("job_files").glob_problem("/dev/shm/nccl-*") is None
    True
    """
    if str(ROOT) not in sys.path:  # module_utils/ as a package: its files import each other relatively
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"module_utils.{module_name}")


def trainer_module(module_name: str):
    """The trainer's eagle3/MODULE.py (its torch-free modules: config, bounds, errors, options), imported from
    training/ on the controller: where the controller side reads what the trainer declares.

    >>> trainer_module("bounds").SEQ_BLOCK
    128
    """
    training = str(ROOT / "training")
    if training not in sys.path:
        sys.path.insert(0, training)
    return importlib.import_module(f"eagle3.{module_name}")


def trainer_constant(name: str):
    """The value the trainer's eagle3/MODULE.py declares as NAME (trainer_module).

    >>> trainer_constant("config.SEQ_BLOCK")
    128
    """
    module_name, attr = _split(name, "config.SEQ_BLOCK")
    return copy.deepcopy(getattr(trainer_module(module_name), attr))


class FilterModule:
    def filters(self):
        return {"target_constant": target_constant, "trainer_constant": trainer_constant}
