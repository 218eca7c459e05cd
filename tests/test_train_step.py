"""Tests for accumjax.train_step: stream/scan vs full batch, mixed precision, data parallel."""

import functools
import itertools
import re
import warnings

import _composition as composition
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import Mesh

import accumjax
from accumjax import TrainState, accumulate, make_train_step
from accumjax.distributed import unreplicate

K = 4  # microbatches per window
MICRO = 8  # rows per microbatch
WINDOWS = 3
N_DEV = 8

# Tolerances. Accumulating K microbatch means and dividing once vs one full-batch mean
# differ only by float32 summation order: a few ulps per gradient, which momentum/Adam
# carry over 3 windows to ~1e-7 absolute on O(1) parameters.
F32 = {"rtol": 1e-5, "atol": 1e-6}
# Stream and scan add the same float32 microbatch gradients in the same order; only
# XLA's fusion choices differ between the two programs.
SAME_SUM = {"rtol": 1e-6, "atol": 1e-7}


def _data(seed=0, rows=K * MICRO * WINDOWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 3)) + 0.1 * rng.normal(size=(rows, 3))).astype(np.float32)
    return x, y


def _params(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
        "b": jnp.full((3,), 0.5, jnp.float32),
    }


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


@functools.cache
def _step(loss=loss_fn, **kwargs):
    """``make_train_step(loss, **kwargs)``, made once per module: the tests that use the same
    step (and the same optimizer object, `_sgd`) share its compiled program."""
    return make_train_step(loss, **kwargs)


def _sgd(lr=0.1, k=K, **kwargs):
    """``accumulate(optax.sgd(lr), k, **kwargs)``, one object per arguments however they are
    spelled (the optimizer is static in the state: the same object compiles once)."""
    return _sgd_object(float(lr), k, tuple(sorted(kwargs.items())))


@functools.cache
def _sgd_object(lr, k, kwargs):
    return accumulate(optax.sgd(lr), k, **dict(kwargs))


def _windows(x, y):
    n = K * MICRO
    return [{"x": x[i : i + n], "y": y[i : i + n]} for i in range(0, len(x), n)]


def _microbatches(window):
    """Scan mode's strided microbatches: microbatch i is rows i, i + K, ..."""
    return [jax.tree.map(lambda a, i=i: a[i::K], window) for i in range(K)]


def _full_batch_reference(tx, params, windows, loss=loss_fn):
    """A plain optax step per window on the whole window."""
    opt_state = tx.init(params)
    for window in windows:
        grads = jax.grad(loss)(params, window)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _assert_tree_close(actual, expected, tol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol)


def _assert_tree_equal(actual, expected):
    jax.tree.map(
        lambda a, e: np.testing.assert_array_equal(np.asarray(a), np.asarray(e)), actual, expected
    )


TXS = {
    "adam": lambda: optax.adam(0.05),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
}


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", sorted(TXS))
def test_stream_scan_and_full_batch_agree(name):
    x, y = _data()
    windows = _windows(x, y)
    ref = _full_batch_reference(TXS[name](), _params(), windows)

    scan = _step(mode="scan")
    scan_state = scan.init(_params(), accumulate(TXS[name](), K))
    for window in windows:
        scan_state, metrics = scan(scan_state, window)
        assert bool(metrics["updated"])

    stream = _step()
    stream_state = stream.init(_params(), accumulate(TXS[name](), K))
    updated = []
    for window in windows:
        for mb in _microbatches(window):
            stream_state, metrics = stream(stream_state, mb)
            updated.append(bool(metrics["updated"]))

    assert updated == ([False] * (K - 1) + [True]) * WINDOWS
    assert int(scan_state.step) == int(stream_state.step) == WINDOWS
    _assert_tree_close(scan_state.params, ref, F32)
    _assert_tree_close(stream_state.params, ref, F32)
    _assert_tree_close(stream_state.params, scan_state.params, SAME_SUM)
    # The test can fail: the parameters moved by much more than the tolerance.
    assert float(jnp.max(jnp.abs(ref["w"] - _params()["w"]))) > 1e-2


def test_scan_sgd_matches_numpy_float64():
    x, y = _data()
    lr = 0.1
    w = np.asarray(_params()["w"], np.float64)
    b = np.asarray(_params()["b"], np.float64)
    for window in _windows(x, y):
        xw, yw = np.asarray(window["x"], np.float64), np.asarray(window["y"], np.float64)
        resid = 2.0 * (xw @ w + b - yw) / yw.size  # d mean((xw+b-y)^2) / d pred
        w, b = w - lr * xw.T @ resid, b - lr * resid.sum(0)

    step = _step(mode="scan")
    state = step.init(_params(), _sgd(lr))
    for window in _windows(x, y):
        state, _ = step(state, window)
    # float32 forward/backward vs exact float64 arithmetic on O(1) data: ~1e-6 relative.
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.params["b"], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("accum_steps", "unroll"), [(K, 2), (K, True), (1, 1)])
def test_scan_unroll_and_single_microbatch_match_full_batch(accum_steps, unroll):
    x, y = _data()
    windows = _windows(x, y)
    ref = _full_batch_reference(optax.adam(0.05), _params(), windows)
    step = _step(mode="scan", unroll=unroll)
    state = step.init(_params(), accumulate(optax.adam(0.05), accum_steps))
    for window in windows:
        state, metrics = step(state, window)
    assert metrics["loss"].shape == ()
    _assert_tree_close(state.params, ref, F32)


def test_accum_steps_one_stream_is_a_plain_step():
    # TrainState.create's state (opt_state = tx.init(params), as flax's) in a stream step.
    x, y = _data()
    windows = _windows(x, y)
    ref = _full_batch_reference(optax.adam(0.05), _params(), windows)
    state = TrainState.create(apply_fn=None, params=_params(), tx=optax.adam(0.05))
    step = _step()
    for window in windows:
        state, metrics = step(state, window)
    assert bool(metrics["updated"]) and int(state.step) == WINDOWS
    # Same program up to jit: identical float32 operations, at most an ulp from fusion.
    _assert_tree_close(state.params, ref, SAME_SUM)


def _masked_loss(params, batch):
    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


def _masked_windows():
    x, y = _data()
    rng = np.random.default_rng(3)
    # Microbatches with very different numbers of valid rows (some nearly empty).
    mask = rng.random(len(x)) < np.repeat(rng.uniform(0.1, 1.0, len(x) // MICRO), MICRO)
    mask[::MICRO] = True  # at least one valid row per microbatch
    windows = _windows(x, y)
    n = K * MICRO
    for i, window in enumerate(windows):
        window["mask"] = jnp.asarray(mask[i * n : (i + 1) * n], jnp.float32)
    return windows


def _count_valid(batch):
    return jnp.sum(batch["mask"])


def test_weighted_scan_and_stream_match_full_batch_masked_mean():
    windows = _masked_windows()
    tx = lambda: optax.sgd(0.1, momentum=0.9)
    ref = _full_batch_reference(tx(), _params(), windows, loss=_masked_loss)

    scan = make_train_step(_masked_loss, mode="scan", weight_fn=_count_valid)
    scan_state = scan.init(_params(), accumulate(tx(), K, scaling="weighted"))
    stream = make_train_step(_masked_loss, weight_fn=_count_valid)
    stream_state = stream.init(_params(), accumulate(tx(), K, scaling="weighted"))
    unweighted = make_train_step(_masked_loss, mode="scan")
    unweighted_state = unweighted.init(_params(), accumulate(tx(), K))
    for window in windows:
        scan_state, metrics = scan(scan_state, window)
        unweighted_state, _ = unweighted(unweighted_state, window)
        for mb in _microbatches(window):
            stream_state, _ = stream(stream_state, mb)
    # sum_i n_i * mean_i / sum_i n_i is the full-batch masked mean: float32 reordering only.
    _assert_tree_close(scan_state.params, ref, F32)
    _assert_tree_close(stream_state.params, ref, F32)
    # The plain mean of microbatch means is a different (wrong here) gradient.
    assert float(jnp.max(jnp.abs(unweighted_state.params["w"] - ref["w"]))) > 1e-3
    # The reported loss is the weighted mean too: the full-batch masked loss at the old params.
    assert np.isfinite(float(metrics["loss"]))


def test_has_aux_scan_stacks_microbatch_aux_and_stream_returns_it():
    def aux_loss(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"first_y": batch["y"][0, 0], "loss": loss}

    x, y = _data()
    window = _windows(x, y)[0]
    scan = make_train_step(aux_loss, mode="scan", has_aux=True)
    _, metrics = scan(scan.init(_params(), _sgd()), window)
    assert metrics["aux"]["first_y"].shape == (K,)
    np.testing.assert_array_equal(metrics["aux"]["first_y"], y[0:K, 0])  # strided
    micro_losses = [float(loss_fn(_params(), mb)) for mb in _microbatches(window)]
    np.testing.assert_allclose(metrics["aux"]["loss"], micro_losses, rtol=1e-6)
    # metrics["loss"] is the mean of the microbatch losses, i.e. the full-batch loss.
    np.testing.assert_allclose(metrics["loss"], loss_fn(_params(), window), rtol=1e-6)

    step = make_train_step(aux_loss, has_aux=True)
    _, metrics = step(step.init(_params(), _sgd()), _microbatches(window)[0])
    assert float(metrics["aux"]["first_y"]) == y[0, 0]


# ----------------------------------------------------------------------------- model state


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6, use_bias=False)(x)  # a bias before BN has a zero gradient
        x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
        return nn.Dense(3)(nn.relu(x))


_BN_MODEL = _BNNet()


def _bn_loss(params, model_state, batch):
    pred, new_state = _BN_MODEL.apply(
        {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
    )
    return jnp.mean((pred - batch["y"]) ** 2), new_state


@functools.cache
def _bn_variables():
    """The model's initial variables on the host, initialised once for the module."""
    x, _ = _data()
    # Under jit: one program, not one per operation.
    return jax.tree.map(np.asarray, jax.jit(_BN_MODEL.init)(jax.random.key(0), x[:2]))


def _bn_setup():
    x, y = _data()
    variables = jax.tree.map(jnp.asarray, _bn_variables())  # the test's own arrays
    params = variables["params"]
    model_state = {"batch_stats": variables["batch_stats"]}
    return _bn_loss, params, model_state, _windows(x, y)


@functools.cache
def _jit_grad(loss):
    """``jax.jit(jax.grad(loss, has_aux=True))``, one per loss (the references share it)."""
    return jax.jit(jax.grad(loss, has_aux=True))


def _bn_reference(bn_loss, tx, params, model_state, windows, devices=1):
    """Each device threads the model state through its K microbatches; states are averaged
    over devices, gradients over all device-microbatches, then one optax update."""
    grad_fn = _jit_grad(bn_loss)
    opt_state = tx.init(params)
    for window in windows:
        rows = len(window["x"]) // devices
        states, grads = [], []
        for d in range(devices):
            ms = model_state
            local = jax.tree.map(lambda a, lo=d * rows, n=rows: a[lo : lo + n], window)
            for i in range(K):
                mb = jax.tree.map(lambda a, i=i: a[i::K], local)  # strided, as scan mode
                g, ms = grad_fn(params, ms, mb)
                grads.append(g)
            states.append(ms)
        params, opt_state, model_state = _jit_window_update(tx)(grads, states, opt_state, params)
    return params, model_state


@functools.cache
def _jit_window_update(tx):
    """The window's averages and its optax update, as one program per optimizer object (the
    same float32 operations as run op by op)."""

    def update(grads, states, opt_state, params):
        mean = lambda trees: jax.tree.map(lambda *a: sum(a) / len(a), *trees)
        updates, opt_state = tx.update(mean(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mean(states)

    return jax.jit(update)


# A plain BatchNorm stands for any mutable collection here (the reference threads it through
# every microbatch too): the step's warning about it is expected.
_PLAIN_BN = "ignore:make_train_step.*plain BatchNorm:UserWarning"


@pytest.mark.filterwarnings(_PLAIN_BN)
def test_model_state_threaded_through_scan_and_stream():
    bn_loss, params, model_state, windows = _bn_setup()
    tx = lambda: optax.sgd(0.1, momentum=0.9)
    ref_tx = tx()  # one object for both references: one compiled update
    ref_params, ref_state = _bn_reference(bn_loss, ref_tx, params, model_state, windows)

    scan = _step(bn_loss, mode="scan")
    scan_state = scan.init(params, accumulate(tx(), K), model_state=model_state)
    stream = _step(bn_loss)
    stream_state = stream.init(params, accumulate(tx(), K), model_state=model_state)
    for window in windows:
        scan_state, _ = scan(scan_state, window)
        for mb in _microbatches(window):
            stream_state, _ = stream(stream_state, mb)
    # Same per-microbatch float32 computations, summed in a different order.
    _assert_tree_close(scan_state.params, ref_params, F32)
    _assert_tree_close(scan_state.model_state, ref_state, F32)
    _assert_tree_close(stream_state.params, ref_params, F32)
    _assert_tree_close(stream_state.model_state, ref_state, F32)
    # Running statistics saw all K * WINDOWS microbatches, not just the first of each window.
    once = _bn_reference(bn_loss, ref_tx, params, model_state, [w for w in windows[:1]])[1]
    assert not np.allclose(
        once["batch_stats"]["BatchNorm_0"]["mean"], ref_state["batch_stats"]["BatchNorm_0"]["mean"]
    )


# ----------------------------------------------------------------------------- AGC


def _agc_sgd(lr=0.1, clip_factor=0.01, **kwargs):
    """AGC on the window gradient: `accumjax.adaptive_clip` first in the inner chain."""
    return optax.chain(accumjax.adaptive_clip(clip_factor, 1e-3, **kwargs), optax.sgd(lr))


def test_scan_agc_clips_the_accumulated_gradient_once():
    x, y = _data()
    window = _windows(x, y)[0]
    params = _params()
    clip_factor = 0.01
    grads = jax.grad(loss_fn)(params, window)
    clipped = accumjax.adaptive_clip_grad(params, grads, clip_factor, 1e-3)
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, params, clipped)
    step = _step(mode="scan")
    state = step.init(params, accumulate(_agc_sgd(0.1, clip_factor), K))
    state, _ = step(state, window)
    _assert_tree_close(state.params, ref, F32)
    # Clipping is active here: the unclipped step lands elsewhere.
    unclipped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert float(jnp.max(jnp.abs(unclipped["w"] - ref["w"]))) > 1e-2


# ----------------------------------------------------------------------------- mixed precision


def test_bfloat16_casts_the_parameters_with_float32_master_state():
    seen = []

    def recording_loss(params, batch):
        seen.append((params["w"].dtype, batch["x"].dtype))
        return loss_fn(params, batch)

    x, y = _data()
    window = _windows(x, y)[0]
    step = make_train_step(recording_loss, mode="scan", mixed_precision="bfloat16")
    state = step.init(_params(), accumulate(optax.adam(0.05), K))
    new, metrics = step(state, window)
    # The parameters are cast; the batch is passed as given (float32 here).
    assert seen and set(seen) == {(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))}
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(new.params))
    assert all(
        leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(new.opt_state.inner_tx_state[0].mu)
    )
    assert metrics["loss"].dtype == jnp.float32

    grads32 = jax.grad(loss_fn)(_params(), window)
    to16 = lambda p: jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    grads16 = jax.grad(lambda p: loss_fn(to16(p), window))(_params())
    # The accumulated gradient (in step) and a full-batch gradient with bfloat16 parameters
    # agree to bf16 precision (8-bit mantissa: ~1% relative); the float32 gradient is further.
    ref = optax.apply_updates(
        _params(), optax.adam(0.05).update(grads16, optax.adam(0.05).init(_params()))[0]
    )
    _assert_tree_close(new.params, ref, {"rtol": 1e-2, "atol": 1e-2})
    assert not np.allclose(np.asarray(grads16["w"], np.float32), grads32["w"], rtol=1e-5)


def _token_problem():
    """A token-weighted loss (sum(ce * mask) / sum(mask)) on ragged sequences whose token
    counts (of 2 microbatches) are not bfloat16 numbers: 619 and 634 tokens."""
    rng = np.random.default_rng(0)
    rows, length, vocab = 32, 40, 7
    tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    counts = {0: 619, 1: 634}  # scan mode's microbatch i holds rows i, i + 2, ...
    for i, n in counts.items():
        lengths = np.full(rows // 2, n // (rows // 2))
        lengths[: n % (rows // 2)] += 1
        for row, m in zip(range(i, rows, 2), lengths, strict=True):
            mask[row, :m] = 1
    params = {"embed": jnp.asarray(rng.normal(size=(vocab, 4)), jnp.float32),
              "out": jnp.asarray(rng.normal(size=(4, vocab)), jnp.float32)}  # fmt: skip

    def loss(params, batch):
        logits = jnp.tanh(params["embed"][batch["tokens"]]) @ params["out"]
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["tokens"]
        )
        return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])

    return params, tokens, mask, loss


def test_bfloat16_does_not_round_a_float_masks_token_count():
    params, tokens, mask, loss = _token_problem()
    weight_fn = lambda b: jnp.sum(b["mask"])
    tx = accumulate(optax.sgd(1.0), 2, scaling="weighted")
    updates = {}
    for precision, dtype in ((None, np.float32), ("bfloat16", np.float32), ("bfloat16", np.int32)):
        step = make_train_step(
            loss, mode="scan", mixed_precision=precision, weight_fn=weight_fn, donate=False
        )
        state = step.init(params, tx)
        new, _ = step(state, {"tokens": tokens, "mask": mask.astype(dtype)})
        flat = [np.ravel(np.asarray(params[k] - new.params[k])) for k in sorted(params)]
        updates[precision, dtype] = np.concatenate(flat)  # -lr x the window's gradient
    f32, float_mask, int_mask = updates.values()
    # A float mask and an int mask give one computation: the same gradient to the bit (a
    # float mask cast to bfloat16 divides by 620 and 632 tokens: 1.3e-2 relative away).
    np.testing.assert_array_equal(float_mask, int_mask)
    # bfloat16 parameters against float32: bf16 compute noise (measured 2.1e-2 relative L2 on
    # this small model, whose gradient entries are sums of terms of both signs).
    assert np.linalg.norm(float_mask - f32) < 5e-2 * np.linalg.norm(f32)


def _huge(batch, rows=slice(0, 1)):
    """A microbatch whose float16 forward pass overflows (1e4 ** 2 > 65504)."""
    x = np.array(batch["x"])
    x[rows] = 1e4
    return {**batch, "x": jnp.asarray(x)}


def test_float16_scan_skips_overflowed_window_and_lowers_scale():
    x, y = _data()
    windows = _windows(x, y)
    step = _step(mode="scan", mixed_precision="float16", donate=False)
    state = step.init(
        _params(),
        accumulate(optax.adam(0.05), K, on_nonfinite="skip_window"),
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**10, period=2),
    )
    bad = _huge(windows[0], rows=slice(K * MICRO - 1, K * MICRO))  # last microbatch only
    after, metrics = step(state, bad)
    assert not bool(metrics["grads_finite"]) and not bool(metrics["updated"])
    _assert_tree_equal(after.params, state.params)
    _assert_tree_equal(after.opt_state.inner_tx_state, state.opt_state.inner_tx_state)
    assert int(after.opt_state.skipped_windows) == 1 and int(after.opt_state.nonfinite_count) == 1
    assert int(after.step) == 0
    assert float(after.loss_scale.loss_scale) == 2.0**9 and float(metrics["loss_scale"]) == 2.0**9

    after, metrics = step(after, windows[0])
    assert bool(metrics["grads_finite"]) and bool(metrics["updated"]) and int(after.step) == 1
    assert int(after.loss_scale.counter) == 1
    ref = _full_batch_reference(optax.adam(0.05), _params(), windows[:1])
    # float16 inputs/params (11-bit mantissa); Adam's first step is ~lr * sign(g), so the
    # result is within a fraction of lr of the float32 step.
    _assert_tree_close(after.params, ref, {"rtol": 0, "atol": 2e-3})


def test_float16_loss_scaling_rescues_underflowing_gradients():
    x, y = _data()
    window = _windows(x, y)[0]

    def tiny_loss(params, batch):  # gradients ~1e-9: below float16's smallest subnormal
        return 1e-9 * loss_fn(params, batch).astype(jnp.float32)

    step = make_train_step(tiny_loss, mode="scan", mixed_precision="float16")
    tx = _sgd(1e8)

    def run(loss_scale):
        return step(step.init(_params(), tx, loss_scale=loss_scale), window)[0]

    ref = _full_batch_reference(optax.sgd(1e8), _params(), [window], loss=tiny_loss)
    scaled = run(accumjax.dynamic_loss_scale(initial=2.0**24))
    unscaled = run(accumjax.dynamic_loss_scale(initial=1.0))
    # Scaled: float16 precision of the rescued gradients (~1e-3 relative of O(1) updates).
    _assert_tree_close(scaled.params, ref, {"rtol": 0, "atol": 3e-2})
    # Unscaled: the float16 backward pass flushes every gradient to zero; nothing moves.
    _assert_tree_equal(unscaled.params, _params())


def test_float16_stream_skips_overflowed_microbatch_bit_for_bit():
    x, y = _data()
    window = _windows(x, y)[0]
    micro = _microbatches(window)
    step = _step(mixed_precision="float16", donate=False)
    # 2**15 is borderline for these O(1) gradients (65504 is float16's largest value).
    state = step.init(
        _params(),
        accumulate(optax.adam(0.05), K),
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**12),
    )
    state, metrics = step(state, micro[0])
    assert not bool(metrics["updated"]) and bool(metrics["grads_finite"])

    after, metrics = step(state, _huge(micro[1]))
    assert not bool(metrics["grads_finite"])
    # The overflowed microbatch is a non-finite microbatch: skipped and counted, the window
    # goes on; nothing else changed bit for bit, and the scale waits for the window's end.
    _assert_tree_equal(after.params, state.params)
    _assert_tree_equal(after.opt_state.inner_tx_state, state.opt_state.inner_tx_state)
    _assert_tree_equal(after.opt_state.window.partial_sums, state.opt_state.window.partial_sums)
    assert int(after.opt_state.window.micro_step) == 2
    assert float(after.loss_scale.loss_scale) == 2.0**12

    for mb in micro[2:]:
        after, metrics = step(after, mb)
    assert bool(metrics["updated"]) and int(after.step) == 1
    assert float(after.loss_scale.loss_scale) == 2.0**11  # lowered once, at the window's end
    assert int(after.opt_state.nonfinite_count) == 1
    scan = _step(mode="scan", mixed_precision="float16")
    scan_state = scan.init(
        _params(),
        accumulate(optax.adam(0.05), K),
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**12),
    )
    scan_state, _ = scan(scan_state, _huge(window, rows=slice(1, 2)))  # row 1: microbatch 1
    # Same float16 microbatch gradients and the same skipped microbatch in both modes.
    _assert_tree_close(after.params, scan_state.params, SAME_SUM)


# ----------------------------------------------------------------------------- data parallel


def _mesh():
    assert jax.device_count() >= N_DEV
    return Mesh(np.array(jax.devices()[:N_DEV]), ("data",))


def _per_device(window):
    return jax.tree.map(lambda a: a.reshape(N_DEV, -1, *a.shape[1:]), window)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def test_data_parallel_scan_mesh_and_pmap_match_full_batch():
    windows = _dp_windows()
    tx = lambda: optax.sgd(0.05, momentum=0.9)  # not Adam: blind to a wrong gradient scale
    ref = _full_batch_reference(tx(), _params(), windows)

    mesh_step = _step(mode="scan", axis_name="data", mesh=_mesh())
    mesh_state = mesh_step.init(_params(), accumulate(tx(), K))
    pmap_step = _step(mode="scan", axis_name="data")
    pmap_state = pmap_step.init(_params(), accumulate(tx(), K))  # replicated per device
    for window in windows:
        before = _host(mesh_state.params)
        mesh_state, mesh_metrics = mesh_step(mesh_state, window)
        pmap_state, pmap_metrics = pmap_step(pmap_state, _per_device(window))
    # Per-device float32 sums all-reduced vs one full-batch sum: reordering only.
    _assert_tree_close(mesh_state.params, ref, F32)
    _assert_tree_close(unreplicate(pmap_state.params), ref, F32)
    _assert_tree_equal(pmap_state.params["w"][0], pmap_state.params["w"][-1])
    # On a mesh every metric is global: the loss is the window's, as on one device; under
    # pmap it stays per device (pmap's convention), the same rows' mean on each device.
    assert mesh_metrics["loss"].shape == () and pmap_metrics["loss"].shape == (N_DEV,)
    np.testing.assert_allclose(mesh_metrics["loss"], loss_fn(before, windows[-1]), rtol=1e-6)
    np.testing.assert_allclose(mesh_metrics["loss"], np.mean(pmap_metrics["loss"]), rtol=1e-6)


def _dp_windows(rows=2):
    """Windows of N_DEV * K * rows rows: ``rows`` per device-microbatch."""
    x, y = _data(rows=N_DEV * K * rows * WINDOWS)
    n = N_DEV * K * rows
    return [{"x": x[i : i + n], "y": y[i : i + n]} for i in range(0, len(x), n)]


def _stream_dp_microbatches(window):
    """The K stream-mode calls of a window, each as (global batch, per-device batch):
    call i gives device d the rows of device d's scan-mode microbatch i (strided)."""
    per_dev = _per_device(window)
    calls = []
    for i in range(K):
        local = jax.tree.map(lambda a, i=i: a[:, i::K], per_dev)
        calls.append((jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), local), local))
    return calls


def test_data_parallel_stream_mesh_and_pmap_match_full_batch():
    windows = _dp_windows()
    tx = lambda: optax.sgd(0.05, momentum=0.9)
    ref = _full_batch_reference(tx(), _params(), windows)
    inner = lambda: accumulate(tx(), K, axis_name="data")
    mesh_step = _step(axis_name="data", mesh=_mesh())
    mesh_state = mesh_step.init(_params(), inner())
    pmap_step = _step(axis_name="data")
    pmap_state = pmap_step.init(_params(), inner())  # tx.init's window, replicated
    for window in windows:
        for global_batch, local in _stream_dp_microbatches(window):
            before = _host(mesh_state.params)
            mesh_state, mesh_metrics = mesh_step(mesh_state, global_batch)
            pmap_state, pmap_metrics = pmap_step(pmap_state, local)
    # All-reduced per-device window sums vs one full-batch sum: float32 reordering only.
    _assert_tree_close(mesh_state.params, ref, F32)
    _assert_tree_close(unreplicate(pmap_state.params), ref, F32)
    assert int(mesh_state.step) == WINDOWS
    # Stream mode: the microbatch's loss, global on a mesh (as on one device), per device
    # under pmap.
    assert mesh_metrics["loss"].shape == () and pmap_metrics["loss"].shape == (N_DEV,)
    np.testing.assert_allclose(mesh_metrics["loss"], loss_fn(before, global_batch), rtol=1e-6)
    np.testing.assert_allclose(mesh_metrics["loss"], np.mean(pmap_metrics["loss"]), rtol=1e-6)


@pytest.mark.filterwarnings(_PLAIN_BN)
def test_data_parallel_model_state_scan_and_stream_match_reference():
    bn_loss, params, model_state, _ = _bn_setup()
    windows = _dp_windows(rows=8)[:2]  # BN on 2 rows is too ill-conditioned to compare
    tx = lambda: optax.sgd(0.1, momentum=0.9)
    ref_params, ref_state = _bn_reference(bn_loss, tx(), params, model_state, windows, N_DEV)
    scan = _step(bn_loss, mode="scan", axis_name="data", mesh=_mesh())
    scan_state = scan.init(params, accumulate(tx(), K), model_state=model_state)
    stream = _step(bn_loss, axis_name="data", mesh=_mesh())
    stream_state = stream.init(
        params, accumulate(tx(), K, axis_name="data"), model_state=model_state
    )
    for window in windows:
        scan_state, _ = scan(scan_state, window)
        for global_batch, _ in _stream_dp_microbatches(window):
            stream_state, _ = stream(stream_state, global_batch)
    # Float32 reordering (per-device sums, all-reduce) of the same per-microbatch values;
    # model state is averaged over devices once per window in both modes.
    for state in (scan_state, stream_state):
        _assert_tree_close(state.params, ref_params, F32)
        _assert_tree_close(state.model_state, ref_state, F32)


def _assert_every_replica_equal(actual, expected):
    """Checks each device's copy, not just the one a global read returns."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        shards = a.addressable_shards
        assert len(shards) == N_DEV
        for shard in shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(e))


def test_data_parallel_float16_overflow_on_one_device_skips_everywhere():
    mesh = _mesh()
    window = _dp_windows()[0]
    last_row = slice(len(window["x"]) - 1, None)  # lands on the last device only
    scan = _step(mode="scan", axis_name="data", mesh=mesh, mixed_precision="float16", donate=False)
    state = scan.init(
        _params(),
        accumulate(optax.sgd(0.1), K, on_nonfinite="skip_window"),
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**8),  # clean data stays finite
    )
    after, metrics = scan(state, _huge(window, last_row))
    # Global, as every metric on a mesh: one device's overflow makes the window's not finite.
    assert metrics["grads_finite"].shape == () and not bool(metrics["grads_finite"])
    _assert_every_replica_equal(after.params, state.params)
    _assert_every_replica_equal(after.loss_scale.loss_scale, jnp.float32(2.0**7))

    stream = _step(axis_name="data", mesh=mesh, mixed_precision="float16", donate=False)
    stream_state = stream.init(
        _params(),
        accumulate(optax.sgd(0.1), K, axis_name="data"),
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**8),  # clean data stays finite
    )
    calls = [batch for batch, _ in _stream_dp_microbatches(window)]
    last_row = slice(len(calls[0]["x"]) - 1, None)
    after, metrics = stream(stream_state, _huge(calls[0], last_row))
    assert metrics["grads_finite"].shape == () and not bool(metrics["grads_finite"])
    _assert_every_replica_equal(after.params, stream_state.params)
    for batch in calls[1:]:
        after, metrics = stream(after, batch)
    assert bool(metrics["updated"])
    # One window-end reduction: every replica counts the one overflow, lowers the scale once
    # and applies the same update (the other devices' first microbatch included).
    _assert_every_replica_equal(after.opt_state.nonfinite_count, jnp.int32(1))
    _assert_every_replica_equal(after.loss_scale.loss_scale, jnp.float32(2.0**7))
    reference = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), after.params)
    _assert_every_replica_equal(after.params, reference)


# ----------------------------------------------------------------------------- errors & misc


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "loop"}, ValueError, "mode"),
        ({"mixed_precision": "fp8"}, ValueError, "mixed_precision"),
        ({"mixed_precision": "float32"}, ValueError, "mixed_precision"),
        ({"mesh": "mesh", "axis_name": "data"}, TypeError, "Mesh"),
        ({"weight_fn": 3}, TypeError, "weight_fn"),
        ({"unroll": 0}, ValueError, "unroll"),
        ({"unroll": "2"}, TypeError, "unroll"),  # a str is the wrong kind: TypeError
    ],
)
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_train_step(loss_fn, **kwargs)


_AGC = r"microbatch_transform=accumjax\.adaptive_clip.*optax\.chain\(accumjax\.adaptive_clip"


@pytest.mark.parametrize(
    ("removed", "replacement"),
    [
        ({"accum_steps": K}, r"K is stated once.*accumjax\.accumulate\(inner, K\)"),
        ({"use_agc": True}, _AGC),
        ({"clip_factor": 0.01}, "adaptive_clip's clip_factor,.*" + _AGC),
        ({"agc_eps": 1e-3}, "adaptive_clip's eps,.*" + _AGC),
        ({"agc_mask": None}, "adaptive_clip's mask,.*" + _AGC),
        ({"agc_axis": -1}, "adaptive_clip's axis,.*" + _AGC),
    ],
)
@pytest.mark.parametrize(
    "make", [make_train_step, accumjax.make_nnx_train_step], ids=["linen", "nnx"]
)
def test_the_arguments_0_3_deprecated_are_removed(make, removed, replacement):
    # 0.4.0 removed them, as 0.3.0 announced: the error says what to write instead.
    (name,) = removed
    with pytest.raises(
        TypeError, match=rf"make_train_step\({name}=\.\.\.\): removed.*{replacement}"
    ):
        make(loss_fn, **removed)
    with pytest.raises(TypeError, match="unexpected keyword argument 'accum_step'"):  # a typo
        make(loss_fn, accum_step=K)


def test_mesh_errors():
    with pytest.raises(ValueError, match="axis_name"):
        make_train_step(loss_fn, mesh=_mesh())
    with pytest.raises(ValueError, match="not an axis"):
        make_train_step(loss_fn, mesh=_mesh(), axis_name="model")


def test_trace_time_errors():
    x, y = _data()
    window = _windows(x, y)[0]
    scan, stream = _step(mode="scan"), _step()
    with pytest.raises(ValueError, match="not divisible by K=3"):
        scan(scan.init(_params(), _sgd(k=3)), window)
    # A state made elsewhere (step.init refuses these optimizers, below) is refused by the call.
    scheduled = stream.init(_params(), accumulate(optax.sgd(0.1), lambda n: jnp.int32(2)))
    with pytest.raises(
        TypeError,
        match=r"(?s)not a schedule.*num_real_microbatches=n"
        r".*rows i, i \+ K, i \+ 2K, \.\.\. \(strided\)",
    ):
        scan(scheduled, window)
    other_axis = TrainState.create(apply_fn=None, params=_params(), tx=_sgd(axis_name="model"))
    with pytest.raises(ValueError, match="axis_name"):
        stream(other_axis, window)
    flax_state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"accumjax\.TrainState"):
        stream(flax_state, window)
    with pytest.raises(ValueError, match="scaling='weighted'"):
        make_train_step(loss_fn, weight_fn=lambda b: 1.0)(stream.init(_params(), _sgd()), window)
    # A state laid out for the other mode is refused, naming step.init.
    with pytest.raises(ValueError, match=r"built for scan mode.*step\.init"):
        stream(scan.init(_params(), _sgd()), window)
    with pytest.raises(ValueError, match=r"stream-mode accumulator.*step\.init"):
        scan(stream.init(_params(), _sgd()), window)
    created = TrainState.create(apply_fn=None, params=_params(), tx=_sgd())
    with pytest.raises(ValueError, match=r"stream-mode accumulator.*step\.init"):
        scan(created, window)


_NOT_A_SCHEDULE = r"(?s)mode='scan' needs an int K in accumjax\.accumulate, not a schedule"


def test_a_scheduled_k_in_scan_mode_is_refused_first_at_init_and_call():
    # The refusal names the argument and the fix wherever the step meets the optimizer: at
    # step.init, and at a call before num_real_microbatches is checked against K.
    window = _windows(*_data())[0]
    scan = _step(mode="scan")
    tx = accumulate(optax.sgd(0.1), lambda count: 2)
    with pytest.raises(TypeError, match=_NOT_A_SCHEDULE):
        scan.init(_params(), tx)
    state = TrainState.create(apply_fn=None, params=_params(), tx=tx)
    for n in (1, jnp.int32(1)):
        with pytest.raises(TypeError, match=_NOT_A_SCHEDULE):
            scan(state, window, num_real_microbatches=n)
    with pytest.raises(TypeError, match=_NOT_A_SCHEDULE):
        scan.lower(state, window, num_real_microbatches=1)
    _step().init(_params(), tx)  # stream mode takes a schedule


def test_an_accumulate_on_another_axis_is_refused_at_init():
    with pytest.raises(ValueError, match=r"accumulate\(axis_name='model'\) differs.*only"):
        _step().init(_params(), _sgd(axis_name="model"))


def test_resuming_under_another_k_or_scaling_is_refused():
    x, y = _data()
    window = _windows(x, y)[0]
    step = _step(mode="scan")
    saved = step.init(_params(), _sgd())
    for tx, match in (
        (_sgd(k=2), "every_k=4"),
        (_sgd(scaling="sum"), "scaling='mean'"),
    ):
        resumed = saved.replace(tx=tx)
        with pytest.raises(ValueError, match=match):
            step(resumed, window)


def test_has_aux_mismatch_errors():
    x, y = _data()
    window = _windows(x, y)[0]
    state = TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1))
    with_aux = lambda p, b: (loss_fn(p, b), {"a": 1.0})
    with pytest.raises(TypeError, match="pass has_aux=True"):
        make_train_step(with_aux)(state, window)
    with pytest.raises(TypeError, match="has_aux=True"):
        make_train_step(loss_fn, has_aux=True)(state, window)
    with pytest.raises(TypeError, match="scalar"):
        make_train_step(lambda p, b: b["x"] @ p["w"])(state, window)

    bn_loss, params, model_state, _ = _bn_setup()
    bn_state = TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1), model_state=model_state
    )

    def bn_with_aux(p, ms, b):
        loss, new = bn_loss(p, ms, b)
        return loss, (new, {"extra": loss})

    with pytest.raises(TypeError, match="pass has_aux=True"):
        make_train_step(bn_with_aux)(bn_state, window)
    with pytest.raises(TypeError, match=r"\(new_model_state, aux\)"):
        make_train_step(bn_loss, has_aux=True)(bn_state, window)


def test_donation_and_create_validation():
    x, y = _data()
    window = _windows(x, y)[0]
    keep, donate = _step(donate=False), _step()
    params = _params()
    state = keep.init(params, accumulate(optax.adam(0.1), K))
    keep(state, window)
    assert not state.params["w"].is_deleted()
    donate(state, window)
    assert state.params["w"].is_deleted()  # donated to the output
    assert not params["w"].is_deleted()  # step.init's arrays are its own
    with pytest.raises(TypeError, match="DynamicLossScale"):
        TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1), loss_scale=2.0)
    with pytest.raises(TypeError, match="DynamicLossScale"):
        keep.init(_params(), optax.sgd(0.1), loss_scale=2.0)


def test_public_export():
    assert accumjax.make_train_step is make_train_step


# ----------------------------------------------------------------------------- randomness


def _dropout_loss(params, batch, key):
    """Input dropout with the step's key; the mask comes back as aux."""
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    pred = jnp.where(keep, batch["x"] / 0.5, 0.0) @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2), keep


def _all_distinct(masks):
    """Whether the masks (stacked on the leading axis) are pairwise different."""
    flat = np.asarray(masks).reshape(len(masks), -1)
    return len({m.tobytes() for m in flat}) == len(flat)


def _dropout_step(mode, **kwargs):
    return _step(_dropout_loss, mode=mode, has_aux=True, **kwargs)


def _dropout_run(step, mode, seed, windows):
    """(state, masks): masks[w] stacks window w's K microbatch masks."""
    params = jax.tree.map(lambda a: a.astype(jnp.float32), _params())  # not weakly typed
    state = step.init(params, _sgd(0.05))
    masks = []
    for window in windows:
        batches = [window] if mode == "scan" else _microbatches(window)
        calls = []
        for batch in batches:
            state, metrics = step(state, batch, jax.random.key(seed))
            calls.append(np.asarray(metrics["aux"]))
        masks.append(calls[0] if mode == "scan" else np.stack(calls))
    return state, masks


def test_dropout_keys_differ_across_microbatches_and_steps_and_match_between_modes():
    x, y = _data()
    windows = _windows(x, y)
    _, scan_masks = _dropout_run(_dropout_step("scan"), "scan", 0, windows)
    _, stream_masks = _dropout_run(_dropout_step("stream"), "stream", 0, windows)
    assert scan_masks[0].shape == (K, MICRO, 5)
    assert _all_distinct(np.concatenate(scan_masks))  # every microbatch of every step
    # The documented key: fold_in(fold_in(rng, state.step), microbatch index).
    for s, window_masks in enumerate(scan_masks):
        for i, mask in enumerate(window_masks):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), i)
            np.testing.assert_array_equal(mask, jax.random.bernoulli(key, 0.5, mask.shape))
    # Stream mode folds in the window position: the same key for the same microbatch.
    for scan, stream in zip(scan_masks, stream_masks, strict=True):
        np.testing.assert_array_equal(stream, scan)


def test_dropout_keys_differ_across_devices_on_a_mesh():
    windows = _dp_windows(rows=8)[:2]  # 8 rows per device and microbatch: 40-bit masks
    step = _dropout_step("scan", axis_name="data", mesh=_mesh())
    state, masks = _dropout_run(step, "scan", 0, windows)
    # Per microbatch, every device's rows (the batch's), device by device.
    assert masks[0].shape == (K, N_DEV * 8, 5)
    every = np.concatenate([m.reshape(K, N_DEV, 8, 5).reshape(K * N_DEV, 8, 5) for m in masks])
    assert _all_distinct(every)  # 2 steps x 8 devices x 4 microbatches
    assert int(state.step) == 2


def test_same_seed_is_bit_identical_and_another_seed_is_not():
    x, y = _data()
    windows = _windows(x, y)
    for mode in ("scan", "stream"):
        step = _dropout_step(mode)  # one compiled program: the seed is an argument
        first, first_masks = _dropout_run(step, mode, 5, windows)
        again, again_masks = _dropout_run(step, mode, 5, windows)
        _, other_masks = _dropout_run(step, mode, 6, windows)
        _assert_tree_equal(again.params, first.params)
        _assert_tree_equal(again_masks, first_masks)
        assert not np.array_equal(np.stack(other_masks), np.stack(first_masks))


class _DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(10)(x)


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


@pytest.mark.slow
def test_dropout_mlp_on_digits_k4_reaches_the_accuracy_of_k1():
    """Same examples per update (K=4 x 32 vs K=1 x 128), same init and batch order; only
    the dropout masks differ (per microbatch vs per batch)."""
    x_train, x_test, y_train, y_test = _digits()
    model = _DropoutMLP()
    init = jax.jit(functools.partial(model.init, train=False))  # one program, not one per op
    params = init(jax.random.key(0), x_train[:1])["params"]
    # Evaluated under jit: one compiled program, not one per operation.
    predict = jax.jit(lambda params, x: model.apply({"params": params}, x, train=False))

    def loss(params, batch, key):
        logits = model.apply({"params": params}, batch["x"], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = make_train_step(loss, mode="scan")  # microbatches of batch // k rows

    def accuracy(k, epochs=25, batch=128):
        state = step.init(params, accumulate(optax.adam(3e-3), k))
        order = np.random.default_rng(0)
        for _ in range(epochs):
            perm = order.permutation(len(x_train))
            for s in range(0, len(perm) - batch + 1, batch):
                idx = perm[s : s + batch]
                state, _ = step(state, {"x": x_train[idx], "y": y_train[idx]}, jax.random.key(1))
        assert int(state.step) == epochs * (len(x_train) // batch)
        logits = predict(state.params, x_test)
        return float(np.mean(np.argmax(logits, -1) == y_test))

    full, accumulated = accuracy(1), accuracy(4)
    print(f"digits dropout MLP test accuracy: K=1 {full:.4f}, K=4 {accumulated:.4f}")
    assert full > 0.93 and accumulated > 0.93
    assert abs(full - accumulated) <= 0.02


def _temp_bytes(step, *args):
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _plain(tx, grad_fn):
    """A jitted ``(params, opt_state), batch`` step of ``tx`` on ``grad_fn``'s gradient, its
    state donated (``grad_fn``: ``jax.grad`` of the loss, or ``optax.microbatch`` of it)."""

    def step(carry, batch):
        params, opt_state = carry
        updates, opt_state = tx.update(grad_fn(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=0)


@pytest.mark.slow
def test_scan_temp_memory_at_most_optax_microbatch_and_the_full_batch():
    """XLA's own temp figure for a parameter-heavy MLP (0.59M parameters, small activations).

    Scan mode holds one accumulator and one microbatch's activations; the window-end update
    must not add a second gradient-sized buffer (a scaled copy of the sum). With
    "propagate", at every K, it needs no more than ``optax.microbatch``, and no more than the
    full batch except at K=2 (where an accumulator, one gradient leaf in flight and half the
    batch's activations exceed the full batch's gradients plus its activations on this
    model). Each policy's bound: test_scan_temp_memory_of_each_policy_is_what_it_must_hold.
    """
    dims, rows = (64, 512, 512, 512, 64), 256
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
        for i, (a, b) in enumerate(itertools.pairwise(dims))
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, dims[0])), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, dims[-1])), jnp.float32),
    }

    def loss(params, batch):
        h = batch["x"]
        for i in range(len(dims) - 1):
            h = h @ params[f"w{i}"]
            h = jax.nn.relu(h) if i < len(dims) - 2 else h
        return jnp.mean((h - batch["y"]) ** 2)

    tx = optax.adam(1e-3)
    carry = (params, tx.init(params))
    full = _temp_bytes(_plain(tx, jax.grad(loss)), carry, batch)
    scan = make_train_step(loss, mode="scan")
    for k in (1, 2, 4, 8):
        mean = optax.microbatching.AccumulationType.MEAN
        reference = optax.microbatch(
            jax.grad(loss), argnums=1, microbatch_size=rows // k, accumulator=mean
        )
        optax_temp = _temp_bytes(_plain(tx, reference), carry, batch)
        state = scan.init(params, accumulate(tx, k, on_nonfinite="propagate"))
        blind = _temp_bytes(scan, state, batch)
        assert blind <= optax_temp, (k, blind, optax_temp)
        if k != 2:
            assert blind <= full, (k, blind, full)


# A parameter-dominated model (issue 37): 4 dense 512x512 tanh layers, 4 MiB of float32
# parameters against 16 rows per microbatch (32 KiB of activations a layer), K = 4, Adam: the
# shape of large-model fine-tuning, where a gradient-sized buffer is what a step pays for.
_WIDTH, _LAYERS, _ROWS = 512, 4, 16


def _dense_loss(params, batch):
    h = batch["x"]
    for i in range(_LAYERS):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


@functools.cache
def _dense_problem():
    """The model's parameters and one window's batch, and ``optax.microbatch``'s temp for it
    (the same loss, K and Adam): made and compiled once for the module."""
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": jnp.asarray(rng.normal(size=(_WIDTH, _WIDTH)) / np.sqrt(_WIDTH), jnp.float32)
        for i in range(_LAYERS)
    }
    batch = {k: jnp.asarray(rng.normal(size=(K * _ROWS, _WIDTH)), jnp.float32) for k in ("x", "y")}
    tx = optax.adam(1e-3)
    mean = optax.microbatching.AccumulationType.MEAN
    grad_fn = optax.microbatch(
        jax.grad(_dense_loss), argnums=1, microbatch_size=_ROWS, accumulator=mean
    )
    reference = _temp_bytes(_plain(tx, grad_fn), (params, tx.init(params)), batch)
    return params, batch, reference


# What each policy must hold besides optax.microbatch's blind sum: "propagate" nothing;
# "skip_window" nothing (a NaN in a blind sum already drops the window); the default a
# finite flag per microbatch, 5% of slack for where XLA puts it; max_norm and skip_fn read
# the gradient before it is added, so they may hold it whole once.
_MEMORY = {
    "propagate": ({"on_nonfinite": "propagate"}, 1.0, 0),
    "skip_window": ({"on_nonfinite": "skip_window"}, 1.0, 0),
    "skip_microbatch": ({}, 1.05, 0),
    "max_norm": ({"max_norm": 1.0}, 1.0, 1),
    "skip_fn": ({"skip_fn": lambda g, p: optax.tree.norm(g) > 1e3}, 1.0, 1),
}


@pytest.mark.parametrize("policy", list(_MEMORY))
def test_scan_temp_memory_of_each_policy_is_what_it_must_hold(policy):
    """XLA's temp figure of the scan step (one device) against ``optax.microbatch``'s on the
    same model: at most ``factor`` times it plus ``gradients`` whole gradients."""
    params, batch, reference = _dense_problem()
    kwargs, factor, gradients = _MEMORY[policy]
    step = make_train_step(_dense_loss, mode="scan")
    state = step.init(params, accumulate(optax.adam(1e-3), K, **kwargs))
    temp = _temp_bytes(step, state, batch)
    gradient = sum(p.nbytes for p in params.values())
    bound = factor * reference + gradients * gradient
    assert temp <= bound, (
        f"{policy}: {temp / 2**20:.2f} MiB of temp, bound {bound / 2**20:.2f} MiB "
        f"(optax.microbatch {reference / 2**20:.2f} MiB, a gradient {gradient / 2**20:.2f})"
    )


def _half_problem():
    """`_dense_loss`'s layers at 256x256 (float32 master weights), 8 rows a microbatch."""
    width, rows = 256, 8
    params = {f"w{i}": jnp.full((width, width), 0.01, jnp.float32) for i in range(_LAYERS)}
    ones = jnp.ones((rows * K, width), jnp.float32)
    return _dense_loss, params, {"x": ones, "y": ones}


@pytest.mark.parametrize(
    "policy, precision",
    [("skip_microbatch", "bfloat16"), ("skip_microbatch", "float16")],
)
def test_a_16_bit_windows_decision_costs_no_memory(policy, precision):
    """Issue 44: in 16 bits the scan step's decision about its microbatches needs no memory of
    its own: its XLA temp is at most ``"propagate"``'s in bfloat16 (up to the decisions'
    scalars, under a KiB). The window's sum decides; a check that read each microbatch's
    gradient a second time kept a 16-bit copy and a float32 one of a layer's gradient."""
    loss, params, batch = _half_problem()

    def temp(precision, **kwargs):
        step = make_train_step(loss, mode="scan", mixed_precision=precision)
        state = step.init(params, accumulate(optax.adam(1e-3), K, **kwargs))
        return _temp_bytes(step, state, batch)

    kwargs = {} if policy == "skip_microbatch" else {"on_nonfinite": policy}
    scalars = 4096
    propagate = temp("bfloat16", on_nonfinite="propagate")
    assert temp(precision, **kwargs) <= propagate + scalars, (temp(precision, **kwargs), propagate)


def _counting_loss(params, model_state, batch):
    """``loss_fn`` with a model state that counts the microbatches it saw."""
    return loss_fn(params, batch), {"seen": model_state["seen"] + 1}


@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_a_scan_window_its_sum_decides_keeps_only_the_finite_microbatches_state(precision):
    """The default policy's scan window, decided by its sum: a non-finite microbatch keeps no
    model state and counts in no loss, as every other window's microbatch (one owner)."""
    window = _windows(*_data())[0]
    bad = 1  # microbatch 1: rows 1, 1 + K, ...
    x = window["x"].copy()
    x[bad::K] = np.nan
    window = {**window, "x": x}
    step = make_train_step(_counting_loss, mode="scan", mixed_precision=precision)
    seen = {"seen": jnp.zeros((), jnp.int32)}
    state = step.init(_params(), accumulate(optax.sgd(0.1), K), model_state=seen)
    new, metrics = step(state, window)
    assert int(new.model_state["seen"]) == K - 1
    assert int(metrics["nonfinite_microbatches"]) == 1
    assert int(metrics["skipped_microbatches"]) == 1
    finite = [mb for i, mb in enumerate(_microbatches(window)) if i != bad]
    losses = [loss_fn(_params(), mb) for mb in finite]  # the state's buffers are donated
    tol = 1e-5 if precision is None else 2e-2  # bfloat16: the loss of bfloat16 activations
    np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- misuse: clear errors

_P, _Named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding


def _multisteps_txs():
    inner = optax.sgd(0.1)
    multi = optax.MultiSteps(inner, K)
    injected = optax.inject_hyperparams(
        lambda learning_rate: optax.MultiSteps(
            optax.sgd(learning_rate), K
        ).gradient_transformation()
    )(learning_rate=0.1)
    return {
        "alone": multi,
        "in_chain": optax.chain(optax.clip(1.0), multi.gradient_transformation()),
        "in_inject_hyperparams": injected,
        # accumulate(multi, K) is refused as it is built (test_accumulation)
        "inside_accumulate": accumulate(multi.gradient_transformation(), K),
    }


@pytest.mark.parametrize(
    "where", ["alone", "in_chain", "in_inject_hyperparams", "inside_accumulate"]
)
@pytest.mark.parametrize("mode", ["stream", "scan", "scan_sharded", "pmap", "shard_map"])
def test_multisteps_tx_is_refused_in_every_mode(mode, where):
    """optax.MultiSteps driven by the step would run as K=1: updated True on every call and
    state.step counting calls while the parameters never move. It is refused, pointing to
    accumulate: by step.init, and by the step for a state built elsewhere."""
    tx = _multisteps_txs()[where]
    x, y = _data()
    batch = _windows(x, y)[0]  # 32 rows: divisible by K and by the 8 devices
    kwargs = {"mode": "stream" if mode == "stream" else "scan"}
    params = _params()
    if mode == "scan_sharded":
        batch = jax.device_put(batch, _Named(_mesh(), _P("data")))
        params = jax.device_put(params, _Named(_mesh(), _P()))
    elif mode == "pmap":
        kwargs["axis_name"] = "data"
        batch = _per_device(batch)
    elif mode == "shard_map":
        kwargs.update(axis_name="data", mesh=_mesh())
    step = _step(**kwargs)
    tx_word = "" if where == "inside_accumulate" else "tx "
    refusal = rf"{tx_word}.*optax\.MultiSteps.*accumjax\.accumulate\(inner, K\)"
    with pytest.raises(TypeError, match=refusal):
        step.init(params, tx)
    if where == "inside_accumulate":
        return  # its own init refuses it: no state holds it
    state = step.init(params, optax.sgd(0.1))  # replicated per device under pmap
    opt_state = tx.init(_params())
    if mode == "pmap":
        opt_state = accumjax.replicate(opt_state)
    with pytest.raises(TypeError, match=refusal):
        step(state.replace(tx=tx, opt_state=opt_state), batch)


def test_multisteps_tx_is_refused_by_plan_microbatches():
    state = TrainState.create(
        apply_fn=None, params=_params(), tx=optax.MultiSteps(optax.sgd(0.1), K)
    )
    x, y = _data()
    batch = _windows(x, y)[0]
    # the planner wraps a plain tx in accumulate(tx, k), which refuses MultiSteps as inner
    with pytest.raises(TypeError, match=r"optax\.MultiSteps.*accumjax\.accumulate\(inner, K\)"):
        accumjax.plan_microbatches(loss_fn, state, batch, memory_budget=2**40)


def _bad_rngs():
    return {
        "int": (0, TypeError),
        "float_array": (jnp.ones((2,), jnp.float32), TypeError),
        "split_keys": (jax.random.split(jax.random.key(0), 3), ValueError),
        "split_raw_keys": (jax.random.split(jax.random.PRNGKey(0), 3), ValueError),
    }


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("kind", ["int", "float_array", "split_keys", "split_raw_keys"])
def test_rng_that_is_not_one_key_is_refused(kind, mode):
    rng, error = _bad_rngs()[kind]
    x, y = _data()
    batch = _windows(x, y)[0]
    step = _step(_dropout_loss, mode=mode, has_aux=True, donate=False)
    state = step.init(_params(), _sgd())
    with pytest.raises(error, match=r"rng must be .*jax\.random\.key"):
        step(state, batch, rng)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_rng_accepts_none_a_typed_key_and_a_raw_key(mode):
    # A plain optimizer's TrainState.create state (no accumulator) fits both modes.
    state = TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1))
    x, y = _data()
    batch = _windows(x, y)[0]
    _step(mode=mode, donate=False)(state, batch, None)
    step = _step(_dropout_loss, mode=mode, has_aux=True, donate=False)
    typed = step(state, batch, jax.random.key(3))[0]
    raw = step(state, batch, jax.random.PRNGKey(3))[0]
    _assert_tree_equal(raw.params, typed.params)  # the same threefry key, two spellings


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_rng_given_to_a_loss_without_key_names_rng(mode):
    state = TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1))
    x, y = _data()
    batch = _windows(x, y)[0]
    step = _step(mode=mode, donate=False)
    with pytest.raises(TypeError, match=r"loss_fn takes no key argument but step.* rng=.*`key`"):
        step(state, batch, jax.random.key(0))
    bn_loss, params, model_state, _ = _bn_setup()  # with model state: one more argument
    bn_state = TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1), model_state=model_state
    )
    bn_batch = {"x": batch["x"], "y": batch["y"]}
    with pytest.raises(TypeError, match="loss_fn takes no key argument"):
        _step(bn_loss, mode=mode, donate=False)(bn_state, bn_batch, jax.random.key(0))
    varargs = lambda *args: loss_fn(*args[:2])  # *args: the key is taken, nothing refused
    make_train_step(varargs, mode=mode, donate=False)(state, batch, jax.random.key(0))


def _two_meshes():
    devices = jax.devices()
    return Mesh(np.array(devices[:4]), ("data",)), Mesh(np.array(devices[4:8]), ("data",))


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("params_spec", [_P(), _P("data")])
def test_params_and_batch_on_different_meshes_is_refused(mode, params_spec):
    first, second = _two_meshes()
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    params = {
        "w": jax.device_put(params["w"], _Named(first, params_spec)),
        "b": jax.device_put(params["b"], _Named(first, _P())),
    }
    step = _step(mode=mode)
    state = step.init(params, _sgd())
    x, y = _data()
    batch = {"x": x[: K * MICRO, :4], "y": y[: K * MICRO]}
    batch = jax.device_put(batch, _Named(second, _P("data")))
    with pytest.raises(
        ValueError,
        match=r"(?s)batch\['x'\].*devices \[4, 5, 6, 7\].*state.*devices \[0, 1, 2, 3\]",
    ):
        step(state, batch)
    assert not state.params["w"].is_deleted()  # refused before anything ran


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_reusing_a_donated_state_says_the_step_donated_it(mode):
    x, y = _data()
    batch = _windows(x, y)[0]
    step = _step(mode=mode)
    state = step.init(_params(), _sgd())
    new, _ = step(state, batch)
    donated = r"(?s)state.*deleted.*donate.*returns.*donate=False.*jnp\.copy"
    with pytest.raises(ValueError, match=donated):
        step(state, batch)  # the old state: its buffers went to `new`
    with pytest.raises(ValueError, match=donated):
        accumjax.stats(state)  # read by accumjax's free functions
    step(new, batch)  # the returned state works


# ----------------------------------------------------------------------------- restored states


def test_float16_needs_the_loss_scale_in_the_state():
    # step.init gives a float16 step its loss scale; a state from elsewhere may lack it.
    state = TrainState.create(apply_fn=None, params=_params(), tx=_sgd())
    step = _step(mixed_precision="float16")
    with pytest.raises(ValueError, match=r"loss_scale.*dynamic_loss_scale"):
        step(state, _microbatches(_windows(*_data())[0])[0])
    assert isinstance(step.init(_params(), _sgd()).loss_scale, accumjax.DynamicLossScale)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_float16_with_propagate_is_refused(mode):
    step = _step(mode=mode, mixed_precision="float16")
    propagate = _sgd(on_nonfinite="propagate")
    with pytest.raises(ValueError, match=r"float16.*propagate.*skip_microbatch"):
        step.init(_params(), propagate)  # at step.init (issue 38)
    # A state built elsewhere (a checkpoint's, another step's) is refused at the call.
    state = step.init(_params(), _sgd()).replace(tx=propagate)
    batch = _windows(*_data())[0]
    with pytest.raises(ValueError, match=r"float16.*propagate.*skip_microbatch"):
        step(state, batch if mode == "scan" else _microbatches(batch)[0])


def test_self_closing_batch_norm_is_refused_by_the_step():
    model = nn.Sequential([accumjax.AccumBatchNorm(accum_steps=K), nn.Dense(1)])
    x, y = _data()
    variables = model.init(jax.random.key(0), x[:MICRO], use_running_average=False)

    def bn_loss(params, model_state, batch):
        pred, new = model.apply(
            {"params": params, **model_state},
            batch["x"],
            use_running_average=False,
            mutable=["batch_stats"],
        )
        return jnp.mean((pred - batch["y"]) ** 2), new

    step = make_train_step(bn_loss)
    state = step.init(
        variables["params"], _sgd(), model_state={"batch_stats": variables["batch_stats"]}
    )
    with pytest.raises(ValueError, match=r"accum_steps=K.*accum_steps=None"):
        step(state, {"x": x[:MICRO], "y": y[:MICRO]})


def test_a_restored_state_with_another_k_is_refused_after_the_first_call():
    micro = _microbatches(_windows(*_data())[0])
    step = _step(donate=False)
    state = step.init(_params(), _sgd())
    state, _ = step(state, micro[0])
    state, _ = step(state, micro[1])  # the returned state: no host check needed
    other = step.init(_params(), _sgd(k=2))
    # A checkpoint of another run (K=2) restored into this run's state: refused.
    restored = state.replace(opt_state=other.opt_state)
    with pytest.raises(ValueError, match="every_k=2"):
        step(restored, micro[2])


def test_mesh_stream_resumes_a_state_restored_mid_window():
    # step.init's stream window keeps every data shard's partial sum, so a copy taken in
    # the middle of a window (as a checkpoint would) resumes it; it was refused before the
    # window was kept per shard.
    mesh = _mesh()
    micro = _microbatches(_windows(*_data())[0])
    step = _step(axis_name="data", mesh=mesh, donate=False)
    state = step.init(_params(), _sgd())
    state, _ = step(state, micro[0])
    assert state.opt_state.window.partial_sums["w"].shape == (N_DEV, 5, 3)
    copy = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), state)  # as a checkpoint would
    for mb in micro[1:]:
        state, _ = step(state, mb)
        copy, metrics = step(copy, mb)
    assert bool(metrics["updated"]) and int(copy.step) == 1
    _assert_tree_equal(copy.params, state.params)
    assert int(state.opt_state.window.micro_step) == 0


# ----------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(("mode", "agc"), [("stream", False), ("scan", False), ("scan", True)])
def test_metrics_grad_norm_is_the_norm_of_the_window_gradient(mode, agc):
    window = _windows(*_data())[0]
    full = jax.grad(loss_fn)(_params(), window)  # the full-batch mean gradient
    expected = float(optax.tree.norm(full))
    # AGC in the inner chain clips inside the inner optimizer: the metric is the norm of
    # the window gradient the inner optimizer is given, before it clips.
    tx = accumulate(_agc_sgd(0.1) if agc else optax.sgd(0.1), K)
    step = _step(mode=mode)
    state = step.init(_params(), tx)
    if mode == "scan":
        state, metrics = step(state, window)
    else:
        for mb in _microbatches(window):
            state, metrics = step(state, mb)
    assert bool(metrics["updated"])
    # float32 sums of K microbatch gradients vs one full-batch gradient: ~1e-7 relative.
    np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=2e-6)
    assert float(state.opt_state.grad_norm) == float(metrics["grad_norm"])
    if agc:  # and AGC clipped: the update is the clipped one
        clipped = accumjax.adaptive_clip_grad(_params(), full, 0.01, 1e-3)
        assert float(optax.tree.norm(clipped)) < 0.9 * expected
        _assert_tree_close(state.params, _sgd_reference(clipped, lr=0.1), F32)


def test_metrics_of_a_call_without_update_are_not_nan():
    """A call that applies no update (stream mode's first K - 1 calls; a scan window that
    skip_window drops) reports grad_norm 0.0, and on clean data no metric is NaN."""
    window = _windows(*_data())[0]
    step = _step()
    state = step.init(_params(), _sgd())
    for i, mb in enumerate(_microbatches(window)):
        state, metrics = step(state, mb)
        assert bool(metrics["updated"]) == (i == K - 1)
        assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
        assert (float(metrics["grad_norm"]) == 0.0) == (i < K - 1)
    scan = _step(mode="scan")
    bad = {**window, "y": window["y"].copy()}
    bad["y"][1, 0] = np.nan  # row 1: microbatch 1
    _, metrics = scan(scan.init(_params(), _sgd(on_nonfinite="skip_window")), bad)
    assert not bool(metrics["updated"]) and float(metrics["grad_norm"]) == 0.0
    assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_metrics_count_skipped_microbatches_under_pmap(mode):
    """Under pmap every device reports the counts of the whole microbatches: NaN rows on
    devices 0 and 3 in microbatch 1 (one microbatch, counted once) and on device 5 in
    microbatch 2: 2 skipped, 2 non-finite, as `stats` says; int32, one entry per device."""
    window = _dp_windows()[0]
    rows = len(window["x"]) // N_DEV  # per device; its microbatch i holds its rows i, i + K
    bad = [1, 3 * rows + 1, 5 * rows + 2]
    window = {**window, "x": window["x"].copy()}
    window["x"][bad, 0] = np.nan
    step = _step(mode=mode, axis_name="data")
    state = step.init(_params(), _sgd())
    calls = (
        [_per_device(window)] if mode == "scan" else [b for _, b in _stream_dp_microbatches(window)]
    )
    counts = []
    for call in calls:
        state, metrics = step(state, call)
        for name in ("skipped_microbatches", "nonfinite_microbatches"):
            assert (metrics[name].shape, metrics[name].dtype) == ((N_DEV,), jnp.int32)
            assert len(set(np.asarray(metrics[name]).tolist())) == 1  # the same on each device
        counts.append(
            (int(metrics["skipped_microbatches"][0]), int(metrics["nonfinite_microbatches"][0]))
        )
    assert bool(metrics["updated"][0])
    assert counts == ([(2, 2)] if mode == "scan" else [(0, 0), (1, 1), (1, 1), (0, 0)])
    stats = accumjax.stats(unreplicate(state.opt_state))
    assert (int(stats.skipped_microbatches), int(stats.num_nonfinite)) == (2, 2)


# ----------------------------------------------------------------------------- optax.microbatch


def _sgd_state(mode="scan"):
    return _step(mode=mode).init(_params(), _sgd(0.5))


def _sgd_reference(grads, lr=0.5):
    return jax.tree.map(lambda p, g: p - lr * g, _params(), grads)


def test_num_real_microbatches_leaves_the_padded_tail_out_without_a_recompile():
    window = _windows(*_data())[0]
    window = jax.tree.map(jnp.asarray, window)
    window["y"] = window["y"].at[3].set(jnp.nan)  # row 3: microbatch 3, padded away below
    step = make_train_step(loss_fn, mode="scan", donate=False)
    state = _sgd_state()
    after, metrics = step(state, window, num_real_microbatches=jnp.int32(3))
    # optax.microbatch over the 3 real microbatches (its strided split is the same), summed,
    # divided by the 3 real ones: the full-batch mean gradient over their 24 rows.
    summed = optax.microbatch(
        jax.grad(loss_fn),
        argnums=1,
        microbatch_size=MICRO,
        accumulator=optax.microbatching.AccumulationType.SUM,
        num_real_microbatches=3,
    )(_params(), window)
    expected = _sgd_reference(jax.tree.map(lambda g: g / 3, summed))
    _assert_tree_close(after.params, expected, F32)
    assert bool(metrics["updated"]) and int(after.opt_state.nonfinite_count) == 0  # not counted
    again, _ = step(state, window, num_real_microbatches=jnp.int32(2))  # another n: no retrace
    assert step.__wrapped__._cache_size() == 1
    rows = window["x"][np.arange(K * MICRO) % K < 2], window["y"][np.arange(K * MICRO) % K < 2]
    full = jax.grad(loss_fn)(_params(), {"x": rows[0], "y": rows[1]})
    _assert_tree_close(again.params, _sgd_reference(full), F32)


def test_num_real_microbatches_is_checked():
    step = _step(mode="scan")
    window = _windows(*_data())[0]
    with pytest.raises(ValueError, match=r"num_real_microbatches must be in \[0, K=4\]"):
        step(_sgd_state(), window, num_real_microbatches=5)
    with pytest.raises(ValueError, match="num_real_microbatches is for make_train_step"):
        _step()(_sgd_state("stream"), window, num_real_microbatches=2)


def test_batch_axis_per_leaf_and_unbatched_inputs_match_optax_microbatch():
    window = _windows(*_data())[0]
    scale = jnp.asarray([1.0, 2.0, 0.5])  # not batched: every microbatch sees it whole

    def axis_loss(params, batch):
        pred = batch["xt"].T @ params["w"] + params["b"]  # xt: (features, rows)
        return jnp.mean(((pred - batch["y"]) * batch["scale"]) ** 2)

    batch = {"xt": window["x"].T, "y": window["y"], "scale": scale}
    step = make_train_step(
        axis_loss, mode="scan", batch_axis={"xt": 1, "y": 0, "scale": None}, donate=False
    )
    after, _ = step(_sgd_state(), batch)

    def split_args_grad(params, xt, y, scale):
        return jax.grad(axis_loss)(params, {"xt": xt, "y": y, "scale": scale})

    grads = optax.microbatch(
        split_args_grad,
        argnums=(1, 2),
        microbatch_size=MICRO,
        accumulator=optax.microbatching.AccumulationType.MEAN,
        in_axes=(1, 0),
    )(_params(), batch["xt"], batch["y"], scale)
    _assert_tree_close(after.params, _sgd_reference(grads), F32)


def test_aux_rows_come_back_in_the_batch_row_order():
    window = _windows(*_data())[0]

    def aux_loss(params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2), {"pred": pred}

    step = make_train_step(aux_loss, mode="scan", has_aux=True, aux_rows=True, donate=False)
    _, metrics = step(_sgd_state(), window)
    full = window["x"] @ _params()["w"] + _params()["b"]  # each row's prediction, in order
    np.testing.assert_allclose(metrics["aux"]["pred"], full, rtol=1e-6, atol=1e-6)
    stacked = make_train_step(aux_loss, mode="scan", has_aux=True, donate=False)
    assert stacked(_sgd_state(), window)[1]["aux"]["pred"].shape == (K, MICRO, 3)


def test_scan_only_options_are_refused_in_stream_mode():
    with pytest.raises(ValueError, match="batch_axis is for mode='scan'"):
        make_train_step(loss_fn, batch_axis=1)
    with pytest.raises(ValueError, match="aux_rows is for mode='scan'"):
        make_train_step(loss_fn, aux_rows=True)
    with pytest.raises(TypeError, match="batch_axis"):
        make_train_step(loss_fn, mode="scan", batch_axis="rows")


def _axis_clipped():
    """The full-batch gradient clipped per column of ``w`` (axis=-1): not AGC's default."""
    window = _windows(*_data())[0]
    full = jax.grad(loss_fn)(_params(), window)
    clipped = accumjax.adaptive_clip_grad(_params(), full, 0.01, 1e-3, axis=-1)
    default = accumjax.adaptive_clip_grad(_params(), full, 0.01, 1e-3)
    assert not np.allclose(clipped["w"], default["w"])  # the axis matters on this problem
    return window, clipped


def test_adaptive_clip_axis_in_the_inner_chain_reaches_adaptive_clip_grad():
    window, clipped = _axis_clipped()
    step = _step(mode="scan", donate=False)
    tx = accumulate(optax.chain(accumjax.adaptive_clip(0.01, 1e-3, axis=-1), optax.sgd(0.5)), K)
    after, _ = step(step.init(_params(), tx), window)
    _assert_tree_close(after.params, _sgd_reference(clipped), F32)


# ----------------------------------------------------------------------------- optax combinators


def test_the_composition_table_of_the_modes_guide_has_a_test_per_row():
    assert list(composition.table()) == list(composition.BUILDERS)


@pytest.mark.parametrize("row", composition.IDS)
def test_an_accumulate_inside_a_combinator_is_refused_as_the_modes_guide_says(row):
    """The step would run such a tx as a plain optimizer (an update reported on every call,
    none applied in scan mode): step.init refuses it, naming the form the guide's table
    gives."""
    cell = composition.ROWS[row]
    with pytest.raises(TypeError, match=re.escape(composition.step_refusal(cell))):
        _step(mode="stream").init(_params(), composition.BUILDERS[cell](_sgd()))


def test_a_wrapper_that_keeps_accumulates_state_as_its_own_is_refused():
    """Its state is an AccumulationState at the top, but K and the policies are not readable
    from tx: refused, naming accumulate itself as the form that works."""
    acc = _sgd()

    def doubled(grads, state, params=None):
        return acc.update(jax.tree.map(lambda g: 2 * g, grads), state, params)

    tx = optax.GradientTransformation(acc.init, doubled)
    with pytest.raises(TypeError, match=r"pass accumulate itself.*accumulate\(your_trans"):
        _step(mode="stream").init(_params(), tx)


@pytest.mark.parametrize("mode", ["stream", "scan", "scan_sharded"])
def test_a_chain_around_accumulate_is_refused_at_init_and_at_the_first_trace(mode):
    """In both modes, on one device and on an 8-device mesh: by step.init, and by the step
    for a state built elsewhere (TrainState.create)."""
    cell = composition.ROWS["chain_before"]
    tx = composition.BUILDERS[cell](_sgd())
    refusal = re.escape(composition.step_refusal(cell))
    batch, params = _windows(*_data())[0], _params()  # 32 rows: K and 8 devices divide it
    if mode == "scan_sharded":
        batch = jax.device_put(batch, _Named(_mesh(), _P("data")))
        params = jax.device_put(params, _Named(_mesh(), _P()))
    step = _step(mode="stream" if mode == "stream" else "scan")
    with pytest.raises(TypeError, match=refusal):
        step.init(params, tx)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(TypeError, match=refusal):
        step(state, batch)


# ----------------------------------------------------------------------------- plain BatchNorm


def test_a_plain_batch_norm_under_accumulation_warns_once_per_step():
    model = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=False)])
    x, y = _data()
    batch = {"x": x[: 2 * MICRO], "y": y[: 2 * MICRO]}
    variables = model.init(jax.random.key(0), batch["x"])

    def bn_loss(params, model_state, batch):
        pred, new = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), new

    model_state = {"batch_stats": variables["batch_stats"]}
    step = make_train_step(bn_loss, mode="scan")
    state = step.init(variables["params"], _sgd(k=2), model_state=model_state)
    with pytest.warns(UserWarning) as seen:
        for _ in range(2):
            state, _ = step(state, batch)
    message = r"make_train_step.*\['batch_stats'\]\['layers_1'\].*K=2.*AccumBatchNorm"
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert seen[0].category is UserWarning
    assert re.search(message + r".*convert_batch_norm_variables", str(seen[0].message))
    one = step.init(variables["params"], optax.sgd(0.1), model_state=model_state)
    frozen = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=True)])

    def frozen_loss(params, model_state, batch):
        pred, new = frozen.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), new

    fine_tune = make_train_step(frozen_loss, mode="scan")
    fine_tune_state = fine_tune.init(variables["params"], _sgd(k=2), model_state=model_state)
    with warnings.catch_warnings():  # K=1, or statistics frozen: nothing moves per microbatch
        warnings.simplefilter("error")
        step(one, batch)
        fine_tune(fine_tune_state, batch)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_weighted_scaling_errors_name_make_train_step_weight_fn(mode):
    x, y = _data()
    batch = {"x": x[: K * MICRO], "y": y[: K * MICRO]}
    weighted = make_train_step(loss_fn, mode=mode)
    state = weighted.init(_params(), _sgd(scaling="weighted"))
    with pytest.raises(ValueError, match=r"make_train_step\(\.\.\., weight_fn=fn\)"):
        weighted(state, batch)
    unweighted = make_train_step(loss_fn, mode=mode, weight_fn=lambda b: b["x"].shape[0])
    state = unweighted.init(_params(), _sgd())
    with pytest.raises(ValueError, match=r"weight_fn=\.\.\.\).*only taken with scaling='weighted'"):
        unweighted(state, batch)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_weight_fn_that_returns_more_than_a_scalar_is_refused_naming_it(mode):
    x, y = _data()
    batch = {"x": x[: K * MICRO], "y": y[: K * MICRO]}
    step = make_train_step(loss_fn, mode=mode, weight_fn=lambda b: jnp.abs(b["x"][:, 0]))
    state = step.init(_params(), _sgd(scaling="weighted"))
    refused = r"weight_fn must return a scalar, got shape \(\d+,\): make_train_step\(weight_fn="
    with pytest.raises(ValueError, match=refused):
        step(state, batch)
    if mode == "scan":  # the call's own check of a short batch's padding reads it first
        with pytest.raises(ValueError, match=refused):
            step(state, batch, num_real_microbatches=2)
