"""Tests for accumjax.nnx_batch_norm: the flax.nnx AccumBatchNorm.

References are flax.nnx.BatchNorm (on each microbatch for outputs, once on the concatenated
window for running statistics) and the linen layer's variable layout.
"""

import inspect
import warnings
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _assertions import assert_within_ulps
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

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
        # Names, dtypes and shapes only: jax.eval_shape gives them without compiling the init.
        variables = jax.eval_shape(
            partial(linen.init, use_running_average=True), jax.random.key(0), x
        )
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


def test_rejects_bad_accum_steps_kinds():
    # accumjax._checks: a wrong kind (a bool, a float) is a TypeError, as in the linen layer.
    for accum_steps in (True, 2.0):
        with pytest.raises(TypeError, match="accum_steps"):
            AccumBatchNorm(FEATURES, accum_steps=accum_steps, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------------
# The NNX layer against the linen layer: one arithmetic (accumjax._batch_norm_math), so on the
# same inputs and parameters the two agree exactly. Both run eagerly, op by op: the same
# operations in the same order on the same arrays give the same bits (the NNX layer only adds
# reshapes, which do not round), so any difference is a plumbing bug, not rounding.
# ---------------------------------------------------------------------------------------------


def _linen_run(layer, variables, data, masks=None, close=False):
    """Trains the linen ``layer`` eagerly on ``data``; returns outputs and batch_stats.

    With ``close``, ``close_batch_norm_windows`` runs after every ``len(data[w])``-long
    window ``data[w]`` (``data`` is then a list of windows).
    """
    stats, outputs = variables["batch_stats"], []
    windows = data if close else [data]
    for w, window in enumerate(windows):
        for i, x in enumerate(window):
            mask = None if masks is None else masks[w][i]
            y, upd = layer.apply(
                {**variables, "batch_stats": stats},
                x,
                use_running_average=False,
                mask=mask,
                mutable=["batch_stats"],
            )
            stats = upd["batch_stats"]
            outputs.append(y)
        if close:
            stats = close_batch_norm_windows(stats, True)
    return outputs, stats


def _nnx_run(layer, data, masks=None, close=False):
    """The NNX twin of :func:`_linen_run`; returns outputs and the pure batch stats."""
    outputs = []
    windows = data if close else [data]
    for w, window in enumerate(windows):
        for i, x in enumerate(window):
            outputs.append(layer(x, mask=None if masks is None else masks[w][i]))
        if close:
            nnx.update(layer, close_batch_norm_windows(nnx.state(layer, nnx.BatchStat), True))
    return outputs, nnx.to_pure_dict(nnx.state(layer, nnx.BatchStat))


def _copy_params(layer, variables):
    """Gives the NNX ``layer`` the linen ``variables``' scale and bias (reshaped)."""
    for name in ("scale", "bias"):
        param = getattr(layer, name)
        param[...] = jnp.asarray(variables["params"][name]).reshape(param[...].shape)


def _assert_equal_stats(nnx_stats, linen_stats):
    assert set(nnx_stats) == set(linen_stats)
    for name, value in linen_stats.items():
        ours = np.asarray(nnx_stats[name])
        assert ours.dtype == value.dtype, name
        np.testing.assert_array_equal(ours.reshape(np.shape(value)), value, err_msg=name)


def _tuple_axis_data(seed: int, steps: int) -> np.ndarray:
    """float32 microbatches ``(rows=5, 4, 3)`` whose (4, 3) features differ a lot."""
    rng = np.random.default_rng(seed)
    loc = rng.uniform(-4.0, 4.0, size=(steps, 1, 4, 3))
    scale = rng.uniform(0.2, 3.0, size=loc.shape)
    return (rng.standard_normal((steps, 5, 4, 3)) * scale + loc).astype(np.float32)


@pytest.mark.parametrize("num_features", [(4, 3), 12], ids=["feature_shape", "flat"])
@pytest.mark.parametrize("accum_steps", [None, 3], ids=["step_driven", "self_closing"])
def test_tuple_axis_matches_linen(num_features, accum_steps):
    steps, axis = 3, (1, 2)
    data = _tuple_axis_data(4, steps)
    kwargs = dict(axis=axis, momentum=MOMENTUM, accum_steps=accum_steps)
    linen = LinenAccumBatchNorm(scale_init=nnx.initializers.normal(), **kwargs)
    variables = linen.init(jax.random.key(1), data[0], use_running_average=False)
    layer = AccumBatchNorm(num_features, rngs=nnx.Rngs(0), **kwargs)
    _copy_params(layer, variables)
    # Per-feature statistics of a (4, 3) feature grid: the layout is the linen layer's
    # (or flat, as flax.nnx.BatchNorm keeps it, for an int num_features).
    flat = isinstance(num_features, int)
    assert layer.mean[...].shape == layer.acc_m2[...].shape == ((12,) if flat else (4, 3))

    close = accum_steps is None
    windows = [data] if close else data
    expected, linen_stats = _linen_run(linen, variables, windows, close=close)
    outputs, nnx_stats = _nnx_run(layer, windows, close=close)
    for ours, theirs in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(ours, theirs)  # same ops, same order: same bits
    _assert_equal_stats(nnx_stats, linen_stats)
    assert np.any(nnx_stats["mean"])  # the window was closed
    layer.eval()
    eval_expected = linen.apply(
        {**variables, "batch_stats": linen_stats}, data[0], use_running_average=True
    )
    np.testing.assert_array_equal(layer(data[0]), eval_expected)


def test_tuple_axis_matches_flax_linen_batchnorm():
    # An independent reference for the (4, 3) feature grid: flax.linen.BatchNorm with the
    # same tuple axis. One call per window (accum_steps=1) is BatchNorm's update.
    data = _tuple_axis_data(5, 2)
    layer = AccumBatchNorm((4, 3), axis=(1, 2), momentum=MOMENTUM, accum_steps=1, rngs=nnx.Rngs(0))
    flax_bn = nn.BatchNorm(axis=(1, 2), momentum=MOMENTUM, use_running_average=False)
    variables = flax_bn.init(jax.random.key(0), data[0])
    for x in data:
        y = layer(x)
        expected, upd = flax_bn.apply(variables, x, mutable=["batch_stats"])
        variables = {**variables, **upd}
        # Same float32 formulas, sums vs means in another order: float32 tolerance.
        _assert_close(y, expected, rtol=1e-5, atol=1e-5)
        _assert_close(layer.mean[...], variables["batch_stats"]["mean"], rtol=1e-6, atol=1e-6)
        _assert_close(layer.var[...], variables["batch_stats"]["var"], rtol=1e-6, atol=1e-6)


def test_tuple_axis_rejects_mismatched_features():
    layer = AccumBatchNorm((4, 3), axis=(1, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="features"):
        layer(jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="features"):
        AccumBatchNorm(13, axis=(1, 2), rngs=nnx.Rngs(0))(jnp.ones((2, 4, 3)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("accum_steps", [None, 2], ids=["step_driven", "self_closing"])
def test_half_precision_without_forced_float32_matches_linen(dtype, accum_steps):
    steps = 2
    data = jnp.asarray(_microbatches(6, steps), dtype)
    kwargs = dict(
        momentum=MOMENTUM,
        accum_steps=accum_steps,
        dtype=dtype,
        param_dtype=dtype,
        force_float32_reductions=False,
    )
    linen = LinenAccumBatchNorm(scale_init=nnx.initializers.normal(), **kwargs)
    variables = linen.init(jax.random.key(2), data[0], use_running_average=False)
    layer = AccumBatchNorm(FEATURES, rngs=nnx.Rngs(0), **kwargs)
    _copy_params(layer, variables)
    # Unforced, the running statistics take param_dtype (forced, they would be float32).
    assert layer.mean[...].dtype == layer.var[...].dtype == dtype
    assert layer.acc_m2[...].dtype == jnp.float32  # accumulators are float32 either way

    close = accum_steps is None
    windows = [data] if close else data
    expected, linen_stats = _linen_run(linen, variables, windows, close=close)
    outputs, nnx_stats = _nnx_run(layer, windows, close=close)
    for ours, theirs in zip(outputs, expected, strict=True):
        assert ours.dtype == theirs.dtype == dtype
        np.testing.assert_array_equal(ours, theirs)  # same ops, same order: same bits
    _assert_equal_stats(nnx_stats, linen_stats)
    assert np.any(np.asarray(nnx_stats["mean"], np.float32))
    layer.eval()
    eval_expected = linen.apply(
        {**variables, "batch_stats": linen_stats}, data[0], use_running_average=True
    )
    np.testing.assert_array_equal(layer(data[0]), eval_expected)


@pytest.mark.parametrize("accum_steps", [None, 3], ids=["step_driven", "self_closing"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast_var", "centred_var"])
def test_window_of_k_microbatches_matches_linen(accum_steps, fast):
    steps, windows = 3, 2
    data = _microbatches(7, steps * windows).reshape(windows, steps, -1, 4, FEATURES)
    rng = np.random.default_rng(8)
    masks = rng.uniform(size=(windows, steps, data.shape[2], 4, 1)) < 0.7
    masks[1, 1] = False  # a fully masked microbatch contributes nothing
    kwargs = dict(momentum=MOMENTUM, accum_steps=accum_steps, use_fast_variance=fast)
    linen = LinenAccumBatchNorm(scale_init=nnx.initializers.normal(), **kwargs)
    variables = linen.init(jax.random.key(3), data[0, 0], use_running_average=False)
    layer = AccumBatchNorm(FEATURES, rngs=nnx.Rngs(0), **kwargs)
    _copy_params(layer, variables)

    close = accum_steps is None
    if close:  # the train step closes each window
        expected, linen_stats = _linen_run(linen, variables, data, masks, close=True)
        outputs, nnx_stats = _nnx_run(layer, data, masks, close=True)
    else:  # the layer closes it on every K-th call
        flat_data, flat_masks = (
            data.reshape(-1, *data.shape[2:]),
            [masks.reshape(-1, *masks.shape[2:])],
        )
        expected, linen_stats = _linen_run(linen, variables, flat_data, flat_masks)
        outputs, nnx_stats = _nnx_run(layer, flat_data, flat_masks)
    for ours, theirs in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(ours, theirs)  # same ops, same order: same bits
    _assert_equal_stats(nnx_stats, linen_stats)
    assert int(nnx_stats["acc_step"]) == 0 and np.any(nnx_stats["mean"])


# ----------------------------------------------------------------------------- nnx.Optimizer


class _NormFirst(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = AccumBatchNorm(3, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(x))


@pytest.mark.parametrize("nan_microbatch", [None, 1])
def test_nnx_optimizer_recipe_closes_windows_and_drops_skipped_statistics(nan_microbatch):
    """The documented recipe: two lines beyond plain Flax NNX (``before`` and the update)."""
    import optax

    import accumjax

    k, rows = 3, np.random.default_rng(0).normal(3.0, 2.0, (24, 3)).astype(np.float32)
    if nan_microbatch is not None:
        rows[4 * nan_microbatch + 1] = np.nan
    model = _NormFirst(nnx.Rngs(0))
    opt = nnx.Optimizer(model, accumjax.accumulate(optax.sgd(0.1), k), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, xb):
        before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        grads = nnx.grad(lambda m: jnp.mean(m(xb) ** 2))(model)
        opt.update(model, grads)
        after = nnx.state(model, nnx.BatchStat)
        nnx.update(model, accumjax.sync_batch_norm(after, before, opt.opt_state))

    for i in range(2 * k):
        train_step(model, opt, jnp.asarray(rows[4 * i : 4 * i + 4]))
    mean, var = np.zeros(3), np.ones(3)
    for w in range(2):  # flax BatchNorm once per window, on the microbatches that were added
        block = [rows[4 * i : 4 * i + 4] for i in range(w * k, (w + 1) * k) if i != nan_microbatch]
        block = np.concatenate(block).astype(np.float64)
        mean, var = 0.9 * mean + 0.1 * block.mean(0), 0.9 * var + 0.1 * block.var(0)
    # float32 statistics of 8-12 rows and two momentum steps: ~1e-7 relative observed.
    np.testing.assert_allclose(model.norm.mean[...], mean, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(model.norm.var[...], var, rtol=2e-5, atol=2e-6)
    assert int(model.norm.acc_step[...]) == 0


def test_sync_batch_norm_refuses_a_live_view_as_old_stats():
    import optax

    import accumjax

    model = _NormFirst(nnx.Rngs(0))
    opt_state = accumjax.accumulate(optax.sgd(0.1), 2).init(nnx.state(model, nnx.Param))
    live = nnx.state(model, nnx.BatchStat)
    with pytest.raises(ValueError, match="live view"):
        accumjax.sync_batch_norm(nnx.state(model, nnx.BatchStat), live, opt_state)


# ---------------------------------------------------------------------------------------------
# nnx.BatchNorm's constructor, dtypes and complex inputs
# ---------------------------------------------------------------------------------------------


def test_constructor_takes_every_nnx_batchnorm_argument():
    theirs = inspect.signature(nnx.BatchNorm.__init__).parameters
    ours = inspect.signature(AccumBatchNorm.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)  # nnx's order; accumjax's own after
    for name, param in theirs.items():
        assert (ours[name].kind, ours[name].default) == (param.kind, param.default), name
    seen = []

    def promote(args, *, dtype=None):
        seen.append((tuple(None if a is None else a.dtype for a in args), dtype))
        return nnx_dtypes.promote_dtype(args, dtype=dtype)

    layer = AccumBatchNorm(
        FEATURES,
        dtype=jnp.bfloat16,
        promote_dtype=promote,
        bias_metadata={"tag": "bias"},
        scale_metadata={"tag": "scale"},
        rngs=nnx.Rngs(0),
    )
    assert layer.bias.get_metadata()["tag"] == "bias"
    assert layer.scale.get_metadata()["tag"] == "scale"
    assert layer.promote_dtype is promote and layer.use_bias and layer.use_scale
    y = layer(jnp.ones((2, FEATURES)))
    # Called as nnx.BatchNorm calls it: (x, mean, var, scale, bias) and the layer's dtype.
    assert seen == [((jnp.float32,) * 5, jnp.bfloat16)] and y.dtype == jnp.bfloat16


@nnx.jit  # one for the module: a case's train and evaluation calls share their programs
def _call(layer, x, mask):
    return layer(x, mask=mask)


@pytest.mark.parametrize("layer_dtype", [None, "input"], ids=["dtype_None", "dtype_input"])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_accum_steps_one_matches_nnx_batchnorm_bit_for_bit(x_dtype, layer_dtype):
    # Exactly, as the linen layer matches flax.linen.BatchNorm (test_batch_norm.py's
    # test_accum_steps_one_is_batchnorm_bit_for_bit): the same promote_dtype, jnp.mean calls
    # and update expression, so XLA compiles the same arithmetic. Before, the missing
    # promote_dtype (x, scale and bias, and in evaluation mean and var, cast to dtype first)
    # put outputs up to 2 half-precision steps away, and statistics up to 64 float32 steps.
    dtype = x_dtype if layer_dtype == "input" else None
    data = jnp.asarray(_microbatches(9, 3), x_dtype)
    masks = np.random.default_rng(10).random(data.shape) < 0.7
    kwargs = dict(momentum=MOMENTUM, dtype=dtype, scale_init=nnx.initializers.normal())
    for jit in (False, True):
        for masked in (False, True):
            ours = AccumBatchNorm(FEATURES, accum_steps=1, rngs=nnx.Rngs(4), **kwargs)
            theirs = nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(4), **kwargs)
            call = _call if jit else lambda layer, x, m: layer(x, mask=m)
            for x, mask in zip(data, masks if masked else [None] * len(data), strict=True):
                pairs = [(call(ours, x, mask), call(theirs, x, mask))]
                pairs += [(getattr(ours, n)[...], getattr(theirs, n)[...]) for n in ("mean", "var")]
                ours.eval(), theirs.eval()
                pairs.append((call(ours, x, None), call(theirs, x, None)))
                ours.train(), theirs.train()
                for i, (value, expected) in enumerate(pairs):
                    where = f"jit={jit} masked={masked} value {i}"
                    assert value.dtype == expected.dtype, where
                    if jit:  # two programs: XLA may fuse them differently elsewhere
                        assert_within_ulps(value, expected, 2, err_msg=where)
                    else:
                        np.testing.assert_array_equal(value, expected, err_msg=where)


def _complex_microbatches(seed: int, steps: int, rows: int = 8) -> np.ndarray:
    real, imag = _microbatches(seed, steps, rows), _microbatches(seed + 1, steps, rows)
    return (real + 1j * imag).astype(np.complex64)


def test_complex_inputs_match_nnx_batchnorm_outputs_and_linen_statistics():
    data = _complex_microbatches(10, 3)
    kwargs = dict(momentum=MOMENTUM, scale_init=nnx.initializers.normal())
    ours = AccumBatchNorm(FEATURES, accum_steps=1, rngs=nnx.Rngs(5), **kwargs)
    theirs = nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(5), **kwargs)
    linen = nn.BatchNorm(**kwargs)
    variables = linen.init(jax.random.key(0), data[0], use_running_average=False)
    variables["params"] = {"scale": ours.scale[...], "bias": ours.bias[...]}
    for x in data:
        y = ours(x)
        with warnings.catch_warnings():  # nnx.BatchNorm drops the running mean's imaginary part
            warnings.simplefilter("ignore")
            expected = theirs(x)
        linen_y, upd = linen.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
        variables = {**variables, **upd}
        assert y.dtype == expected.dtype == jnp.complex64
        np.testing.assert_array_equal(y, expected)  # the same arithmetic: the same bits
        np.testing.assert_array_equal(y, linen_y)
        # The running mean is complex, as flax.linen.BatchNorm's; the variance real.
        assert ours.mean[...].dtype == ours.acc_mean[...].dtype == jnp.complex64
        np.testing.assert_array_equal(ours.mean[...], variables["batch_stats"]["mean"])
        np.testing.assert_array_equal(ours.var[...], variables["batch_stats"]["var"])
        np.testing.assert_array_equal(ours.var[...], theirs.var[...])
    assert np.any(ours.mean[...].imag)


@pytest.mark.parametrize("accum_steps", [None, 3], ids=["step_driven", "self_closing"])
def test_complex_window_matches_linen(accum_steps):
    steps = 3
    data = _complex_microbatches(11, 2 * steps)
    kwargs = dict(momentum=MOMENTUM, accum_steps=accum_steps)
    linen = LinenAccumBatchNorm(scale_init=nnx.initializers.normal(), **kwargs)
    variables = linen.init(jax.random.key(6), data[0], use_running_average=False)
    layer = AccumBatchNorm(FEATURES, rngs=nnx.Rngs(0), **kwargs)
    _copy_params(layer, variables)

    close = accum_steps is None
    windows = list(data.reshape(2, steps, *data.shape[1:])) if close else data
    expected, linen_stats = _linen_run(linen, variables, windows, close=close)
    outputs, nnx_stats = _nnx_run(layer, windows, close=close)
    for ours, theirs in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(ours, theirs)  # same ops, same order: same bits
    _assert_equal_stats(nnx_stats, linen_stats)  # complex mean and acc_mean, real var
    assert nnx_stats["mean"].dtype == jnp.complex64 and np.any(nnx_stats["mean"].imag)


def test_sync_batch_norm_refuses_its_statistics_swapped():
    import optax

    import accumjax

    model = _NormFirst(nnx.Rngs(0))
    opt = nnx.Optimizer(model, accumjax.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, xb):
        before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        opt.update(model, nnx.grad(lambda m: jnp.mean(m(xb) ** 2))(model))
        after = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        nnx.update(model, accumjax.sync_batch_norm(before, after, opt.opt_state))  # swapped

    with pytest.raises(jax.errors.JaxRuntimeError, match=r"sync_batch_norm\(new_stats, old_"):
        train_step(model, opt, jnp.ones((4, 3)))
        jax.effects_barrier()


def test_own_loop_warns_about_a_plain_nnx_batch_norm():
    import optax

    import accumjax

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.BatchNorm(3, rngs=rngs)

    model = Plain(nnx.Rngs(0))
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    opt_state = accumjax.accumulate(optax.sgd(0.1), 2).init({"w": jnp.zeros(1)})
    moved = jax.tree.map(lambda a: a + 1, stats)  # what a training forward pass returns
    with pytest.warns(UserWarning, match=r"\['norm'\].*NNXAccumBatchNorm"):
        accumjax.sync_batch_norm(moved, stats, opt_state)


def test_a_synchronized_layer_on_one_device_names_the_one_device_case():
    layer = AccumBatchNorm(3, axis_name="data", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"axis_name='data'.*one device.*axis_name=None"):
        layer(jnp.ones((4, 3)))
