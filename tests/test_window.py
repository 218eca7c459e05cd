"""The one accumulation window: the same policies in every mode, and nothing is ever poisoned.

References: the state before the window (bit for bit), a float64 full-batch computation, each
policy's window computed by hand in float64 NumPy (tests/_reference.py), flax's BatchNorm in
float64, and optax.MultiSteps for differentiation through the optimizer.
"""

import functools

import _reference as reference
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import accumjax
import accumjax._window as window
from accumjax import TrainState, accumulate, make_train_step

K = 4
ROWS = 8  # per microbatch


def _data(seed=0, rows=K * ROWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = rng.normal(size=(rows, 3)).astype(np.float32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def _microbatches(batch):
    """The K strided microbatches of ``batch`` (microbatch i holds rows i, i + K, ...), sliced
    in numpy: eagerly, each slice would be compiled on its own."""
    host = jax.tree.map(np.asarray, batch)
    return [jax.tree.map(lambda a, i=i: jnp.asarray(a[i::K]), host) for i in range(K)]


def _all_finite(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


class _Net(nn.Module):
    """Dense -> AccumBatchNorm: parameters and model state, and no more (every step of the
    policies' tests compiles it; a layer more costs about a third more compile time)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(3, use_bias=False)(x)
        return accumjax.AccumBatchNorm(use_running_average=False, momentum=0.8)(x)


_MODEL = _Net()


def _bn_loss(params, model_state, batch):
    pred, new = _MODEL.apply({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2), new


@functools.cache
def _step(loss=_bn_loss, **kwargs):
    """``make_train_step(loss, **kwargs)``, made once per module: the tests that use the same
    step share its compiled program."""
    return make_train_step(loss, **kwargs)


@functools.cache
def _bn_variables():
    """`_MODEL`'s variables, made once for the module (one program, not each op of the init
    compiled on its own) and kept in numpy: every state gets fresh buffers, which a donating
    step may consume. An "rbg" key: its kernel draws compile faster than threefry's."""
    init = jax.jit(_MODEL.init)(jax.random.key(0, impl="rbg"), np.ones((2, 5), np.float32))
    return jax.tree.map(np.asarray, init)


def _bn_state(step, tx, precision):
    """The step's state for `_MODEL`, with a loss scale for a float16 ``step``."""
    variables = jax.tree.map(jnp.asarray, _bn_variables())
    f16 = precision == "float16"
    return step.init(
        variables["params"],
        tx,
        model_state={"batch_stats": variables["batch_stats"]},
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**8) if f16 else None,
    )


def _nan_rows(batch, rows):
    x = np.array(batch["x"])
    x[rows] = np.nan
    return {**batch, "x": jnp.asarray(x)}


def _equal(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


# float16 (loss scaling, overflow as non-finite) and full precision; bfloat16 takes the
# full-precision path with a cast, which test_train_step.py covers.
PRECISIONS = [None, "float16"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("policy", ["skip_microbatch", "skip_window"])
def test_stream_nan_microbatch_changes_nothing_and_is_counted(policy, precision):
    step = _step(mixed_precision=precision, donate=False)
    state = _bn_state(step, accumulate(optax.adam(1e-2), K, on_nonfinite=policy), precision)
    micro = _microbatches(_data())
    state, _ = step(state, micro[0])
    before = state
    after, metrics = step(state, _nan_rows(micro[1], slice(0, 1)))
    # Bit for bit: params, the optimizer's inner state and window sum, the model state.
    _equal(after.params, before.params)
    _equal(after.opt_state.inner_tx_state, before.opt_state.inner_tx_state)
    _equal(after.opt_state.window.partial_sums, before.opt_state.window.partial_sums)
    _equal(after.model_state, before.model_state)
    assert int(after.opt_state.window.window_nonfinite) == 1
    for mb in micro[2:]:
        after, metrics = step(after, mb)
    s = accumjax.stats(after.opt_state)
    assert int(s.num_nonfinite) == 1 and int(s.skipped_microbatches) == 1
    assert _all_finite(after.params) and _all_finite(after.model_state)
    if policy == "skip_window":  # nothing applied: as before the window
        assert not bool(metrics["updated"]) and int(after.step) == 0
        assert int(s.skipped_windows) == 1
        _equal(after.params, before.params)
        _equal(after.opt_state.inner_tx_state, before.opt_state.inner_tx_state)
        stats = after.model_state["batch_stats"]["AccumBatchNorm_0"]
        _equal(stats["mean"], before.model_state["batch_stats"]["AccumBatchNorm_0"]["mean"])
        assert float(np.sum(stats["acc_count"])) == 0.0  # window reset
    else:
        assert bool(metrics["updated"]) and int(after.step) == 1


def _bn_reference(batch, added):
    """A scan window of `_MODEL` over the microbatches ``added`` of ``batch`` with the
    default ``scaling="mean"`` and SGD (0.1, momentum 0.9: its first step is -0.1 g), in
    float64: flax's own BatchNorm normalizes each microbatch by its statistics, and the running
    statistics move once (momentum 0.8) by the pooled statistics of the added rows (NumPy).
    Returns the parameters and the running ``(mean, var)``."""
    variables = _bn_variables()
    micro = [jax.tree.map(lambda a: np.asarray(a, np.float64), mb) for mb in _microbatches(batch)]
    micro = [micro[i] for i in added]
    flax_bn = nn.BatchNorm(use_running_average=False, epsilon=1e-5)
    stats = {"mean": np.zeros(3), "var": np.ones(3)}

    def loss(params, mb):
        h = mb["x"] @ params["Dense_0"]["kernel"]
        out, _ = flax_bn.apply(
            {"params": params["AccumBatchNorm_0"], "batch_stats": stats},
            h,
            mutable=["batch_stats"],
        )
        return jnp.mean((out - mb["y"]) ** 2)

    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
        grad = jax.jit(jax.grad(loss))  # one program for the microbatches
        grads = [jax.tree.map(np.asarray, grad(params, mb)) for mb in micro]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean)
    kernel = np.asarray(variables["params"]["Dense_0"]["kernel"], np.float64)
    h = np.concatenate([mb["x"] for mb in micro]) @ kernel
    running = variables["batch_stats"]["AccumBatchNorm_0"]
    move = lambda old, new: 0.8 * np.asarray(old, np.float64) + 0.2 * new
    return params, (move(running["mean"], h.mean(0)), move(running["var"], h.var(0)))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("policy", ["skip_microbatch", "skip_window"])
def test_scan_nan_microbatch(policy, precision):
    tx = accumulate(optax.sgd(0.1, momentum=0.9), K, on_nonfinite=policy)
    step = _step(mode="scan", mixed_precision=precision, donate=False)
    state = _bn_state(step, tx, precision)
    batch = _data()
    after, metrics = step(state, _nan_rows(batch, slice(1, 2)))  # row 1: microbatch 1
    s = accumjax.stats(after.opt_state)
    assert int(s.num_nonfinite) == 1 and int(s.skipped_microbatches) == 1
    for tree in (after.params, after.model_state, after.opt_state):
        assert _all_finite(tree)
    if policy == "skip_window":
        assert not bool(metrics["updated"]) and int(after.step) == 0
        _equal(after.params, state.params)
        _equal(after.opt_state.inner_tx_state, state.opt_state.inner_tx_state)
        _equal(after.model_state, state.model_state)
        return
    # The NaN microbatch is simply absent: the float64 reference over the other three.
    assert bool(metrics["updated"])
    params, (mean, var) = _bn_reference(batch, added=(0, 2, 3))
    # float32: sums of 8 rows' products, a normalization and K terms, ~1e-6 of the values'
    # scale (measured: 1e-7); float16 runs the model in float16 (2**-11 relative per
    # operation; measured: 3e-4): 2e-3.
    tol = 1e-6 if precision is None else 2e-3
    close = lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float64), b, rtol=tol, atol=tol * np.max(np.abs(b))
    )
    jax.tree.map(close, after.params, params)
    running = after.model_state["batch_stats"]["AccumBatchNorm_0"]
    close(running["mean"], mean)
    close(running["var"], var)


def test_overflowing_sum_of_finite_microbatches_skips_the_window():
    big = jnp.asarray([60000.0], jnp.float16)  # finite; two of them overflow float16
    tx = accumulate(optax.sgd(1.0), 2, scaling="sum", accumulator_dtype=None)
    params = {"a": jnp.zeros(1, jnp.float16)}
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of the update compiled
    for _ in range(2):
        updates, state = update({"a": big}, state, params)
    assert not bool(accumjax.has_updated(state)) and int(state.skipped_windows) == 1
    assert int(state.nonfinite_count) == 0  # no microbatch was bad; the sum was
    assert float(optax.apply_updates(params, updates)["a"][0]) == 0.0


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def test_scan_zero_weights_never_apply_and_negative_weights_are_skipped():
    params = {"w": jnp.ones((5, 3))}
    batch = _data()
    tx = accumulate(optax.sgd(0.1), K, scaling="weighted")
    step = make_train_step(_loss, mode="scan", weight_fn=lambda b: 0.0, donate=False)
    state = step.init(params, tx)
    after, metrics = step(state, batch)  # a fully padded batch
    assert not bool(metrics["updated"])
    _equal(after.params, params)
    assert int(after.opt_state.skipped_windows) == 1
    weights = iter([1.0, -1.0, 1.0, 1.0])
    w = np.asarray([next(weights) for _ in range(K)], np.float32)
    batch = {**batch, "w": jnp.asarray(np.tile(w, ROWS))}  # strided: microbatch i has weight w[i]
    step = make_train_step(_loss, mode="scan", weight_fn=lambda b: b["w"][0], donate=False)
    after, metrics = step(state, batch)
    assert bool(metrics["updated"]) and int(after.opt_state.nonfinite_count) == 1


def test_float64_stays_float64_end_to_end():
    with jax.enable_x64(True):
        batch = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), _data())
        params = {"w": jnp.asarray(np.ones((5, 3)))}
        grad = jax.jit(jax.grad(_loss))(params, batch)  # one program, not op by op
        ref = {"w": np.asarray(params["w"]) - 0.1 * np.asarray(grad["w"])}  # numpy float64
        for mode in ("scan", "stream"):
            tx = accumulate(optax.sgd(0.1), K)
            step = make_train_step(_loss, mode=mode, donate=False)
            state = step.init(params, tx)
            calls = [batch] if mode == "scan" else _microbatches(batch)
            if mode == "scan":  # the accumulator lives inside the step: read its program
                program = step.lower(state, batch).as_text()
                assert "tensor<5x3xf64>" in program and "tensor<5x3xf32>" not in program
            for b in calls:
                state, _ = step(state, b)
            assert state.params["w"].dtype == jnp.float64
            if mode == "stream":
                assert state.opt_state.window.partial_sums["w"].dtype == jnp.float64
            else:
                assert state.opt_state.window.grad_sum is None  # a scan-mode state holds none
            # float64 sums in another order: 1e-15 relative, far below float32's 1e-7.
            np.testing.assert_allclose(state.params["w"], ref["w"], rtol=1e-13, atol=1e-14)


def test_complex_parameters_stay_complex():
    params = {"z": jnp.ones(3, jnp.complex64)}
    tx = accumulate(optax.sgd(0.1), 2)
    loss = lambda p, b: jnp.sum(jnp.abs(p["z"] - b) ** 2)
    step = make_train_step(loss, donate=False)
    state = step.init(params, tx)
    for _ in range(2):
        state, metrics = step(state, jnp.asarray(np.full(3, 1j, np.complex64)))
    assert state.params["z"].dtype == jnp.complex64 and bool(metrics["updated"])
    assert abs(np.imag(np.asarray(state.params["z"])[0])) > 0.0


def test_step_counts_updates_whichever_way_the_state_advances():
    tx = accumulate(optax.sgd(0.1), K)
    state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)
    apply_gradients = jax.jit(lambda s, g: s.apply_gradients(grads=g))  # one program
    for _ in range(2 * K + 1):
        state = apply_gradients(state, {"w": jnp.ones(2)})
    assert int(state.step) == 2


def test_field_names_do_not_collide_with_optax_wrappers():
    inner = optax.chain(
        optax.apply_if_finite(optax.inject_hyperparams(optax.adam)(1e-3), 3),
        optax.masked(optax.sgd(0.1), {"w": True}),
    )
    state = accumulate(inner, K).init({"w": jnp.zeros(2)})
    for name in accumjax.AccumulationState._fields + window.Window._fields:
        optax.tree_utils.tree_get(state, name)  # raises on 0 or 2+ matches


def test_grad_through_update_matches_multisteps():
    params = {"w": jnp.ones(3)}

    def meta(lr, make):
        tx = make(lr)
        state = tx.init(params)
        p = params
        for i in range(2):
            updates, state = tx.update({"w": (i + 1.0) * p["w"]}, state, p)
            p = optax.apply_updates(p, updates)
        return jnp.sum(p["w"] ** 2)

    # Jitted: one program each, not every op of two updates compiled on its own.
    grad = jax.jit(jax.grad(meta), static_argnums=1)
    ours = grad(0.1, lambda lr: accumulate(optax.sgd(lr), 2))
    theirs = grad(0.1, lambda lr: optax.MultiSteps(optax.sgd(lr), 2))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert abs(float(ours)) > 0.1


def test_a_window_end_is_a_loop_on_cpu_and_a_conditional_on_cuda():
    # On an H200 a while loop's data-dependent predicate cost a host round trip per step: the
    # scan step with on_nonfinite="propagate" took 1.43-2.55x optax.microbatch's time with
    # the window's end as a loop and 1.04-1.35x as a conditional. XLA:CPU updates the loop's
    # carry in place, where its conditional copied the train step's state (a stream call 17%
    # slower). Lowered for CUDA on this CPU machine with jax.export: no GPU is needed to read
    # the module. An Adam update has no loop of its own.
    from jax import export

    tx = accumulate(optax.adam(1e-2), K)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    args = jax.eval_shape(lambda: (params, tx.init(params), params))
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for platform, loop in (("cpu", True), ("cuda", False)):
        module = export.export(update, platforms=[platform])(*args).mlir_module()
        assert ("stablehlo.while" in module) == loop, platform
        if not loop:  # the window's end is a conditional
            assert "stablehlo.case" in module or "stablehlo.if" in module


def test_skip_fn_skips_and_counts():
    tx = accumulate(optax.sgd(1.0), 2, skip_fn=lambda g, p: optax.tree.norm(g) > 10.0)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of the update compiled
    _, state = update({"a": jnp.array([100.0, 0.0])}, state, params)
    updates, state = update({"a": jnp.array([2.0, 2.0])}, state, params)
    np.testing.assert_allclose(updates["a"], [-2.0, -2.0])  # the mean of the one added
    assert int(state.skipped_microbatches) == 1 and int(state.nonfinite_count) == 0


# Each policy in a loop of your own (accumulate's update, microbatch by microbatch) against the
# float64 reference of tests/_reference.py: microbatch 1's gradient has a NaN (the non-finite
# policies; "propagate" makes that one entry of the window gradient NaN and the rest is
# checked) and the largest norm; microbatch 2 weighs nothing ("weighted").
_OWN_LOOP = reference.policies(max_norm=2.0, skip_norm=4.0)
# float32 against float64: the window's sums of K terms and one division, each rounded to
# 2**-24 relative: 1e-6 of the values' scale is a margin of about 10 (measured: 1e-7).
_FLOAT32 = 1e-6


@pytest.mark.parametrize("policy", list(_OWN_LOOP))
def test_an_own_loop_window_matches_the_float64_reference(policy):
    rng = np.random.default_rng(0)
    grads = [
        {"w": rng.normal(size=(3, 2)) * s, "b": rng.normal(size=2) * s}
        for s in (1.0, 3.0, 0.5, 1.5)
    ]
    grads = [jax.tree.map(lambda a: a.astype(np.float32), g) for g in grads]
    if policy not in ("max_norm", "skip_fn"):
        grads[1]["w"][0, 0] = np.nan
    weights = [2.0, 1.0, 0.0, 3.5]
    kwargs = _OWN_LOOP[policy]
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "skip_fn"}
    if policy == "skip_fn":
        ref_kwargs["skip_norm"] = 4.0
    expected = reference.window_of(grads, weights=weights, **ref_kwargs)
    if policy in ("max_norm", "skip_fn"):  # some microbatches clipped (skipped), some not
        norms = [reference.global_norm(g) for g in grads]
        assert min(norms) < 2.0 and max(norms) > 4.0
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    tx = accumulate(optax.sgd(1.0), K, **kwargs)
    state = tx.init(params)
    update = jax.jit(tx.update)  # one program, not each op of the update compiled
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        extra = {"weight": jnp.float32(w)} if policy == "weighted" else {}
        updates, state = update(g, state, params, **extra)
        if i < K - 1:  # no update before the window's end
            _equal(updates, jax.tree.map(jnp.zeros_like, params))
    s = accumjax.stats(state)
    counts = {k: int(getattr(s, k)) for k in expected.counts}
    assert counts == expected.counts, (counts, expected.counts)
    for key in params:
        want = np.zeros(params[key].shape)
        if expected.gradient is not None:
            want = -expected.gradient[key]
        scale = np.nanmax(np.abs(want)) if expected.gradient is not None else 0.0
        np.testing.assert_allclose(updates[key], want, rtol=_FLOAT32, atol=_FLOAT32 * scale)
    if expected.gradient is not None:  # the norm the optimizer saw, when it saw one
        np.testing.assert_allclose(s.max_grad_norm, expected.grad_norm, rtol=_FLOAT32)


@pytest.mark.parametrize("way", ["scan", "stream", "own loop", "own loop, pmap"])
def test_a_window_that_skips_a_microbatch_applies_the_mean_of_the_others(way):
    """SGD, K=4, microbatch 1 of 4 has a NaN target: the default policy leaves it out and the
    step is the float64 mean of the other three microbatches' gradients (not their sum over
    K: a 3/4-size step), in both modes of the train step and in a loop of your own (on one
    device, and under pmap on 2 devices, each with half of every microbatch's rows: the NaN
    is on device 0's); the metrics and counts say one microbatch was left out."""
    lr = 0.5
    params, batch = reference.problem(K * ROWS, seed=2)
    batch["y"][1, 0] = np.nan  # row 1: microbatch 1
    micro = reference.microbatches(batch, K)
    used = [reference.value_and_grad(params, mb)[1] for i, mb in enumerate(micro) if i != 1]
    want = {k: np.float64(params[k]) - lr * sum(g[k] for g in used) / 3 for k in params}
    tx = accumulate(optax.sgd(lr), K)
    if way == "own loop":
        state = tx.init(params)
        update, grad = jax.jit(tx.update), jax.jit(jax.grad(reference.loss))
        for mb in micro:
            updates, state = update(grad(params, mb), state, params)
        got = optax.apply_updates(params, updates)
        counts = [(int(state.skipped_microbatches), int(state.nonfinite_count))]
    elif way == "own loop, pmap":
        tx = accumulate(optax.sgd(lr), K, axis_name="d")
        devices = jax.devices()[:2]

        @functools.partial(jax.pmap, axis_name="d", devices=devices)
        def step(params, state, mb):
            updates, state = tx.update(jax.grad(reference.loss)(params, mb), state, params)
            return optax.apply_updates(params, updates), state

        got = jax.tree.map(lambda p: np.stack([p] * 2), params)
        state = jax.pmap(tx.init, devices=devices)(got)
        for mb in micro:  # device d holds rows 4d to 4d + 3 of each microbatch
            got, state = step(
                got, state, jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), mb)
            )
        assert int(state.update_count[1]) == 1
        got = jax.tree.map(lambda p: p[1], got)  # device 1: its own rows were all finite
        counts = [(int(state.skipped_microbatches[1]), int(state.nonfinite_count[1]))]
    else:
        step = make_train_step(reference.loss, mode=way, donate=False)
        state = step.init(params, tx)
        counts = []
        for call in [batch] if way == "scan" else micro:
            state, metrics = step(state, jax.tree.map(jnp.asarray, call))
            counts.append(
                (int(metrics["skipped_microbatches"]), int(metrics["nonfinite_microbatches"]))
            )
        got = state.params
        assert bool(metrics["updated"]) and int(state.step) == 1
    assert counts == ([(1, 1)] if way != "stream" else [(0, 0), (1, 1), (0, 0), (0, 0)])
    # float32 against float64: sums of 8 rows' products and of 3 microbatches, one division
    # and the SGD step, each rounded to 2**-24 relative: 1e-6 of the values' scale (measured:
    # 1e-7). A division by K instead of 3 moves the parameters by a quarter of the step.
    for key in params:
        scale = np.max(np.abs(want[key]))
        np.testing.assert_allclose(got[key], want[key], rtol=_FLOAT32, atol=_FLOAT32 * scale)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_norm": "1"}, TypeError, "max_norm"),
        ({"max_norm": True}, TypeError, "max_norm"),
        ({"max_norm": float("nan")}, ValueError, "max_norm"),
        ({"skip_fn": 3}, TypeError, "skip_fn"),
    ],
)
def test_bad_policy_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        accumulate(optax.sgd(1.0), 2, **kwargs)


def test_plain_optax_state_is_refused_by_update():
    tx = accumulate(optax.sgd(1.0), 2)
    with pytest.raises(TypeError, match="AccumulationState"):
        tx.update({"a": jnp.ones(1)}, optax.sgd(1.0).init({"a": jnp.ones(1)}))


def test_counters_saturate():
    top = jnp.iinfo(jnp.int32).max
    assert int(window.saturating_add(jnp.int32(top - 1), jnp.int32(5))) == top
    assert int(window.saturating_add(jnp.int32(3), jnp.int32(4))) == 7


def test_shard_map_nan_on_one_device_keeps_replicas_identical():
    assert jax.device_count() >= 8
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params = {"w": jnp.ones((5, 3))}
    batch = _data(rows=8 * K * 2)
    tx = accumulate(optax.adam(0.1), K)
    step = make_train_step(_loss, mode="scan", axis_name="data", mesh=mesh, donate=False)
    state = step.init(params, tx)
    after, metrics = step(state, _nan_rows(batch, slice(len(batch["x"]) - 1, None)))
    assert bool(metrics["updated"])
    s = after.opt_state
    for leaf in (after.params["w"], s.nonfinite_count, s.skipped_microbatches):
        shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        assert len(shards) == 8 and all(np.array_equal(shards[0], x) for x in shards)
    assert int(s.nonfinite_count) == 1 and _all_finite(after.params)


def test_data_parallel_batch_norm_window_pools_the_global_batch_exactly():
    # Devices see batches with different means: averaging per-device statistics (on every
    # call, or once per window) loses the spread between devices; pooling keeps it. Integer
    # and key leaves of the model state pass through untouched.
    assert jax.device_count() >= 8
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    model = nn.Sequential([nn.Dense(4), accumjax.AccumBatchNorm(use_running_average=False)])
    rows = 8 * 2 * 3  # 8 devices x K=2 microbatches x 3 rows
    x = np.random.default_rng(0).normal(size=(rows, 5)).astype(np.float32)
    x += np.repeat(np.arange(8.0, dtype=np.float32), rows // 8)[:, None]  # device offsets
    # One program, with an "rbg" key (as _bn_variables): not each op of the init compiled.
    variables = jax.jit(model.init)(jax.random.key(0, impl="rbg"), x[:2])
    momentum = 0.99  # AccumBatchNorm's default

    def loss_fn(params, model_state, batch):
        out, new = model.apply(
            {"params": params, "batch_stats": model_state["batch_stats"]},
            batch,
            mutable=["batch_stats"],
        )
        count = model_state["count"] + 1
        return jnp.mean(out**2), {**model_state, **new, "count": count}

    model_state = {
        "batch_stats": variables["batch_stats"],
        "count": jnp.int32(0),
        "key": jax.random.key(3),
    }
    step = make_train_step(loss_fn, mode="scan", axis_name="data", mesh=mesh, donate=False)
    state = step.init(variables["params"], accumulate(optax.sgd(0.0), 2), model_state=model_state)
    after, _ = step(state, jnp.asarray(x))
    kernel, bias = (
        variables["params"]["layers_0"]["kernel"],
        variables["params"]["layers_0"]["bias"],
    )
    h = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64) + np.asarray(bias)
    stats = after.model_state["batch_stats"]["layers_1"]
    # float32 shifted sums over 48 rows vs float64: ~1e-6 relative.
    np.testing.assert_allclose(stats["mean"], (1 - momentum) * h.mean(0), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(
        stats["var"], momentum + (1 - momentum) * h.var(0), rtol=2e-5, atol=1e-6
    )
    assert int(after.model_state["count"]) == 2  # per device: its two microbatches
    assert jax.random.key_data(after.model_state["key"]).tolist() == (
        jax.random.key_data(model_state["key"]).tolist()
    )


def _masked_loss(p, b):  # masked mean over the (micro)batch's valid rows
    err = jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2, axis=-1)
    return jnp.sum(err * b["m"]) / jnp.sum(b["m"])


@functools.cache
def _float64_problem():
    """A ragged float64 batch, parameters, and the window gradient each scaling makes of it
    (with its AGC for "sum"): computed once for the module, in one program under x64, and
    kept in numpy (float64)."""
    batch = jax.tree.map(lambda a: np.asarray(a, np.float64), _data(seed=4))
    batch["m"] = ((np.arange(K * ROWS) % 3 != 0) | (np.arange(K * ROWS) < K)).astype(np.float64)
    params = {"w": np.random.default_rng(5).normal(size=(5, 3))}

    def window_gradients(params, batch):
        grad = jax.grad(_masked_loss)
        micro = [grad(params, jax.tree.map(lambda a, i=i: a[i::K], batch)) for i in range(K)]
        total = jax.tree.map(lambda *g: sum(g), *micro)  # "sum": K times the mean's
        mean = jax.tree.map(lambda g: g / K, total)  # the mean of the microbatch gradients
        # "weighted": sum_i n_i g_i / sum_i n_i, the full-batch masked mean
        # Nothing is skipped: "mean" and "sum_over_k" divide by K alike.
        grads = {"mean": mean, "sum_over_k": mean, "sum": total}
        grads["weighted"] = grad(params, batch)
        return grads, accumjax.adaptive_clip_grad(params, total, 0.05, 1e-3)

    with jax.enable_x64(True):
        grads, clipped_sum = jax.jit(window_gradients)(params, batch)
    return batch, params, jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, clipped_sum)


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize(
    ("scaling", "agc"),
    [("mean", False), ("sum", False), ("sum_over_k", False), ("weighted", False), ("sum", True)],
)
def test_every_scaling_matches_a_float64_full_batch_reference(scaling, mode, agc):
    # AGC (adaptive_clip first in the inner chain) clips the window gradient the scaling
    # made: checked with "sum", whose gradient is K times the mean's.
    batch, params, grads, clipped_sum = _float64_problem()
    grad = grads[scaling]
    clipped = clipped_sum if agc else grad
    ref = params["w"] - 0.1 * clipped["w"]  # numpy float64
    assert agc != np.allclose(clipped["w"], grad["w"])  # AGC is active when asked
    with jax.enable_x64(True):
        params = jax.tree.map(jnp.asarray, params)
        inner = optax.sgd(0.1)
        if agc:
            inner = optax.chain(accumjax.adaptive_clip(0.05, 1e-3), inner)
        tx = accumulate(inner, K, scaling=scaling)
        weight_fn = (lambda b: jnp.sum(b["m"])) if scaling == "weighted" else None
        step = make_train_step(_masked_loss, mode=mode, weight_fn=weight_fn, donate=False)
        state = step.init(params, tx)
        batch = jax.tree.map(jnp.asarray, batch)
        for b in [batch] if mode == "scan" else _microbatches(batch):
            state, _ = step(state, b)
        assert int(state.step) == 1
        # float64 sums in another order: ~1e-16 relative per operation.
        np.testing.assert_allclose(state.params["w"], ref, rtol=1e-12, atol=1e-13)


def _state_loss(params, model_state, batch):
    """tests/_reference.py's loss, with a model state: the rows it has seen and the sum of
    their inputs, which only the microbatches the window adds may change."""
    new = {
        "rows": model_state["rows"] + batch["x"].shape[0],
        "x_sum": model_state["x_sum"] + jnp.sum(batch["x"].astype(jnp.float32), axis=0),
    }
    return reference.loss(params, batch), new


@pytest.mark.parametrize(
    "case", ["first", "two", "all", "padded", "unrolled", "weighted", "float16"]
)
def test_scan_nonfinite_microbatches_match_the_float64_reference(case):
    """Scan mode decides about each microbatch as it comes: NaN targets in microbatches
    ``rows`` (microbatch i holds rows i, i + K, ...). The parameters after one SGD step, the
    model state, the counts and the metrics against tests/_reference.py."""
    rows = {"first": [0], "two": [1, 3], "all": [0, 1, 2, 3]}.get(case, [2])
    scaling = "weighted" if case == "weighted" else "mean"
    real = 3 if case == "padded" else K
    params, batch = reference.problem(K * ROWS, seed=1)
    batch["y"][rows, 0] = np.nan
    if case == "weighted":
        batch["m"][np.arange(K * ROWS) % 3 == 0] = 0.0
    micro = reference.microbatches(batch, K)[:real]
    expected = reference.window(params, micro, scaling=scaling)
    step_kwargs: dict = {"donate": False, "unroll": case == "unrolled"}
    if case == "weighted":
        step_kwargs["weight_fn"] = lambda b: jnp.sum(b["m"])
    if case == "float16":
        step_kwargs["mixed_precision"] = "float16"
    step = _step(_state_loss, mode="scan", **step_kwargs)
    model_state = {"rows": jnp.int32(0), "x_sum": jnp.zeros(reference.FEATURES)}
    state = step.init(
        params,
        accumulate(optax.sgd(0.5), K, scaling=scaling),
        model_state=model_state,
        loss_scale=accumjax.dynamic_loss_scale(initial=2.0**8) if case == "float16" else None,
    )
    call = {"num_real_microbatches": real} if case == "padded" else {}
    after, metrics = step(state, jax.tree.map(jnp.asarray, batch), **call)
    s = accumjax.stats(after.opt_state)
    assert {k: int(getattr(s, k)) for k in expected.counts} == expected.counts
    assert bool(metrics["updated"]) == (expected.gradient is not None)
    # float32 sums of at most 32 products: 1e-6 of the values' scale. float16 runs the loss
    # and its gradient in float16 (2**-11 relative per operation; measured: 8e-4): 5e-3.
    tol = 1e-6 if case != "float16" else 5e-3
    want = expected.params_after(params, 0.5)
    for key in params:
        scale = np.max(np.abs(want[key]))
        np.testing.assert_allclose(after.params[key], want[key], rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(metrics["loss"], expected.loss, rtol=tol)
    np.testing.assert_allclose(metrics["grad_norm"], expected.grad_norm, rtol=tol)
    # The model state of the added microbatches only; none added: as it was, bit for bit.
    added = [mb for mb in micro if np.isfinite(reference.value_and_grad(params, mb)[0])]
    assert int(after.model_state["rows"]) == sum(len(mb["x"]) for mb in added)
    x_sum = sum((np.sum(mb["x"], axis=0, dtype=np.float64) for mb in added), np.zeros(8))
    scale = np.max(np.abs(x_sum))  # float16: the inputs the loss sees are rounded to float16
    np.testing.assert_allclose(after.model_state["x_sum"], x_sum, rtol=tol, atol=tol * scale)


def test_float16_shares_of_a_whole_gradient_are_summed_in_float32():
    """Issue 37: in a user's shard_map loop, a policy that reads the whole gradient sums the
    devices' float16 shares and weights in float32: two devices' gradients of 40000 (their
    float16 sum, 80000, overflows) weighted by 40000 tokens each (80000 in all) give the
    weighted mean 40000, finite, as one device holding both would; max_norm=1e9 clips nothing.
    Expected: SGD with learning rate 1 from 0, so the parameter becomes -40000."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = accumjax.accumulate(optax.sgd(1.0), 1, scaling="weighted", max_norm=1e9, axis_name="data")
    params = {"w": jnp.zeros(1, jnp.float16)}

    def step(params, state, grads, weight):
        updates, state = tx.update({"w": grads}, state, params, weight=weight[0])
        return optax.apply_updates(params, updates), state

    mapped = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    split = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    grads = split(jnp.full((2,), 40000.0, jnp.float16))
    weights = split(jnp.full((2,), 40000.0, jnp.float16))
    whole = jax.sharding.NamedSharding(mesh, P())
    state = jax.device_put(tx.init(params), whole)
    new, state = mapped(jax.device_put(params, whole), state, grads, weights)
    assert bool(state.updated) and int(accumjax.stats(state).num_nonfinite) == 0
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [-40000.0])
