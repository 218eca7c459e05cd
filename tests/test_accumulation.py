"""Tests of `accumjax.accumulate` and the free functions on its state.

References: the bare optimizer on the full batch (float64 under ``jax.enable_x64``), and
``optax.MultiSteps`` for the semantics its own test-suite checks.
"""

import functools
import gc
import re

import _composition as composition
import _reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import accumjax

K = 4
MICRO = 8


def _data(seed=0, n=K * MICRO, dim=5, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype(dtype)
    y = (np.sin(x @ rng.normal(size=(dim,))) + 0.1 * rng.normal(size=n)).astype(dtype)
    return x, y


def _params(dtype=jnp.float32, dim=5, hidden=7):
    rng = np.random.default_rng(42)
    return {
        "w1": jnp.asarray(rng.normal(size=(dim, hidden)) * 0.5, dtype),
        "b1": jnp.zeros((hidden,), dtype),
        "w2": jnp.asarray(rng.normal(size=(hidden,)) * 0.5, dtype),
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


_grad = jax.jit(jax.grad(_loss))


def _full_batch_reference(opt, steps, x, y):
    """The bare optimizer on the whole batch, in float64: the exact answer."""

    @jax.jit  # one program, not each op of a step compiled on its own
    def step(params, state, x64, y64):
        updates, state = opt.update(jax.grad(_loss)(params, x64, y64), state, params)
        return optax.apply_updates(params, updates), state

    with jax.enable_x64(True):
        params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p, np.float64)), _params())
        x64, y64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(y, np.float64))
        state = opt.init(params)
        for _ in range(steps):
            params, state = step(params, state, x64, y64)
        return jax.tree.map(np.asarray, params)


def _run_accumulated(tx, steps, x, y, k=K, jit=True):
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for _ in range(steps):
        for i in range(k):
            sl = slice(i * MICRO, (i + 1) * MICRO)
            updates, state = update(_grad(params, x[sl], y[sl]), state, params)
            params = optax.apply_updates(params, updates)
    return params, state


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_k_microbatches_equal_full_batch_float64(name):
    x, y = _data()
    steps = 25
    ref = _full_batch_reference(OPTIMIZERS[name](), steps, x, y)
    got, state = _run_accumulated(accumjax.accumulate(OPTIMIZERS[name](), K), steps, x, y)
    assert int(state.update_count) == steps
    # float32 arithmetic against a float64 reference: each gradient carries ~1e-7 relative
    # rounding, 25 steps of sgd/momentum/adam (lr <= 0.05) amplify it to well under 1e-5.
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=2e-5, atol=2e-6)
    # The check is sharp: updating every K/2 microbatches (half batches) is far off.
    wrong, _ = _run_accumulated(accumjax.accumulate(OPTIMIZERS[name](), K // 2), steps, x, y)
    assert max(float(np.max(np.abs(np.asarray(wrong[k]) - ref[k]))) for k in ref) > 1e-3


def test_non_update_calls_return_zeros_and_leave_inner_state_bit_identical():
    x, y = _data()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    params = _params()
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    updates, state = update(_grad(params, x[:8], y[:8]), state, params)
    params = optax.apply_updates(params, updates)
    for _ in range(3):  # close the first window so adam's moments are non-zero
        updates, state = update(_grad(params, x[:8], y[:8]), state, params)
        params = optax.apply_updates(params, updates)
    inner_before = state.inner_tx_state
    for step in range(1, K):
        updates, state = update(_grad(params, x[:8], y[:8]), state, params)
        assert all(not np.any(u) for u in jax.tree.leaves(updates))
        assert int(state.window.micro_step) == step
        assert not bool(accumjax.has_updated(state))
        for a, b in zip(
            jax.tree.leaves(inner_before), jax.tree.leaves(state.inner_tx_state), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The inner count equals real updates, so schedules inside inner see optimizer steps.
    assert int(state.inner_tx_state[0].count) == 1


def test_matches_optax_multisteps_with_stateful_param_dependent_inner():
    """MultiSteps' own test: updates only every K, has_updated, same trajectory."""
    inner = lambda: optax.chain(
        optax.scale_by_adam(), optax.add_decayed_weights(1e-2), optax.scale(-1e-2)
    )
    ours = accumjax.accumulate(inner(), K)
    ms = optax.MultiSteps(inner(), K)
    x, y = _data()
    p_ours, p_ms = _params(), _params()
    s_ours, s_ms = ours.init(p_ours), ms.init(p_ms)
    ours_update, ms_update = jax.jit(ours.update), jax.jit(ms.update)
    for idx in range(5 * K):
        sl = slice((idx % K) * MICRO, (idx % K + 1) * MICRO)
        u, s_ours = ours_update(_grad(p_ours, x[sl], y[sl]), s_ours, p_ours)
        new_ours = optax.apply_updates(p_ours, u)
        u, s_ms = ms_update(_grad(p_ms, x[sl], y[sl]), s_ms, p_ms)
        p_ms = optax.apply_updates(p_ms, u)
        is_update = idx % K == K - 1
        assert bool(accumjax.has_updated(s_ours)) == is_update == bool(ms.has_updated(s_ms))
        if not is_update:
            jax.tree.map(np.testing.assert_array_equal, new_ours, p_ours)
        p_ours = new_ours
        # MultiSteps keeps a running (Welford) mean, we keep a sum divided once: both are
        # float32 roundings of the same mean, a few ulp apart.
        jax.tree.map(
            functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), p_ours, p_ms
        )


def test_every_k_schedule_as_multisteps():
    tx = accumjax.accumulate(optax.sgd(1e-4), lambda step: jnp.where(step < 2, 1, 3))
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    tx = tx._replace(update=jax.jit(tx.update))
    grad = {"a": jnp.zeros([])}
    assert not bool(accumjax.has_updated(state))
    for _ in range(2):
        _, state = tx.update(grad, state, params)
        assert bool(accumjax.has_updated(state))
    for _ in range(5):
        for _ in range(2):
            _, state = tx.update(grad, state, params)
            assert not bool(accumjax.has_updated(state))
            assert int(accumjax.stats(state).every_k) == 3
        assert bool(accumjax.should_update(state))
        _, state = tx.update(grad, state, params)
        assert bool(accumjax.has_updated(state))


def test_stats_accumulation_steps_is_every_k_under_its_old_name_with_a_deprecation_warning():
    stats = accumjax.stats(accumjax.accumulate(optax.sgd(0.1), 8).init({"a": jnp.zeros(2)}))
    with pytest.warns(DeprecationWarning, match=r"accumulation_steps .*0\.6.*every_k"):
        old = stats.accumulation_steps
    assert old is stats.every_k and int(old) == 8
    assert "accumulation_steps" not in stats._fields and stats._fields[0] == "every_k"


def test_computes_mean_exactly():
    tx = accumjax.accumulate(optax.scale(1.0), 4)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    for i in (1, 2, 3):
        updates, state = update({"a": jnp.asarray(float(i))}, state, params)
        assert float(updates["a"]) == 0.0
    updates, state = update({"a": jnp.asarray(4.0)}, state, params)
    assert float(updates["a"]) == 2.5


def test_scan_dtype_stability_with_bf16_grads():
    tx = accumjax.accumulate(optax.sgd(1e-4), 2)
    params = {"a": jnp.zeros([], jnp.bfloat16)}

    def body(state, _):
        updates, state = tx.update({"a": jnp.ones([], jnp.bfloat16)}, state, params)
        return state, updates

    final, updates = jax.lax.scan(body, tx.init(params), jnp.arange(4))
    assert final.window.grad_sum["a"].dtype == jnp.float32
    assert updates["a"].dtype == jnp.bfloat16


def test_compatible_with_zero_nans():
    tx = accumjax.accumulate(optax.chain(optax.zero_nans(), optax.sgd(1e-4)), 2)
    params = {"a": jnp.zeros([])}
    jax.jit(tx.update)({"a": jnp.zeros([])}, tx.init(params), params)


@pytest.mark.parametrize("upd_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_output_dtype_equals_inner_optimizers(upd_dtype, param_dtype):
    # Dtypes are fixed when a function is traced: jax.eval_shape gives the ones a call would
    # return (each of the 9 cases would compile every op of two optimizers eagerly).
    params = {
        "w": jax.ShapeDtypeStruct((3, 2), param_dtype),
        "b": jax.ShapeDtypeStruct((2,), param_dtype),
    }
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, upd_dtype), params)
    inner = optax.adam(1e-3)
    plain, _ = jax.eval_shape(inner.update, grads, jax.eval_shape(inner.init, params), params)
    tx = accumjax.accumulate(optax.adam(1e-3), 2)
    state = jax.eval_shape(tx.init, params)
    for _ in range(2):
        ours, state = jax.eval_shape(tx.update, grads, state, params)
        assert jax.tree.map(lambda a: a.dtype, ours) == jax.tree.map(lambda a: a.dtype, plain)
    assert state.window.grad_sum["w"].dtype == jnp.float32


def test_float32_accumulator_for_bf16_grads_is_accurate():
    # 300 bf16 gradients of bf16(1/3) (8 significant bits): their float32 sum needs 17 bits, so
    # it and the mean are exact; a bf16 running sum has a spacing of 0.5 past 64 and drifts.
    k = 300
    g = {"a": jnp.asarray(1.0 / 3.0, jnp.bfloat16)}
    tx = accumjax.accumulate(optax.scale(1.0), k)
    state = tx.init({"a": jnp.zeros([], jnp.bfloat16)})
    update = jax.jit(tx.update)
    for _ in range(k):
        out, state = update(g, state)
    assert out["a"].dtype == jnp.bfloat16
    assert float(out["a"]) == float(g["a"])
    # A bf16 accumulator loses it: the sum stalls once it reaches 256.
    bf16 = accumjax.accumulate(optax.scale(1.0), k, accumulator_dtype=None)
    state = bf16.init({"a": jnp.zeros([], jnp.bfloat16)})
    for _ in range(k):
        bad, state = jax.jit(bf16.update)(g, state)
    assert float(bad["a"]) != float(g["a"])


def test_mean_divides_by_the_microbatches_used_and_sum_over_k_by_k():
    tx = accumjax.accumulate(optax.scale(1.0), 3)
    over_k = accumjax.accumulate(optax.scale(1.0), 3, scaling="sum_over_k")
    params = {"a": jnp.zeros(2)}
    grads = [jnp.array([1.0, 2.0]), jnp.array([np.nan, 0.0]), jnp.array([3.0, 6.0])]
    s, s_k = tx.init(params), over_k.init(params)
    update, k_update = jax.jit(tx.update), jax.jit(over_k.update)  # one program each
    for g in grads:
        out, s = update({"a": g}, s, params)
        out_k, s_k = k_update({"a": g}, s_k, params)
    np.testing.assert_array_equal(out["a"], [2.0, 4.0])  # (1+3)/2, (2+6)/2: exact in binary
    np.testing.assert_array_equal(out_k["a"], np.array([4.0, 8.0], np.float32) / np.float32(3))
    assert int(s.nonfinite_count) == 1 and bool(accumjax.stats(s).overflow_detected)


def test_a_state_resumes_under_another_name_of_a_mean_and_not_under_sum():
    """A checkpoint stores its strategy's index: a 0.4 "count" state (index 2) resumes under
    "mean", a "mean" state under "sum_over_k" (0.4's "mean"); "sum" refuses either."""
    params, g = {"a": jnp.zeros(2)}, {"a": jnp.ones(2)}
    state = accumjax.accumulate(optax.sgd(0.1), 2).init(params)
    count_state = state._replace(scaling_code=jnp.int32(2))
    accumjax.accumulate(optax.sgd(0.1), 2).update(g, count_state, params)
    accumjax.accumulate(optax.sgd(0.1), 2, scaling="sum_over_k").update(g, state, params)
    with pytest.raises(ValueError, match="made with scaling='count'"):
        accumjax.accumulate(optax.sgd(0.1), 2, scaling="sum").update(g, count_state, params)


def test_weighted_token_mean_is_exact():
    """Microbatches of per-token-mean losses, weighted by token count = full token-mean loss."""
    rng = np.random.default_rng(1)
    lengths = [3, 11, 1, 17]
    xs = [rng.normal(size=(n, 5)) for n in lengths]
    ys = [rng.normal(size=(n,)) for n in lengths]
    tx = accumjax.accumulate(optax.sgd(0.1), len(lengths), scaling="weighted")
    params = _params()
    state = tx.init(params)
    for x, y in zip(xs, ys, strict=True):
        g = _grad(params, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        updates, state = jax.jit(tx.update)(g, state, params, weight=jnp.asarray(len(x)))
    got = optax.apply_updates(params, updates)
    ref = _full_batch_reference(optax.sgd(0.1), 1, np.concatenate(xs), np.concatenate(ys))
    # float32 vs float64 for one sgd step: ~1e-7 relative on gradients of order 1.
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-6, atol=1e-6)
    # Plain mean over microbatches (equal weights) is visibly different for ragged lengths.
    tx_mean = accumjax.accumulate(optax.sgd(0.1), len(lengths))
    s = tx_mean.init(params)
    for x, y in zip(xs, ys, strict=True):
        g = _grad(params, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        u_mean, s = jax.jit(tx_mean.update)(g, s, params)
    wrong = optax.apply_updates(params, u_mean)
    assert max(float(np.max(np.abs(np.asarray(wrong[k]) - ref[k]))) for k in ref) > 1e-3


def test_max_norm_clips_each_microbatch():
    grads = [{"a": jnp.array([3.0, 4.0])}, {"a": jnp.array([0.3, 0.4])}]  # norms 5 and 0.5
    tx = accumjax.accumulate(optax.scale(1.0), 2, max_norm=1.0)
    state = tx.init({"a": jnp.zeros(2)})
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    for g in grads:
        out, state = update(g, state)
    clip = optax.clip_by_global_norm(1.0)
    clipped = jax.jit(lambda g: clip.update(g, clip.init(g))[0]["a"])
    ref = sum(np.asarray(clipped(g)) for g in grads) / 2
    np.testing.assert_allclose(
        out["a"], ref, rtol=1e-6
    )  # a norm and a division: 1e-7 was tighter than float32
    # stats see the applied window gradient's norm: (0.6 + 0.3, 0.8 + 0.4) / 2
    assert float(state.max_grad_norm) == pytest.approx(0.75)


# GradientAccumulator's use_agc=True (tests/_reference.py: per microbatch, AGC of the gradient
# of loss / K, summed, one SGD step a window), over 3 windows of the linear problem. Biases
# start at zero, so their units clip at clip_factor * eps. accumjax's transform sees each
# microbatch's own gradient, K times GradientAccumulator's: AGC(g / K, c) == AGC(g, K c) / K.
_GA_C, _GA_EPS, _GA_LR, _GA_WINDOWS = 0.8, 1e-3, 0.1, 3
# float32 against float64: per window K gradients of 8-row sums, per-unit norms, a division
# and a sum of K, each rounded to 2**-24 relative, over 3 SGD steps: 1e-6 of the values'
# scale (measured: 1.1e-7 in every entry point).
_GA_FLOAT32 = 1e-6


def _ga_problem():
    """float32 parameters (zero biases), the windows' batches (K * MICRO rows each) and
    GradientAccumulator's float64 result after them."""
    params, batch = reference.problem(_GA_WINDOWS * K * MICRO)
    params["b"] = np.zeros_like(params["b"])
    rows = K * MICRO
    batches = [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(3)]
    windows = [reference.microbatches(b, K) for b in batches]
    expected, clipped = reference.ga_agc_training(params, windows, _GA_LR, _GA_C, _GA_EPS)
    assert 0.2 < clipped < 0.8  # some gradient entries clipped, some not
    return params, batches, windows, expected


def _ga_tx():
    agc = accumjax.adaptive_clip(K * _GA_C, _GA_EPS)
    return accumjax.accumulate(optax.sgd(_GA_LR), K, microbatch_transform=agc)


@pytest.mark.parametrize("entry", ["own loop", "scan", "stream"])
def test_microbatch_agc_is_gradient_accumulators_use_agc(entry):
    params, batches, windows, expected = _ga_problem()
    params = jax.tree.map(jnp.asarray, params)
    if entry == "own loop":
        tx = _ga_tx()
        state = tx.init(params)
        grad = jax.jit(jax.grad(reference.loss))
        tx_update = jax.jit(tx.update)  # one program, not each op of an update compiled
        for micro in windows:
            for mb in micro:
                updates, state = tx_update(grad(params, mb), state, params)
                params = optax.apply_updates(params, updates)
    else:
        step = accumjax.make_train_step(reference.loss, mode=entry, donate=False)
        state = step.init(params, _ga_tx())
        for batch, micro in zip(batches, windows, strict=True):
            for call in [batch] if entry == "scan" else micro:
                state, metrics = step(state, call)
            assert bool(metrics["updated"])
        params = state.params
    for key, want in expected.items():
        scale = np.max(np.abs(want))
        got = np.asarray(params[key])
        np.testing.assert_allclose(got, want, rtol=_GA_FLOAT32, atol=_GA_FLOAT32 * scale)


def test_a_microbatch_transform_sees_only_the_microbatches_added():
    # The non-finite microbatch is left out and counted; the others are clipped unit by unit
    # and "mean" divides by the two added (float64 NumPy AGC, same units, as reference).
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    grads = [
        {"w": rng.normal(size=(3, 2)).astype(np.float32) * s, "b": np.ones(2, np.float32)}
        for s in (1.0, 1.0, 0.01)
    ]
    grads[1]["w"][0, 0] = np.nan
    agc = accumjax.adaptive_clip(0.1)
    tx = accumjax.accumulate(optax.sgd(1.0), 3, microbatch_transform=agc)
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of an update compiled
    for g in grads:
        updates, state = update(g, state, params)
    clipped = [reference.ga_adaptive_clip_grad(params, g, 0.1, 1e-3) for g in grads[::2]]
    assert not np.array_equal(clipped[0]["w"], grads[0]["w"])  # clipped
    assert np.array_equal(clipped[1]["w"], grads[2]["w"])  # not clipped
    s = accumjax.stats(state)
    assert int(s.skipped_microbatches) == 1 and int(s.num_nonfinite) == 1
    for key in params:  # a norm, a division and a sum of 2, in float32
        want = -(clipped[0][key] + clipped[1][key]) / 2
        np.testing.assert_allclose(updates[key], want, rtol=1e-6, atol=1e-7)


def test_a_scan_window_of_one_microbatch_is_transformed():
    # K=1: the microbatch opens the window as its sum (no loop); it is transformed too.
    params, batch = reference.problem(8)
    params["b"] = np.zeros_like(params["b"])
    agc = accumjax.adaptive_clip(0.1)
    tx = accumjax.accumulate(optax.sgd(1.0), 1, microbatch_transform=agc)
    step = accumjax.make_train_step(reference.loss, mode="scan", donate=False)
    state, _ = step(step.init(params, tx), batch)
    grad = reference.value_and_grad(params, batch)[1]
    clipped = reference.ga_adaptive_clip_grad(params, grad, 0.1, 1e-3)
    assert not np.array_equal(clipped["w"], grad["w"])
    for key in params:  # float32 against float64: an 8-row sum, norms and one step
        want = params[key] - clipped[key]
        np.testing.assert_allclose(state.params[key], want, rtol=1e-6, atol=1e-6)


def test_max_norm_is_microbatch_clip_by_global_norm():
    grads = [{"a": jnp.array([3.0, 4.0])}, {"a": jnp.array([0.3, 0.4])}]  # norms 5 and 0.5
    outs = []
    for kwargs in ({"max_norm": 1.0}, {"microbatch_transform": optax.clip_by_global_norm(1.0)}):
        tx = accumjax.accumulate(optax.scale(1.0), 2, **kwargs)
        state = tx.init({"a": jnp.zeros(2)})
        update = jax.jit(tx.update)  # one program, not each op of an update compiled
        for g in grads:
            out, state = update(g, state)
        outs.append(np.asarray(out["a"]))
    # A factor (max_norm) against optax's g / norm * max_norm: 1 ulp apart at most.
    np.testing.assert_allclose(outs[0], outs[1], rtol=2e-7)
    np.testing.assert_allclose(outs[0], [0.45, 0.6], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"microbatch_transform": lambda g: g}, TypeError, "GradientTransformation"),
        (
            {"microbatch_transform": optax.clip_by_global_norm(1.0), "max_norm": 1.0},
            ValueError,
            "not both",
        ),
    ],
)
def test_bad_microbatch_transform(kwargs, error, match):
    with pytest.raises(error, match=match):
        accumjax.accumulate(optax.sgd(1.0), 2, **kwargs)


def test_a_stateful_microbatch_transform_is_refused_at_init():
    tx = accumjax.accumulate(optax.sgd(1.0), 2, microbatch_transform=optax.scale_by_adam())
    with pytest.raises(ValueError, match="microbatch_transform must be stateless"):
        tx.init({"a": jnp.zeros(2)})


def test_skip_window_drops_whole_window_and_keeps_inner_state():
    tx = accumjax.accumulate(optax.sgd(1.0, momentum=0.9), 2, on_nonfinite="skip_window")
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    for g in ([1.0, 1.0], [1.0, 1.0]):
        u, state = update({"a": jnp.array(g)}, state, params)
        params = optax.apply_updates(params, u)
    inner = state.inner_tx_state
    for g in ([np.inf, 1.0], [1.0, 1.0]):
        u, state = update({"a": jnp.array(g)}, state, params)
        assert all(not np.any(v) for v in jax.tree.leaves(u))
    assert not bool(accumjax.has_updated(state)) and int(state.update_count) == 1
    jax.tree.map(np.testing.assert_array_equal, inner, state.inner_tx_state)
    assert int(state.window.micro_step) == 0 and not np.any(state.window.grad_sum["a"])
    assert np.isfinite(params["a"]).all()


def test_skip_microbatch_keeps_params_and_inner_state_finite_when_window_all_bad():
    tx = accumjax.accumulate(optax.adam(1.0), 2)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    for _ in range(2):
        u, state = jax.jit(tx.update)({"a": jnp.array([jnp.nan, 1.0])}, state, params)
    # Nothing was added: no update at all (adam on a zero gradient would still move params).
    assert not bool(accumjax.has_updated(state)) and int(state.inner_tx_state[0].count) == 0
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((u, state)))


def test_propagate_passes_nan_through():
    tx = accumjax.accumulate(optax.sgd(1.0), 1, on_nonfinite="propagate")
    u, state = jax.jit(tx.update)({"a": jnp.array([np.nan])}, tx.init({"a": jnp.zeros(1)}))
    # "propagate" does not look for non-finite values: nothing is skipped or counted.
    assert np.isnan(u["a"][0]) and int(state.nonfinite_count) == 0
    assert bool(accumjax.has_updated(state))


def test_traced_invalid_weight_is_skipped_and_counted():
    tx = accumjax.accumulate(optax.scale(1.0), 2, scaling="weighted")
    update = jax.jit(tx.update)
    state = tx.init({"a": jnp.zeros(())})
    _, state = update({"a": jnp.array(5.0)}, state, weight=jnp.array(-1.0))
    out, state = update({"a": jnp.array(2.0)}, state, weight=jnp.array(3.0))
    assert float(out["a"]) == 2.0 and int(state.nonfinite_count) == 1


def test_stats_sizes_every_state_layout():
    """Issue 38: a scan-mode state holds no accumulator, and ``stats`` reported 0 parameters
    and 0 bytes for it. Every layout of one problem (9 scalars, a bfloat16 leaf summed in
    float32: 36 bytes a sum) reports its parameters, and the bytes of its window's sum."""
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    tx = accumjax.accumulate(optax.sgd(1.0), 3)
    scan = accumjax.make_train_step(lambda p, b: 0.0, mode="scan").init(params, tx)
    stream = accumjax.make_train_step(lambda p, b: 0.0).init(params, tx)
    create = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)
    for layout in (tx.init(params), scan, stream, stream.opt_state, create):
        s = accumjax.stats(layout)
        assert (s.num_parameters, s.memory_bytes) == (9, 36), type(layout).__name__
    # On its own a scan-mode optimizer state knows neither: unknown, not 0.
    s = accumjax.stats(scan.opt_state)
    assert (s.num_parameters, s.memory_bytes) == (None, None)
    # Kept per data shard on 8 devices: the parameters once, every shard's sum.
    mesh = jax.make_mesh((8,), ("data",))
    placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    s = accumjax.stats(accumjax.make_train_step(lambda p, b: 0.0).init(placed, tx))
    assert (s.num_parameters, s.memory_bytes) == (9, 8 * 36)


def test_free_functions_on_state():
    tx = accumjax.accumulate(optax.sgd(1.0), 3, scaling="weighted")
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    state = tx.init(params)
    assert not bool(accumjax.should_update(state))
    g = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    _, state = update(g, state, params, weight=1.0)
    _, state = update(jax.tree.map(lambda x: 4 * x, g), state, params, weight=3.0)
    assert bool(accumjax.should_update(state))
    acc = accumjax.accumulated_gradients(state)
    np.testing.assert_allclose(acc["w"], np.full((2, 3), 13.0 / 4.0))
    s = accumjax.stats(state)
    assert (int(s.current_step), int(s.total_cycles), s.num_parameters) == (2, 0, 9)
    assert s.memory_bytes == 9 * 4  # bf16 leaf accumulates in float32
    assert float(s.max_grad_norm) == 0.0  # no window applied yet
    cleared = accumjax.reset(state)
    assert int(cleared.window.micro_step) == 0 and float(cleared.window.weight_sum) == 0.0
    assert all(
        float(jnp.sum(x)) == 0 for x in jax.tree.leaves(accumjax.accumulated_gradients(cleared))
    )
    assert cleared.inner_tx_state is state.inner_tx_state


# ----------------------------------------------------------------------------- optax combinators

# What the readers say about a state inside apply_if_finite or MultiSteps (the guide's "readers
# refuse" rows): why the count would be wrong, and the fix.
_READERS_REFUSE = {"apply_if_finite": "on_nonfinite=", "multisteps_around": "Drop MultiSteps"}


@pytest.mark.parametrize("row", composition.IDS)
def test_own_loop_readers_do_as_the_modes_guide_says(row):
    """Each row of the guide's table in your own loop, K = 2: the readers find the one
    accumulate state inside the combinator's (its counts after each call), or refuse."""
    cell = composition.ROWS[row]
    own = composition.table()[cell][1]
    build = composition.BUILDERS[cell]
    if row == "multisteps_inside":
        assert own.startswith("`accumulate` refuses it as it is built")
        with pytest.raises(TypeError, match="Drop MultiSteps"):
            build(accumjax.accumulate(optax.sgd(0.1), 2))
        return
    tx = build(accumjax.accumulate(optax.sgd(0.1), 2))
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    state = tx.init(params)
    if row in _READERS_REFUSE:
        assert own.startswith("readers refuse")
        for read in (accumjax.stats, accumjax.has_updated, accumjax.reset):
            with pytest.raises(ValueError, match=re.escape(_READERS_REFUSE[row])):
                read(state)
        return
    assert own.startswith("runs; readers find the state")
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)  # norm < 1: clip(1.0) is idle
    update = jax.jit(tx.update)
    seen = []
    for _ in range(3):
        _, state = update(grads, state, params)
        s = accumjax.stats(state)
        seen.append(
            (
                bool(accumjax.should_update(state)),
                bool(accumjax.has_updated(state)),
                int(s.current_step),
                int(s.total_cycles),
            )
        )
        assert accumjax.accumulated_gradients(state) is not None
    assert seen == [(True, False, 1, 0), (False, True, 0, 1), (True, False, 1, 1)]
    cleared = accumjax.reset(state)
    assert type(cleared) is type(state)
    assert int(accumjax.stats(cleared).current_step) == 0


def test_own_loop_readers_name_where_to_look():
    """No accumulate state: TypeError saying what to pass; two (two accumulates in a
    multi_transform): ValueError naming both paths."""
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    with pytest.raises(TypeError, match=r"got ScaleByAdamState.*holds none.*accumulate"):
        accumjax.stats(optax.adam(0.1).init(params)[0])
    two = optax.multi_transform(
        {"a": accumjax.accumulate(optax.sgd(0.1), 2), "b": accumjax.accumulate(optax.sgd(0.1), 2)},
        lambda p: {"a": "a", "b": "b"},
    )
    paths = r"state\.inner_states\['a'\]\.inner_state, state\.inner_states\['b'\]\.inner_state"
    with pytest.raises(ValueError, match=rf"holds 2 accumjax AccumulationStates, at {paths}"):
        accumjax.has_updated(two.init(params))


def test_own_loop_readers_find_the_state_in_an_nnx_optimizer_around_a_chain():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = optax.chain(optax.scale(1.0), accumjax.accumulate(optax.sgd(0.1), 2))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = lambda m: jnp.mean(m(jnp.ones((1, 2))) ** 2)

    @nnx.jit
    def train_step(model, opt):
        opt.update(model, nnx.grad(loss)(model))

    updated = []
    for _ in range(2):
        train_step(model, opt)
        updated.append(bool(accumjax.has_updated(opt.opt_state)))
    assert updated == [False, True]
    assert int(accumjax.stats(opt.opt_state).total_cycles) == 1


def test_an_inner_that_accumulates_too_is_refused():
    """MultiSteps as a transformation (not detectable as accumulate is built) or another
    accumulate inside: K x K' microbatches per update, refused at init."""
    params = {"w": jnp.zeros(2)}
    multi = optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()
    with pytest.raises(TypeError, match=r"inner holds optax\.MultiSteps.*Drop MultiSteps"):
        accumjax.accumulate(optax.chain(optax.scale(1.0), multi), 2).init(params)
    nested = optax.chain(optax.scale(1.0), accumjax.accumulate(optax.sgd(0.1), 2))
    with pytest.raises(TypeError, match=r"inner holds another accumulate.*State K once"):
        accumjax.accumulate(nested, 2).init(params)


def test_vmap_over_independent_states():
    tx = accumjax.accumulate(optax.adam(0.1), 2)
    params = {"a": jnp.zeros((4, 3))}  # 4 independent problems
    state = jax.vmap(tx.init)(params)
    grads = {"a": jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(4, 3) + 1)}
    update = jax.jit(jax.vmap(tx.update))
    for _ in range(4):
        u, state = update(grads, state, params)
        params = optax.apply_updates(params, u)
    ref_p = {"a": jnp.zeros(3)}
    ref_tx = accumjax.accumulate(optax.adam(0.1), 2)
    rs = ref_tx.init(ref_p)
    ref_update = jax.jit(ref_tx.update)
    for _ in range(4):
        u, rs = ref_update({"a": jnp.asarray(np.asarray(grads["a"])[1])}, rs, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    # vmap may fuse adam's arithmetic differently: equal to an ulp, not bit for bit.
    np.testing.assert_allclose(params["a"][1], ref_p["a"], rtol=1e-6)
    np.testing.assert_array_equal(state.update_count, [2, 2, 2, 2])


def test_pmap_all_reduces_once_per_window_and_matches_full_batch():
    n_dev = 4
    assert jax.device_count() >= n_dev
    x, y = _data(n=n_dev * K * MICRO)
    steps = 3
    ref = _full_batch_reference(optax.adam(1e-2), steps, x, y)
    tx = accumjax.accumulate(optax.adam(1e-2), K, axis_name="d")

    @functools.partial(jax.pmap, axis_name="d", devices=jax.devices()[:n_dev])
    def step(params, state, xb, yb):
        updates, state = tx.update(jax.grad(_loss)(params, xb, yb), state, params)
        return optax.apply_updates(params, updates), state

    params = jax.tree.map(lambda p: np.stack([p] * n_dev), _params())  # numpy: no compile
    state = jax.pmap(tx.init, devices=jax.devices()[:n_dev])(params)
    xs = x.reshape(n_dev, K, MICRO, -1)
    ys = y.reshape(n_dev, K, MICRO)
    for _ in range(steps):
        for i in range(K):
            params, state = step(params, state, xs[:, i], ys[:, i])
    # Same float32-vs-float64 reasoning as the single-device exactness test.
    for key in ref:
        np.testing.assert_allclose(params[key][0], ref[key], rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(params[key][0], params[key][n_dev - 1])
    hlo = step.lower(params, state, xs[:, 0], ys[:, 0]).compile().as_text()
    # The window's sum once (in the window end); issue 32: each call's microbatch is decided by
    # every device together, in an all-reduce of two scalars.
    assert accumjax.collectives.count_collectives(hlo, min_bytes=64)["all-reduce"] == 1
    assert accumjax.collectives.count_collectives(hlo)["all-reduce"] == 2


def test_orbax_checkpoint_mid_window_resumes_bit_identical(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    x, y = _data()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    update = jax.jit(tx.update)

    def run(params, state, calls):
        for c in calls:
            sl = slice((c % K) * MICRO, (c % K + 1) * MICRO)
            updates, state = update(_grad(params, x[sl], y[sl]), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    p0 = _params()
    full_p, _ = run(p0, tx.init(p0), range(3 * K))
    mid_p, mid_s = run(p0, tx.init(p0), range(K + 2))  # stop inside the second window
    assert int(mid_s.window.micro_step) == 2
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": mid_p, "opt": mid_s})
    ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": mid_p, "opt": mid_s})
    restored = ckptr.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt"], accumjax.AccumulationState)
    resumed_p, _ = run(restored["params"], restored["opt"], range(K + 2, 3 * K))
    jax.tree.map(np.testing.assert_array_equal, resumed_p, full_p)


@pytest.mark.parametrize("every_k", [0, -1, 2.0, True, "4", None])
def test_bad_every_k(every_k):
    with pytest.raises((ValueError, TypeError), match="every_k"):
        accumjax.accumulate(optax.sgd(1.0), every_k)


def test_bad_schedule_value():
    with pytest.raises(ValueError, match=r"every_k schedule's K at step 0 must be an int in \[1"):
        accumjax.accumulate(optax.sgd(1.0), lambda step: 0)
    with pytest.raises(TypeError, match="every_k schedule must return an integer"):
        accumjax.accumulate(optax.sgd(1.0), lambda step: jnp.float32(jnp.nan))
    with pytest.raises(ValueError, match="every_k"):
        accumjax.accumulate(optax.sgd(1.0), 2**31)
    tx = accumjax.accumulate(optax.sgd(1.0), np.int64(2))  # numpy integers are ints
    assert int(tx.init({"a": jnp.zeros(1)}).every_k) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scaling": "median"}, "scaling"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"max_norm": 0.0}, "max_norm"),
        ({"max_norm": -1.0}, "max_norm"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accumjax.accumulate(optax.sgd(1.0), 2, **kwargs)


@pytest.mark.parametrize(
    ("weight", "error", "match"),
    [
        (None, ValueError, r"make_train_step\(\.\.\., weight_fn=fn\).*update\(\.\.\., weight=w\)"),
        (-1.0, ValueError, ">= 0"),
        (float("inf"), ValueError, "finite"),
        (float("nan"), ValueError, "finite"),
        (jnp.ones(2), ValueError, "scalar"),
        (jnp.array(True), TypeError, "real number"),
    ],
)
def test_bad_weight(weight, error, match):
    tx = accumjax.accumulate(optax.sgd(1.0), 2, scaling="weighted")
    state = tx.init({"a": jnp.zeros(2)})
    with pytest.raises(error, match=match):
        tx.update({"a": jnp.ones(2)}, state, weight=weight)


def test_weight_without_weighted_scaling_is_an_error():
    tx = accumjax.accumulate(optax.sgd(1.0), 2)
    with pytest.raises(ValueError, match="only taken with scaling='weighted'"):
        tx.update({"a": jnp.ones(2)}, tx.init({"a": jnp.zeros(2)}), weight=1.0)


def test_bad_grads_are_rejected_at_trace_time():
    tx = accumjax.accumulate(optax.sgd(1.0), 2)
    state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(3)})
    update = jax.jit(tx.update)
    with pytest.raises(ValueError, match="structure"):
        update({"a": jnp.ones(2)}, state)
    with pytest.raises(ValueError, match="shape"):
        update({"a": jnp.ones(2), "b": jnp.ones(4)}, state)
    with pytest.raises(TypeError, match="floating point"):
        update({"a": jnp.ones(2), "b": jnp.ones(3, jnp.int32)}, state)
    with pytest.raises(TypeError, match="floating-point"):
        tx.init({"a": jnp.zeros(2, jnp.int32)})


def test_accumulator_never_narrower_than_params():
    with jax.enable_x64(True):
        state = accumjax.accumulate(optax.sgd(1.0), 2).init({"a": jnp.zeros(2, jnp.float64)})
        assert state.window.grad_sum["a"].dtype == jnp.float64
    state = accumjax.accumulate(optax.sgd(1.0), 2, accumulator_dtype=None).init(
        {"a": jnp.zeros(2, jnp.float16)}
    )
    assert state.window.grad_sum["a"].dtype == jnp.float16


def test_stats_count_the_open_window_at_once():
    tx = accumjax.accumulate(optax.sgd(0.1), 4)
    state = tx.init({"w": jnp.zeros(2)})
    update = jax.jit(tx.update)  # one program, not each op of an update compiled on its own
    _, state = update({"w": jnp.array([1.0, np.nan])}, state)
    s = accumjax.stats(state)
    assert bool(s.overflow_detected) and int(s.num_nonfinite) == 1
    assert int(s.skipped_microbatches) == 1 and int(s.current_step) == 1
    for _ in range(3):  # the window closes: the counts move to the state, not counted twice
        _, state = update({"w": jnp.ones(2)}, state)
    s = accumjax.stats(state)
    assert int(s.num_nonfinite) == 1 and int(s.skipped_microbatches) == 1


_K_CHANGED = r"(?s)made with every_k=4; this accumulate uses every_k=8.*with_every_k\(tx, 4\)"


def test_a_state_of_another_k_is_refused_at_trace_time():
    # K is in the state's type (every_k_tag's shape), so jit sees it when it traces.
    params = {"w": jnp.zeros(3)}
    tx4 = accumjax.accumulate(optax.sgd(0.1), 4)
    state4 = tx4.init(params)
    tx8 = accumjax.with_every_k(tx4, 8)
    with pytest.raises(ValueError, match=_K_CHANGED):
        jax.jit(tx8.update)(params, state4, params)  # a jitted loop of your own
    with pytest.raises(ValueError, match=_K_CHANGED):
        tx8.update(params, state4, params)  # eager
    schedule = accumjax.with_every_k(tx4, lambda n: jnp.int32(4))
    with pytest.raises(ValueError, match="every_k=4; this accumulate uses an every_k schedule"):
        jax.jit(schedule.update)(params, state4, params)
    with pytest.raises(ValueError, match="an every_k schedule; this accumulate uses every_k=4"):
        jax.jit(tx4.update)(params, schedule.init(params), params)
    # The K it was made with, and a schedule's state with a schedule, go on.
    _, state4 = jax.jit(accumjax.with_every_k(tx8, 4).update)(params, state4, params)
    _, scheduled = jax.jit(schedule.update)(params, schedule.init(params), params)
    assert int(state4.window.micro_step) == int(scheduled.window.micro_step) == 1


# Orbax's refused restore leaves coroutines it never awaits: collected in the test (gc).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_orbax_checkpoint_of_another_k_is_refused_under_nnx_jit(tmp_path):
    # An nnx.Optimizer saved mid-window at K=4, resumed into accumulate(..., 8).
    ocp = pytest.importorskip("orbax.checkpoint")
    nnx = pytest.importorskip("flax.nnx")

    def make(k):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, accumjax.accumulate(optax.sgd(0.1), k), wrt=nnx.Param)

    @nnx.jit
    def train(model, opt, x):
        opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    model, opt = make(4)
    train(model, opt, jnp.ones((2, 3)))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", nnx.to_pure_dict(nnx.state(opt)))
    model8, opt8 = make(8)
    with ocp.StandardCheckpointer() as checkpointer:
        # Into a target of another K, orbax itself refuses: the tag's shape differs.
        target = nnx.to_pure_dict(nnx.state(opt8))
        with pytest.raises(ValueError, match=r"\(8,\) is not compatible with the stored shape"):
            checkpointer.restore(tmp_path / "ckpt", target)
        gc.collect()
        restored = checkpointer.restore(tmp_path / "ckpt")  # as stored
    state = nnx.state(opt8)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(opt8, state)
    with pytest.raises(ValueError, match=_K_CHANGED):
        train(model8, opt8, jnp.ones((2, 3)))


_GUIDE = r"migrating\.md"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_k_schedule": 4}, r"every_k_schedule=.*MultiSteps.*every_k=k"),
        ({"use_grad_mean": True}, r"use_grad_mean=.*scaling='mean'.*scaling='sum'"),
        (
            {"should_skip_update_fn": optax.skip_not_finite},
            r"should_skip_update_fn=.*on_nonfinite='skip_microbatch'.*skip_fn=fn",
        ),
        (
            {"every_k": K, "skip_fn": optax.skip_not_finite},
            r"skip_fn=optax\.skip_not_finite.*\(updates, gradient_step, params\).*\(grads, params\)"
            r".*leave skip_fn out.*on_nonfinite='skip_microbatch'",
        ),
        (
            {
                "every_k": K,
                "skip_fn": functools.partial(optax.skip_large_updates, max_squared_norm=1.0),
            },
            r"skip_fn=optax\.skip_large_updates.*optax\.tree\.norm\(grads\) \*\* 2 > max_squared",
        ),
    ],
    ids=["every_k_schedule", "use_grad_mean", "should_skip_update_fn", "skip_not_finite", "large"],
)
def test_multisteps_arguments_name_their_replacement(kwargs, match):
    with pytest.raises(TypeError, match=rf"(?s){match}.*{_GUIDE}"):
        accumjax.accumulate(optax.sgd(0.1), **kwargs)


def test_multisteps_attributes_name_their_replacement():
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    for name, match in [
        ("has_updated", r"accumjax\.has_updated\(state\)"),
        ("gradient_step", r"state\.update_count"),
        ("mini_step", r"state\.window\.micro_step"),
        ("inner_opt_state", r"state\.inner_tx_state"),
        ("acc_grads", r"accumjax\.accumulated_gradients\(state\)"),
        ("gradient_transformation", r"GradientTransformationExtraArgs already"),
    ]:
        with pytest.raises(AttributeError, match=rf"no {name} \(optax\.MultiSteps'.*{match}"):
            getattr(tx, name)
    assert not hasattr(tx, "no_such_name")
    # Still optax's own type, wherever optax takes a transformation.
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert optax.with_extra_args_support(tx) is tx
    params = {"w": jnp.ones(2)}
    for chained in (optax.chain(tx, optax.scale(2.0)), optax.chain(optax.scale(2.0), tx)):
        state = chained.init(params)
        for _ in range(K):
            updates, state = chained.update(params, state, params)
        np.testing.assert_array_equal(updates["w"], np.float32([-0.2, -0.2]))  # sgd(0.1) of 2
