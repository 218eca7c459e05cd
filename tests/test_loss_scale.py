"""Tests for accumjax.loss_scale: exact scale sequences, scaling round trips, validation, and
the once-per-window rule of `update_loss_scale` against the float16 train step's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import accumjax

# initial=8, period=3, factor=2, min=2. Worked by hand from the rule: a finite step
# counts; the 3rd consecutive one doubles the scale and restarts the count; an
# overflow halves the scale (floored at 2) and restarts the count.
FLAGS = [True, True, True, True, False, False, False, False, True, True, True]
SCALES = [8, 8, 16, 16, 8, 4, 2, 2, 2, 2, 4]
COUNTERS = [1, 2, 0, 1, 0, 0, 0, 0, 1, 2, 0]


def test_constructor_values_and_dtypes():
    ls = accumjax.dynamic_loss_scale(initial=1024.0, period=7, factor=3.0, min_loss_scale=0.5)
    assert isinstance(ls, accumjax.DynamicLossScale)
    assert [float(ls.loss_scale), int(ls.counter), int(ls.period)] == [1024.0, 0, 7]
    assert [float(ls.factor), float(ls.min_loss_scale)] == [3.0, 0.5]
    assert [x.dtype for x in ls] == [jnp.float32, jnp.int32, jnp.int32, jnp.float32, jnp.float32]
    assert all(x.shape == () for x in ls)
    defaults = accumjax.dynamic_loss_scale()
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
        accumjax.dynamic_loss_scale(**kwargs)


def test_adjust_exact_sequence_eager():
    ls = accumjax.dynamic_loss_scale(initial=8.0, period=3, factor=2.0, min_loss_scale=2.0)
    scales, counters = [], []
    for flag in FLAGS:
        ls = accumjax.adjust_loss_scale(ls, flag)
        scales.append(float(ls.loss_scale))
        counters.append(int(ls.counter))
    assert scales == SCALES
    assert counters == COUNTERS
    assert int(ls.period) == 3 and float(ls.factor) == 2.0  # constants untouched


def test_adjust_exact_sequence_under_jit_scan():
    ls = accumjax.dynamic_loss_scale(initial=8.0, period=3, factor=2.0, min_loss_scale=2.0)

    def body(ls, flag):
        ls = accumjax.adjust_loss_scale(ls, flag)
        return ls, (ls.loss_scale, ls.counter)

    final, (scales, counters) = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(
        ls, jnp.asarray(FLAGS)
    )
    np.testing.assert_array_equal(scales, np.asarray(SCALES, np.float32))
    np.testing.assert_array_equal(counters, np.asarray(COUNTERS, np.int32))
    assert jax.tree.structure(final) == jax.tree.structure(ls)
    assert [x.dtype for x in final] == [x.dtype for x in ls]


def test_adjust_non_power_of_two_factor_and_floor():
    ls = accumjax.dynamic_loss_scale(initial=9.0, period=1, factor=3.0, min_loss_scale=2.0)
    ls = accumjax.adjust_loss_scale(ls, jnp.asarray(False))
    assert float(ls.loss_scale) == 3.0
    ls = accumjax.adjust_loss_scale(ls, jnp.asarray(False))
    assert float(ls.loss_scale) == 2.0  # 3 / 3 = 1 is below the floor
    ls = accumjax.adjust_loss_scale(ls, jnp.asarray(True))  # period 1: grows on every finite step
    assert float(ls.loss_scale) == 6.0 and int(ls.counter) == 0


def test_adjust_never_grows_to_inf():
    big = float(np.finfo(np.float32).max) / 1.5
    ls = accumjax.dynamic_loss_scale(initial=big, period=1, factor=2.0)
    ls = accumjax.adjust_loss_scale(ls, True)
    assert float(ls.loss_scale) == np.float32(big)  # 2 * big overflows float32: kept


def test_scale_loss_keeps_dtype():
    ls = accumjax.dynamic_loss_scale(initial=4.0)
    out = accumjax.scale_loss(ls, jnp.float32(0.75))
    assert out.dtype == jnp.float32 and float(out) == 3.0
    out16 = accumjax.scale_loss(ls, jnp.float16(0.75))
    assert out16.dtype == jnp.float16 and float(out16) == 3.0


def test_unscale_grads_casts_to_float32_and_keeps_ints():
    ls = accumjax.dynamic_loss_scale(initial=8.0)
    grads = {"a": jnp.asarray([8.0, -16.0], jnp.float16), "b": jnp.asarray(4.0, jnp.bfloat16)}
    grads["i"] = jnp.asarray([3], jnp.int32)
    out = accumjax.unscale_grads(ls, grads)
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
    ls = accumjax.dynamic_loss_scale(initial=2.0**15)
    g = accumjax.unscale_grads(ls, jax.grad(lambda x: accumjax.scale_loss(ls, loss(x)))(x))
    # float16 keeps ~3 significant digits at this magnitude (plus the rounding of 1e-4).
    np.testing.assert_allclose(float(g), 1e-8, rtol=5e-3)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_all_finite_detects_nonfinite(bad):
    tree = {"a": jnp.ones((2, 2)), "b": [jnp.zeros(3), jnp.asarray([1.0, bad])]}
    assert bool(accumjax.all_finite(tree)) is False
    tree["b"][1] = jnp.asarray([1.0, 2.0])
    assert bool(accumjax.all_finite(tree)) is True
    assert bool(jax.jit(accumjax.all_finite)(tree)) is True


def test_all_finite_ignores_non_float_and_empty():
    assert bool(accumjax.all_finite({})) is True
    assert bool(accumjax.all_finite({"i": jnp.asarray([1, 2]), "f": jnp.float16(1.0)})) is True
    assert bool(accumjax.all_finite({"f": jnp.asarray(jnp.inf, jnp.bfloat16)})) is False


def test_loss_scale_is_a_pytree_under_jit():
    ls = accumjax.dynamic_loss_scale(initial=4.0, period=2)
    out = jax.jit(lambda ls: accumjax.adjust_loss_scale(ls, False))(ls)
    assert isinstance(out, accumjax.DynamicLossScale)
    assert len(jax.tree.leaves(ls)) == 5
    assert float(out.loss_scale) == 2.0


def test_public_export():
    assert accumjax.dynamic_loss_scale is accumjax.loss_scale.dynamic_loss_scale
    assert accumjax.update_loss_scale is accumjax.loss_scale.update_loss_scale


# ----------------------------------------------------------------------------- update_loss_scale

INF = float("inf")


def _run_windows(tx, grads, ls):
    """``tx.update`` on each scalar gradient, then `update_loss_scale`, in one jitted call
    each: the scale, its counter, ``stats(...).num_nonfinite`` and ``nonfinite_count`` after
    every call."""
    params = {"w": jnp.zeros(2)}

    @jax.jit
    def call(opt_state, ls, g):
        _, new_opt_state = tx.update({"w": jnp.full(2, g)}, opt_state, params)
        return new_opt_state, accumjax.update_loss_scale(ls, opt_state, new_opt_state)

    opt_state, rows = tx.init(params), []
    for g in grads:
        opt_state, ls = call(opt_state, ls, g)
        seen = accumjax.stats(opt_state).num_nonfinite
        rows.append(
            (float(ls.loss_scale), int(ls.counter), int(seen), int(opt_state.nonfinite_count))
        )
    return [list(column) for column in zip(*rows, strict=True)]


@pytest.mark.parametrize("on_nonfinite", ["skip_microbatch", "skip_window"])
def test_update_loss_scale_changes_the_scale_only_when_a_window_closes(on_nonfinite):
    # K=3, initial 2**15, period 2, by hand: window 1 overflows at its closing call, window 2
    # at its first call; each halves the scale at its end, not before. Windows 3 and 4 are
    # finite: each counts once (at its end), and the second in a row doubles the scale.
    tx = accumjax.accumulate(optax.sgd(0.1), 3, on_nonfinite=on_nonfinite)
    grads = [1.0, 1.0, INF, INF, 1.0, 1.0] + [1.0] * 6
    scales, counters, seen, closed = _run_windows(
        tx, grads, accumjax.dynamic_loss_scale(2.0**15, 2)
    )
    assert scales == [2.0**15] * 2 + [2.0**14] * 3 + [2.0**13] * 6 + [2.0**14]
    assert counters == [0] * 8 + [1, 1, 1, 0]
    # stats counts an overflow at the call that met it; nonfinite_count at its window's end.
    assert seen == [0, 0, 1, 2, 2, 2] + [2] * 6
    assert closed == [0, 0, 1, 1, 1, 2] + [2] * 6


@pytest.mark.parametrize(
    ("every_k", "grads", "scales", "counters"),
    [
        # every call closes a window: the per-step rule of adjust_loss_scale
        (1, [INF, 1.0, 1.0, INF], [2.0**14, 2.0**14, 2.0**15, 2.0**14], [0, 1, 0, 0]),
        # K from a schedule: 1 until the first applied update, then 2
        (
            lambda n: jnp.where(n < 1, 1, 2),
            [1.0, 1.0, INF, 1.0],
            [2.0**15] * 2 + [2.0**14] * 2,
            [1, 1, 0, 0],
        ),
    ],
    ids=["k1", "schedule"],
)
def test_update_loss_scale_follows_the_state_k(every_k, grads, scales, counters):
    tx = accumjax.accumulate(optax.sgd(0.1), every_k)
    got_scales, got_counters, _, _ = _run_windows(
        tx, grads, accumjax.dynamic_loss_scale(2.0**15, 2)
    )
    assert (got_scales, got_counters) == (scales, counters)


def test_update_loss_scale_names_an_argument_that_is_not_accumulates_state():
    plain = optax.sgd(0.1).init({"w": jnp.zeros(2)})
    ours = accumjax.accumulate(optax.sgd(0.1), 2).init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"opt_state is a tuple, not the state of accumjax"):
        accumjax.update_loss_scale(accumjax.dynamic_loss_scale(), plain, ours)
    with pytest.raises(TypeError, match=r"new_opt_state is a DynamicLossScale"):
        accumjax.update_loss_scale(
            accumjax.dynamic_loss_scale(), ours, accumjax.dynamic_loss_scale()
        )


# The float16 train step and a hand loop with update_loss_scale, on the same microbatches:
# K=2, three windows, microbatch 0 overflows float16 in its forward pass at any scale (inputs
# of 1e4: squared residuals ~1e8 > 65504). By hand (initial 2**10, period 2): window 1 halves
# the scale at its end, windows 2 and 3 are finite and the second doubles it.
HAND_K, HAND_ROWS = 2, 4
HAND_SCALES = [2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**9, 2.0**10]


def _hand_loss(params, batch):  # integer ``ids`` index a bias: the cast leaves them alone
    pred = batch["x"] @ params["w"] + params["b"][batch["ids"]]
    return jnp.mean((pred - batch["y"]) ** 2)


def _hand_microbatches():
    rng = np.random.default_rng(0)
    n = 3 * HAND_K * HAND_ROWS
    x = rng.normal(size=(n, 3)).astype(np.float32)
    x[:HAND_ROWS] = 1e4
    ids = rng.integers(0, 3, size=n).astype(np.int32)
    y = rng.normal(size=n).astype(np.float32)
    rows = [slice(i, i + HAND_ROWS) for i in range(0, n, HAND_ROWS)]
    return [{"x": x[r], "ids": ids[r], "y": y[r]} for r in rows]


def _to_float16(tree):
    def cast(a):
        return a.astype(jnp.float16) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(cast, tree)


def _hand_loop(tx, params, ls, microbatches):
    """The mixed precision guide's own float16 step; the parameters and scale after each call."""

    @jax.jit
    def step(params, opt_state, ls, batch):
        def scaled_loss(p):
            loss = _hand_loss(_to_float16(p), batch).astype(jnp.float32)  # the batch as given
            return accumjax.scale_loss(ls, loss)

        grads = accumjax.unscale_grads(ls, jax.grad(scaled_loss)(params))
        updates, new_opt_state = tx.update(grads, opt_state, params)
        ls = accumjax.update_loss_scale(ls, opt_state, new_opt_state)
        return optax.apply_updates(params, updates), new_opt_state, ls

    opt_state, out = tx.init(params), []
    for batch in microbatches:
        params, opt_state, ls = step(params, opt_state, ls, batch)
        out.append((params, float(ls.loss_scale)))
    return out, opt_state


def _float64_sgd(lr, params, windows):
    """Plain SGD in float64 on each window's mean gradient over the microbatches it used;
    ``None`` microbatches are left out (as ``"skip_microbatch"`` with ``"mean"``)."""
    w, b = (np.asarray(params[k], np.float64) for k in ("w", "b"))
    for window in windows:
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        used = [m for m in window if m is not None]
        for mb in used:
            x, ids, y = np.asarray(mb["x"], np.float64), mb["ids"], np.asarray(mb["y"], np.float64)
            r = 2 * (x @ w + b[ids] - y) / len(y)
            gw, gb = gw + x.T @ r, gb + np.bincount(ids, r, minlength=len(b))
        w, b = w - lr * gw / len(used), b - lr * gb / len(used)
    return {"b": b, "w": w}


def test_update_loss_scale_is_the_float16_train_steps_rule():
    # SGD with a power-of-two rate: its update (lr * g) rounds no bit, so the hand loop's
    # apply_updates and the step's fused one agree to the bit (Adam's can differ by an ulp).
    tx = accumjax.accumulate(optax.sgd(2.0**-3), HAND_K)
    params = {"w": jnp.asarray([0.5, -0.25, 1.0]), "b": jnp.asarray([0.1, 0.2, 0.3])}
    ls = accumjax.dynamic_loss_scale(2.0**10, period=2)
    micro = _hand_microbatches()
    hand, opt_state = _hand_loop(tx, params, ls, micro)
    assert [scale for _, scale in hand] == HAND_SCALES
    stats = accumjax.stats(opt_state)
    assert (int(stats.num_nonfinite), int(stats.total_cycles), int(stats.skipped_windows)) == (
        1,
        3,
        0,
    )

    stream = accumjax.make_train_step(_hand_loss, mixed_precision="float16", donate=False)
    state = stream.init(params, tx, loss_scale=ls)
    for batch, (hand_params, scale) in zip(micro, hand, strict=True):
        state, metrics = stream(state, batch)
        assert float(metrics["loss_scale"]) == scale
        jax.tree.map(np.testing.assert_array_equal, state.params, hand_params)

    scan = accumjax.make_train_step(_hand_loss, mode="scan", mixed_precision="float16")
    state = scan.init(params, tx, loss_scale=ls)
    for w in range(3):
        window = micro[HAND_K * w : HAND_K * (w + 1)]
        # scan mode's microbatch i is rows i, i + K, ... of the batch: interleave them
        batch = jax.tree.map(lambda *m: np.stack(m, 1).reshape(-1, *m[0].shape[1:]), *window)
        state, metrics = scan(state, batch)
        hand_params, scale = hand[HAND_K * w + HAND_K - 1]
        assert float(metrics["loss_scale"]) == scale
        jax.tree.map(np.testing.assert_array_equal, state.params, hand_params)

    # Against float64 SGD on the microbatches kept (the overflowed one left out). The forward
    # and backward passes see float16 parameters: 1e-3 is two float16 spacings at
    # these O(0.5) parameters (measured 1.1e-4; a window dropped or divided wrongly: ~0.1).
    kept = [None, *micro[1:]]
    ref = _float64_sgd(2.0**-3, params, [kept[i : i + HAND_K] for i in range(0, 6, HAND_K)])
    jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=0, atol=1e-3), hand[-1][0], ref)
