"""The step object (accumjax._host): the state it builds, and composing it with JAX's
transformations.

``step.init`` lays the state out for the step's mode, mesh and precision (each stated once);
a step called inside ``jax.jit`` (several steps in one program), ``jax.vmap`` or a
``lax.scan`` over steps runs as called step by step, on one device and on a mesh, its
host-side checks skipped where values are traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
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
    f16 = accumjax.make_train_step(_loss, mixed_precision="float16").init(params, tx)
    assert float(f16.loss_scale.loss_scale) == 2.0**15  # the step's precision: its scale
    own = accumjax.dynamic_loss_scale(initial=8.0)
    given = accumjax.make_train_step(_loss).init(params, tx, loss_scale=own).loss_scale
    assert float(given.loss_scale) == 8.0
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
    tx = accumjax.accumulate(optax.adam(1e-2), K)
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
        with pytest.raises(TypeError, match=r"accumjax\.TrainState.*step\.init\(params, tx\)"):
            call(state, batch)


@pytest.mark.parametrize("state", [{"params": {}}, object()], ids=["dict", "object"])
def test_the_nnx_step_refuses_a_state_that_is_not_an_nnx_train_state(state):
    step = accumjax.make_nnx_train_step(lambda model, batch: jnp.mean(model(batch) ** 2))
    for call in (step, step.lower):
        with pytest.raises(TypeError, match=r"accumjax\.NNXTrainState.*step\.init\(model, tx\)"):
            call(state, jnp.ones((4, 3)))
