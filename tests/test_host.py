"""The step object (accumjax._host): the state it builds, and composing it with JAX's
transformations.

``step.init`` lays the state out for the step's mode, mesh and precision (each stated once);
a step called inside ``jax.jit`` (several steps in one program), ``jax.vmap`` or a
``lax.scan`` over steps runs as called step by step, on one device and on a mesh, its
host-side checks skipped where values are traced.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

K = 4


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _problem():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    x = rng.normal(size=(2 * K * 16, 5)).astype(np.float32)
    return params, {"x": x, "y": x[:, :3] ** 2}


def _calls(batch, mode, mesh=None):
    rows = 16 if mode == "stream" else K * 16
    parts = [
        jax.tree.map(lambda a, i=i: a[i : i + rows], batch) for i in range(0, len(batch["x"]), rows)
    ]
    return parts if mesh is None else jax.device_put(parts, NamedSharding(mesh, P("data")))


def test_init_lays_the_state_out_for_mode_mesh_and_precision():
    params, _ = _problem()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    scan = accumjax.make_train_step(_loss, mode="scan").init(params, tx)
    assert scan.opt_state.window.grad_sum is None and scan.loss_scale is None
    stream = accumjax.make_train_step(_loss).init(params, tx)
    assert stream.opt_state.window.partial_sums["w"].shape == (1, 5, 3)  # one shard
    mesh = jax.make_mesh((8,), ("data",))
    on_mesh = accumjax.make_train_step(_loss).init(
        jax.device_put(params, NamedSharding(mesh, P())), tx
    )
    sums = on_mesh.opt_state.window.partial_sums["w"]
    assert sums.shape == (8, 5, 3) and sums.sharding.spec[0] == "data"
    assert jax.tree.structure(on_mesh) == jax.tree.structure(stream)  # 1 device or 8
    f16_step = accumjax.make_train_step(_loss, mixed_precision="float16")
    f16 = f16_step.init(params, tx)
    assert float(f16.loss_scale.loss_scale) == 2.0**15  # the step's precision: its scale
    own = accumjax.dynamic_loss_scale(initial=8.0)
    assert float(f16_step.init(params, tx, loss_scale=own).loss_scale.loss_scale) == 8.0
    pmapped = accumjax.make_train_step(_loss, axis_name="data").init(params, tx)
    assert pmapped.params["w"].shape == (jax.local_device_count(), 5, 3)
    # The arrays are the state's own: donating them leaves the parameters given usable.
    state = accumjax.make_train_step(_loss).init(jnp.asarray(params["w"]), optax.sgd(0.1))
    assert state.params is not params["w"]


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize("where", ["one device", "mesh"])
def test_a_step_composes_with_jit_scan_and_vmap(mode, where):
    # Today's failure was ConcretizationTypeError from the donated-array check on a tracer.
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",)) if where == "mesh" else None
    step = accumjax.make_train_step(_loss, mode=mode, donate=False)
    # skip_window: no window run again, so the program of several calls compiles once each.
    tx = accumjax.accumulate(optax.adam(1e-2), K, on_nonfinite="skip_window")
    placed = params if mesh is None else jax.device_put(params, NamedSharding(mesh, P()))
    calls = _calls(batch, mode, mesh)
    start = step.init(placed, tx)
    ref = start
    for b in calls:
        ref, ref_metrics = step(ref, b)

    @jax.jit
    def many(state, calls):
        for b in calls:
            state, metrics = step(state, b)
        return state, metrics

    stacked = jax.tree.map(lambda *a: jnp.stack(a), *calls)
    scanned, scanned_metrics = jax.lax.scan(step, start, stacked)
    jitted, metrics = many(start, calls)
    for got in (jitted, scanned):
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            # One program instead of several: XLA may fuse the same float32 sums otherwise.
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert metrics["loss"].shape == () and scanned_metrics["loss"].shape == (len(calls),)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    if mesh is None:  # vmap: two copies of the state, one call each
        pair = jax.tree.map(lambda a: jnp.stack([a, a]), start)
        both, _ = jax.vmap(step, in_axes=(0, None))(pair, calls[0])
        one, _ = step(start, calls[0])
        for a, b in zip(jax.tree.leaves(both), jax.tree.leaves(one), strict=True):
            np.testing.assert_allclose(a[1], b, rtol=1e-6, atol=1e-7)


def test_host_checks_run_on_concrete_values_only():
    params, batch = _problem()
    step = accumjax.make_train_step(_loss)  # donates
    state = step.init(params, accumjax.accumulate(optax.sgd(0.1), K))
    first = _calls(batch, "stream")[0]
    step(state, first)
    with pytest.raises(ValueError, match=r"was deleted.*donated"):
        step(state, first)
    other = accumjax.accumulate(optax.sgd(0.1), 2 * K)
    fresh = step.init(params, accumjax.accumulate(optax.sgd(0.1), K)).replace(tx=other)
    with pytest.raises(ValueError, match=r"every_k=4.*every_k=8"):
        step(fresh, first)


@pytest.mark.parametrize("mode", ["stream", "scan"])
@pytest.mark.parametrize(
    "state", [{"params": {"w": np.zeros((5, 3))}}, object()], ids=["dict", "object"]
)
def test_a_state_that_is_not_a_train_state_is_a_type_error(mode, state):
    """What is not a TrainState is refused before any of its fields is read, naming the type
    the step takes and how to build one (it was an AttributeError on ``state.params``)."""
    _, batch = _problem()
    step = accumjax.make_train_step(_loss, mode=mode)
    for call in (step, step.lower):
        with pytest.raises(
            TypeError, match=r"accumjax\.TrainState.*step\.init\(params, tx\)"
        ) as err:
            call(state, batch)
        # Not TrainState.create: its stream-mode state without a loss scale is refused by a
        # scan step (issue 38: the suggested fix led to a second error).
        assert "create" not in str(err.value)


@pytest.mark.parametrize("state", [{"params": {}}, object()], ids=["dict", "object"])
def test_the_nnx_step_refuses_a_state_that_is_not_an_nnx_train_state(state):
    step = accumjax.make_nnx_train_step(lambda model, batch: jnp.mean(model(batch) ** 2))
    for call in (step, step.lower):
        with pytest.raises(TypeError, match=r"accumjax\.NNXTrainState.*step\.init\(model, tx\)"):
            call(state, jnp.ones((4, 3)))


# ----------------------------------------------------------------------------- on a mesh (issue 38)


def _lowerings(step, run):
    """How many programs of ``step``'s own function ``run()`` lowers, counted from JAX's
    public monitoring events: one per compilation (a persistent-cache hit is lowered too,
    so the count does not depend on what the suite compiled before)."""
    name = f"jit({step.__wrapped__.__name__})"
    seen = []

    def listen(event, duration, **kwargs):
        if event.endswith("jaxpr_to_mlir_module_duration") and kwargs.get("fun_name") == name:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(seen)


@pytest.mark.parametrize(
    "kind, mode",
    [(AxisType.Auto, "scan"), (AxisType.Auto, "stream"), (AxisType.Explicit, "scan")],
    ids=["auto-scan", "auto-stream", "explicit-scan"],
)
def test_init_lays_the_optimizer_state_out_like_the_parameters_and_compiles_once(kind, mode):
    """Issue 38: on an Auto mesh ``step.init`` left Adam's moments replicated (8x the
    per-device bytes); the first call sharded them, and the second compiled the step again."""
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    params = {  # FSDP: "w" split over "data" on its rows, "b" replicated
        "w": jax.device_put(np.zeros((8, 3), np.float32), NamedSharding(mesh, P("data"))),
        "b": jax.device_put(params["b"], NamedSharding(mesh, P())),
    }
    rows = 2 * K * 16  # two calls in scan mode, 2K in stream mode
    batch = {"x": np.ones((rows, 8), np.float32), "y": np.ones((rows, 3), np.float32)}
    step = accumjax.make_train_step(_loss, mode=mode)
    state = step.init(params, accumjax.accumulate(optax.adam(1e-2), K))
    adam = state.opt_state.inner_tx_state[0]
    for moment in (adam.mu, adam.nu):
        assert moment["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
        assert moment["w"].addressable_shards[0].data.shape == (1, 3)  # 1/8 of the rows
    calls = _calls(batch, mode, mesh)[:2]

    def two_calls():
        nonlocal state
        for b in calls:
            state, _ = step(state, b)

    assert _lowerings(step, two_calls) == 1  # the second call runs the first one's program


def test_init_on_a_one_device_auto_mesh_compiles_the_step_once():
    """Issue 38 (a new user's run): on an Auto mesh of one device the step returns every array
    replicated; ``step.init`` left some of them ``P("data")`` (the same layout there, another
    ``jit`` cache entry), so the second call compiled the step again."""
    params, batch = _problem()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), params)
    step = accumjax.make_train_step(_loss, mode="scan")
    state = step.init(params, accumjax.accumulate(optax.adam(1e-2), K))
    batch = jax.device_put(_calls(batch, "scan")[0], NamedSharding(mesh, P("data")))

    def two_calls():
        nonlocal state
        for _ in range(2):
            state, _ = step(state, batch)

    assert _lowerings(step, two_calls) == 1


class _Embed(nn.Module):
    """The smallest linen GPT part that failed: an embedding lookup (a gather)."""

    @nn.compact
    def __call__(self, ids):
        return nn.Dense(16)(nn.Embed(16, 8)(ids))


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_a_one_device_mesh_runs_the_path_of_n_devices(mode):
    """Issue 38: on ``jax.make_mesh((1,), ("data",))`` (Explicit axes) the embedding lookup
    raised ShardingTypeError, while 8 devices ran: the one-device mesh took the plain jitted
    path, where Explicit types reach the gather (``jax.jit(jax.grad(loss))`` fails there
    too). It takes the mesh path now, and trains as SGD on each window's rows does."""
    model = _Embed()
    ids = np.arange(2 * K * 16).reshape(-1, 1) % 16  # two windows
    loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, b)[:, 0], (b[:, 0] + 1) % 16
    ).mean()
    params = jax.jit(model.init)(jax.random.key(0), ids[:1])["params"]
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = accumjax.make_train_step(loss, mode=mode)
    state = step.init(
        jax.device_put(params, NamedSharding(mesh, P())), accumjax.accumulate(optax.sgd(0.5), K)
    )
    for b in _calls({"x": ids}, mode, mesh):
        state, _ = step(state, b["x"])
    grad = jax.jit(jax.grad(loss))  # off the mesh: one program, each window's rows at once
    for window in np.split(ids, 2):
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad(params, window))
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # float32 sums, another order


# ----------------------------------------------------------------------------- messages (issue 38)
# Each names the call that works on the first try.

_TX = accumjax.accumulate(optax.sgd(0.1), K)


def test_a_float16_state_without_a_loss_scale_names_step_init_which_works():
    # It named TrainState.create(..., loss_scale=...), whose stream-mode state a scan step
    # then refused for its accumulator.
    params, batch = _problem()
    rows = _calls(batch, "scan")[0]
    step = accumjax.make_train_step(_loss, mode="scan", mixed_precision="float16")
    created = accumjax.TrainState.create(apply_fn=None, params=params, tx=_TX)
    fix = r"step\.init\(params, tx\[, loss_scale=accumjax\.dynamic_loss_scale\(\.\.\.\)\]\)"
    with pytest.raises(ValueError, match=rf"loss_scale is None.*{fix}") as err:
        step(created, rows)
    assert "create" not in str(err.value)
    _, metrics = step(step.init(params, _TX), rows)  # the fix, as named, runs
    assert float(metrics["loss_scale"]) > 0


def test_swapped_init_arguments_are_a_short_type_error_naming_the_order():
    # It was "Error interpreting argument to functools.partial(...)" and every parameter value.
    params, _ = _problem()
    with pytest.raises(TypeError, match=r"parameters first.*call step\.init\(params, tx\)") as err:
        accumjax.make_train_step(_loss).init(_TX, params)
    assert len(str(err.value)) < 200 and "Array" not in str(err.value)


def test_a_loss_scale_for_a_step_that_is_not_float16_is_refused_at_init():
    # It was silently ignored: the step never reads it.
    params, _ = _problem()
    for precision in (None, "bfloat16"):
        step = accumjax.make_train_step(_loss, mixed_precision=precision)
        with pytest.raises(
            ValueError, match=r"mixed_precision='float16'.*Leave loss_scale out of step\.init"
        ):
            step.init(params, _TX, loss_scale=accumjax.dynamic_loss_scale())


def test_float16_with_propagate_is_refused_at_init():
    # It was refused only at the first call.
    params, _ = _problem()
    step = accumjax.make_train_step(_loss, mode="scan", mixed_precision="float16")
    with pytest.raises(ValueError, match=r"float16.*propagate.*on_nonfinite='skip_microbatch'"):
        step.init(params, accumjax.accumulate(optax.sgd(0.1), K, on_nonfinite="propagate"))


def _mesh_state(step):
    mesh = jax.make_mesh((8,), ("data",))
    params, _ = _problem()
    return mesh, step.init(jax.device_put(params, NamedSharding(mesh, P())), _TX)


def test_a_batch_that_does_not_split_over_devices_and_k_states_the_global_rule():
    # It was "the (per-device) batch size 9 is not divisible by K=4".
    step = accumjax.make_train_step(_loss, mode="scan")
    mesh, state = _mesh_state(step)
    x = np.ones((72, 5), np.float32)
    batch = jax.device_put({"x": x, "y": x[:, :3]}, NamedSharding(mesh, P("data")))
    rule = r"72 rows on 8 devices with K=4.*devices x K = 8 x 4 = 32.*64 or 96 rows.*divides 9"
    with pytest.raises(ValueError, match=rule):
        step(state, batch)


def test_a_batch_accumjax_puts_on_the_mesh_says_so_and_states_the_rule():
    # A 66-row batch off the mesh got JAX's own sharding error from the step's device_put.
    step = accumjax.make_train_step(_loss)
    _, state = _mesh_state(step)
    x = np.ones((66, 5), np.float32)
    said = r"not on the mesh, so accumjax puts it there.*'data'.*66 rows on 8 devices.*64 or 72"
    with pytest.raises(ValueError, match=said):
        step(state, {"x": x, "y": x[:, :3]})


def test_a_batch_that_does_not_split_into_k_on_one_device_names_the_rows():
    step = accumjax.make_train_step(_loss, mode="scan")
    params, _ = _problem()
    x = np.ones((9, 5), np.float32)
    with pytest.raises(ValueError, match=r"9 rows.*not divisible by K=4: use 8 or 12 rows"):
        step(step.init(params, _TX), {"x": x, "y": x[:, :3]})


def _masked_loss(params, batch):
    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=1)
    return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


def test_a_short_batch_against_the_strided_rule_is_refused_where_the_step_can_tell():
    # 3 real microbatches of 4 rows, K=4: 16 rows, the padding's mask 0.
    params, batch = _problem()
    real = {k: v[:12] for k, v in batch.items()} | {"mask": np.ones(12, np.float32)}
    pad = jax.tree.map(lambda a: np.zeros_like(a[:4]), real)
    appended = jax.tree.map(lambda a, b: np.concatenate([a, b]), real, pad)
    # Interleaved: row j*K + i is real microbatch i's row j (the first 3 of every 4 rows).
    interleaved = jax.tree.map(
        lambda a, b: (
            np.concatenate([a.reshape(3, 4, *a.shape[1:]), b[None]])
            .swapaxes(0, 1)
            .reshape(16, *a.shape[1:])
        ),
        real,
        pad,
    )
    tx = accumjax.accumulate(optax.sgd(0.1), K, scaling="weighted")
    step = accumjax.make_train_step(
        _masked_loss, mode="scan", weight_fn=lambda b: jnp.sum(b["mask"]), donate=False
    )
    state = step.init(params, tx)
    with pytest.raises(
        ValueError,
        match=r"(?s)num_real_microbatches=3, but microbatches \[3\].*weigh more than 0"
        r".*rows i, i \+ K, i \+ 2K.*first 3 of every 4 rows",
    ):
        step(state, appended, None, 3)  # microbatch 3 is rows 3, 7, 11, 15: 3 of them real
    new, metrics = step(state, interleaved, None, 3)
    assert bool(metrics["updated"])
    # The 12 real rows' update: 3 microbatches of 4 rows, each weighing 4 (float32 sums of
    # the same terms in another order).
    three, _ = step(step.init(params, accumjax.with_every_k(tx, 3)), real)
    for key in params:
        np.testing.assert_allclose(new.params[key], three.params[key], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"microbatches \[3\]"):  # a concrete array n too
        step(state, appended, None, jnp.int32(3))
    step(state, appended, None, 4)  # every microbatch real: nothing to tell


# ----------------------------------------------------------------------------- departures


def test_parameters_off_the_batchs_mesh_are_replicated_with_a_warning():
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",))
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    step = accumjax.make_train_step(_loss, mode="scan", donate=False)
    state = step.init(params, tx)  # one device: the batch's mesh is not known here
    on_mesh = jax.device_put(batch, NamedSharding(mesh, P("data")))
    with pytest.warns(UserWarning, match=r"params\['b'\] \(and 1 more\).*replicated.*FSDP"):
        new, _ = step(state, on_mesh)
    assert new.params["w"].sharding.is_fully_replicated  # as the warning says
    placed = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
    with warnings.catch_warnings():  # placed by the user, or by a step told its mesh: silent
        warnings.simplefilter("error")
        step(placed, on_mesh)
        accumjax.make_train_step(_loss, mesh=mesh, axis_name="data").init(params, tx)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_parameters_with_mixed_precision_warn_naming_float32_master_weights(dtype):
    params, batch = _problem()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    step = accumjax.make_train_step(_loss, mode="scan", mixed_precision=jnp.dtype(dtype).name)
    half = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
    with pytest.warns(UserWarning, match=r"params\['b'\] \(\w+16\) and 1 more.*float32 master"):
        step(step.init(half, tx), _calls(batch, "scan")[0])
    with warnings.catch_warnings():  # float32 master weights: nothing to say
        warnings.simplefilter("error")
        step(step.init(params, tx), _calls(batch, "scan")[0])
