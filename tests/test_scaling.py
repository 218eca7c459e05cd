"""Tests of `accumjax.scaling`: strategy names and weight validation (denominators: test_window)."""

import jax
import jax.numpy as jnp
import pytest

from accumjax import scaling


def test_validate_scaling():
    assert scaling.validate_scaling("count") == "count"
    with pytest.raises(ValueError, match="scaling must be one of"):
        scaling.validate_scaling("avg")


def test_microbatch_weight_checks_concrete_and_flags_traced():
    w, ok = scaling.microbatch_weight("weighted", 3)
    assert (float(w), bool(ok), w.dtype) == (3.0, True, jnp.float32)
    assert bool(jax.jit(lambda v: scaling.microbatch_weight("weighted", v)[1])(-2.0)) is False
    assert bool(jax.jit(lambda v: scaling.microbatch_weight("weighted", v)[1])(jnp.nan)) is False
    with pytest.raises(ValueError, match=">= 0"):
        scaling.microbatch_weight("weighted", -0.5)
    w, ok = scaling.microbatch_weight("mean", None)
    assert (float(w), bool(ok)) == (1.0, True)


def test_concrete_value():
    assert scaling.concrete_value(jnp.asarray(2.5)) == 2.5
    assert jax.jit(lambda x: jnp.asarray(scaling.concrete_value(x) is None))(1.0)
