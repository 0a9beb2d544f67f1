"""Every worked example in the controller side's docstrings holds: module_utils, the project's plugins, the roles'
filter plugins and the modules in library/ that have examples. A file with examples that none of its doctests reach
(an import that hides them) fails too."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE_UTILS = sorted(p for p in (ROOT / "module_utils").glob("*.py") if p.name != "__init__.py")
PLUGINS = sorted((ROOT / "plugins").glob("*/*.py")) + sorted(ROOT.glob("roles/*/filter_plugins/*.py"))
LIBRARY = sorted(p for p in (ROOT / "library").glob("*.py") if ">>>" in p.read_text())


def load(path: Path):
    if path.parent.name == "module_utils":
        return importlib.import_module(f"module_utils.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"doctest_{path.parent.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", MODULE_UTILS + PLUGINS + LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_docstring_examples_hold(path):
    results = doctest.testmod(load(path))
    assert results.failed == 0
    if ">>>" in path.read_text():
        assert results.attempted > 0, f"{path.name} has examples that doctest does not reach"
