"""The worked examples in the pipeline modules' docstrings are tests too."""

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import eagle3
import pytest

# Every module of the package that has an example in a docstring (a new module's examples run without a list to
# extend).
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(eagle3.__path__, "eagle3.")
    if ">>> " in Path(importlib.util.find_spec(info.name).origin).read_text()
)


def test_the_modules_with_examples_are_found():
    assert {"eagle3.config", "eagle3.rope", "eagle3.train", "eagle3.plan.model"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
