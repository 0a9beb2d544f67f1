"""The worked examples in the pipeline modules' docstrings are tests too."""

import doctest
import importlib

import pytest

MODULES = [
    "eagle3.config",
    "eagle3.data",
    "eagle3.packing",
    "eagle3.checkpoint",
    "eagle3.checkpointer",
    "eagle3.metrics",
    "eagle3.options",
    "eagle3.plan.model",
    "eagle3.plan.gpu_probe",
    "eagle3.plan.cli",
    "eagle3.cli",
    "eagle3.standin",
    "eagle3.train",
    "eagle3.synth",
    "eagle3.observe",
    "eagle3.report",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
