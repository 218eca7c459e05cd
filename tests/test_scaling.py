"""Tests of `accumjax.scaling`: strategy names and weight validation (denominators: test_window)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import accumjax
import accumjax._scaling as scaling
from accumjax._state import config_of


def test_validate_scaling():
    assert scaling.validate_scaling("sum_over_k") == "sum_over_k"
    with pytest.raises(ValueError, match="scaling must be one of"):
        scaling.validate_scaling("avg")


def test_count_is_a_deprecated_name_of_mean():
    """0.5's "mean" divides by the microbatches used, which 0.4's "count" did: "count" warns,
    names "mean", and gives a transformation whose policy is "mean"."""
    with pytest.warns(DeprecationWarning, match="scaling='mean'.*0.6|0.6.*scaling='mean'"):
        tx = accumjax.accumulate(optax.sgd(0.1), 2, scaling="count")
    assert config_of(tx).scaling == "mean"


def test_the_state_codes_keep_their_meaning():
    """A checkpoint stores its strategy as an index into SCALINGS: 0.4's indices stay, new
    strategies come after them; the "mean" family resumes across its names."""
    assert scaling.SCALINGS[:4] == ("mean", "sum", "count", "weighted")
    assert scaling.SCALINGS[4] == "sum_over_k"
    assert scaling.compatible("count", "mean") and scaling.compatible("mean", "sum_over_k")
    assert not scaling.compatible("mean", "sum") and not scaling.compatible("weighted", "mean")


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
