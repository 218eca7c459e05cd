"""Tests for accumjax.loss_scale: exact scale sequences, scaling round trips, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import accumjax
from accumjax.loss_scale import (
    DynamicLossScale,
    adjust_loss_scale,
    all_finite,
    dynamic_loss_scale,
    scale_loss,
    unscale_grads,
)

# initial=8, period=3, factor=2, min=2. Worked by hand from the rule: a finite step
# counts; the 3rd consecutive one doubles the scale and restarts the count; an
# overflow halves the scale (floored at 2) and restarts the count.
FLAGS = [True, True, True, True, False, False, False, False, True, True, True]
SCALES = [8, 8, 16, 16, 8, 4, 2, 2, 2, 2, 4]
COUNTERS = [1, 2, 0, 1, 0, 0, 0, 0, 1, 2, 0]


def test_constructor_values_and_dtypes():
    ls = dynamic_loss_scale(initial=1024.0, period=7, factor=3.0, min_loss_scale=0.5)
    assert isinstance(ls, DynamicLossScale)
    assert [float(ls.loss_scale), int(ls.counter), int(ls.period)] == [1024.0, 0, 7]
    assert [float(ls.factor), float(ls.min_loss_scale)] == [3.0, 0.5]
    assert [x.dtype for x in ls] == [jnp.float32, jnp.int32, jnp.int32, jnp.float32, jnp.float32]
    assert all(x.shape == () for x in ls)
    defaults = dynamic_loss_scale()
    assert float(defaults.loss_scale) == 2.0**15 and int(defaults.period) == 2000


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial": 0.5, "min_loss_scale": 1.0}, ValueError, "initial"),
        ({"min_loss_scale": 0.0, "initial": 1.0}, ValueError, "min_loss_scale"),
        ({"min_loss_scale": -1.0, "initial": 1.0}, ValueError, "min_loss_scale"),
        ({"period": 0}, ValueError, "period"),
        ({"period": 2.5}, TypeError, "period"),
        ({"period": True}, TypeError, "period"),
        ({"factor": 1.0}, ValueError, "factor"),
        ({"factor": 0.5}, ValueError, "factor"),
        ({"initial": "big"}, TypeError, "initial"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        dynamic_loss_scale(**kwargs)


def test_adjust_exact_sequence_eager():
    ls = dynamic_loss_scale(initial=8.0, period=3, factor=2.0, min_loss_scale=2.0)
    scales, counters = [], []
    for flag in FLAGS:
        ls = adjust_loss_scale(ls, flag)
        scales.append(float(ls.loss_scale))
        counters.append(int(ls.counter))
    assert scales == SCALES
    assert counters == COUNTERS
    assert int(ls.period) == 3 and float(ls.factor) == 2.0  # constants untouched


def test_adjust_exact_sequence_under_jit_scan():
    ls = dynamic_loss_scale(initial=8.0, period=3, factor=2.0, min_loss_scale=2.0)

    def body(ls, flag):
        ls = adjust_loss_scale(ls, flag)
        return ls, (ls.loss_scale, ls.counter)

    final, (scales, counters) = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(
        ls, jnp.asarray(FLAGS)
    )
    np.testing.assert_array_equal(scales, np.asarray(SCALES, np.float32))
    np.testing.assert_array_equal(counters, np.asarray(COUNTERS, np.int32))
    assert jax.tree.structure(final) == jax.tree.structure(ls)
    assert [x.dtype for x in final] == [x.dtype for x in ls]


def test_adjust_non_power_of_two_factor_and_floor():
    ls = dynamic_loss_scale(initial=9.0, period=1, factor=3.0, min_loss_scale=2.0)
    ls = adjust_loss_scale(ls, jnp.asarray(False))
    assert float(ls.loss_scale) == 3.0
    ls = adjust_loss_scale(ls, jnp.asarray(False))
    assert float(ls.loss_scale) == 2.0  # 3 / 3 = 1 is below the floor
    ls = adjust_loss_scale(ls, jnp.asarray(True))  # period 1: grows on every finite step
    assert float(ls.loss_scale) == 6.0 and int(ls.counter) == 0


def test_adjust_never_grows_to_inf():
    big = float(np.finfo(np.float32).max) / 1.5
    ls = dynamic_loss_scale(initial=big, period=1, factor=2.0)
    ls = adjust_loss_scale(ls, True)
    assert float(ls.loss_scale) == np.float32(big)  # 2 * big overflows float32: kept


def test_scale_loss_keeps_dtype():
    ls = dynamic_loss_scale(initial=4.0)
    out = scale_loss(ls, jnp.float32(0.75))
    assert out.dtype == jnp.float32 and float(out) == 3.0
    out16 = scale_loss(ls, jnp.float16(0.75))
    assert out16.dtype == jnp.float16 and float(out16) == 3.0


def test_unscale_grads_casts_to_float32_and_keeps_ints():
    ls = dynamic_loss_scale(initial=8.0)
    grads = {"a": jnp.asarray([8.0, -16.0], jnp.float16), "b": jnp.asarray(4.0, jnp.bfloat16)}
    grads["i"] = jnp.asarray([3], jnp.int32)
    out = unscale_grads(ls, grads)
    assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.float32
    np.testing.assert_array_equal(out["a"], np.asarray([1.0, -2.0], np.float32))
    assert float(out["b"]) == 0.5
    assert out["i"].dtype == jnp.int32 and int(out["i"][0]) == 3


def test_scaled_float16_gradients_recover_underflowing_values():
    # d/dx of 1e-4 * x**2 / 2 at x = 1e-4 is 1e-8, below float16's smallest subnormal
    # (6e-8): unscaled it flushes to 0; scaled by 2**15 it is representable.
    x = jnp.asarray(1e-4, jnp.float16)

    def loss(x):
        return jnp.float16(1e-4) * (x * x) / 2

    assert float(jax.grad(loss)(x)) == 0.0
    ls = dynamic_loss_scale(initial=2.0**15)
    g = unscale_grads(ls, jax.grad(lambda x: scale_loss(ls, loss(x)))(x))
    # float16 keeps ~3 significant digits at this magnitude (plus the rounding of 1e-4).
    np.testing.assert_allclose(float(g), 1e-8, rtol=5e-3)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_all_finite_detects_nonfinite(bad):
    tree = {"a": jnp.ones((2, 2)), "b": [jnp.zeros(3), jnp.asarray([1.0, bad])]}
    assert bool(all_finite(tree)) is False
    tree["b"][1] = jnp.asarray([1.0, 2.0])
    assert bool(all_finite(tree)) is True
    assert bool(jax.jit(all_finite)(tree)) is True


def test_all_finite_ignores_non_float_and_empty():
    assert bool(all_finite({})) is True
    assert bool(all_finite({"i": jnp.asarray([1, 2]), "f": jnp.float16(1.0)})) is True
    assert bool(all_finite({"f": jnp.asarray(jnp.inf, jnp.bfloat16)})) is False


def test_loss_scale_is_a_pytree_under_jit():
    ls = dynamic_loss_scale(initial=4.0, period=2)
    out = jax.jit(lambda ls: adjust_loss_scale(ls, False))(ls)
    assert isinstance(out, DynamicLossScale)
    assert len(jax.tree.leaves(ls)) == 5
    assert float(out.loss_scale) == 2.0


def test_public_export():
    assert accumjax.dynamic_loss_scale is dynamic_loss_scale
