"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import accumjax

MODULES = sorted(m.name for m in pkgutil.iter_modules(accumjax.__path__))
# Modules whose functions have no examples of their own (their callers' examples run them).
WITHOUT_EXAMPLES = {"scaling"}


def test_the_package_has_modules():
    assert "window" in MODULES and "train_step" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"accumjax.{name}")
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0
    if name not in WITHOUT_EXAMPLES:
        assert results.attempted > 0
