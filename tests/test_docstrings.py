"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib

import pytest

MODULES = [
    "accumulation",
    "batch_norm",
    "clipping",
    "distributed",
    "loss_scale",
    "nnx_batch_norm",
    "nnx_train_step",
    "planner",
    "scaling",
    "sharded",
    "train_step",
    "window",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"accumjax.{name}")
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0
    if name != "scaling":  # the one module without public examples
        assert results.attempted > 0
