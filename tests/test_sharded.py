"""The train step on a mesh under ``jit`` (accumjax.sharded, accumjax._sharded_steps).

8 host CPU devices: replicated data parallel and FSDP, Explicit and Auto meshes, a 2-D
(data, model) mesh, BatchNorm model state. References: plain optax on the whole batch, every
policy's window computed by hand in float64 NumPy (tests/_reference.py) on 1 and 8 devices,
and the collectives in the compiled HLO. Every metric is a scalar equal to the one-device
value; the gradient is reduced once per window in both modes.
"""

import dataclasses
import functools
import re
from typing import Any, cast

import _reference as reference
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax
import accumjax._mesh as mesh_lib
from accumjax.collectives import count_collectives

K = 4
N = 8
# A reduction of gradients moves at least one parameter's worth of bytes (the smallest, b1,
# is 32 floats); the metrics a stream call reduces are a few scalars.
GRADIENT_BYTES = 32 * 4
# float32 sums of the same rows in another order (per device and microbatch, reduced once)
# against plain optax's full-batch sum: a few ulps, which two momentum steps carry.
SAME_SUM = dict(rtol=2e-5, atol=2e-6)


_loss = reference.mlp_loss  # the model most tests here train


def _problem():
    return reference.mlp_problem(N * K * 2, (16, 32, 4), (1.0, 0.3))


FSDP = {"w1": P("data", None), "b1": P(), "w2": P("data", None)}


def _mesh(kind="explicit"):
    assert jax.device_count() >= N
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((N,), ("data",), axis_types=types)


def _put(params, mesh, fsdp):
    specs = FSDP if fsdp else dict.fromkeys(params, P())
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}


def _counts(compiled, trips, min_bytes=0):
    return count_collectives(
        compiled, per_execution=True, default_trip_count=trips, min_bytes=min_bytes
    )


# ----------------------------------------------------------------------------- scan mode


def _scan_run(mesh, fsdp, steps=2):
    params, batch = _problem()
    step = accumjax.make_train_step(_loss, mode="scan")
    tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
    if mesh is None:
        state = step.init(params, tx)
    else:
        state = step.init(_put(params, mesh, fsdp), tx)
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    compiled = step.lower(state, batch).compile()
    for _ in range(steps):
        state, metrics = step(state, batch)
    return state, metrics, compiled


@functools.cache
def _plain_optax(steps):
    """The reference of `_scan_run`: plain optax (SGD, 0.1, momentum 0.9) on one device,
    ``steps`` steps on the whole batch's gradient (float32, one jitted program), and the last
    step's loss and gradient norm (a mean over rows: the mean of equal microbatches' means)."""
    params, batch = _problem()
    tx = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state, loss, norm = step(params, opt_state)
    return jax.tree.map(np.asarray, params), {"loss": float(loss), "grad_norm": float(norm)}


@pytest.mark.parametrize(
    "kind,fsdp", [("explicit", False), ("auto", False), ("explicit", True), ("auto", True)]
)
def test_scan_on_a_mesh_matches_plain_optax_and_reduces_once_per_window(kind, fsdp):
    state, metrics, compiled = _scan_run(_mesh(kind), fsdp)
    ref, ref_metrics = _plain_optax(2)
    for key in ref:
        np.testing.assert_allclose(state.params[key], ref[key], **SAME_SUM)
    # Global values: the scalars of one device (the loss travels in the window's reduction).
    counts = ("skipped_microbatches", "nonfinite_microbatches")
    assert {k: jnp.shape(v) for k, v in metrics.items()} == {
        k: () for k in (*ref_metrics, "updated", *counts)
    }
    for key in ("loss", "grad_norm"):  # float32 sums in another order: 1e-6
        np.testing.assert_allclose(float(metrics[key]), ref_metrics[key], rtol=1e-6)
    # Issue 37: each microbatch is added as it comes; the devices' verdicts about it travel in
    # the window's one all-reduce (with the replicated gradients and the loss), so a NaN row
    # still leaves the whole microbatch out, and nothing is reduced per microbatch but FSDP's
    # kernels, reduce-scattered into an accumulator sharded like them. Only a window with a
    # refused microbatch runs again (a loop of at most one trip here), reducing the same again.
    clean, again = _counts(compiled, 0), _counts(compiled, 1)
    assert clean == {**clean, "all-reduce": 1, "collective-permute": 0, "all-to-all": 0}
    assert clean["all-gather"] == (2 if fsdp else 0)  # FSDP: the two kernels, once
    assert clean["reduce-scatter"] == (2 * K if fsdp else 0)  # two kernels, each microbatch
    assert again == {**clean, "all-reduce": 2, "reduce-scatter": 2 * clean["reduce-scatter"]}


def test_fsdp_state_stays_sharded_and_memory_scales_down():
    mesh = _mesh()
    state, _, compiled = _scan_run(mesh, fsdp=True, steps=1)
    for key, spec in FSDP.items():
        momentum = state.opt_state.inner_tx_state[0].trace[key]
        for x in (state.params[key], momentum):  # Explicit or Auto spelling of the spec
            assert tuple(x.sharding.spec)[: len(spec)] == tuple(spec)
    assert state.opt_state.window.grad_sum is None  # scan mode: the state holds no accumulator
    _, _, replicated = _scan_run(mesh, fsdp=False, steps=1)

    def held(c):
        m = c.memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes

    _, batch = _problem()
    batch_bytes = sum(v.nbytes for v in batch.values()) // N  # the batch is sharded in both
    # 1/N of the replicated state plus the per-device batch, bias and scalars (< 2 KiB here).
    assert held(compiled) <= (held(replicated) - 2 * batch_bytes) / N + 2 * batch_bytes + 4096


def test_layout_of_reads_the_data_axis_and_refuses_what_it_cannot_split():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    batch = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("data")))
    tp = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "model")))
    fsdp = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("data", "model")))
    layout = mesh_lib.layout_of({"tp": tp, "fsdp": fsdp}, batch)
    assert (layout.axis, layout.param_dims, layout.shards) == ("data", (0, None), 2)
    both = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P(("data", "model"))))
    with pytest.raises(NotImplementedError, match="one mesh axis"):
        mesh_lib.layout_of({"w": jnp.ones(3)}, both)
    assert mesh_lib.layout_of({"w": jnp.ones(3)}, jnp.ones((8, 3))) is None  # one device
    with pytest.raises(ValueError, match=r"several axes.*axis_name='data'"):
        mesh_lib.data_axis(mesh)


def test_the_mesh_path_keeps_a_sharded_state_and_places_what_is_off_the_mesh():
    # make_train_step(mesh=, axis_name=) runs where the arrays lie: an FSDP state stays
    # sharded (it used to be refused), unsharded inputs go on the mesh.
    mesh = _mesh()
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
    step = accumjax.make_train_step(_loss, mode="scan", axis_name="data", mesh=mesh)
    plain = step.init(params, tx)  # off the mesh: init puts it there, replicated
    assert plain.params["w1"].sharding.mesh == mesh
    state = step.init(_put(params, mesh, fsdp=True), tx)
    for _ in range(2):
        state, metrics = step(state, batch)  # the batch is split over "data" by the step
    ref, _ = _plain_optax(2)
    for key in ref:
        np.testing.assert_allclose(state.params[key], ref[key], **SAME_SUM)
    assert state.params["w1"].sharding.spec[0] == "data" and metrics["loss"].shape == ()


def test_params_and_batch_on_meshes_of_the_same_devices_with_other_axes_are_named():
    params, batch = _problem()
    mesh = _mesh()
    other = jax.make_mesh((N,), ("batch",))
    step = accumjax.make_train_step(_loss, mode="scan", donate=False)
    state = step.init(_put(params, mesh, False), accumjax.accumulate(optax.sgd(0.1), K))
    batch = jax.device_put(batch, NamedSharding(other, P("batch")))
    with pytest.raises(ValueError, match=r"'data': 8.*'batch': 8.*same devices"):
        step(state, batch)


@pytest.mark.parametrize("other", ["order", "types"])
def test_meshes_that_print_alike_say_what_differs(other):
    params, batch = _problem()
    mesh = _mesh()
    devices, types = mesh.devices, mesh.axis_types
    if other == "order":
        devices, match = devices[::-1], r"device order \[0, 1, .*\] vs \[7, 6, "
    else:
        types, match = (AxisType.Auto,), r"axis types \(Explicit,\) vs \(Auto,\)"
    batch = jax.device_put(
        batch, NamedSharding(Mesh(devices, ("data",), axis_types=types), P("data"))
    )
    step = accumjax.make_train_step(_loss, mode="scan", donate=False)
    state = step.init(_put(params, mesh, False), accumjax.accumulate(optax.sgd(0.1), K))
    with pytest.raises(ValueError, match=rf"'data': 8.*'data': 8.*same devices.*{match}"):
        step(state, batch)


def test_fsdp_gather_per_microbatch_trades_gathers_for_memory():
    mesh = _mesh()
    params, batch = _problem()
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
    results = {}
    for gather in ("window", "microbatch"):
        step = accumjax.make_train_step(_loss, mode="scan", gather_params=gather, donate=False)
        state = step.init(_put(params, mesh, True), tx)
        compiled = step.lower(state, batch).compile()
        results[gather] = (step(state, batch)[0].params, _counts(compiled, 1))
    (window_params, window_counts), (micro_params, micro_counts) = results.values()
    # Per microbatch: two kernels x K, in the window's loop of K microbatches, and again in
    # its second pass (a loop of at most one trip here) when the devices refused one: every
    # device runs the same gathers. Each microbatch's kernel gradients are reduce-scattered.
    assert window_counts["all-gather"] == 2 and micro_counts["all-gather"] == 2 * 2 * K
    assert window_counts["reduce-scatter"] == micro_counts["reduce-scatter"] == 2 * 2 * K
    ref, _ = _plain_optax(1)
    for key in ref:
        np.testing.assert_allclose(window_params[key], ref[key], **SAME_SUM)
        np.testing.assert_allclose(micro_params[key], ref[key], **SAME_SUM)
    with pytest.raises(ValueError, match="gather_params"):
        accumjax.make_train_step(_loss, mode="scan", gather_params="layer")


@pytest.mark.parametrize("policy", ["skip_microbatch", "max_norm"])
def test_a_gather_per_microbatch_matches_the_float64_reference(policy):
    # A NaN target (a large one for max_norm) in device 0's rows of microbatch 1. Gathering
    # per microbatch puts collectives in the loop: a re-run decided on device 0 alone left the
    # others waiting in the gather (XLA aborted after 40 s). The whole microbatch is left out
    # (clipped by its whole norm), as when gathering once per window.
    params, batch, expected = _reference_problem(policy)
    state, metrics = _reference_run(
        policy, "scan", "8 fsdp", params, batch, gather_params="microbatch"
    )
    _check_against_reference(state, metrics, "scan", params, expected)


@pytest.mark.parametrize("on_nonfinite", ["skip_microbatch", "skip_window"])
def test_float16_overflow_on_one_shard_under_fsdp_is_skipped_and_lowers_the_scale(on_nonfinite):
    # One row of one device's shard of one microbatch overflows float16 (issue 17: params and
    # Adam state became Inf, grads_finite said True and the scale never went down).
    mesh = _mesh()
    params, batch = _problem()
    batch["y"][3] = 1e4  # row 3: device 0's rows, microbatch 3 (rows i, i + K, ...)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    tx = accumjax.accumulate(optax.adam(1e-2), K, on_nonfinite=on_nonfinite)
    step = accumjax.make_train_step(_loss, mode="scan", mixed_precision="float16")
    state = step.init(_put(params, mesh, True), tx)  # float16: init makes the loss scale
    assert float(state.loss_scale.loss_scale) == 2.0**15
    before = jax.tree.map(np.asarray, state.params)
    after, metrics = step(state, batch)
    assert not bool(metrics["grads_finite"]) and metrics["grads_finite"].shape == ()
    assert float(after.loss_scale.loss_scale) < 2.0**15  # lowered at the window's end
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(after.params))
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(after.opt_state))
    assert int(after.opt_state.nonfinite_count) >= 1
    if on_nonfinite == "skip_window":  # nothing applied: the parameters bit for bit
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after.params), before)
    else:  # the other microbatches were applied
        assert bool(metrics["updated"])


def test_aux_is_global_rows_concatenated_and_scalars_averaged():
    # Per-row aux (a residual per row) has every device's rows; a scalar per microbatch is
    # the mean over the devices (their rows are equal in number): one device's values.
    def loss(params, batch):
        err = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"] - batch["y"]
        return jnp.mean(err**2), {"row": jnp.mean(err**2, axis=1), "mean": jnp.mean(err)}

    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    mesh = _mesh()
    # The reference, float64 NumPy: each row's residual at the parameters.
    wide = {k: np.asarray(v, np.float64) for k, v in params.items()}
    err = np.tanh(batch["x"] @ wide["w1"] + wide["b1"]) @ wide["w2"] - batch["y"]
    scan_ref = {  # stacked per microbatch (rows i, i + K, ...)
        "row": np.stack([np.mean(err[i::K] ** 2, axis=1) for i in range(K)]),
        "mean": np.array([np.mean(err[i::K]) for i in range(K)]),
    }
    stream_ref = {"row": np.mean(err[:N] ** 2, axis=1), "mean": np.mean(err[:N])}
    for mode, rows, ref in (
        ("scan", batch, scan_ref),
        ("stream", jax.tree.map(lambda a: a[:N], batch), stream_ref),
    ):
        step = accumjax.make_train_step(loss, mode=mode, has_aux=True, donate=False)
        on_mesh = jax.device_put(rows, NamedSharding(mesh, P("data")))
        _, got = step(step.init(_put(params, mesh, False), tx), on_mesh)
        for key in ref:  # float32 against float64: sums of 16 and 32 terms, 1e-6
            assert got["aux"][key].shape == ref[key].shape, key
            np.testing.assert_allclose(got["aux"][key], ref[key], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- stream mode


def _micro(batch, mesh):
    data = NamedSharding(mesh, P("data")) if mesh is not None else None
    parts = [jax.tree.map(lambda a, j=j: a[j * N : (j + 1) * N], batch) for j in range(2 * K)]
    return [p if data is None else jax.device_put(p, data) for p in parts]


def _stream_run(mesh, fsdp, tx, step=None):
    """K stream calls per window (N rows each), two windows, from ``step.init``."""
    params, batch = _problem()
    step = step or accumjax.make_train_step(_loss)
    state = step.init(params if mesh is None else _put(params, mesh, fsdp), tx)
    micro = _micro(batch, mesh)
    compiled = step.lower(state, micro[0]).compile()
    metrics = []
    for mb in micro:
        state, m = step(state, mb)
        metrics.append(m)
    return state, metrics, compiled


@functools.cache
def _full_batch_sgd():
    """One device, plain optax SGD on each window's K * N rows at once (float32, one jitted
    program): the parameters after the two windows, and each stream call's loss (its N rows'
    mean at the window's parameters)."""
    params, batch = _problem()
    tx = optax.sgd(0.5)

    @jax.jit
    def window(params, opt_state, rows):
        updates, opt_state = tx.update(jax.grad(_loss)(params, rows), opt_state, params)
        calls = jax.tree.map(lambda a: a.reshape(K, N, *a.shape[1:]), rows)
        losses = jax.vmap(_loss, in_axes=(None, 0))(params, calls)
        return optax.apply_updates(params, updates), opt_state, losses

    opt_state, losses = tx.init(params), []
    for w in range(len(batch["x"]) // (K * N)):
        rows = jax.tree.map(lambda a, w=w: a[w * K * N : (w + 1) * K * N], batch)
        params, opt_state, window_losses = window(params, opt_state, rows)
        losses += [float(x) for x in window_losses]
    return jax.tree.map(np.asarray, params), losses


@pytest.mark.parametrize(
    "kind,fsdp", [("explicit", False), ("auto", False), ("explicit", True), ("auto", True)]
)
def test_stream_on_a_mesh_reduces_once_per_window_with_global_metrics(kind, fsdp):
    # A state from step.init keeps one partial sum per device (FSDP: the gather of the
    # sharded parameters and the reduce-scatter of their gradient, per call); each call's
    # loss and counts travel in one small all-reduce; the gradient is reduced when the
    # window closes. SGD, not adam: adam's scale invariance would hide a window counted 8
    # times.
    state, metrics, compiled = _stream_run(
        _mesh(kind), fsdp, accumjax.accumulate(optax.sgd(0.5), K)
    )
    ref, losses = _full_batch_sgd()
    for key in ref:
        np.testing.assert_allclose(state.params[key], ref[key], rtol=1e-5, atol=1e-6)
    assert int(state.step) == 2
    for got, want in zip(metrics, losses, strict=True):  # global scalars: each call's rows
        assert {k: jnp.shape(v) for k, v in got.items()} == dict.fromkeys(got, ())
        np.testing.assert_allclose(float(got["loss"]), want, rtol=1e-6)  # another order
    # The close runs in a loop of at most one trip whose count XLA does not know: a trip
    # count of 0 counts what every call runs, 1 what the closing call runs.
    every, closing = _counts(compiled, 0), _counts(compiled, 1)
    sharded_leaves = 2 if fsdp else 0
    assert every == {**every, "all-reduce": 1, "all-gather": sharded_leaves}  # the metrics
    assert every["reduce-scatter"] == sharded_leaves
    assert _counts(compiled, 0, GRADIENT_BYTES)["all-reduce"] == 0  # no gradient every call
    assert closing == {**every, "all-reduce": 2}
    assert _counts(compiled, 1, GRADIENT_BYTES)["all-reduce"] == 1  # once per window


def test_stream_states_from_create_train_on_a_mesh_reducing_every_call():
    # TrainState.create's parameter-shaped window: the gradient is reduced on every call
    # (in the same shard_map), the result is the same.
    mesh = _mesh()
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    step = accumjax.make_train_step(_loss)
    state = accumjax.TrainState.create(apply_fn=None, params=_put(params, mesh, False), tx=tx)
    micro = _micro(batch, mesh)
    compiled = step.lower(state, micro[0]).compile()
    for mb in micro:
        state, _ = step(state, mb)
    ref, _ = _full_batch_sgd()
    for key in ref:
        np.testing.assert_allclose(state.params[key], ref[key], rtol=1e-5, atol=1e-6)
    assert _counts(compiled, 0, GRADIENT_BYTES)["all-reduce"] == 1


class _Tagged(accumjax.TrainState):
    """A train state of the user's own: a traced field and a static one besides the step's."""

    seen: Any = None
    tag: str = struct.field(pytree_node=False, default="mine")


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_a_train_state_subclass_trains_on_a_mesh_as_a_train_state_does(mode):
    # The step's shard_map takes the train state as it is (FSDP parameters as they lie, every
    # other field whole): a subclass's own fields pass through untouched, and its windows
    # are a TrainState's, bit for bit.
    mesh = _mesh()
    params, batch = _problem()
    step = accumjax.make_train_step(_loss, mode=mode)
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    whole = jax.device_put(batch, NamedSharding(mesh, P("data")))
    calls = _micro(batch, mesh) if mode == "stream" else [whole, whole]
    runs = []
    for cls in (accumjax.TrainState, _Tagged):
        state = step.init(_put(params, mesh, True), tx)
        if cls is _Tagged:
            fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
            state = _Tagged(**fields, seen=jnp.arange(3.0))
        losses = []
        for batch_of_call in calls:
            state, metrics = step(state, batch_of_call)
            losses.append(float(metrics["loss"]))
        runs.append((state, losses))
    (base, base_losses), (mine, losses) = runs
    assert isinstance(mine, _Tagged) and mine.tag == "mine"
    np.testing.assert_array_equal(mine.seen, [0.0, 1.0, 2.0])
    assert int(mine.step) == int(base.step) == 2 and losses == base_losses
    for key in base.params:
        np.testing.assert_array_equal(mine.params[key], base.params[key])


def test_stream_on_a_2d_mesh_reduces_once_per_window_over_the_data_axis():
    # (data=4, model=2): replicated parameters, and a tensor-parallel kernel split over
    # "model". The window is kept per data shard and reduced over "data" once per window.
    params, batch = _problem()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    ref, _ = _full_batch_sgd()
    for tp in (False, True):
        step = accumjax.make_train_step(_loss, mesh=mesh, axis_name="data")
        placed = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in params.items()}
        if tp:
            placed["w1"] = jax.device_put(params["w1"], NamedSharding(mesh, P(None, "model")))
        state = step.init(placed, tx)
        assert state.opt_state.window.partial_sums["w1"].shape == (4, 16, 32)
        micro = [jax.tree.map(lambda a, j=j: a[j * N : (j + 1) * N], batch) for j in range(2 * K)]
        compiled = step.lower(state, micro[0]).compile()
        for mb in micro:
            state, metrics = step(state, mb)
        for key in ref:
            np.testing.assert_allclose(state.params[key], ref[key], rtol=1e-5, atol=1e-6)
        assert metrics["loss"].shape == ()
        gradient = _counts(compiled, 1, GRADIENT_BYTES)["all-reduce"]
        every = _counts(compiled, 0, GRADIENT_BYTES)["all-reduce"]
        if not tp:  # nothing else moves gradients: once per window, never per call
            assert (every, gradient) == (0, 1)
        # Over "data": the call's metrics, and the window's close (the gradient): the
        # tensor-parallel reductions over "model" are the model's own.
        assert _data_axis_reductions(compiled, mesh) == 2


def _data_axis_reductions(compiled, mesh):
    """All-reduces in the program whose replica groups are the data axis's (each group one
    device of every data index), as written (a stream call has no microbatch loop)."""
    data_groups = {frozenset(int(d.id) for d in row) for row in mesh.devices.T}
    found = 0
    for line in compiled.as_text().splitlines():
        groups = re.search(r" all-reduce(?:-start)?\(.*replica_groups=\{(\{[\d,{}]+\})\}", line)
        if groups is None:
            continue
        sets = {frozenset(map(int, g.strip("{}").split(","))) for g in groups.group(1).split("},{")}
        found += sets == data_groups
    return found


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = accumjax.AccumBatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(8)(x))
        return nn.Dense(4)(nn.relu(x))


def _batch_norm_stream_window(batch):
    """One stream window (K calls of N rows) of `_BatchNormNet` on the 8-device mesh, from
    ``step.init``: the state after it, each call's metrics, the compiled call and the
    initial variables."""
    model = _BatchNormNet()
    variables = jax.jit(model.init)(jax.random.key(0), batch["x"][:N])  # one program

    def loss(params, model_state, b):
        out, new = model.apply({"params": params, **model_state}, b["x"], mutable=["batch_stats"])
        return jnp.mean((out - b["y"]) ** 2), new

    tx = accumjax.accumulate(optax.sgd(0.1), K)
    mesh = _mesh()
    step = accumjax.make_train_step(loss, donate=False)
    params = jax.device_put(variables["params"], NamedSharding(mesh, P()))
    state = step.init(params, tx, model_state={"batch_stats": variables["batch_stats"]})
    micro = _micro(batch, mesh)[:K]  # one window: the parameters are the same throughout
    compiled = step.lower(state, micro[0]).compile()
    metrics = []
    for mb in micro:
        state, m = step(state, mb)
        metrics.append(m)
    return state, metrics, compiled, variables


def _pooled_running_stats(variables, x):
    """The reference of a window's close, float64 NumPy: the running statistics moved by
    the first Dense layer's outputs over the rows ``x`` (momentum 0.5 from (0, 1))."""
    dense = {k: np.asarray(v, np.float64) for k, v in variables["params"]["Dense_0"].items()}
    h = x @ dense["kernel"] + dense["bias"]
    return {"mean": 0.5 * h.mean(0), "var": 0.5 + 0.5 * h.var(0)}


def test_stream_with_batch_norm_pools_statistics_per_call_and_reduces_gradients_once():
    # BatchNorm windows are pooled with each call's loss in its one small all-reduce, so the
    # running statistics move at the close with the whole window's pooled statistics, as on
    # one device; the gradient is reduced once per window.
    _, batch = _problem()
    state, _, compiled, variables = _batch_norm_stream_window(batch)
    stats_mesh = state.model_state["batch_stats"]["AccumBatchNorm_0"]
    # The running statistics move once by the pooled window's statistics (Chan et al.), as on
    # one device (the updates differ: each device normalizes its own rows). The reference:
    # the window's K * N rows. float32 sums of 32 rows: 1e-6.
    want = _pooled_running_stats(variables, batch["x"][: K * N])
    for name in ("mean", "var"):
        np.testing.assert_allclose(stats_mesh[name], want[name], rtol=1e-5, atol=1e-6)
    assert int(stats_mesh["acc_step"]) == 0 and stats_mesh["acc_mean"].shape == (8,)
    assert _counts(compiled, 0, GRADIENT_BYTES)["all-reduce"] == 0
    assert _counts(compiled, 1, GRADIENT_BYTES)["all-reduce"] == 1
    assert _counts(compiled, 0)["all-reduce"] == 1  # loss, counts and statistics together


def test_a_skipped_stream_microbatch_on_a_mesh_leaves_its_batch_norm_statistics_out():
    # A NaN target in one device's row of microbatch 1 makes that call's gradient non-finite:
    # every device skips it, and its BatchNorm statistics (finite: BatchNorm sees only x) are
    # not merged into the pooled window. The running statistics move by the other three
    # microbatches' rows alone, as on one device.
    _, batch = _problem()
    batch["y"][1 * N + 3] = np.nan  # microbatch 1, device 3's row
    state, metrics, _, variables = _batch_norm_stream_window(batch)
    assert [int(m["skipped_microbatches"]) for m in metrics] == [0, 1, 0, 0]
    stats_mesh = state.model_state["batch_stats"]["AccumBatchNorm_0"]
    kept = np.concatenate([batch["x"][:N], batch["x"][2 * N : K * N]])
    want = _pooled_running_stats(variables, kept)
    for name in ("mean", "var"):
        np.testing.assert_allclose(stats_mesh[name], want[name], rtol=1e-5, atol=1e-6)
    assert int(stats_mesh["acc_step"]) == 0 and bool(metrics[-1]["updated"])


def test_stream_mode_resumes_a_mid_window_orbax_checkpoint_bit_for_bit(tmp_path):
    # The partial sums are every device's slice of a global array: a checkpoint saved
    # mid-window (orbax's own route, step.init's abstract state as the target) holds every
    # device's and resumes bit for bit on the same devices.
    import orbax.checkpoint as ocp

    mesh = _mesh()
    params, batch = _problem()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    step = accumjax.make_train_step(_loss, donate=False)
    placed = _put(params, mesh, True)
    state = step.init(placed, tx)
    micro = _micro(batch, mesh)[:K]
    for mb in micro[:2]:
        state, _ = step(state, mb)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), placed
    )
    restored = checkpointer.restore(tmp_path / "ckpt", step.init(abstract, tx))
    checkpointer.close()
    assert int(restored.opt_state.window.micro_step) == 2
    for mb in micro[2:]:
        state, _ = step(state, mb)
        restored, _ = step(restored, mb)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same program
        assert a.sharding == b.sharding  # nothing replicated behind the user's back


def test_a_state_for_another_number_of_devices_is_refused_naming_the_fix():
    params, batch = _problem()
    step = accumjax.make_train_step(_loss)
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    state = step.init(_put(params, _mesh(), False), tx)  # 8 partial sums
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    rows = jax.device_put(jax.tree.map(lambda a: a[:N], batch), NamedSharding(four, P("data")))
    moved = jax.device_put(state, NamedSharding(four, P()))
    with pytest.raises(ValueError, match=r"8 partial sums.*4 data shards.*restore_checkpoint"):
        step(moved, rows)


class _LinenEmbed(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Dense(11)(nn.Embed(11, 8)(ids).mean(axis=1))


class _NNXEmbed(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.out = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.embed(ids).mean(axis=1))


def test_embedding_models_train_in_stream_mode_on_the_default_explicit_mesh():
    # jax.make_mesh's default axes are Explicit, where jit of an embedding lookup with a
    # sharded batch fails ("Use .at[...].get(out_sharding=)"); the step takes each device's
    # gradient inside a shard_map, where the lookup is local.
    mesh = jax.make_mesh((N,), ("data",))
    assert mesh.axis_types == (AxisType.Explicit,)
    ids = np.random.default_rng(0).integers(0, 11, size=(2 * K * N, 5)).astype(np.int32)
    micro = [
        jax.device_put(ids[i * N : (i + 1) * N], NamedSharding(mesh, P("data")))
        for i in range(2 * K)
    ]
    xent = optax.softmax_cross_entropy_with_integer_labels
    linen = _LinenEmbed()
    linen_loss = lambda p, b: xent(linen.apply({"params": p}, b), b[:, 0]).mean()
    init = jax.jit(linen.init)  # one program, not each op of the init compiled on its own
    params = init(jax.random.key(0), ids[:1])["params"]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    step = accumjax.make_train_step(linen_loss)
    state = step.init(params, tx)
    for mb in micro:
        state, _ = step(state, mb)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: _NNXEmbed(nnx.Rngs(0)))()  # one program, as init above
    nnx_step = accumjax.make_nnx_train_step(lambda m, b: xent(m(b), b[:, 0]).mean())
    nnx_state = nnx_step.init(model, accumjax.accumulate(optax.sgd(0.5), K))
    for mb in micro:
        nnx_state, _ = nnx_step(nnx_state, mb)
    assert int(state.step) == 2 and int(nnx_state.step) == 2
    # One device, each window's rows at once: the same SGD steps.
    ref = jax.device_get(init(jax.random.key(0), ids[:1])["params"])
    full_batch_grad = jax.jit(jax.grad(linen_loss))  # one program, not one per operation
    for w in range(2):
        grads = full_batch_grad(ref, ids[w * K * N : (w + 1) * K * N])
        ref = jax.tree.map(lambda p, g: p - 0.5 * g, ref, grads)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx_state.params))


# ----------------------------------------------------------------------------- a fixed reference

# Issues 32 and 36: every policy decides about the whole microbatch, as one device holding all
# its rows would, and makes of the window what tests/_reference.py computes by hand in float64
# NumPy, on one device, on 8 (replicated parameters) and under FSDP. Each policy's trait sits
# in row 1 (microbatch 1; on a mesh, device 0's rows): a NaN target (the non-finite policies;
# under "propagate" one column of the gradient is NaN and the other is checked) or targets
# _LARGE times the others' (max_norm clips microbatch 1 and two more by their whole norms,
# skip_fn skips microbatch 1; on one device's two rows of a microbatch the norms differ, up to
# 111 against 13).
_MAX_NORM, _SKIP_NORM, _LARGE = 7.0, 11.0, 30.0
_POLICIES = reference.policies(_MAX_NORM, _SKIP_NORM)
_LR = 0.5
# float32 against float64: each gradient entry is a sum of at most 64 products of O(1) terms,
# each rounded once (2**-24 relative), and the SGD step rounds once more: a few 1e-7 of the
# values' scale (measured: at most 5e-7, on 1 and 8 devices). A halved gradient, a microbatch
# decided on one device's rows or a wrong K moves the parameters by 1e-2 or more.
_FLOAT32 = 2e-6


def _reference_problem(policy):
    """Parameters, one window's batch (K * N * 2 rows) with ``policy``'s trait, and the
    float64 reference of that window."""
    params, batch = reference.problem(N * K * 2)
    if policy in ("max_norm", "skip_fn"):
        batch["y"][1] *= _LARGE
    else:
        batch["y"][1, 0] = np.nan
    if policy == "weighted":
        rows = np.arange(N * K * 2)
        batch["m"] = np.where(rows % 3 == 0, 0.0, np.where(rows % 5 == 0, 0.5, 1.0))
        batch["m"] = batch["m"].astype(np.float32)
        # Microbatch 2's rows on device 7 (rows 56-63) weigh nothing: that device's unguarded
        # masked mean is 0/0, which must neither vote nor add.
        batch["m"][[58, 62]] = 0.0
    ref_kwargs = {k: v for k, v in _POLICIES[policy].items() if k != "skip_fn"}
    if policy == "skip_fn":
        ref_kwargs["skip_norm"] = _SKIP_NORM
    expected = reference.window(params, reference.microbatches(batch, K), **ref_kwargs)
    return params, batch, expected


def _reference_run(policy, mode, devices, params, batch, calls=None, **step_kwargs):
    """One window of ``policy`` in ``mode`` ("1", "8" or "8 fsdp" devices) from ``params``,
    by ``make_train_step(..., **step_kwargs)`` (stream mode: its first ``calls`` calls, or
    all K): the state and every call's metrics (floats)."""
    scaling = _POLICIES[policy].get("scaling", "mean")
    step = accumjax.make_train_step(
        reference.total_loss if scaling == "sum" else reference.loss,
        mode=mode,
        weight_fn=(lambda b: jnp.sum(b["m"])) if scaling == "weighted" else None,
        **step_kwargs,
    )
    tx = accumjax.accumulate(optax.sgd(_LR), K, **_POLICIES[policy])
    put = lambda tree, spec: tree
    specs = {"w": P(), "b": P()}
    if devices != "1":
        mesh = _mesh()
        put = lambda tree, spec: jax.device_put(
            tree, jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
        )
        if devices == "8 fsdp":
            specs["w"] = P("data", None)  # (8, 2): one row a device
    state = step.init(put(params, specs), tx)
    every = [batch] if mode == "scan" else reference.microbatches(batch, K)
    metrics = []
    for call in every[:calls]:
        state, m = step(state, put(call, dict.fromkeys(call, P("data"))))
        for name in ("skipped_microbatches", "nonfinite_microbatches"):  # counts: int scalars
            assert (m[name].shape, m[name].dtype) == ((), jnp.int32)
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def _counts_of(state):
    """The integer `stats` of a state (memory_bytes, a Python int, is the layout's)."""
    stats = accumjax.stats(state.opt_state)._asdict()
    is_count = lambda v: isinstance(v, jax.Array) and not jnp.issubdtype(v.dtype, jnp.floating)
    return {k: int(v) for k, v in stats.items() if is_count(v)}


def _check_against_reference(state, metrics, mode, params, expected):
    counts = expected.counts
    assert _counts_of(state) == {
        **counts,
        "every_k": K,
        "current_step": 0,
        "overflow_detected": int(counts["num_nonfinite"] > 0),
    }
    got = jax.tree.map(np.asarray, state.params)
    if expected.gradient is None:  # not applied: the parameters bit for bit
        jax.tree.map(np.testing.assert_array_equal, got, params)
    want = expected.params_after(params, _LR)
    for key in params:
        scale = np.nanmax(np.abs(want[key]))
        np.testing.assert_allclose(got[key], want[key], rtol=_FLOAT32, atol=_FLOAT32 * scale)
    updated = expected.gradient is not None
    # The count metrics: what each call did with its microbatches (scan: the window's K;
    # stream: its one, the policy's trait in microbatch 1), the counts `stats` adds up.
    skipped, nonfinite = counts["skipped_microbatches"], counts["num_nonfinite"]
    per_call = [(m["skipped_microbatches"], m["nonfinite_microbatches"]) for m in metrics]
    if mode == "scan":
        assert per_call == [(skipped, nonfinite)]
    else:
        assert per_call == [(0, 0), (skipped, nonfinite)] + [(0, 0)] * (K - 2)
    if mode == "scan":
        (m,) = metrics
        assert m["updated"] == updated
        np.testing.assert_allclose(m["loss"], expected.loss, rtol=_FLOAT32)
        np.testing.assert_allclose(m["grad_norm"], expected.grad_norm, rtol=_FLOAT32)
        return
    assert [m["updated"] for m in metrics] == [False] * (K - 1) + [updated]
    losses = [m["loss"] for m in metrics]  # each call's microbatch (NaN: microbatch 1)
    np.testing.assert_allclose(losses, expected.losses, rtol=_FLOAT32)
    norms = [m["grad_norm"] for m in metrics]  # 0.0 on a call without an update
    np.testing.assert_allclose(norms, [0.0] * (K - 1) + [expected.grad_norm], rtol=_FLOAT32)


# FSDP for the policies whose decision reads a sharded gradient differently (the verdicts of
# the rows beside a reduce-scatter, the shards' norm, the gathered gradient, the weights):
# the scalings without them ("sum_over_k", "sum") and skip_window add nothing there.
_CASES = [
    (policy, devices)
    for policy in _POLICIES
    for devices in ("1", "8", "8 fsdp")
    if devices != "8 fsdp" or policy not in ("sum_over_k", "sum", "skip_window")
]


@pytest.mark.parametrize("mode", ["scan", "stream"])
@pytest.mark.parametrize("policy, devices", _CASES)
def test_every_policy_matches_a_float64_reference(policy, mode, devices):
    assert jax.device_count() >= N
    params, batch, expected = _reference_problem(policy)
    state, metrics = _reference_run(policy, mode, devices, params, batch)
    _check_against_reference(state, metrics, mode, params, expected)


@pytest.mark.parametrize("devices", ["8", "8 fsdp"])
@pytest.mark.parametrize("policy", ["skip_microbatch", "weighted", "max_norm", "skip_fn"])
def test_a_mesh_stream_window_counts_each_microbatch_as_one_device_does(policy, devices):
    """Mid-window (K - 1 calls, microbatch 1 left out or clipped), the state's window counters
    on a mesh are one device's, exactly: each call's decision about the whole microbatch
    advances them once (its weight the whole microbatch's), and the partial sums add up to
    one device's sum."""
    params, batch, _ = _reference_problem(policy)
    one, _ = _reference_run(policy, "stream", "1", params, batch, calls=K - 1)
    mesh, _ = _reference_run(policy, "stream", devices, params, batch, calls=K - 1)
    counters = ("weight_sum", "micro_step", "window_nonfinite", "window_skipped")
    windows = [cast(Any, state.opt_state).window for state in (one, mesh)]
    want, got = ({c: np.asarray(getattr(w, c)) for c in counters} for w in windows)
    assert {c: (v.dtype, v.tolist()) for c, v in got.items()} == {
        c: (v.dtype, v.tolist()) for c, v in want.items()
    }
    assert int(got["micro_step"]) == K - 1
    sums = accumjax.accumulated_gradients(mesh.opt_state)
    for key, expected in accumjax.accumulated_gradients(one.opt_state).items():
        scale = np.abs(np.asarray(expected)).max()
        np.testing.assert_allclose(sums[key], expected, rtol=_FLOAT32, atol=_FLOAT32 * scale)


@pytest.mark.parametrize("policy", ["max_norm", "skip_fn"])
def test_a_policy_that_reads_the_gradient_reduces_each_microbatch(policy):
    """max_norm and skip_fn read the whole microbatch's gradient: on a mesh that is one
    gradient-sized all-reduce per microbatch (its weight and validity travel in it), which the
    scan window adds: none is left for the window's end (issue 37: K, not K + 1). A stream
    window keeps each device's partial sum and reduces it when it closes."""
    mesh = _mesh()
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1), K, **_POLICIES[policy])
    params = _put(params, mesh, False)
    scan = accumjax.make_train_step(_loss, mode="scan")
    whole = jax.device_put(batch, NamedSharding(mesh, P("data")))
    compiled = scan.lower(scan.init(params, tx), whole).compile()
    assert _counts(compiled, 1, min_bytes=GRADIENT_BYTES)["all-reduce"] == K
    stream = accumjax.make_train_step(_loss)
    call = jax.device_put(jax.tree.map(lambda a: a[:16], batch), NamedSharding(mesh, P("data")))
    compiled = stream.lower(stream.init(params, tx), call).compile()
    # One for the microbatch on every call; the window's end (a loop of at most one trip
    # here) reduces the partial sums.
    assert _counts(compiled, 0, min_bytes=GRADIENT_BYTES)["all-reduce"] == 1
    assert _counts(compiled, 1, min_bytes=GRADIENT_BYTES)["all-reduce"] == 2


# GradientAccumulator's use_agc=True on a mesh (tests/_reference.py; one device in
# tests/test_accumulation.py): AGC's units span the devices' rows and, under FSDP, the
# shards of a kernel split on its rows (one row a device), so each microbatch's transform
# reads the whole gradient, gathered. Biases start at zero (their units clip at
# clip_factor * eps). The tolerance is one device's (1.1e-7 measured there).
_AGC_C, _AGC_EPS = 0.8, 1e-3


@pytest.mark.parametrize(
    ("mode", "devices"),
    [("scan", "8 fsdp"), ("stream", "8"), ("stream", "8 fsdp"), ("stream", "pmap")],
)
def test_microbatch_agc_on_a_mesh_is_gradient_accumulators_use_agc(mode, devices):
    params, batch = reference.problem(2 * N * K * 2)
    params["b"] = np.zeros_like(params["b"])
    rows = N * K * 2
    batches = [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(2)]
    windows = [reference.microbatches(b, K) for b in batches]
    expected, clipped = reference.ga_agc_training(params, windows, _LR, _AGC_C, _AGC_EPS)
    assert 0.2 < clipped < 0.8  # some gradient entries clipped, some not
    agc = accumjax.adaptive_clip(K * _AGC_C, _AGC_EPS)
    tx = accumjax.accumulate(optax.sgd(_LR), K, microbatch_transform=agc)
    if devices == "pmap":  # make_train_step(axis_name=...): each device's rows in a row
        put = lambda tree, spec: jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), tree)
        step = accumjax.make_train_step(reference.loss, mode=mode, axis_name="data")
        state = step.init(params=params, tx=tx)
    else:
        mesh = _mesh()
        put = lambda tree, spec: jax.device_put(
            tree, jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
        )
        specs = {"w": P("data", None) if devices == "8 fsdp" else P(), "b": P()}
        step = accumjax.make_train_step(reference.loss, mode=mode)
        state = step.init(put(params, specs), tx)
    for batch, micro in zip(batches, windows, strict=True):
        for call in [batch] if mode == "scan" else micro:
            state, metrics = step(state, put(call, dict.fromkeys(call, P("data"))))
        assert np.all(metrics["updated"])
    if devices == "8 fsdp":  # the kernel stays split over the devices
        assert state.params["w"].sharding.spec == P("data", None)
    if devices == "pmap":
        state = accumjax.unreplicate(state)
    for key, want in expected.items():
        got = np.asarray(state.params[key])
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("scaling", ["sum", "weighted"])
def test_a_microbatch_transform_under_sum_and_weighted_on_8_devices(scaling):
    """Under "sum" and "weighted" the whole microbatch's transformed gradient is the same on
    every device: in a stream window kept per device each device adds its share of it (its
    weight's share), so that the window holds what one device's would: the float64
    window of AGC'd microbatch gradients, summed (times their weights, over their weights).
    (Scan mode adds the whole gradient once, as under "mean": the tests above.)"""
    params, batch = reference.problem(N * K * 2)
    batch["m"] = np.where(np.arange(N * K * 2) % 3 == 0, 0.5, 1.0).astype(np.float32)
    total = scaling == "sum"
    micro = reference.microbatches(batch, K)
    grads = [reference.value_and_grad(params, mb, total)[1] for mb in micro]
    clipped = [reference.ga_adaptive_clip_grad(params, g, 0.05, 1e-3) for g in grads]
    assert any(not np.array_equal(c["w"], g["w"]) for c, g in zip(clipped, grads, strict=True))
    weights = [1.0 if total else float(np.sum(mb["m"], dtype=np.float64)) for mb in micro]
    divide = 1.0 if total else sum(weights)
    want = {
        k: params[k] - 0.05 * sum(w * c[k] for w, c in zip(weights, clipped, strict=True)) / divide
        for k in params
    }
    tx = accumjax.accumulate(
        optax.sgd(0.05), K, scaling=scaling, microbatch_transform=accumjax.adaptive_clip(0.05)
    )
    step = accumjax.make_train_step(
        reference.total_loss if total else reference.loss,
        weight_fn=None if total else (lambda b: jnp.sum(b["m"])),
    )
    mesh = _mesh()
    state = step.init(jax.device_put(params, NamedSharding(mesh, P())), tx)
    for call in micro:
        state, metrics = step(state, jax.device_put(call, NamedSharding(mesh, P("data"))))
    assert bool(metrics["updated"])
    for key in params:  # float32 against float64, as _FLOAT32
        scale = np.max(np.abs(want[key]))
        np.testing.assert_allclose(
            state.params[key], want[key], rtol=_FLOAT32, atol=_FLOAT32 * scale
        )


@pytest.mark.parametrize("mode", ["scan", "stream"])
def test_the_pmap_step_matches_the_float64_reference(mode):
    """The pmap step (make_train_step(axis_name=...)) decides about whole microbatches too: a
    NaN target on one device leaves its microbatch out on every device, counted once. Its
    metrics are per device (pmap's convention): the devices' mean loss is the whole one."""
    params, batch, expected = _reference_problem("skip_microbatch")
    step = accumjax.make_train_step(reference.loss, mode=mode, axis_name="data")
    state = step.init(params=params, tx=accumjax.accumulate(optax.sgd(_LR), K))
    per_device = lambda b: jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), b)
    metrics = []
    for call in [batch] if mode == "scan" else reference.microbatches(batch, K):
        state, m = step(state, per_device(call))
        m = jax.tree.map(np.asarray, m)  # per device, as pmap's: the mean of the losses
        assert all(
            np.array_equal(v, v[:1].repeat(N), equal_nan=True) for k, v in m.items() if k != "loss"
        )
        metrics.append({k: float(np.mean(v) if k == "loss" else v[0]) for k, v in m.items()})
    _check_against_reference(accumjax.unreplicate(state), metrics, mode, params, expected)


# ----------------------------------------------------------------------------- float16 shares


def _f16_run(devices):
    """One float16 scan step on a microbatch of 4 rows whose two large residuals (40) lie in
    the first two rows: on 2 devices, all on device 0."""
    x = np.ones((4, 1), np.float32)
    y = np.array([-40.0, -40.0, 0.0, 0.0], np.float32)
    params = {"w": jnp.zeros(1), "b": jnp.zeros(())}
    loss = lambda p, b: jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)
    step = accumjax.make_train_step(loss, mode="scan", mixed_precision="float16")
    batch = (jnp.asarray(x), jnp.asarray(y))
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    scale = accumjax.dynamic_loss_scale(2.0**10)
    state = step.init(params, accumjax.accumulate(optax.sgd(1e-3), 1), loss_scale=scale)
    state, metrics = step(state, batch)
    return state, metrics


def test_float16_overflows_on_two_devices_as_on_one():
    """Issue 37: each device's float16 backward sees its share of the whole microbatch's loss
    (the scale over the devices' number). The whole microbatch's scaled bias gradient is
    2**10 * 2 * 80 / 4 = 40960, finite in float16 (max 65504); device 0's mean over its own two
    rows at the full scale would be 81920, an overflow that skipped the microbatch on 2
    devices only. The expected update is float64 SGD: the bias gradient is 2 * (0 - y).mean()."""
    one, m1 = _f16_run(1)
    two, m2 = _f16_run(2)
    for state, metrics in ((one, m1), (two, m2)):
        assert bool(metrics["updated"]) and float(metrics["loss_scale"]) == 2.0**10
        assert int(accumjax.stats(state.opt_state).num_nonfinite) == 0
        # float16 round-off of a few products: 1e-3 relative.
        np.testing.assert_allclose(float(state.params["b"]), -1e-3 * 40.0, rtol=1e-3)
    np.testing.assert_array_equal(one.params["b"], two.params["b"])
