"""ZeRO on a mesh under ``jit``: ``make_train_step(optimizer_sharding="zero1" | "zero2")``
and an optimizer state the user split over the data axis himself (accumjax._layout).

Parameters replicated over "data" on 1, 2 and 8 host CPU devices, Explicit and Auto meshes,
scan and stream mode. References: the float64 window of tests/_reference.py, the replicated
layout's parameters, and the collectives of one window in the compiled HLO.
"""

from typing import Any

import _reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax
from accumjax._layout import REPLICATED, LeafLayout, Reduction, leaf_layout
from accumjax._reduction import reduce_leaves
from accumjax.collectives import count_collectives

K = 4
N = 8
LR = 0.5
FLOAT32 = 2e-6
# A gradient's reduction moves at least the smallest leaf reduced (32 floats); the metrics and
# counts a window reduces are a few scalars.
GRADIENT_BYTES = 32 * 4


def _mesh(devices, kind):
    assert jax.device_count() >= N
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((devices,), ("data",), axis_types=types, devices=jax.devices()[:devices])


def _specs(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _same_layout(before, after):
    """Every array of ``after`` lies as the one of ``before`` at its place."""
    pairs = zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    for x, y in pairs:
        if isinstance(x, jax.Array):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


def _adam():
    return accumjax.accumulate(optax.adam(0.1), K)


def _window(mesh, mode, state, step, batch):
    """One window (scan: one call; stream: K calls) of ``batch`` on ``mesh``."""
    put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P("data")))
    calls = [batch] if mode == "scan" else reference.microbatches(batch, K)
    for call in calls:
        state, _ = step(state, put(call))
    return state


def test_the_layout_plan_has_one_row_per_layout():
    row = lambda dim, zero, rs="microbatch": leaf_layout(
        dim, (8, 3), (), 2, optimizer_sharding=zero, reduce_scatter=rs
    )
    assert row(None, "replicated") == REPLICATED
    assert row(None, "zero1") == LeafLayout(None, None, 0, Reduction.REDUCE_SCATTER_WINDOW)
    assert row(None, "zero2") == LeafLayout(None, 0, 0, Reduction.REDUCE_SCATTER_MICROBATCH)
    assert row(0, "zero1") == LeafLayout(0, 0, 0, Reduction.REDUCE_SCATTER_MICROBATCH)  # FSDP
    assert row(0, "zero2", "window") == LeafLayout(0, None, 0, Reduction.REDUCE_SCATTER_WINDOW)
    odd = leaf_layout(None, (3, 5), (), 2, optimizer_sharding="zero1", reduce_scatter="window")
    assert odd == REPLICATED  # no dimension divides by 2


# What each reduction does at the window's close and to a microbatch before it is added.
_REDUCED = {
    False: {
        Reduction.ALL_REDUCE: "sum",
        Reduction.REDUCE_SCATTER_WINDOW: "shard",
        Reduction.REDUCE_SCATTER_MICROBATCH: "as is",
        Reduction.ALL_REDUCE_MICROBATCH: "as is",
    },
    True: {
        Reduction.ALL_REDUCE: "as is",
        Reduction.REDUCE_SCATTER_WINDOW: "as is",
        Reduction.REDUCE_SCATTER_MICROBATCH: "shard",
        Reduction.ALL_REDUCE_MICROBATCH: "sum",
    },
}


@pytest.mark.parametrize("per_microbatch", [False, True])
def test_each_leaf_is_reduced_as_its_reduction_says_when_it_runs(per_microbatch):
    kinds = list(Reduction)
    layouts = [LeafLayout(None, None, 0, kind) for kind in kinds]

    def on_device(x):
        leaves, count = reduce_leaves(
            [x] * len(kinds), "i", layouts, jnp.ones(()), per_microbatch=per_microbatch
        )
        return leaves, count

    x = jnp.arange(8.0).reshape(2, 4)  # two devices, a leaf of 4 each
    leaves, count = jax.vmap(on_device, axis_name="i")(x)
    total = np.asarray(x).sum(0)
    want = {"as is": x, "shard": total.reshape(2, 2), "sum": np.stack([total, total])}
    assert float(count[0]) == 2.0
    for kind, got in zip(kinds, leaves, strict=True):
        expected = want[_REDUCED[per_microbatch][kind]]
        np.testing.assert_array_equal(got, expected, err_msg=kind.value)


# (devices, mesh kind, mode, optimizer_sharding)
_CASES = [
    (1, "explicit", "scan", "zero1"),
    (2, "auto", "scan", "zero1"),
    (8, "explicit", "scan", "zero1"),
    (8, "auto", "scan", "zero1"),
    (2, "explicit", "stream", "zero1"),
    (8, "auto", "stream", "zero1"),
    (2, "auto", "scan", "zero2"),
    (8, "explicit", "scan", "zero2"),
    (8, "explicit", "stream", "zero2"),
]


def _nan_problem():
    """The reference problem with a NaN target in microbatch 1: the default policy still
    leaves that microbatch out."""
    params, batch = reference.problem(N * K * 2)
    batch["y"][1, 0] = np.nan
    return params, batch


def _zero_window(devices, kind, mode, layout) -> Any:
    """The state after one window of ``_nan_problem`` in ``layout``, every output laid out as
    it came in."""
    params, batch = _nan_problem()
    mesh = _mesh(devices, kind)
    step = accumjax.make_train_step(reference.loss, mode=mode, optimizer_sharding=layout)
    tx = accumjax.accumulate(optax.sgd(LR, momentum=0.9), K)
    state = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
    before = _specs(state)
    state = _window(mesh, mode, state, step, batch)
    _same_layout(before, _specs(state))  # every output lies as it came in
    return state


@pytest.fixture(scope="module")
def replicated_runs():
    """The replicated layout's parameters per (devices, kind, mode), filled as the tests ask:
    the ZeRO-1 and ZeRO-2 cases of one mesh and mode compare with the same run."""
    return {}


@pytest.mark.parametrize("devices, kind, mode, zero", _CASES)
def test_zero_matches_the_replicated_layout_and_the_float64_reference(
    replicated_runs, devices, kind, mode, zero
):
    params, batch = _nan_problem()
    expected = reference.window(params, reference.microbatches(batch, K))
    key = (devices, kind, mode)
    if key not in replicated_runs:
        replicated_runs[key] = _zero_window(devices, kind, mode, "replicated").params
    replicated_params = replicated_runs[key]
    state = _zero_window(devices, kind, mode, zero)
    trace = state.opt_state.inner_tx_state[0].trace
    # w (8, 2) splits over any number of devices; b (2,) over 1 and 2, not 8.
    assert trace["w"].sharding.spec[0] == "data"
    assert (trace["b"].sharding.spec[:1] == ("data",)) == (devices <= 2)
    # ZeRO-1 reduces the same sums (a reduce-scatter, not an all-reduce): bit for bit. ZeRO-2
    # adds each microbatch's reduced shard: float32 sums in another order, an ulp or two.
    same = dict(rtol=0, atol=0) if zero == "zero1" else dict(rtol=1e-6, atol=3e-7)
    for key in ("w", "b"):
        assert state.params[key].sharding.is_fully_replicated
        np.testing.assert_allclose(state.params[key], replicated_params[key], **same)
    want = expected.params_after(params, LR)
    for key in params:
        scale = np.abs(want[key]).max()
        np.testing.assert_allclose(state.params[key], want[key], rtol=FLOAT32, atol=FLOAT32 * scale)


def _loss(params, batch):
    return reference.mlp_loss(params, batch) + jnp.sum(params["odd"] ** 2)


def _problem():
    params, batch = reference.mlp_problem(N * K * 2, (16, 32, 4), (1.0, 0.3))
    # "odd": no dimension divides by 8, so it stays replicated.
    return {**params, "odd": np.ones(3, np.float32)}, batch


def _compiled_window(kind, layout):
    """Two scan windows of Adam behind ``clip_by_global_norm`` (which clips here) on 8
    devices, under ``jax.set_mesh`` (where a sharding constraint equal to an Explicit
    array's type is dropped): the state and the compiled step."""
    params, batch = _problem()
    mesh = _mesh(N, kind)
    step = accumjax.make_train_step(_loss, mode="scan", optimizer_sharding=layout)
    tx = accumjax.accumulate(optax.chain(optax.clip_by_global_norm(0.05), optax.adam(0.1)), K)
    with jax.set_mesh(mesh):
        state = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        compiled = step.lower(state, batch).compile()
        for _ in range(2):
            state, _ = step(state, batch)
    return state, compiled


def _per_window(compiled, trips=0, min_bytes=0):
    return count_collectives(
        compiled, per_execution=True, default_trip_count=trips, min_bytes=min_bytes
    )


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_zero1_reduce_scatters_and_gathers_once_per_window_and_clips_by_the_whole_norm(kind):
    replicated, compiled_replicated = _compiled_window(kind, "replicated")
    zero1, compiled = _compiled_window(kind, "zero1")
    # clip_by_global_norm in the inner chain reads the whole gradient's norm: the same update.
    for key, want in replicated.params.items():
        np.testing.assert_allclose(zero1.params[key], want, rtol=1e-6, atol=1e-7)
    assert _per_window(compiled_replicated, min_bytes=GRADIENT_BYTES)["all-reduce"] == 1
    # No gradient-sized all-reduce. The three leaves that split are reduce-scattered once a
    # window, and their new values all-gathered once, in the update (a loop of at most one
    # trip, as a non-finite window's re-run: a trip count of 0 counts a clean window without
    # its update, 1 with the update and a re-run). "odd" (3 floats) travels in the window's
    # one small all-reduce with the counts and the loss.
    assert _per_window(compiled, 1, GRADIENT_BYTES)["all-reduce"] == 0
    clean, applied = _per_window(compiled), _per_window(compiled, 1)
    assert clean == {**clean, "all-reduce": 1, "reduce-scatter": 3, "all-gather": 0}
    assert applied == {**applied, "reduce-scatter": 2 * 3, "all-gather": 3}
    assert applied["collective-permute"] == applied["all-to-all"] == 0
    mu = zero1.opt_state.inner_tx_state[1][0].mu
    assert [mu[k].sharding.spec[:1] for k in ("w1", "b1", "w2")] == [("data",)] * 3
    assert mu["odd"].sharding.is_fully_replicated


def test_zero2_reduce_scatters_each_microbatch_and_stream_zero1_once_per_window():
    params, batch = _problem()
    mesh = _mesh(N, "explicit")
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = accumjax.accumulate(optax.adam(0.1), K)
    scan = accumjax.make_train_step(_loss, mode="scan", optimizer_sharding="zero2")
    whole = jax.device_put(batch, NamedSharding(mesh, P("data")))
    compiled = scan.lower(scan.init(params, tx), whole).compile()
    clean, applied = _per_window(compiled), _per_window(compiled, 1)
    assert clean == {**clean, "all-reduce": 1, "reduce-scatter": 3 * K, "all-gather": 0}
    assert applied["all-gather"] == 3
    stream = accumjax.make_train_step(_loss, optimizer_sharding="zero1")
    call = jax.device_put(jax.tree.map(lambda a: a[:16], batch), NamedSharding(mesh, P("data")))
    compiled = stream.lower(stream.init(params, tx), call).compile()
    # The close runs in a loop of at most one trip: 0 counts what every call runs, 1 what
    # the closing call runs.
    every, closing = _per_window(compiled, 0), _per_window(compiled, 1, GRADIENT_BYTES)
    assert every == {**every, "all-reduce": 1, "reduce-scatter": 0, "all-gather": 0}
    assert closing == {**closing, "all-reduce": 0, "reduce-scatter": 1, "all-gather": 3}
    assert _per_window(compiled, 1)["reduce-scatter"] == 3  # two are under 128 bytes


@pytest.mark.parametrize("mode", ["scan", "stream"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_an_optimizer_state_the_user_split_runs_as_zero1_and_keeps_every_layout(kind, mode):
    params, batch = reference.problem(N * K * 2)
    expected = reference.window(params, reference.microbatches(batch, K))
    mesh = _mesh(N, kind)
    step = accumjax.make_train_step(reference.loss, mode=mode)  # optimizer_sharding default
    tx = accumjax.accumulate(optax.sgd(LR, momentum=0.9), K)
    state = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
    trace = dict(state.opt_state.inner_tx_state[0].trace)
    trace["w"] = jax.device_put(trace["w"], NamedSharding(mesh, P("data")))  # (8, 2)
    first, *rest = state.opt_state.inner_tx_state
    inner = (first._replace(trace=trace), *rest)
    state = state.replace(opt_state=state.opt_state._replace(inner_tx_state=inner))
    before = _specs(state)
    state = _window(mesh, mode, state, step, batch)
    _same_layout(before, _specs(state))
    assert state.params["w"].sharding.is_fully_replicated
    want = expected.params_after(params, LR)
    for key in params:
        scale = np.abs(want[key]).max()
        np.testing.assert_allclose(state.params[key], want[key], rtol=FLOAT32, atol=FLOAT32 * scale)


@pytest.mark.parametrize("zero", ["zero1", "zero2"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_plain_optimizer_in_stream_mode_keeps_the_zero_state_step_init_split(kind, zero):
    # A plain optax optimizer: each call is a window of one microbatch, its state split over
    # the data axis by step.init and updated where it lies (an Explicit mesh refused the
    # update's branches when the call planned it replicated).
    params, batch = reference.problem(N * K * 2)
    call = reference.microbatches(batch, K)[0]
    mesh = _mesh(N, kind)
    step = accumjax.make_train_step(reference.loss, mode="stream", optimizer_sharding=zero)
    tx = optax.sgd(LR, momentum=0.9)
    state = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
    assert state.opt_state[0].trace["w"].sharding.spec[0] == "data"
    before = _specs(state)
    state, metrics = step(state, jax.device_put(call, NamedSharding(mesh, P("data"))))
    _same_layout(before, _specs(state))
    assert bool(metrics["updated"])
    want = reference.window(params, [call]).params_after(params, LR)
    for key in params:
        scale = np.abs(want[key]).max()
        np.testing.assert_allclose(state.params[key], want[key], rtol=FLOAT32, atol=FLOAT32 * scale)


def test_zero_memory_per_device_holds_no_copy_of_the_parameters_more():
    # 4 kernels of 128x128 (P = 256 KiB of parameters), Adam, 2 devices. Per device,
    # arguments + temp in units of P: replicated 3P of state + 2P of temp (a full-size sum,
    # the gradient); ZeRO-1 2P of state (the moments halved) + 1.3P; ZeRO-2 also halves the
    # sum (0.9P of temp). A 1/N copy of the parameters more at the peak (their slices taken
    # before the window, or the new shards in a buffer of their own) is 0.1P to 0.5P more.
    width, layers, n = 128, 4, 2
    rng = np.random.default_rng(0)
    params = {f"w{i}": (rng.normal(size=(width, width)) / width**0.5) for i in range(layers)}
    params = jax.tree.map(lambda a: a.astype(np.float32), params)
    batch = {k: rng.normal(size=(n * K * 2, width)).astype(np.float32) for k in "xy"}

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - b["y"]) ** 2)

    mesh = _mesh(n, "explicit")
    size = layers * width * width * 4
    held = {}
    for layout in ("replicated", "zero1", "zero2"):
        step = accumjax.make_train_step(loss, mode="scan", optimizer_sharding=layout)
        state = step.init(jax.device_put(params, NamedSharding(mesh, P())), _adam())
        whole = jax.device_put(batch, NamedSharding(mesh, P("data")))
        m = step.lower(state, whole).compile().memory_analysis()
        held[layout] = (m.argument_size_in_bytes + m.temp_size_in_bytes) / size
    assert held["replicated"] > 5.0
    assert held["zero1"] < 3.35  # 3.31 measured
    assert held["zero2"] < 2.98  # 2.93 measured


def test_a_zero_layout_under_pmap_is_refused_naming_the_mesh():
    with pytest.raises(ValueError, match=r"optimizer_sharding='zero1'.*pmap.*mesh"):
        accumjax.make_train_step(reference.loss, axis_name="data", optimizer_sharding="zero1")
    accumjax.make_train_step(reference.loss, axis_name="data")  # replicated under pmap: fine


@pytest.mark.parametrize("mode", ["scan", "stream"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_zero1_beside_a_parameter_split_over_the_data_axis_keeps_both_layouts(kind, mode):
    """FSDP's ``w`` and a replicated ``b`` whose optimizer state ZeRO-1 splits, on 2 devices:
    both pinned where they lie in the update's loop (on an Explicit mesh by spec, inside
    ``auto_axes``)."""
    params, batch = _nan_problem()
    expected = reference.window(params, reference.microbatches(batch, K))
    mesh = _mesh(2, kind)
    placed = {
        "w": jax.device_put(params["w"], NamedSharding(mesh, P("data"))),
        "b": jax.device_put(params["b"], NamedSharding(mesh, P())),
    }
    step = accumjax.make_train_step(reference.loss, mode=mode, optimizer_sharding="zero1")
    state = step.init(placed, accumjax.accumulate(optax.sgd(LR, momentum=0.9), K))
    assert state.opt_state.inner_tx_state[0].trace["b"].sharding.spec[:1] == ("data",)
    before = _specs(state)
    state = _window(mesh, mode, state, step, batch)
    _same_layout(before, _specs(state))
    want = expected.params_after(params, LR)
    for key in params:
        scale = np.abs(want[key]).max()
        np.testing.assert_allclose(state.params[key], want[key], rtol=FLOAT32, atol=FLOAT32 * scale)
