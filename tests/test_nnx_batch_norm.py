"""Tests for accumjax.nnx_batch_norm: the flax.nnx AccumBatchNorm.

References are flax.nnx.BatchNorm (on each microbatch for outputs, once on the concatenated
window for running statistics) and the linen layer's variable layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from accumjax.batch_norm import ACCUMULATOR_NAMES, close_batch_norm_windows
from accumjax.batch_norm import AccumBatchNorm as LinenAccumBatchNorm
from accumjax.nnx_batch_norm import AccumBatchNorm

MOMENTUM = 0.9
FEATURES = 3
# float32 sums of ~100 O(10) values and E[x^2] - E[x]^2 (which amplifies rounding by
# mean^2 / var), plus the float32 momentum scalar of step-driven layers: 2e-5 covers them
# and is far below the gap between pooled and averaged per-microbatch variances.
RTOL = ATOL = 2e-5


def _microbatches(seed: int, steps: int, rows: int = 8) -> np.ndarray:
    """``steps`` float32 microbatches ``(rows, 4, FEATURES)`` with very different means."""
    rng = np.random.default_rng(seed)
    loc = rng.uniform(-4.0, 4.0, size=(steps, 1, 1, FEATURES))
    scale = rng.uniform(0.2, 3.0, size=loc.shape)
    return (rng.standard_normal((steps, rows, 4, FEATURES)) * scale + loc).astype(np.float32)


def _assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _reference_after_one_call(batch: np.ndarray) -> nnx.BatchNorm:
    bn = nnx.BatchNorm(FEATURES, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    bn(jnp.asarray(batch))
    return bn


def test_variables_are_named_like_the_linen_layer():
    x = jnp.ones((2, FEATURES))
    for accum_steps in (None, 3):
        layer = AccumBatchNorm(FEATURES, accum_steps=accum_steps, rngs=nnx.Rngs(0))
        linen = LinenAccumBatchNorm(accum_steps=accum_steps)
        variables = linen.init(jax.random.key(0), x, use_running_average=True)
        stats = nnx.to_pure_dict(nnx.state(layer, nnx.BatchStat))
        assert set(stats) == set(variables["batch_stats"])
        assert set(nnx.to_pure_dict(nnx.state(layer, nnx.Param))) == set(variables["params"])
        for name, value in variables["batch_stats"].items():
            assert stats[name].dtype == value.dtype and stats[name].shape == value.shape
    assert AccumBatchNorm(FEATURES, accum_steps=3, rngs=nnx.Rngs(0)).momentum == 0.99


def test_outputs_equal_nnx_batchnorm():
    data = _microbatches(0, 2)
    kwargs = dict(momentum=MOMENTUM, scale_init=nnx.initializers.normal())
    ours = AccumBatchNorm(FEATURES, accum_steps=1, rngs=nnx.Rngs(3), **kwargs)
    theirs = nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(3), **kwargs)
    np.testing.assert_array_equal(ours.scale[...], theirs.scale[...])
    for x in data:
        # Same float32 formulas, sums vs means in another order: float32 tolerance.
        _assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
        # accum_steps=1 updates the running statistics on every call, like BatchNorm.
        _assert_close(ours.mean[...], theirs.mean[...], rtol=1e-6, atol=1e-6)
        _assert_close(ours.var[...], theirs.var[...], rtol=1e-6, atol=1e-6)
    ours.eval()
    theirs.eval()
    _assert_close(ours(data[0]), theirs(data[0]), rtol=1e-6, atol=1e-6)


def test_self_closing_window_equals_batchnorm_on_concatenated_batch():
    steps = 4
    data = _microbatches(1, steps)
    layer = AccumBatchNorm(FEATURES, momentum=MOMENTUM, accum_steps=steps, rngs=nnx.Rngs(0))
    for i, x in enumerate(data):
        layer(x)
        if i < steps - 1:  # mid-window: running statistics untouched
            np.testing.assert_array_equal(layer.mean[...], np.zeros(FEATURES))
            assert int(layer.acc_step[...]) == i + 1
    reference = _reference_after_one_call(np.concatenate(data))
    _assert_close(layer.mean[...], reference.mean[...])
    _assert_close(layer.var[...], reference.var[...])
    assert int(layer.acc_step[...]) == 0
    assert not any(np.any(getattr(layer, n)[...]) for n in ACCUMULATOR_NAMES[:3])


class _Net(nnx.Module):
    """Linear -> step-driven AccumBatchNorm -> relu -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(FEATURES, FEATURES, rngs=rngs)
        self.norm = AccumBatchNorm(FEATURES, momentum=MOMENTUM, rngs=rngs)
        self.head = nnx.Linear(FEATURES, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.norm(self.linear(x))))


@pytest.mark.parametrize("form", ["state", "pure_dict"])
def test_step_driven_window_closed_by_the_train_step(form):
    steps = 3
    data = _microbatches(2, steps)
    model = _Net(nnx.Rngs(0))
    inputs = [model.linear(x) for x in data]  # what the norm sees (linear is not trained)
    for x in data:
        model(x)
    np.testing.assert_array_equal(model.norm.mean[...], np.zeros(FEATURES))
    assert int(model.norm.acc_step[...]) == steps
    stats = nnx.state(model, nnx.BatchStat)
    closed = close_batch_norm_windows(stats if form == "state" else nnx.to_pure_dict(stats), True)
    nnx.update(model, closed)
    reference = _reference_after_one_call(np.concatenate(inputs))
    _assert_close(model.norm.mean[...], reference.mean[...])
    _assert_close(model.norm.var[...], reference.var[...])
    assert int(model.norm.acc_step[...]) == 0
    assert float(model.norm.momentum[...]) == np.float32(MOMENTUM)


def test_nnx_jit_train_step_matches_eager():
    steps = 3
    data = _microbatches(3, steps)
    eager, jitted = _Net(nnx.Rngs(0)), _Net(nnx.Rngs(0))

    @nnx.jit
    def forward(model, x):
        return model(x)

    @nnx.jit
    def close(model, apply):
        nnx.update(model, close_batch_norm_windows(nnx.state(model, nnx.BatchStat), apply))

    for apply in (False, True):
        for x in data:
            _assert_close(forward(jitted, x), eager(x), rtol=1e-5, atol=1e-5)
        close(jitted, jnp.asarray(apply))
        nnx.update(eager, close_batch_norm_windows(nnx.state(eager, nnx.BatchStat), apply))
        for name in ("mean", "var", "acc_step"):
            _assert_close(getattr(jitted.norm, name)[...], getattr(eager.norm, name)[...])
    assert np.any(jitted.norm.mean[...])  # the second window was applied


def test_rejects_bad_configuration():
    with pytest.raises(ValueError, match="accum_steps"):
        AccumBatchNorm(FEATURES, accum_steps=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="momentum"):
        AccumBatchNorm(FEATURES, momentum=2.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="features"):
        AccumBatchNorm(FEATURES, rngs=nnx.Rngs(0))(jnp.ones((2, FEATURES + 1)))
