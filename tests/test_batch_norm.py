"""Tests for accumjax.batch_norm: AccumBatchNorm and convert_batch_norm_variables.

References are flax.linen.BatchNorm applied once to the concatenated window and numpy
float64 statistics. Microbatches have very different means and scales, so averaging
per-microbatch variances (the seed library's AccumBatchNormalization) would fail them.
"""

import functools
import warnings
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assertions import assert_within_ulps
from flax.core import FrozenDict
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import accumjax
from accumjax.batch_norm import (
    ACCUMULATOR_NAMES,
    AccumBatchNorm,
    close_batch_norm_windows,
)
from accumjax.batch_norm_convert import convert_batch_norm_variables
from accumjax.collectives import count_collectives

MOMENTUM = 0.9
# float32 sums over a few hundred elements of O(10) values plus three momentum updates:
# observed errors are ~1e-7 relative; 2e-5 leaves margin for other reduction orders yet is
# >10,000x below the ~50% gap between pooled and averaged-per-microbatch variances here.
RTOL = ATOL = 2e-5


def _microbatches(seed: int, steps: int, shape: tuple[int, ...]) -> np.ndarray:
    """``steps`` float32 microbatches whose per-feature means and scales differ a lot."""
    rng = np.random.default_rng(seed)
    features = shape[-1]
    loc = rng.uniform(-4.0, 4.0, size=(steps,) + (1,) * (len(shape) - 1) + (features,))
    scale = rng.uniform(0.2, 3.0, size=loc.shape)
    return (rng.standard_normal((steps, *shape)) * scale + loc).astype(np.float32)


def _np_stats(x: np.ndarray, where: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """float64 count, mean and population variance over all but the last axis."""
    x = np.asarray(x, np.float64)
    w = np.ones_like(x) if where is None else np.broadcast_to(where, x.shape).astype(np.float64)
    axes = tuple(range(x.ndim - 1))
    count = w.sum(axes)
    mean = (w * x).sum(axes) / count
    var = (w * (x - mean) ** 2).sum(axes) / count
    return count, mean, var


def _np_running(windows, masks=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 running mean/var after one momentum update per window (whole window)."""
    mean, var = 0.0, 1.0
    for i, window in enumerate(windows):
        where = None if masks is None else np.concatenate(masks[i])
        _, m, v = _np_stats(np.concatenate(window), where)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * m
        var = MOMENTUM * var + (1 - MOMENTUM) * v
    return mean, var


# One jitted training step and init for the module, the layer a static argument (flax modules
# hash by their fields): tests that train an equal layer on the same shapes share the program,
# and an init is one program, not each op of the layer's forward pass compiled on its own.
@partial(jax.jit, static_argnums=0)
def _train_step(module: nn.Module, v, x, mask):
    return module.apply(v, x, use_running_average=False, mask=mask, mutable=["batch_stats"])


def _train(module: nn.Module, variables, batches, masks=None):
    """Applies ``module`` in training mode batch by batch; returns outputs, stats history."""
    outputs, history = [], []
    for i, x in enumerate(batches):
        y, updates = _train_step(module, variables, x, None if masks is None else masks[i])
        variables = {**variables, "batch_stats": updates["batch_stats"]}
        outputs.append(y)
        history.append(variables["batch_stats"])
    return outputs, history


def _key(seed: int):
    """An "rbg" key: XLA:CPU compiles a threefry draw of a conv kernel in ~1 s (rank 4), an
    RngBitGenerator one in ~0.2 s. No test here depends on the initial values' bits."""
    return jax.random.key(seed, impl="rbg")


@partial(jax.jit, static_argnums=0)
def _init(module: nn.Module, x):
    return module.init(_key(0), x, use_running_average=False)


def _init_eagerly(module: nn.Module, x):
    """Op by op: two layers with the same initializers get the same bits (under jit, two
    programs might round a random draw differently)."""
    return module.init(jax.random.key(0), x, use_running_average=False)


def _assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", [(6, 5, 3), (2, 3, 4, 3)], ids=["BTC", "NHWC"])
def test_window_stats_equal_batchnorm_on_concatenated_batch(shape):
    steps, windows = 4, 3
    data = _microbatches(0, steps * windows, shape)
    accum = AccumBatchNorm(accum_steps=steps, momentum=MOMENTUM)
    variables = _init(accum, data[0])
    outputs, history = _train(accum, variables, data)

    flax_bn = nn.BatchNorm(momentum=MOMENTUM)
    concatenated = data.reshape(windows, steps * shape[0], *shape[1:])
    _, flax_history = _train(flax_bn, _init(flax_bn, concatenated[0]), concatenated)
    for w in range(windows):
        closed = history[(w + 1) * steps - 1]
        for name in ("mean", "var"):
            _assert_close(closed[name], flax_history[w][name])
        ref_mean, ref_var = _np_running(data.reshape(windows, steps, *shape)[: w + 1])
        _assert_close(closed["mean"], ref_mean)
        _assert_close(closed["var"], ref_var)
        assert int(closed["acc_step"]) == 0 and not np.any(closed["acc_count"])

    # Mid-window: running stats untouched, accumulators hold the float64 pooled stats.
    for i in range(1, steps - 1):
        open_stats = history[steps + i]
        np.testing.assert_array_equal(open_stats["mean"], history[steps - 1]["mean"])
        np.testing.assert_array_equal(open_stats["var"], history[steps - 1]["var"])
        count, mean, var = _np_stats(np.concatenate(data[steps : steps + i + 1]))
        assert int(open_stats["acc_step"]) == i + 1
        np.testing.assert_array_equal(open_stats["acc_count"], count)
        _assert_close(open_stats["acc_mean"], mean)
        _assert_close(open_stats["acc_m2"] / open_stats["acc_count"], var)

    # The seed approach (mean of per-microbatch variances) misses the spread of means.
    seed_var = 1.0
    for window in data.reshape(windows, steps, *shape):
        per_micro = np.mean([_np_stats(x)[2] for x in window], axis=0)
        seed_var = MOMENTUM * seed_var + (1 - MOMENTUM) * per_micro
    assert not np.allclose(seed_var, history[-1]["var"], rtol=100 * RTOL, atol=100 * ATOL)

    # Training outputs are BatchNorm's on each microbatch alone (same params).
    flax_vars = {"params": variables["params"], "batch_stats": flax_history[0]}
    for x, y in zip(data[:steps], outputs[:steps], strict=True):
        expected = flax_bn.apply(flax_vars, x, use_running_average=False, mutable=["batch_stats"])
        _assert_close(y, expected[0], rtol=1e-6, atol=1e-6)  # same float32 ops, any fusion


@pytest.mark.parametrize("fast", [True, False], ids=["fast_var", "centred_var"])
def test_accum_steps_one_matches_batchnorm_exactly(fast):
    data = _microbatches(1, 3, (8, 4))
    kwargs = dict(momentum=MOMENTUM, use_fast_variance=fast, scale_init=nn.initializers.normal())
    accum, flax_bn = AccumBatchNorm(accum_steps=1, **kwargs), nn.BatchNorm(**kwargs)
    accum_vars, flax_vars = _init_eagerly(accum, data[0]), _init_eagerly(flax_bn, data[0])
    assert set(accum_vars["batch_stats"]) == {"mean", "var", *ACCUMULATOR_NAMES}
    assert jax.tree.map(jnp.shape, accum_vars["params"]) == {"bias": (4,), "scale": (4,)}
    np.testing.assert_array_equal(accum_vars["params"]["scale"], flax_vars["params"]["scale"])

    accum_out, accum_hist = _train(accum, accum_vars, data)
    flax_out, flax_hist = _train(flax_bn, flax_vars, data)
    # Same float32 formulas in the same order: 2 ulp covers XLA fusion differences.
    for ours, theirs in zip(accum_out, flax_out, strict=True):
        np.testing.assert_array_max_ulp(np.asarray(ours), np.asarray(theirs), maxulp=2)
    for ours, theirs in zip(accum_hist, flax_hist, strict=True):
        for name in ("mean", "var"):
            np.testing.assert_array_max_ulp(ours[name], theirs[name], maxulp=2)
        assert int(ours["acc_step"]) == 0

    final = {"params": accum_vars["params"], "batch_stats": accum_hist[-1]}
    flax_final = {"params": flax_vars["params"], "batch_stats": flax_hist[-1]}
    ours = accum.apply(final, data[0], use_running_average=True)
    theirs = flax_bn.apply(flax_final, data[0], use_running_average=True)
    np.testing.assert_array_max_ulp(np.asarray(ours), np.asarray(theirs), maxulp=2)


@pytest.mark.parametrize("mask_kind", ["lengths", "elementwise"])
def test_mask_counts_only_unmasked_elements(mask_kind):
    steps, windows, shape = 3, 2, (4, 6, 3)
    data = _microbatches(2, steps * windows, shape)
    rng = np.random.default_rng(3)
    if mask_kind == "lengths":  # padded sequences, mask (B, T, 1)
        lengths = rng.integers(1, shape[1] + 1, size=(steps * windows, shape[0]))
        masks = np.arange(shape[1])[None, None, :, None] < lengths[..., None, None]
    else:  # per-feature mask (B, T, C): different counts per feature
        masks = rng.random(data.shape) < 0.6
    masks[1] = False  # a microbatch with no unmasked element
    accum = AccumBatchNorm(accum_steps=steps, momentum=MOMENTUM)
    outputs, history = _train(accum, _init(accum, data[0]), data, masks)

    assert all(np.isfinite(y).all() for y in outputs)
    assert int(history[1]["acc_step"]) == 2
    np.testing.assert_array_equal(history[1]["acc_count"], history[0]["acc_count"])
    ref_mean, ref_var = _np_running(
        data.reshape(windows, steps, *shape), masks.reshape(windows, steps, *masks.shape[1:])
    )
    _assert_close(history[-1]["mean"], ref_mean)
    _assert_close(history[-1]["var"], ref_var)
    # Unmasked positions of a training output use the masked microbatch statistics.
    _, mean, var = _np_stats(data[0], masks[0])
    scale_free = (data[0] - mean) / np.sqrt(var + 1e-5)
    where = np.broadcast_to(masks[0], data[0].shape)
    _assert_close(np.asarray(outputs[0])[where], scale_free[where], rtol=1e-4, atol=1e-4)


def test_fully_masked_microbatches_contribute_nothing():
    data = _microbatches(4, 4, (5, 2))
    masks = np.zeros((4, 5, 1), bool)
    masks[1, :3] = True  # windows: [empty, 3 rows], [empty, empty]
    accum = AccumBatchNorm(accum_steps=2, momentum=MOMENTUM)
    outputs, history = _train(accum, _init(accum, data[0]), data, masks)
    assert all(np.isfinite(y).all() for y in outputs)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(history))
    assert int(history[0]["acc_step"]) == 1
    assert not any(np.any(history[0][name]) for name in ACCUMULATOR_NAMES[:3])
    ref_mean, ref_var = _np_running([data[1:2]], [masks[1:2]])
    _assert_close(history[1]["mean"], ref_mean)
    _assert_close(history[1]["var"], ref_var)
    # A window without unmasked elements leaves the running statistics as they were.
    np.testing.assert_array_equal(history[3]["mean"], history[1]["mean"])
    np.testing.assert_array_equal(history[3]["var"], history[1]["var"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs_reduce_in_float32(dtype):
    steps, shape = 3, (16, 3)
    data = jnp.asarray(_microbatches(5, steps, shape), dtype)
    accum = AccumBatchNorm(accum_steps=steps, momentum=MOMENTUM, dtype=dtype)
    outputs, history = _train(accum, _init(accum, data[0]), data)
    stats = history[-1]
    assert stats["mean"].dtype == stats["var"].dtype == jnp.float32
    assert all(stats[name].dtype == jnp.float32 for name in ACCUMULATOR_NAMES[:3])
    assert stats["acc_step"].dtype == jnp.int32
    assert outputs[0].dtype == dtype
    # The inputs are exactly representable in float64, so the reference is exact and the
    # float32 reductions must meet the float32 tolerance (a half-precision sum would not).
    ref_mean, ref_var = _np_running([np.asarray(data, np.float64)])
    _assert_close(stats["mean"], ref_mean)
    _assert_close(stats["var"], ref_var)
    flax_bn = nn.BatchNorm(momentum=MOMENTUM, dtype=dtype)
    expected, _ = _train(flax_bn, _init(flax_bn, data[0]), data[:1])
    # Same float32 stats, then one rounding to half precision: allow 1 ulp of the output.
    eps = float(jnp.finfo(dtype).eps)
    _assert_close(np.asarray(outputs[0], np.float32), np.asarray(expected[0], np.float32), eps, eps)


def test_scan_over_microbatches_matches_loop_and_reference():
    steps, windows, shape = 4, 2, (5, 3)
    data = _microbatches(6, steps * windows, shape)
    accum = AccumBatchNorm(accum_steps=steps, momentum=MOMENTUM)
    variables = _init(accum, data[0])

    @jax.jit
    def run(batch_stats, xs):
        def body(stats, x):
            y, updates = accum.apply(
                {"params": variables["params"], "batch_stats": stats},
                x,
                use_running_average=False,
                mutable=["batch_stats"],
            )
            return updates["batch_stats"], y

        return jax.lax.scan(body, batch_stats, xs)

    scanned, ys = run(variables["batch_stats"], data)
    loop_outputs, history = _train(accum, variables, data)
    # Same float32 program per step, but scan fuses and orders the sums differently, and
    # E[x^2] - E[x]^2 amplifies that by mean^2 / var (up to ~400 here): 1e-5 covers it.
    for name in ("mean", "var", "acc_count", "acc_mean", "acc_m2", "acc_step"):
        _assert_close(scanned[name], history[-1][name], rtol=1e-5, atol=1e-5)
    _assert_close(ys, np.stack(loop_outputs), rtol=1e-5, atol=1e-5)
    ref_mean, ref_var = _np_running(data.reshape(windows, steps, *shape))
    _assert_close(scanned["mean"], ref_mean)
    _assert_close(scanned["var"], ref_var)


def _global_reference(data, steps, windows):
    """Running stats of single-device BatchNorm on each concatenated window."""
    flax_bn = nn.BatchNorm(momentum=MOMENTUM)
    concatenated = data.reshape(windows, -1, data.shape[-1])
    _, history = _train(flax_bn, _init(flax_bn, concatenated[0]), concatenated)
    return flax_bn, history[-1]


def test_pmap_pools_statistics_across_devices():
    devices = 4
    assert jax.device_count() >= devices
    steps, windows = 3, 2
    data = _microbatches(7, steps * windows, (devices * 4, 3))  # global microbatches
    accum = AccumBatchNorm(accum_steps=steps, momentum=MOMENTUM, axis_name="batch")
    variables = _init(accum, data[0])

    @partial(jax.pmap, axis_name="batch", in_axes=(None, 0))
    def step(v, x):
        return accum.apply(v, x, use_running_average=False, mutable=["batch_stats"])

    for i, x in enumerate(data):
        y, updates = step(variables, x.reshape(devices, -1, 3))
        # Replicated stats: every device holds the same values; keep device 0's.
        for leaf in jax.tree.leaves(updates):
            np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
        device0 = jax.tree.map(lambda a: a[0], updates["batch_stats"])
        variables = {**variables, "batch_stats": device0}
        if i == 0:
            first_y = y.reshape(-1, 3)

    flax_bn, flax_stats = _global_reference(data, steps, windows)
    for name in ("mean", "var"):
        _assert_close(variables["batch_stats"][name], flax_stats[name])
    flax_vars = _init(flax_bn, data[0])
    expected, _ = flax_bn.apply(flax_vars, data[0], use_running_average=False, mutable=True)
    _assert_close(first_y, expected, rtol=1e-5, atol=1e-5)  # psum vs one-device sum order


def test_shard_map_pools_statistics_across_devices():
    devices = 8
    assert jax.device_count() >= devices
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    steps, windows = 2, 2
    data = _microbatches(8, steps * windows, (devices * 2, 3))
    accum = AccumBatchNorm(
        accum_steps=steps, momentum=MOMENTUM, axis_name="data", use_fast_variance=False
    )
    variables = _init(accum, data[0])

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=(P("data"), P()),
    )
    def step(v, x):
        y, updates = accum.apply(v, x, use_running_average=False, mutable=["batch_stats"])
        return y, updates["batch_stats"]

    for x in data:
        _, batch_stats = step(variables, x)
        variables = {**variables, "batch_stats": batch_stats}
    _, flax_stats = _global_reference(data, steps, windows)
    for name in ("mean", "var"):
        _assert_close(variables["batch_stats"][name], flax_stats[name])


def test_init_and_eval_do_not_update():
    x = _microbatches(9, 1, (6, 2))[0] + 5.0
    accum = AccumBatchNorm(accum_steps=2, momentum=MOMENTUM)
    for use_running_average in (False, True):
        stats = accum.init(jax.random.key(0), x, use_running_average=use_running_average)
        stats = stats["batch_stats"]
        assert set(stats) == {"mean", "var", *ACCUMULATOR_NAMES}
        np.testing.assert_array_equal(stats["mean"], np.zeros(2))
        np.testing.assert_array_equal(stats["var"], np.ones(2))
        assert not any(np.any(stats[name]) for name in ACCUMULATOR_NAMES)

    variables = _init(accum, x)
    _, history = _train(accum, variables, [x])  # half a window
    trained = {**variables, "batch_stats": history[0]}
    y, updates = accum.apply(trained, x, use_running_average=True, mutable=["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, updates["batch_stats"], history[0])
    # Eval needs only mean/var: plain BatchNorm variables work without conversion.
    plain = {**variables, "batch_stats": {k: history[0][k] for k in ("mean", "var")}}
    np.testing.assert_array_equal(accum.apply(plain, x, use_running_average=True), y)


class _SharedLayer(nn.Module):
    """Applies one normalization layer to two inputs in a single forward pass."""

    accum_steps: int | None

    @nn.compact
    def __call__(self, pair, use_running_average=False, mask=None):
        bn = AccumBatchNorm(accum_steps=self.accum_steps, momentum=MOMENTUM)
        return bn(pair[0], use_running_average) + bn(pair[1], use_running_average)


def test_shared_layer_counts_every_call():
    steps, calls, shape = 3, 2, (4, 3)
    data = _microbatches(10, steps * calls, shape).reshape(steps, calls, *shape)
    model = _SharedLayer(accum_steps=steps * calls)
    _, history = _train(model, _init(model, data[0]), data)
    stats = history[-1]["AccumBatchNorm_0"]
    ref_mean, ref_var = _np_running([data.reshape(-1, *shape)])
    _assert_close(stats["mean"], ref_mean)
    _assert_close(stats["var"], ref_var)
    for i in range(steps - 1):  # the window closes only after the last forward pass
        assert int(history[i]["AccumBatchNorm_0"]["acc_step"]) == calls * (i + 1)
        np.testing.assert_array_equal(history[i]["AccumBatchNorm_0"]["mean"], np.zeros(3))

    # accum_steps=K without the factor closes the window after K calls, mid-window.
    naive = _SharedLayer(accum_steps=steps)
    _, naive_history = _train(naive, _init(naive, data[0]), data[:2])
    assert int(naive_history[1]["AccumBatchNorm_0"]["acc_step"]) == 1
    assert np.any(naive_history[1]["AccumBatchNorm_0"]["mean"])


class _Net(nn.Module):
    """Dense -> norm -> relu -> Dense -> norm, with the normalization layer pluggable."""

    norm: type[nn.Module]

    @nn.compact
    def __call__(self, x, use_running_average=False, mask=None):
        x = nn.Dense(8)(x)
        x = nn.relu(self.norm(momentum=MOMENTUM, name="bn1")(x, use_running_average))
        x = nn.Dense(4)(x)
        return self.norm(momentum=MOMENTUM, name="bn2")(x, use_running_average)


def test_convert_batch_norm_variables_swaps_layers():
    data = _microbatches(11, 5, (8, 3))
    old_model, new_model = _Net(nn.BatchNorm), _Net(partial(AccumBatchNorm, accum_steps=1))
    old_vars = _init(old_model, data[0])
    _, old_history = _train(old_model, old_vars, data[:2])
    trained = {**old_vars, "batch_stats": old_history[-1]}
    snapshot = jax.tree.map(np.array, trained)

    converted = convert_batch_norm_variables(trained, momentum=None)  # self-closing layout
    jax.tree.map(np.testing.assert_array_equal, trained, snapshot)  # input untouched
    for layer in ("bn1", "bn2"):
        assert set(converted["batch_stats"][layer]) == {"mean", "var", *ACCUMULATOR_NAMES}
    expected_tree = jax.tree.structure(jax.eval_shape(_init, new_model, data[0]))
    assert jax.tree.structure(converted) == expected_tree
    assert convert_batch_norm_variables(converted, momentum=None) == converted  # idempotent
    assert isinstance(convert_batch_norm_variables(FrozenDict(trained)), FrozenDict)

    # Identical eval outputs, then identical training with accum_steps=1.
    old_eval = old_model.apply(trained, data[0], use_running_average=True)
    np.testing.assert_array_equal(
        new_model.apply(converted, data[0], use_running_average=True), old_eval
    )
    old_out, old_hist = _train(old_model, trained, data[2:])
    new_out, new_hist = _train(new_model, converted, data[2:])
    # Same float32 formulas in the same order: 2 ulp covers XLA fusion differences.
    for ours, theirs in zip(new_out, old_out, strict=True):
        np.testing.assert_array_max_ulp(np.asarray(ours), np.asarray(theirs), maxulp=2)
    for layer in ("bn1", "bn2"):
        for name in ("mean", "var"):
            ours, theirs = new_hist[-1][layer][name], old_hist[-1][layer][name]
            np.testing.assert_array_max_ulp(ours, theirs, maxulp=2)


def test_convert_rejects_variables_without_batch_norm():
    with pytest.raises(ValueError, match="batch_stats"):
        convert_batch_norm_variables({"params": {}})
    with pytest.raises(ValueError, match="no BatchNorm layer"):
        convert_batch_norm_variables({"batch_stats": {"layer": {"count": jnp.zeros(2)}}})
    with pytest.raises(ValueError, match="shapes differ"):
        convert_batch_norm_variables({"batch_stats": {"mean": jnp.zeros(2), "var": jnp.ones(3)}})


@pytest.mark.parametrize(
    ("accum_steps", "error"),
    [
        # Not an int (accumjax._checks: a wrong kind, bools included, is a TypeError) ...
        (2.0, TypeError),
        (True, TypeError),
        # ... an int out of [1, 2**31 - 1] is a ValueError.
        (0, ValueError),
        (-1, ValueError),
        (2**31, ValueError),
    ],
)
def test_rejects_bad_accum_steps(accum_steps, error):
    with pytest.raises(error, match="accum_steps"):
        AccumBatchNorm(accum_steps=accum_steps)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="momentum"):
        AccumBatchNorm(momentum=1.5)
    with pytest.raises(TypeError, match="momentum must be a real number"):
        AccumBatchNorm(momentum="0.9")  # type: ignore[arg-type]
    for epsilon in (-1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="epsilon"):
            AccumBatchNorm(epsilon=epsilon)
    x = jnp.ones((4, 3))
    bn = AccumBatchNorm(use_running_average=False)
    with pytest.raises(TypeError, match="floating-point"):  # complex is accepted, ints not
        bn.init(jax.random.key(0), x.astype(jnp.int32))
    with pytest.raises(ValueError, match="does not broadcast"):
        bn.init(jax.random.key(0), x, mask=jnp.ones((4, 2), bool))
    with pytest.raises(ValueError, match="out of range"):
        AccumBatchNorm(axis=2, use_running_average=False).init(jax.random.key(0), x)


# ---------------------------------------------------------------------------------------------
# Step-driven windows (accum_steps=None) closed by close_batch_norm_windows
# ---------------------------------------------------------------------------------------------

STEP_DRIVEN_NAMES = {"mean", "var", *ACCUMULATOR_NAMES, "momentum"}


def test_step_driven_window_equals_batchnorm_on_concatenated_batch():
    steps, windows, shape = 4, 2, (6, 5, 3)
    data = _microbatches(20, steps * windows, shape)
    accum = AccumBatchNorm(momentum=MOMENTUM)  # accum_steps=None: step-driven
    variables = _init(accum, data[0])
    stats = variables["batch_stats"]
    assert set(stats) == STEP_DRIVEN_NAMES
    assert stats["momentum"].dtype == jnp.float32 and stats["momentum"].shape == ()

    flax_bn = nn.BatchNorm(momentum=MOMENTUM)
    concatenated = data.reshape(windows, steps * shape[0], *shape[1:])
    _, flax_history = _train(flax_bn, _init(flax_bn, concatenated[0]), concatenated)
    close = jax.jit(close_batch_norm_windows)
    for w in range(windows):
        micro = data[w * steps : (w + 1) * steps]
        outputs, history = _train(accum, {**variables, "batch_stats": stats}, micro)
        pooled = history[-1]
        # The layer pools but never touches the running statistics.
        np.testing.assert_array_equal(pooled["mean"], stats["mean"])
        np.testing.assert_array_equal(pooled["var"], stats["var"])
        assert int(pooled["acc_step"]) == steps
        stats = close(pooled, jnp.array(True))
        # float32 sums as in the self-closing tests, plus the float32 momentum leaf
        # (1 - momentum differs by ~1e-7 relative): RTOL covers both.
        for name in ("mean", "var"):
            _assert_close(stats[name], flax_history[w][name])
        assert int(stats["acc_step"]) == 0
        assert not any(np.any(stats[name]) for name in ACCUMULATOR_NAMES[:3])
        # Training outputs are BatchNorm's on each microbatch (same float32 formulas).
        if w == 0:
            flax_vars = {"params": variables["params"], "batch_stats": flax_history[0]}
            for x, y in zip(micro, outputs, strict=True):
                expected, _ = flax_bn.apply(
                    flax_vars, x, use_running_average=False, mutable=["batch_stats"]
                )
                # Sums vs means in another order; E[x^2] - E[x]^2 amplifies the rounding
                # by mean^2 / var (large here): the float32 RTOL covers it.
                _assert_close(y, expected)


def test_step_driven_window_float64_is_tight():
    steps, shape, momentum = 3, (5, 4, 2), 0.75  # 0.75 is exact in the float32 leaf
    with jax.enable_x64(True):
        data = _microbatches(21, steps, shape).astype(np.float64)
        kwargs = dict(momentum=momentum, param_dtype=jnp.float64, force_float32_reductions=False)
        accum = AccumBatchNorm(**kwargs)
        variables = _init(accum, data[0])
        _, history = _train(accum, variables, data)
        assert history[-1]["acc_mean"].dtype == jnp.float64
        stats = close_batch_norm_windows(history[-1], True)
        assert stats["mean"].dtype == stats["var"].dtype == jnp.float64
        flax_bn = nn.BatchNorm(**kwargs)
        whole = data.reshape(1, -1, *shape[1:])
        _, flax_history = _train(flax_bn, _init(flax_bn, whole[0]), whole)
        _, ref_mean, ref_var = _np_stats(whole[0])
        # float64 sums of a few hundred O(10) values: ~1e-15 relative.
        for ours, flax_value, ref in (
            (stats["mean"], flax_history[0]["mean"], (1 - momentum) * ref_mean),
            (stats["var"], flax_history[0]["var"], momentum + (1 - momentum) * ref_var),
        ):
            np.testing.assert_allclose(ours, flax_value, rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-13)


def test_close_with_apply_false_resets_only_the_window():
    data = _microbatches(22, 2, (6, 3))
    accum = AccumBatchNorm(momentum=MOMENTUM)
    variables = _init(accum, data[0])
    trained = close_batch_norm_windows(_train(accum, variables, data)[1][-1], True)
    _, history = _train(accum, {**variables, "batch_stats": trained}, data)
    skipped = close_batch_norm_windows(history[-1], False)
    assert np.any(history[-1]["acc_count"])
    for name in ("mean", "var", "momentum"):
        np.testing.assert_array_equal(skipped[name], trained[name])
    for name in ACCUMULATOR_NAMES:
        assert not np.any(skipped[name]) and skipped[name].dtype == trained[name].dtype
    assert jax.tree.structure(skipped) == jax.tree.structure(trained)


def test_close_under_jit_with_traced_apply():
    data = _microbatches(23, 2, (6, 3))
    accum = AccumBatchNorm(momentum=MOMENTUM)
    pooled = {"batch_stats": _train(accum, _init(accum, data[0]), data)[1][-1]}
    traces = []

    @jax.jit
    def close(stats, apply):
        traces.append(apply)
        return close_batch_norm_windows(stats, apply)

    for apply in (True, False):
        jitted = close(pooled, jnp.asarray(apply))
        eager = close_batch_norm_windows(pooled, apply)
        for name in ("mean", "var"):
            np.testing.assert_array_max_ulp(
                jitted["batch_stats"][name], eager["batch_stats"][name], maxulp=2
            )
    assert len(traces) == 1  # one trace serves both values of apply
    with pytest.raises(ValueError, match="scalar"):
        close_batch_norm_windows(pooled, jnp.ones(2, bool))


def test_close_leaves_other_entries_and_self_closing_layers_alone():
    x = _microbatches(24, 1, (6, 3))[0]
    step_driven = _train(AccumBatchNorm(), _init(AccumBatchNorm(), x), [x])[1][-1]
    self_closing = AccumBatchNorm(accum_steps=4)
    own = _train(self_closing, _init(self_closing, x), [x])[1][-1]
    tree = FrozenDict({"batch_stats": {"a": step_driven, "b": own}, "other": {"mean": x}})
    closed = close_batch_norm_windows(tree, True)
    assert isinstance(closed, FrozenDict)
    assert closed["batch_stats"]["b"] == own and closed["other"]["mean"] is x
    assert int(closed["batch_stats"]["a"]["acc_step"]) == 0
    assert np.any(closed["batch_stats"]["a"]["mean"] != step_driven["mean"])


def test_step_driven_shared_layer_needs_no_call_factor():
    steps, calls, shape = 3, 2, (4, 3)
    data = _microbatches(25, steps * calls, shape).reshape(steps, calls, *shape)
    model = _SharedLayer(accum_steps=None)
    _, history = _train(model, _init(model, data[0]), data)
    pooled = history[-1]
    assert int(pooled["AccumBatchNorm_0"]["acc_step"]) == steps * calls
    stats = close_batch_norm_windows(pooled, True)["AccumBatchNorm_0"]
    ref_mean, ref_var = _np_running([data.reshape(-1, *shape)])
    _assert_close(stats["mean"], ref_mean)
    _assert_close(stats["var"], ref_var)


class _TwoNorms(nn.Module):
    """Two step-driven norms side by side (their inputs do not depend on each other)."""

    @nn.compact
    def __call__(self, x, use_running_average=False, mask=None):
        a = AccumBatchNorm(momentum=MOMENTUM)(x, use_running_average)
        b = AccumBatchNorm(momentum=MOMENTUM)(jnp.abs(x) ** 1.5, use_running_average)
        return a + b


def _single_and_sharded_windows(model, variables, data, devices):
    """A window of the global microbatches ``data`` through ``model``'s step-driven norms,
    closed: on one device (``single``: every call sees the whole global microbatch), and under
    shard_map on ``devices`` devices (each normalizes its rows alone; the close pools the
    windows). Returns ``single``, the compiled sharded program and its result."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    assert len(mesh.devices) == devices
    params = variables["params"]

    def window(stats, xs, axis_name):
        for x in xs:
            _, updates = model.apply(
                {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            stats = updates["batch_stats"]
        return close_batch_norm_windows(stats, True, axis_name=axis_name)

    single = jax.jit(partial(window, axis_name=None))(variables["batch_stats"], data)
    sharded = jax.jit(
        jax.shard_map(
            partial(window, axis_name="data"),
            mesh=mesh,
            in_specs=(P(), P(None, "data")),
            out_specs=P(),
        )
    )
    compiled = sharded.lower(variables["batch_stats"], data).compile()
    return single, compiled, compiled(variables["batch_stats"], data)


def test_close_pools_across_devices_with_one_all_reduce():
    devices, steps = 8, 3
    data = _microbatches(26, steps, (devices * 2, 3))  # global microbatches (K, B, C)
    model = _TwoNorms()
    single, compiled, pooled = _single_and_sharded_windows(
        model, _init(model, data[0]), data, devices
    )
    assert count_collectives(compiled)["all-reduce"] == 1  # both layers, one all-reduce
    for layer in ("AccumBatchNorm_0", "AccumBatchNorm_1"):
        for name in ("mean", "var"):
            # Shifted per-device sums vs one-device sums: float32 rounding only.
            _assert_close(pooled[layer][name], single[layer][name])
        assert int(pooled[layer]["acc_step"]) == 0
    _, ref_mean, ref_var = _np_stats(data.reshape(-1, 3))
    _assert_close(pooled["AccumBatchNorm_0"]["mean"], (1 - MOMENTUM) * ref_mean)
    _assert_close(pooled["AccumBatchNorm_0"]["var"], MOMENTUM + (1 - MOMENTUM) * ref_var)


# ---------------------------------------------------------------------------------------------
# Converting a model whose norms are created without names (Flax ResNet example style)
# ---------------------------------------------------------------------------------------------


class _Block(nn.Module):
    """conv -> norm -> relu -> conv -> norm, plus the shortcut; norms are unnamed."""

    norm: Any

    @nn.compact
    def __call__(self, x, use_running_average):
        y = nn.relu(self.norm(use_running_average=use_running_average)(nn.Conv(4, (3, 3))(x)))
        y = self.norm(use_running_average=use_running_average)(nn.Conv(4, (3, 3))(y))
        return nn.relu(x + y)


class _ResNet(nn.Module):
    norm: Any

    @nn.compact
    def __call__(self, x, use_running_average=False, mask=None):
        x = nn.relu(self.norm(use_running_average=use_running_average)(nn.Conv(4, (3, 3))(x)))
        for _ in range(2):
            x = _Block(self.norm)(x, use_running_average)
        return nn.Dense(2)(x.mean((1, 2)))


def test_convert_unnamed_norms_in_resnet_style_model():
    images = _microbatches(27, 3, (4, 6, 6, 3))
    old = _ResNet(partial(nn.BatchNorm, momentum=MOMENTUM))
    new = _ResNet(partial(AccumBatchNorm, momentum=MOMENTUM))
    variables = _init(old, images[0])
    _, history = _train(old, variables, images)  # non-trivial running statistics
    trained = {**variables, "batch_stats": history[-1]}
    assert "BatchNorm_0" in trained["batch_stats"]["_Block_1"]

    converted = convert_batch_norm_variables(trained)
    new_init = jax.eval_shape(_init, new, images[0])  # its structure: nothing to compile
    assert jax.tree.structure(converted) == jax.tree.structure(new_init)
    np.testing.assert_array_equal(
        converted["batch_stats"]["_Block_1"]["AccumBatchNorm_1"]["var"],
        trained["batch_stats"]["_Block_1"]["BatchNorm_1"]["var"],
    )
    x = images[0]
    np.testing.assert_array_equal(
        new.apply(converted, x, use_running_average=True),
        old.apply(trained, x, use_running_average=True),
    )
    # The converted variables train (step-driven) and close in a nested tree.
    _, new_history = _train(new, converted, images[:2])
    closed = jax.jit(close_batch_norm_windows)({"batch_stats": new_history[-1]}, jnp.asarray(True))
    assert int(closed["batch_stats"]["_Block_0"]["AccumBatchNorm_0"]["acc_step"]) == 0


class _Chain(nn.Module):
    """Dense -> norm three times, with per-position norm classes and widths."""

    norms: tuple[Any, ...]

    @nn.compact
    def __call__(self, x, use_running_average=False, mask=None):
        for width, norm in zip((3, 4, 5), self.norms, strict=True):
            x = norm(momentum=MOMENTUM, use_running_average=use_running_average)(nn.Dense(width)(x))
        return x


def test_convert_partial_swap_with_target():
    data = _microbatches(28, 2, (6, 2))
    old = _Chain((nn.BatchNorm,) * 3)
    new = _Chain((nn.BatchNorm, AccumBatchNorm, nn.BatchNorm))
    # "rbg" keys, as in _init: the kernels' threefry draws would take longer to compile.
    variables = old.init(_key(0), data[0])
    trained = {**variables, "batch_stats": _train(old, variables, data)[1][-1]}
    target = new.init(_key(1), data[0])  # eager: keys in creation order

    converted = convert_batch_norm_variables(trained, target=target)
    assert list(converted["batch_stats"]) == ["BatchNorm_0", "AccumBatchNorm_0", "BatchNorm_1"]
    assert set(converted["batch_stats"]["BatchNorm_1"]) == {"mean", "var"}
    np.testing.assert_array_equal(
        converted["params"]["BatchNorm_1"]["scale"], trained["params"]["BatchNorm_2"]["scale"]
    )
    np.testing.assert_array_equal(
        new.apply(converted, data[0], use_running_average=True),
        old.apply(trained, data[0], use_running_average=True),
    )
    # Without target, a full swap is assumed; the layout then does not fit this model.
    with pytest.raises(ValueError, match="AccumBatchNorm"):
        convert_batch_norm_variables(convert_batch_norm_variables(trained, target=target))
    # Keys sorted by jax.jit(init) map the wrong layers; their shapes give it away.
    with pytest.raises(ValueError, match="shape"):
        convert_batch_norm_variables(trained, target=jax.jit(new.init)(_key(1), data[0]))
    with pytest.raises(ValueError, match="cannot match"):
        fewer = _Chain((nn.BatchNorm, AccumBatchNorm, partial(AccumBatchNorm, name="named")))
        convert_batch_norm_variables(trained, target=fewer.init(_key(1), data[0]))


# ----------------------------------------------------------------------------- your own loop


@functools.cache  # the two tests share the compiled train_step
def _user_loop_setup(k: int, chained: bool = False):
    """BatchNorm first (its statistics are those of the input, whatever the parameters),
    then a Dense layer; an optax loop with accumulate, as users write it (``chained``: inside
    ``optax.chain(optax.scale(1.0), accumulate(...))``)."""

    model = nn.Sequential(
        [AccumBatchNorm(use_running_average=False, momentum=MOMENTUM), nn.Dense(1)]
    )
    x = _microbatches(3, 2 * k, (4, 3)).reshape(-1, 3)  # numpy: sliced without compiling
    x.flags.writeable = False  # shared by the tests: a test that changes rows copies it
    variables = jax.jit(model.init)(_key(0), x[:4])
    tx = accumjax.accumulate(optax.sgd(0.1), k)
    if chained:
        tx = optax.chain(optax.scale(1.0), tx)

    def loss_fn(params, batch_stats, xb):
        y, new = model.apply(
            {"params": params, "batch_stats": batch_stats}, xb, mutable=["batch_stats"]
        )
        return jnp.mean(y**2), new["batch_stats"]

    @jax.jit
    def train_step(params, batch_stats, opt_state, xb):
        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params, batch_stats, xb)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        batch_stats = accumjax.sync_batch_norm(new_stats, batch_stats, opt_state)  # the recipe
        return params, batch_stats, opt_state

    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    return x, state, train_step


def _batch_norm_reference(rows: np.ndarray, windows: list[slice]) -> tuple[np.ndarray, ...]:
    """flax.linen.BatchNorm run once per window on the window's rows (float64 numpy)."""
    mean, var = np.zeros(3), np.ones(3)
    for w in windows:
        block = rows[w].astype(np.float64)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * block.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * block.var(0)
    return mean, var


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "in_a_chain"])
def test_sync_batch_norm_in_an_optax_loop_equals_batch_norm_per_window(chained):
    """Also with accumulate inside an optax.chain: sync_batch_norm finds its state there."""
    k = 3
    x, (params, batch_stats, opt_state), train_step = _user_loop_setup(k, chained)
    for i in range(2 * k):
        params, batch_stats, opt_state = train_step(
            params, batch_stats, opt_state, x[4 * i : 4 * i + 4]
        )
    mean, var = _batch_norm_reference(np.asarray(x), [slice(0, 12), slice(12, 24)])
    bn = batch_stats["layers_0"]
    np.testing.assert_allclose(bn["mean"], mean, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(bn["var"], var, rtol=RTOL, atol=ATOL)
    assert int(bn["acc_step"]) == 0


def test_sync_batch_norm_leaves_a_skipped_nan_microbatch_out():
    k = 3
    x, (params, batch_stats, opt_state), train_step = _user_loop_setup(k)
    x = x.copy()
    x[5] = np.nan  # microbatch 1 (rows 4..7): NaN gradient, NaN statistics
    for i in range(k):
        params, batch_stats, opt_state = train_step(
            params, batch_stats, opt_state, x[4 * i : 4 * i + 4]
        )
    rows = np.concatenate([x[0:4], x[8:12]])
    mean, var = _batch_norm_reference(rows, [slice(0, 8)])
    bn = batch_stats["layers_0"]
    assert int(opt_state.skipped_microbatches) == 1 and bool(opt_state.updated)
    np.testing.assert_allclose(bn["mean"], mean, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(bn["var"], var, rtol=RTOL, atol=ATOL)


def test_evaluating_an_unclosed_step_driven_window_warns():
    bn = AccumBatchNorm()
    x = jnp.ones((4, 3))
    variables = bn.init(jax.random.key(0), x, use_running_average=False)
    _, updated = bn.apply(variables, 2 * x, use_running_average=False, mutable=["batch_stats"])
    evaluate = jax.jit(lambda v: bn.apply(v, x, use_running_average=True))
    with pytest.warns(UserWarning, match="never closed"):
        evaluate({**variables, **updated}).block_until_ready()
        jax.effects_barrier()
    closed = {**variables, "batch_stats": close_batch_norm_windows(updated["batch_stats"], True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(closed).block_until_ready()
        jax.effects_barrier()


@pytest.mark.parametrize("apply", ["yes", 1, 0.5])
def test_close_rejects_an_apply_that_is_not_a_bool(apply):
    variables = _init(AccumBatchNorm(), np.ones((2, 1), np.float32))
    with pytest.raises(TypeError, match="apply"):
        close_batch_norm_windows(variables, apply)


def test_sync_batch_norm_refuses_self_closing_layers():
    layer = AccumBatchNorm(accum_steps=4)
    x = jnp.ones((4, 3))
    stats = layer.init(jax.random.key(0), x, use_running_average=False)["batch_stats"]
    opt_state = accumjax.accumulate(optax.sgd(0.1), 4).init({"w": jnp.zeros(1)})
    with pytest.raises(ValueError, match=r"accum_steps=K.*accum_steps=None"):
        accumjax.sync_batch_norm(stats, stats, opt_state)


# ---------------------------------------------------------------------------------------------
# accum_steps=1 is BatchNorm bit for bit; complex inputs
# ---------------------------------------------------------------------------------------------


def _complex_microbatches(seed: int, steps: int, shape: tuple[int, ...]) -> np.ndarray:
    """complex64 microbatches whose real and imaginary parts both vary a lot between them."""
    real, imag = _microbatches(seed, steps, shape), _microbatches(seed + 1, steps, shape)
    return (real + 1j * imag).astype(np.complex64)


def _ours_and_batchnorm(data, masks, *, jit: bool, fast: bool, dtype=None) -> list[list[Any]]:
    """AccumBatchNorm(accum_steps=1) and BatchNorm trained side by side: per layer, every
    call's output, mean and var, then an evaluation output."""
    kwargs = dict(
        momentum=MOMENTUM,
        dtype=dtype,
        use_fast_variance=fast,
        scale_init=nn.initializers.normal(),
        bias_init=nn.initializers.normal(),
    )
    results = []
    for module in (AccumBatchNorm(accum_steps=1, **kwargs), nn.BatchNorm(**kwargs)):
        variables = _init_eagerly(module, data[0])

        def step(v, x, mask, module=module):
            return module.apply(v, x, use_running_average=False, mask=mask, mutable=["batch_stats"])

        step = jax.jit(step) if jit else step
        values = []
        for x, mask in zip(data, masks, strict=True):
            y, updates = step(variables, x, mask)
            variables = {**variables, **updates}
            values += [y, updates["batch_stats"]["mean"], updates["batch_stats"]["var"]]
        values.append(module.apply(variables, data[0], use_running_average=True))
        results.append(values)
    return results


def _assert_bit_for_bit(data, rng, dtype=None):
    """AccumBatchNorm(accum_steps=1) equals BatchNorm bit for bit eagerly (one op at a time:
    the same ops give the same bits) and within 2 ulp under jit (two programs XLA may fuse
    differently on another machine), unmasked and masked, fast and centred variance."""
    masks = rng.random(data.shape) < 0.7
    for jit in (False, True):
        for masked in (False, True):
            for fast in (True, False):
                ours, theirs = _ours_and_batchnorm(
                    data, masks if masked else [None] * len(data), jit=jit, fast=fast, dtype=dtype
                )
                for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                    where = f"jit={jit} masked={masked} fast={fast} value {i}"
                    assert a.dtype == b.dtype, where
                    if jit:
                        assert_within_ulps(a, b, 2, err_msg=where)
                    else:
                        np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.parametrize(
    ("dtype", "layer_dtype"),
    [
        (jnp.float32, None),
        (jnp.float16, None),
        (jnp.bfloat16, None),
        (jnp.float16, jnp.float16),
        (jnp.bfloat16, jnp.bfloat16),
    ],
    ids=["float32", "float16", "bfloat16", "float16_dtype", "bfloat16_dtype"],
)
def test_accum_steps_one_is_batchnorm_bit_for_bit(dtype, layer_dtype):
    # 5 rows of 10 features: before, 14 of BatchNorm's 50 evaluation outputs were one
    # rounding step away, from two roundings of ours: a division of the sums by an array
    # count (jnp.mean's constant count becomes a multiplication by 1 / count in XLA) and a
    # select after the momentum blend (which XLA compiled unlike BatchNorm's blend).
    data = jnp.asarray(_microbatches(30, 3, (5, 10)), dtype)
    sums = np.sum(np.asarray(data[0], np.float32), 0)  # IEEE arithmetic: any machine agrees
    assert np.any(sums / np.float32(5) != sums * (np.float32(1) / np.float32(5)))  # differ here
    _assert_bit_for_bit(data, np.random.default_rng(31), layer_dtype)


def test_complex_inputs_with_accum_steps_one_match_batchnorm_bit_for_bit():
    # BatchNorm normalizes a complex input with its complex mean and the real variance
    # E|x - mean|^2, and its running mean turns complex64; ours does the same arithmetic.
    data = _complex_microbatches(32, 3, (5, 10))
    _assert_bit_for_bit(data, np.random.default_rng(33))
    accum = AccumBatchNorm(accum_steps=1)
    stats = _init_eagerly(accum, data[0])["batch_stats"]  # its ops are compiled already
    # Declared complex from init, so the statistics keep their dtypes in a loop carry.
    assert stats["mean"].dtype == stats["acc_mean"].dtype == jnp.complex64
    assert stats["var"].dtype == stats["acc_m2"].dtype == stats["acc_count"].dtype == jnp.float32


def _np_complex_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 mean and population variance E|x - mean|^2 over all but the last axis."""
    x = np.asarray(x, np.complex128).reshape(-1, x.shape[-1])
    mean = x.mean(0)
    return mean, (np.abs(x - mean) ** 2).mean(0)


@pytest.mark.parametrize("accum_steps", [None, 4], ids=["step_driven", "self_closing"])
def test_complex_window_equals_batchnorm_on_concatenated_batch(accum_steps):
    steps, shape = 4, (6, 3)
    data = _complex_microbatches(34, steps, shape)
    accum = AccumBatchNorm(accum_steps=accum_steps, momentum=MOMENTUM)
    _, history = _train(accum, _init(accum, data[0]), data)
    stats = history[-1]
    if accum_steps is None:
        assert int(stats["acc_step"]) == steps and not np.any(stats["mean"])
        stats = jax.jit(close_batch_norm_windows)(stats, jnp.array(True))
    assert stats["mean"].dtype == stats["acc_mean"].dtype == jnp.complex64
    assert stats["var"].dtype == jnp.float32 and not np.any(stats["acc_count"])

    flax_bn = nn.BatchNorm(momentum=MOMENTUM)
    whole = data.reshape(1, -1, shape[-1])
    _, flax_history = _train(flax_bn, _init(flax_bn, whole[0]), whole)
    mean, var = _np_complex_stats(data)
    for name, ref in (("mean", (1 - MOMENTUM) * mean), ("var", MOMENTUM + (1 - MOMENTUM) * var)):
        # float32 sums, as in the real tests: RTOL covers their rounding.
        _assert_close(stats[name], flax_history[0][name])
        _assert_close(stats[name], ref)
    # Without |delta|^2 (the spread of the complex microbatch means) the variance is far off.
    within = np.mean([_np_complex_stats(x)[1] for x in data], axis=0)
    assert not np.allclose(MOMENTUM + (1 - MOMENTUM) * within, stats["var"], rtol=1e-2)


class _ComplexAndRealNorms(nn.Module):
    """A step-driven norm of a complex input beside one of a real input."""

    @nn.compact
    def __call__(self, x, use_running_average=False):
        a = AccumBatchNorm(momentum=MOMENTUM)(x, use_running_average)
        b = AccumBatchNorm(momentum=MOMENTUM)(jnp.abs(x), use_running_average)
        return a + b


def test_complex_windows_pool_across_devices_with_one_all_reduce():
    devices, steps = 8, 3
    data = _complex_microbatches(35, steps, (devices * 2, 3))
    model = _ComplexAndRealNorms()
    single, compiled, pooled = _single_and_sharded_windows(
        model, _init(model, data[0]), data, devices
    )
    assert count_collectives(compiled)["all-reduce"] == 1  # complex and real, one all-reduce
    for layer in ("AccumBatchNorm_0", "AccumBatchNorm_1"):
        for name in ("mean", "var"):
            assert pooled[layer][name].dtype == single[layer][name].dtype
            # Shifted per-device sums vs one-device sums: float32 rounding only.
            _assert_close(pooled[layer][name], single[layer][name])
    assert pooled["AccumBatchNorm_0"]["mean"].dtype == jnp.complex64
    mean, var = _np_complex_stats(data)
    _assert_close(pooled["AccumBatchNorm_0"]["mean"], (1 - MOMENTUM) * mean)
    _assert_close(pooled["AccumBatchNorm_0"]["var"], MOMENTUM + (1 - MOMENTUM) * var)


# ----------------------------------------------------------------------------- mistakes


def test_own_loop_helpers_warn_about_a_plain_batch_norm():
    model = nn.Sequential([nn.BatchNorm(use_running_average=False), nn.Dense(1)])
    variables = model.init(_key(0), jnp.ones((4, 3)))  # flax.linen.BatchNorm, not ours
    stats = variables["batch_stats"]
    opt_state = accumjax.accumulate(optax.sgd(0.1), 4).init(variables["params"])
    names = r"\['layers_0'\].*AccumBatchNorm.*convert_batch_norm_variables"
    moved = jax.tree.map(lambda a: a + 1, stats)  # what a training forward pass returns
    with pytest.warns(UserWarning, match=rf"sync_batch_norm.*{names}") as seen:
        accumjax.sync_batch_norm(moved, stats, opt_state)
    assert len(seen) == 1 and "K=4" in str(seen[0].message)
    with warnings.catch_warnings():  # frozen (use_running_average=True): nothing moved
        warnings.simplefilter("error")
        accumjax.sync_batch_norm(stats, stats, opt_state)
    with pytest.warns(UserWarning, match=rf"close_batch_norm_windows.*{names}"):
        close_batch_norm_windows(stats, True)
    accum = _init(AccumBatchNorm(), np.ones((2, 3), np.float32))
    with warnings.catch_warnings():  # AccumBatchNorm's statistics: nothing to say
        warnings.simplefilter("error")
        close_batch_norm_windows(accum, True)


def test_sync_batch_norm_refuses_its_statistics_swapped():
    k = 2
    x, (params, batch_stats, opt_state), _ = _user_loop_setup(k)
    model = nn.Sequential(
        [AccumBatchNorm(use_running_average=False, momentum=MOMENTUM), nn.Dense(1)]
    )
    _, new = model.apply(
        {"params": params, "batch_stats": batch_stats}, x[:4], mutable=["batch_stats"]
    )
    opt_state = accumjax.accumulate(optax.sgd(0.1), k).init(params)
    order = r"sync_batch_norm\(new_stats, old_stats, opt_state\)"
    with pytest.raises(ValueError, match=rf"other way round.*{order}"):
        accumjax.sync_batch_norm(batch_stats, new["batch_stats"], opt_state)
    swapped = jax.jit(accumjax.sync_batch_norm)  # traced: refused when the program runs
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"other way round.*{order}"):
        jax.block_until_ready(swapped(batch_stats, new["batch_stats"], opt_state))
    jax.block_until_ready(swapped(new["batch_stats"], batch_stats, opt_state))  # the right order


def test_a_synchronized_layer_on_one_device_names_the_one_device_case():
    layer = AccumBatchNorm(axis_name="data")
    x = jnp.ones((4, 3))
    variables = layer.init(_key(0), x, use_running_average=False)  # init pools nothing
    with pytest.raises(ValueError, match=r"axis_name='data'.*one device.*axis_name=None.*mesh"):
        layer.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
