"""Tests for accumjax.nnx_train_step: the train step for Flax NNX models.

References: an NNX full-batch optimizer step per window (float64), ``nnx.BatchNorm`` applied
once to the concatenated window for running statistics, and ``nnx.Optimizer`` around
``accumjax.accumulate``.
"""

import functools
import re

import _composition as composition
import _reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import accumjax
from accumjax.nnx_train_step import (
    NNXTrainState,
    make_nnx_train_step,
    nnx_train_state,
    nnx_update,
)

K = 4  # microbatches per window
MICRO = 8  # rows per microbatch
WINDOWS = 3
FEATURES, HIDDEN, OUT = 5, 6, 3
MOMENTUM = 0.9
N_DEV = 8

# float64: K microbatch means summed and divided by K vs one full-batch mean differ by
# summation order only (~1e-16 relative), which Adam carries over 3 windows far below 1e-12.
F64 = {"rtol": 1e-12, "atol": 1e-12}
# float32: the same reordering, ~1e-7 absolute on O(1) parameters after a few Adam steps.
F32 = {"rtol": 1e-5, "atol": 1e-6}
# Running statistics: float32 sums of 32 values and the float32 momentum scalar of the
# step-driven layer (as in test_nnx_batch_norm.py); far below the ~10% gap between the pooled
# variance and the mean of per-microbatch variances.
STATS = {"rtol": 2e-5, "atol": 2e-5}


class MLP(nnx.Module):
    """Linear -> tanh -> Linear, in ``dtype``."""

    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.hidden = nnx.Linear(FEATURES, HIDDEN, param_dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))


class BNNet(nnx.Module):
    """Linear -> step-driven NNXAccumBatchNorm -> relu -> Dropout (key at call) -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.norm = accumjax.NNXAccumBatchNorm(HIDDEN, momentum=MOMENTUM, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)
        self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.head(self.dropout(nnx.relu(self.norm(self.linear(x))), rngs=rngs))


@functools.cache
def _step(loss, **options):
    """``make_nnx_train_step(loss, **options)``, made once per module: the tests that use the
    same step share its compiled programs."""
    return make_nnx_train_step(loss, **options)


@functools.cache
def _acc(inner=optax.sgd, lr=0.1, k=K):
    """``accumulate(inner(lr), k)``, one object per arguments (the optimizer is static in the
    state: the same object compiles once)."""
    return accumjax.accumulate(inner(lr), k)


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def bn_loss(model, batch, key):
    return jnp.mean((model(batch["x"], rngs=key) - batch["y"]) ** 2)


def _windows(seed=0, dtype=np.float32, rows_per_window=K * MICRO, windows=WINDOWS):
    rng = np.random.default_rng(seed)
    rows = rows_per_window * windows
    x = rng.normal(loc=1.0, size=(rows, FEATURES)).astype(dtype)
    y = (x @ rng.normal(size=(FEATURES, OUT)) + 0.1 * rng.normal(size=(rows, OUT))).astype(dtype)
    n = rows_per_window
    return [
        {"x": jnp.asarray(x[i : i + n]), "y": jnp.asarray(y[i : i + n])} for i in range(0, rows, n)
    ]


def _microbatches(window):
    """Scan mode's strided microbatches: microbatch i is rows i, i + K, ..."""
    return [jax.tree.map(lambda a, i=i: a[i::K], window) for i in range(K)]


def _run(step, state, windows, mode, rng=None):
    metrics = {}
    for window in windows:
        for batch in [window] if mode == "scan" else _microbatches(window):
            state, metrics = step(state, batch, rng)
    return state, metrics


def _pure(tree):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree))


def _assert_tree_close(actual, expected, tol):
    actual, expected = _pure(actual), _pure(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, **tol)


def _reference_batch_norm(model: BNNet, window) -> nnx.BatchNorm:
    """``nnx.BatchNorm`` applied once to what the norm sees for the whole window (the
    linear layer does not change within a window)."""
    reference = nnx.BatchNorm(HIDDEN, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    reference(model.linear(window["x"]))
    return reference


def _assert_stats_equal_reference(state, reference):
    norm = state.model_state["norm"]
    np.testing.assert_allclose(norm["mean"][...], reference.mean[...], **STATS)
    np.testing.assert_allclose(norm["var"][...], reference.var[...], **STATS)
    assert int(norm["acc_step"][...]) == 0  # the step closed the window
    np.testing.assert_array_equal(norm["acc_count"][...], np.zeros(HIDDEN))


# ----------------------------------------------------------------------------- equivalence


@functools.cache
def _float64_reference():
    """The windows and an ``nnx.Optimizer`` full-batch step per window on them, in float64
    (both modes compare with it: it is computed once)."""
    with jax.enable_x64(True):
        windows = _windows(dtype=np.float64)
        reference = MLP(nnx.Rngs(0), jnp.float64)
        opt = nnx.Optimizer(reference, optax.adam(0.05), wrt=nnx.Param)

        @nnx.jit
        def full_batch_step(model, opt, window):
            opt.update(model, nnx.grad(mse)(model, window))

        for window in windows:  # one full-batch step per window
            full_batch_step(reference, opt, window)
        return windows, nnx.state(reference, nnx.Param)


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_float64_params_equal_nnx_full_batch_reference(mode):
    windows, reference = _float64_reference()
    with jax.enable_x64(True):
        step = make_nnx_train_step(mse, mode=mode)
        state = step.init(MLP(nnx.Rngs(0), jnp.float64), accumjax.accumulate(optax.adam(0.05), K))
        state, metrics = _run(step, state, windows, mode)
        assert int(state.step) == WINDOWS and bool(metrics["updated"])
        assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype("float64")}
        assert {leaf.dtype for leaf in jax.tree.leaves(reference)} == {jnp.dtype("float64")}
        _assert_tree_close(state.params, reference, F64)


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_metrics_count_the_skipped_microbatches(mode):
    """NaN inputs in microbatch 2: the metrics of the call(s) count it (int32 scalars, as
    `stats` does), the window applies the other three."""
    (window,) = _windows(windows=1)
    window = {**window, "x": window["x"].at[2, 0].set(jnp.nan)}  # row 2: microbatch 2
    step = _step(mse, mode=mode)
    state = step.init(MLP(nnx.Rngs(0)), _acc())
    counts = []
    for batch in [window] if mode == "scan" else _microbatches(window):
        state, metrics = step(state, batch)
        got = (metrics["skipped_microbatches"], metrics["nonfinite_microbatches"])
        assert all((c.shape, c.dtype) == ((), jnp.int32) for c in got)
        counts.append(tuple(int(c) for c in got))
    assert counts == ([(1, 1)] if mode == "scan" else [(0, 0), (0, 0), (1, 1), (0, 0)])
    stats = accumjax.stats(state.opt_state)
    assert (int(stats.skipped_microbatches), int(stats.num_nonfinite)) == (1, 1)
    assert bool(metrics["updated"]) and int(state.step) == 1


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_batch_norm_stats_after_one_window_equal_batch_norm_on_whole_window(mode):
    window = _windows(seed=1, windows=1)[0]
    model = BNNet(nnx.Rngs(0))
    reference = _reference_batch_norm(model, window)  # before training: the initial linear
    step = _step(bn_loss, mode=mode)
    state = step.init(model, _acc(optax.adam, 1e-2))
    state, metrics = _run(step, state, [window], mode, jax.random.key(0))
    assert int(state.step) == 1 and bool(metrics["updated"])
    _assert_stats_equal_reference(state, reference)
    # The model may be merged back: it holds the closed statistics and trained parameters.
    nnx_update(model, state)
    np.testing.assert_array_equal(model.norm.mean[...], state.model_state["norm"]["mean"][...])
    np.testing.assert_array_equal(model.head.kernel[...], state.params["head"]["kernel"][...])


def test_scan_and_stream_agree_with_batch_norm_and_dropout_keys():
    windows = _windows(seed=2, windows=2)
    results = {}
    for mode in ("scan", "stream"):
        step = _step(bn_loss, mode=mode)
        state = step.init(BNNet(nnx.Rngs(0)), _acc())
        results[mode], _ = _run(step, state, windows, mode, jax.random.key(3))
    scan, stream = results["scan"], results["stream"]
    assert int(scan.step) == int(stream.step) == 2
    # Same microbatches, same keys (fold_in of step and microbatch index), same sums: only
    # XLA's fusion choices differ between the two programs. SGD, not Adam: Adam's first steps
    # move every parameter by about the learning rate whatever the gradient's size, so a
    # rounding difference in a near-zero gradient entry flips its step.
    _assert_tree_close(scan.params, stream.params, F32)
    _assert_tree_close(scan.model_state, stream.model_state, F32)


def test_per_microbatch_agc_is_gradient_accumulators_use_agc():
    """The NNX step applies accumulate's microbatch_transform as the linen step does: AGC of
    each microbatch's gradient, against GradientAccumulator's float64 algorithm
    (tests/_reference.py; its scale: tests/test_accumulation.py)."""
    params, batch = reference.problem(2 * K * MICRO)
    params["b"] = np.zeros_like(params["b"])
    rows = K * MICRO
    windows = [
        reference.microbatches({k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}, K)
        for i in range(2)
    ]
    expected, clipped = reference.ga_agc_training(params, windows, 0.1, 0.8, 1e-3)
    assert 0.2 < clipped < 0.8  # some gradient entries clipped, some not
    model = nnx.Linear(reference.FEATURES, reference.OUTPUTS, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.asarray(params["w"])
    model.bias[...] = jnp.asarray(params["b"])
    step = make_nnx_train_step(
        lambda m, b: reference.loss({"w": m.kernel[...], "b": m.bias[...]}, b)
    )
    agc = accumjax.adaptive_clip(K * 0.8, 1e-3)
    state = step.init(model, accumjax.accumulate(optax.sgd(0.1), K, microbatch_transform=agc))
    for micro in windows:
        for mb in micro:
            state, _ = step(state, mb)
    got = _pure(state.params)
    for name, key in (("kernel", "w"), ("bias", "b")):
        scale = np.max(np.abs(expected[key]))  # float32 against float64, as there
        np.testing.assert_allclose(got[name], expected[key], rtol=1e-6, atol=1e-6 * scale)


def test_nnx_optimizer_with_accumulate_updates_once_per_window():
    windows = _windows(seed=4)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, accumjax.accumulate(optax.adam(0.05), K), wrt=nnx.Param)

    @nnx.jit
    def train(model, opt, batch):
        opt.update(model, nnx.grad(mse)(model, batch))

    for window in windows:
        for i, micro in enumerate(_microbatches(window)):
            before = _pure(nnx.state(model, nnx.Param))
            assert bool(accumjax.should_update(opt.opt_state)) == (i == K - 1)
            train(model, opt, micro)
            assert bool(accumjax.has_updated(opt.opt_state)) == (i == K - 1)
            if i < K - 1:  # mid-window: parameters untouched, bit for bit
                after = _pure(nnx.state(model, nnx.Param))
                jax.tree.map(np.testing.assert_array_equal, after, before)
    assert int(opt.step[...]) == WINDOWS * K  # nnx.Optimizer counts calls...
    assert int(accumjax.stats(opt.opt_state).total_cycles) == WINDOWS  # ...accumulate, updates

    # The same training with make_nnx_train_step (stream mode: the same calls).
    step = _step(mse)
    state = step.init(MLP(nnx.Rngs(0)), accumjax.accumulate(optax.adam(0.05), K))
    state, _ = _run(step, state, windows, "stream")
    assert int(state.step) == WINDOWS
    _assert_tree_close(state.params, nnx.state(model, nnx.Param), F32)


# ----------------------------------------------------------------------------- features


@pytest.mark.slow
def test_data_parallel_pools_batch_norm_over_the_global_window():
    assert jax.device_count() >= N_DEV
    window = _windows(seed=5, rows_per_window=N_DEV * K * 2, windows=1)[0]
    model = BNNet(nnx.Rngs(0))
    reference = _reference_batch_norm(model, window)
    # On a mesh: the state on the mesh, the global batch split over its data axis.
    mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("data",))
    step = _step(bn_loss, mode="scan", axis_name="data", mesh=mesh)
    on_mesh, mesh_metrics = step(step.init(model, _acc()), window, jax.random.key(0))
    # Under pmap: replicated state (step.init replicates it), per-device batches.
    step = _step(bn_loss, mode="scan", axis_name="data")
    per_device = jax.tree.map(lambda a: a.reshape(N_DEV, -1, *a.shape[1:]), window)
    pmapped, pmap_metrics = step(step.init(model, _acc()), per_device, jax.random.key(0))
    pmapped = accumjax.unreplicate(pmapped)
    for state in (on_mesh, pmapped):
        assert isinstance(state, NNXTrainState)
        assert int(state.step) == 1
        _assert_stats_equal_reference(state, reference)
    # Metrics on a mesh are global (the window's loss); under pmap, per device. Each device
    # draws the same dropout keys on both paths (the device index is folded in).
    assert mesh_metrics["loss"].shape == () and pmap_metrics["loss"].shape == (N_DEV,)
    np.testing.assert_allclose(mesh_metrics["loss"], np.mean(pmap_metrics["loss"]), rtol=1e-6)


def test_bfloat16_keeps_float32_master_params_and_follows_float32_training():
    windows = _windows(seed=6, windows=1)
    results = {}
    for precision in (None, "bfloat16"):
        step = _step(mse, mode="scan", mixed_precision=precision)
        results[precision], metrics = _run(
            step, step.init(MLP(nnx.Rngs(0)), _acc()), windows, "scan"
        )
        assert bool(metrics["updated"])
    assert {leaf.dtype for leaf in jax.tree.leaves(results["bfloat16"].params)} == {
        jnp.dtype("float32")
    }
    # bfloat16 has 8 mantissa bits: one SGD step of 0.1 * O(1) gradients agrees to ~1e-2.
    _assert_tree_close(results["bfloat16"].params, results[None].params, {"atol": 2e-2})


def test_has_aux_and_model_held_dropout_rngs():
    class Held(nnx.Module):  # dropout with its own nnx.Rngs: key and count are model state
        def __init__(self, rngs):
            self.linear = nnx.Linear(FEATURES, OUT, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))

        def __call__(self, x):
            return self.dropout(self.linear(x))

    def loss(model, batch):
        pred = model(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), pred == 0  # aux: the dropout mask

    window = _windows(seed=7, windows=1)[0]
    step = make_nnx_train_step(loss, mode="scan", has_aux=True)
    state = step.init(Held(nnx.Rngs(0)), _acc())
    count = int(state.model_state["dropout"]["rngs"]["count"][...])
    state, metrics = step(state, window)
    masks = np.asarray(metrics["aux"])
    assert masks.shape == (K, MICRO, OUT)
    assert len({m.tobytes() for m in masks}) == K  # a fresh mask for every microbatch
    assert int(state.model_state["dropout"]["rngs"]["count"][...]) == count + K


def test_model_stays_usable_after_nnx_update_and_later_steps():
    model = MLP(nnx.Rngs(0))
    step = _step(mse, mode="scan")
    state = step.init(model, _acc())
    windows = _windows(seed=8, windows=2)
    state, _ = step(state, windows[0])
    nnx_update(model, state)
    trained = _pure(nnx.state(model, nnx.Param))
    old = state
    state, _ = step(state, windows[1])  # donates the state nnx_update read from
    assert int(state.step) == 2
    # The donated state, given back to accumjax: the error says it was donated, and the fix.
    donated = r"(?s)state.*was deleted.*donated.*donate=False.*jnp\.copy"
    for read in (lambda: step(old, windows[0]), lambda: nnx_update(model, old)):
        with pytest.raises(ValueError, match=donated):
            read()
    with pytest.raises(ValueError, match=donated):
        accumjax.stats(old)
    jax.tree.map(np.testing.assert_array_equal, _pure(nnx.state(model, nnx.Param)), trained)
    assert model(windows[0]["x"]).shape == (K * MICRO, OUT)
    assert isinstance(state, NNXTrainState)
    assert "func.func" in step.lower(state, windows[0]).as_text()  # lowers, as jit does


def test_errors():
    with pytest.raises(ValueError, match="mode"):
        make_nnx_train_step(mse, mode="loop")
    with pytest.raises(TypeError, match="callable"):
        make_nnx_train_step(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"flax\.nnx\.Module"):
        nnx_train_state({"w": jnp.zeros(2)}, optax.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"flax\.nnx\.Module"):
        _step(mse).init({"w": jnp.zeros(2)}, optax.sgd(0.1))  # type: ignore[arg-type]
    plain = accumjax.TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match="NNXTrainState"):
        make_nnx_train_step(mse)(plain, {"x": jnp.ones((2, FEATURES))})
    with pytest.raises(TypeError, match="NNXTrainState"):
        nnx_update(MLP(nnx.Rngs(0)), plain)  # type: ignore[arg-type]
    window = _windows(seed=9, windows=1)[0]
    state = nnx_train_state(MLP(nnx.Rngs(0)), optax.sgd(0.1))
    with pytest.raises(TypeError, match="has_aux=True"):
        make_nnx_train_step(lambda m, b: (mse(m, b), 0.0))(state, window)
    with pytest.raises(TypeError, match="has_aux=True"):
        make_nnx_train_step(mse, has_aux=True)(state, window)


def test_nnx_train_state_takes_no_mode_and_with_mode_gives_the_step_init_state():
    # 0.3 deprecated nnx_train_state(mode=...), 0.4 removed it: the step builds its state.
    with pytest.raises(TypeError, match="unexpected keyword argument 'mode'"):
        nnx_train_state(MLP(nnx.Rngs(0)), _acc(), mode="scan")  # pyright: ignore[reportCallIssue]
    old = accumjax.with_mode(nnx_train_state(MLP(nnx.Rngs(0)), _acc()), "scan")
    step = _step(mse, mode="scan")
    new = step.init(MLP(nnx.Rngs(0)), _acc())
    assert jax.tree.structure(old) == jax.tree.structure(new)
    window = _windows(seed=10, windows=1)[0]
    (old, _), (new, _) = step(old, window), step(new, window)
    jax.tree.map(np.testing.assert_array_equal, _pure(old.params), _pure(new.params))


# ----------------------------------------------------------------------------- misuse: clear errors


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("where", ["alone", "in_chain"])
def test_multisteps_tx_is_refused(where, mode):
    multi = optax.MultiSteps(optax.sgd(0.1), K)
    tx = (
        multi if where == "alone" else optax.chain(optax.clip(1.0), multi.gradient_transformation())
    )
    step = _step(mse, mode=mode)
    refusal = r"tx .*optax\.MultiSteps.*accumjax\.accumulate\(inner, K\)"
    with pytest.raises(TypeError, match=refusal):
        step.init(MLP(nnx.Rngs(0)), tx)  # type: ignore[arg-type]
    state = nnx_train_state(MLP(nnx.Rngs(0)), tx)  # built elsewhere: refused at trace time
    window = _windows(seed=9, windows=1)[0]
    with pytest.raises(TypeError, match=refusal):
        step(state, window)


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_a_chain_around_accumulate_is_refused_at_init_and_at_the_first_trace(mode):
    """As make_train_step: by step.init(model, tx), and by the step for a state built with
    nnx_train_state, naming the form the modes guide's table gives."""
    cell = composition.ROWS["chain_before"]
    tx = composition.BUILDERS[cell](_acc())
    refusal = re.escape(composition.step_refusal(cell))
    step = _step(mse, mode=mode)
    with pytest.raises(TypeError, match=refusal):
        step.init(MLP(nnx.Rngs(0)), tx)
    state = nnx_train_state(MLP(nnx.Rngs(0)), tx)
    with pytest.raises(TypeError, match=refusal):
        step(state, _windows(seed=9, windows=1)[0])


@pytest.mark.parametrize("mode", ["stream", "scan"])
def test_rng_given_to_a_loss_without_key_names_rng(mode):
    step = _step(mse, mode=mode, donate=False)
    state = step.init(MLP(nnx.Rngs(0)), _acc())
    window = _windows(seed=9, windows=1)[0]
    with pytest.raises(TypeError, match=r"loss_fn takes no key argument but step.* rng=.*`key`"):
        step(state, window, jax.random.key(0))
    with pytest.raises(TypeError, match="loss_fn takes no key argument"):
        step.lower(state, window, jax.random.key(0))
    with pytest.raises(TypeError, match=r"rng must be .*jax\.random\.key"):
        make_nnx_train_step(bn_loss, mode=mode)(state, window, 0)


def test_a_plain_nnx_batch_norm_under_accumulation_warns():
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(FEATURES, OUT, rngs=rngs)
            self.norm = nnx.BatchNorm(OUT, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x))

    step = make_nnx_train_step(mse, mode="scan")
    state = step.init(Plain(nnx.Rngs(0)), _acc())
    with pytest.warns(UserWarning, match=r"\['norm'\].*NNXAccumBatchNorm.*convert_batch_norm"):
        step(state, _windows()[0])


def test_the_layout_plan_of_an_nnx_step_is_its_train_steps_and_sizes_stats():
    # step.layout: None on one device; on a mesh, the plan the step runs. ZeRO-2 on 2
    # devices splits the sums of every leaf with a dimension of even size, not the 3-wide
    # output bias, and stats sizes the window by it: every device's sums together.
    one = _step(mse, mode="scan")
    assert one.layout(one.init(MLP(nnx.Rngs(0)), _acc())) is None
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    step = _step(mse, mode="scan", mesh=mesh, axis_name="data", optimizer_sharding="zero2")
    state = step.init(MLP(nnx.Rngs(0)), _acc())
    layout = step.layout(state)
    assert sorted(leaf.accumulator is not None for leaf in layout.leaves) == [False] + [True] * 3
    full, bias = 4 * sum(x.size for x in jax.tree.leaves(state.params)), 4 * OUT
    assert accumjax.stats(state, layout).memory_bytes == full - bias + 2 * bias
    assert accumjax.stats(state).memory_bytes == full  # without the plan: one device's
