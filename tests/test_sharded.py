"""The steps under ``jit`` with sharded arrays (accumjax.sharded): JAX's default mesh.

Scan mode, and stream mode with a per-device window. On 8 CPU devices: replicated data
parallel and FSDP, Explicit and Auto meshes. References: the same step on unsharded arrays
(one device's view), one-device full-batch optax, and collective counts in the compiled HLO.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax
from accumjax import count_collectives, sharded

K = 4
N = 8


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _problem():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(16, 32)).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": rng.normal(size=(32, 4)).astype(np.float32) * 0.3,
    }
    batch = {
        "x": rng.normal(size=(N * K * 2, 16)).astype(np.float32),
        "y": rng.normal(size=(N * K * 2, 4)).astype(np.float32),
    }
    return params, batch


FSDP = {"w1": P("data", None), "b1": P(), "w2": P("data", None)}


def _mesh(kind):
    assert jax.device_count() >= N
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((N,), ("data",), axis_types=types)


def _run(mesh, fsdp, steps=3):
    params, batch = _problem()
    with jax.set_mesh(mesh):
        specs = FSDP if fsdp else dict.fromkeys(params, P())
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
        state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
        step = accumjax.make_train_step(_loss, mode="scan")
        compiled = step.lower(state, batch).compile()
        for _ in range(steps):
            state, metrics = step(state, batch)
    return state, metrics, compiled


def _reference(steps=3):
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
    step = accumjax.make_train_step(_loss, mode="scan")
    with jax.default_device(jax.devices()[0]):
        for _ in range(steps):
            state, _ = step(state, batch)
    return state


def _spec(x):
    """A leaf's PartitionSpec with trailing unsharded dims dropped (Explicit vs Auto spelling)."""
    spec = tuple(x.sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_scan_under_jit_matches_one_device_and_reduces_once_per_window(kind, fsdp):
    state, metrics, compiled = _run(_mesh(kind), fsdp)
    ref = _reference()
    # Per-device float32 sums reduced once vs one device's sum over the same rows: a few ulps.
    for key in ref.params:
        np.testing.assert_allclose(state.params[key], ref.params[key], rtol=2e-5, atol=2e-6)
    assert metrics["loss"].shape == (N,)  # one loss per device

    static = count_collectives(compiled)
    executed = count_collectives(compiled, per_execution=True, default_trip_count=1)
    assert executed == static  # nothing inside the microbatch loop (or it would count K-1x)
    assert static["all-gather"] == (2 if fsdp else 0)  # FSDP: the two kernels, once; no batch
    if fsdp:
        assert static["reduce-scatter"] == 2  # one per sharded gradient, once per window
        assert static["all-reduce"] <= 1  # the small replicated bias and the scalars
    else:
        assert static == {**static, "all-reduce": 1, "reduce-scatter": 0}


def test_fsdp_state_stays_sharded_and_memory_scales_down():
    mesh = _mesh("explicit")
    state, _, compiled = _run(mesh, fsdp=True, steps=1)
    for key, spec in FSDP.items():
        want = _spec(jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, spec)))
        assert _spec(state.params[key]) == want
        assert _spec(state.opt_state.inner_tx_state[0].trace[key]) == want  # momentum too
    assert state.opt_state.window.grad_sum is None  # scan mode: the state holds no accumulator
    _, _, replicated = _run(mesh, fsdp=False, steps=1)

    def held(c):
        m = c.memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes

    _, batch = _problem()
    batch_bytes = sum(v.nbytes for v in batch.values()) // N  # the batch is sharded in both
    # 1/N of the replicated state plus the per-device batch, bias and scalars (< 2 KiB here).
    assert held(compiled) <= (held(replicated) - 2 * batch_bytes) / N + 2 * batch_bytes + 4096


def test_layout_of_rejects_what_it_cannot_split():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        batch = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("data")))
        tp = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "model")))
        with pytest.raises(NotImplementedError, match="model"):
            sharded.layout_of({"w": tp}, batch)
        both = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P(("data", "model"))))
        with pytest.raises(NotImplementedError, match="one mesh axis"):
            sharded.layout_of({"w": jnp.ones(3)}, both)
    assert sharded.layout_of({"w": jnp.ones(3)}, jnp.ones((8, 3))) is None  # one device


def test_mesh_path_places_its_inputs_and_refuses_a_sharded_state():
    # jax.make_mesh gives Explicit axes: the shard_map step used to reject unsharded inputs.
    mesh = _mesh("explicit")
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
    step = accumjax.make_train_step(_loss, mode="scan", axis_name="data", mesh=mesh, donate=False)
    after, _ = step(state, batch)
    ref = _reference(steps=1)
    for key in ref.params:
        np.testing.assert_allclose(after.params[key], ref.params[key], rtol=2e-5, atol=2e-6)
    with jax.set_mesh(mesh):
        fsdp = {k: jax.device_put(v, NamedSharding(mesh, FSDP[k])) for k, v in params.items()}
        sharded_state = accumjax.TrainState.create(apply_fn=None, params=fsdp, tx=tx, mode="scan")
        with pytest.raises(ValueError, match=r"state\.params\['w1'\] is sharded"):
            step(sharded_state, batch)


def test_fsdp_gather_per_microbatch_trades_gathers_for_memory():
    mesh = _mesh("explicit")
    params, batch = _problem()
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, FSDP[k])) for k, v in params.items()}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        tx = accumjax.accumulate(optax.sgd(0.1, momentum=0.9), K)
        results = {}
        for gather in ("window", "microbatch"):
            state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
            step = accumjax.make_train_step(_loss, mode="scan", gather_params=gather, donate=False)
            compiled = step.lower(state, batch).compile()
            counts = count_collectives(compiled, per_execution=True, default_trip_count=1)
            results[gather] = (step(state, batch)[0].params, counts)
    (window_params, window_counts), (micro_params, micro_counts) = results.values()
    # Per microbatch: two kernels x K, in one loop of K microbatches (no re-run: every
    # device must run the same gathers).
    assert window_counts["all-gather"] == 2 and micro_counts["all-gather"] == 2 * K
    assert window_counts["reduce-scatter"] == micro_counts["reduce-scatter"] == 2  # once
    for key in window_params:  # the same arithmetic, gathered at another time
        np.testing.assert_array_equal(window_params[key], micro_params[key])
    with pytest.raises(ValueError, match="gather_params"):
        accumjax.make_train_step(_loss, mode="scan", gather_params="layer")


def test_a_nan_on_one_device_with_a_gather_per_microbatch_is_skipped_on_that_device_only():
    # A NaN in device 0's rows of microbatch 3. Gathering per microbatch puts collectives in
    # the loop: a re-run decided on device 0 alone left the others waiting in the gather
    # (XLA aborted after 40 s). Each device's rows are a microbatch of their own (as on the
    # mesh= path), so only device 0's are left out, as when gathering once per window.
    mesh = _mesh("explicit")
    params, batch = _problem()
    batch["x"][3] = np.nan
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, FSDP[k])) for k, v in params.items()}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        tx = accumjax.accumulate(optax.sgd(0.1), K)
        state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
        out = {}
        for gather in ("microbatch", "window"):
            step = accumjax.make_train_step(_loss, mode="scan", gather_params=gather, donate=False)
            out[gather] = step(state, batch)[0]
    lean, usual = out["microbatch"], out["window"]
    skipped = [int(s.opt_state.skipped_microbatches) for s in (lean, usual)]
    assert skipped == [1, 1]
    for key in params:  # bit for bit, finite
        np.testing.assert_array_equal(lean.params[key], usual.params[key])
        assert np.isfinite(np.asarray(lean.params[key])).all()


@pytest.mark.parametrize("on_nonfinite", ["skip_microbatch", "skip_window"])
def test_float16_overflow_on_one_shard_under_fsdp_is_skipped_and_lowers_the_scale(on_nonfinite):
    # One row of one device's shard of one microbatch overflows float16 (issue 17: params and
    # Adam state became Inf, grads_finite said True and the scale never went down).
    mesh = _mesh("explicit")
    params, batch = _problem()
    batch["y"][3] = 1e4  # row 3: device 0's rows, microbatch 3 (rows i, i + K, ...)
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, FSDP[k])) for k, v in params.items()}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        tx = accumjax.accumulate(optax.adam(1e-2), K, on_nonfinite=on_nonfinite)
        state = accumjax.TrainState.create(
            apply_fn=None,
            params=params,
            tx=tx,
            loss_scale=accumjax.dynamic_loss_scale(initial=2.0**15),
            mode="scan",
        )
        step = accumjax.make_train_step(_loss, mode="scan", mixed_precision="float16")
        before = jax.tree.map(np.asarray, state.params)
        after, metrics = step(state, batch)
    assert not bool(metrics["grads_finite"])
    assert float(after.loss_scale.loss_scale) < 2.0**15  # lowered at the window's end
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(after.params))
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(after.opt_state))
    assert int(after.opt_state.nonfinite_count) >= 1
    if on_nonfinite == "skip_window":  # nothing applied: the parameters bit for bit
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after.params), before)
    else:  # the other microbatches were applied
        assert bool(metrics["updated"])


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_stream_mode_under_jit_resumes_a_mid_window_orbax_checkpoint_bit_for_bit(tmp_path, fsdp):
    # Issues 17 and 19: on the plain-jit path each device's partial window sum is its own
    # slice of a global array, so a checkpoint saved mid-window (orbax, restored with the
    # live shardings) holds every device's and resumes bit for bit.
    import orbax.checkpoint as ocp

    mesh = _mesh("explicit")
    params, batch = _problem()
    specs = FSDP if fsdp else dict.fromkeys(params, P())
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        micro = [
            jax.device_put(
                jax.tree.map(lambda a, i=i: a[i::K], batch), NamedSharding(mesh, P("data"))
            )
            for i in range(K)
        ]
        tx = accumjax.accumulate(optax.adam(1e-2), K)
        step = accumjax.make_train_step(_loss, donate=False)

        state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)
        for mb in micro[:2]:
            state, _ = step(state, mb)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        restored = checkpointer.restore(tmp_path / "ckpt", target)
        checkpointer.close()
        assert int(restored.opt_state.window.micro_step) == 2
        for mb in micro[2:]:
            state, _ = step(state, mb)
            restored, _ = step(restored, mb)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding  # nothing replicated behind the user's back


# ----------------------------------------------------------------------------- stream mode


def _stream_run(mesh, fsdp, tx):
    """K stream calls per window (N rows each) on ``mesh``, from a state created on it."""
    params, batch = _problem()
    specs = FSDP if fsdp else dict.fromkeys(params, P())
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = accumjax.make_train_step(_loss)  # stream mode, plain jit: no mesh, no axis_name
    data = NamedSharding(mesh, P("data"))
    micro = [
        jax.device_put(jax.tree.map(lambda a, j=j: a[j * N : (j + 1) * N], batch), data)
        for j in range(len(batch["x"]) // N)
    ]
    compiled = step.lower(state, micro[0]).compile()
    for mb in micro:
        state, metrics = step(state, mb)
    return state, metrics, compiled


def _full_batch_sgd():
    """One device, plain optax SGD on each window's K * N rows at once (float32)."""
    params, batch = _problem()
    tx = optax.sgd(0.5)
    opt_state = tx.init(params)
    for w in range(len(batch["x"]) // (K * N)):
        rows = jax.tree.map(lambda a, w=w: a[w * K * N : (w + 1) * K * N], batch)
        updates, opt_state = tx.update(jax.grad(_loss)(params, rows), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_stream_under_jit_reduces_once_per_window_and_matches_full_batch(kind, fsdp):
    # Issue 19: a per-device window (made by TrainState.create from parameters on the mesh)
    # takes each call's gradient on each device, with no collective (FSDP: the gather of the
    # sharded parameters and the reduce-scatter of their gradient, per call); one all-reduce
    # when the window closes. SGD, not adam: adam's scale invariance would hide a window
    # counted 8 times.
    state, metrics, compiled = _stream_run(
        _mesh(kind), fsdp, accumjax.accumulate(optax.sgd(0.5), K)
    )
    ref = _full_batch_sgd()
    # float32: per-device sums reduced once vs one device's sum over the same rows: ulps.
    for key in ref:
        np.testing.assert_allclose(state.params[key], ref[key], rtol=1e-5, atol=1e-6)
    assert int(state.step) == 2 and metrics["loss"].shape == (N,)  # one loss per device
    # The close runs in a loop of at most one trip whose count XLA does not know: a trip
    # count of 0 counts what every call runs, 1 what the closing call runs.
    every = count_collectives(compiled, per_execution=True, default_trip_count=0)
    closing = count_collectives(compiled, per_execution=True, default_trip_count=1)
    sharded_leaves = 2 if fsdp else 0
    assert every == {**every, "all-reduce": 0, "all-gather": sharded_leaves}
    assert every["reduce-scatter"] == sharded_leaves
    assert closing == {**every, "all-reduce": 1}


def test_stream_state_on_a_2d_mesh_keeps_the_parameter_shaped_window():
    # On a (data=4, model=2) mesh the state cannot know which axis the batch will be split
    # over, so it keeps the parameter-shaped sum (XLA reduces each call, as before issue 19)
    # and trains as the per-device window on a 1-D mesh of 4 devices does.
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    two_d = jax.make_mesh((4, 2), ("data", "model"))
    one_d = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    state_2d, _, _ = _stream_run(two_d, False, tx)
    state_1d, _, _ = _stream_run(one_d, False, tx)
    assert state_2d.opt_state.window.grad_sum["w1"].shape == state_2d.params["w1"].shape
    assert state_1d.opt_state.window.grad_sum["w1"].shape == (4, 16, 32)
    for key in state_1d.params:  # float32 sums in two orders: ulps
        np.testing.assert_allclose(state_2d.params[key], state_1d.params[key], rtol=1e-5, atol=1e-6)


def test_stream_per_device_window_needs_a_batch_on_its_mesh():
    mesh = _mesh("explicit")
    params, batch = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = accumjax.accumulate(optax.sgd(0.5), K)
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = accumjax.make_train_step(_loss)
    with pytest.raises(ValueError, match=r"per device.*not split over that mesh.*device_put"):
        step(state, jax.tree.map(lambda a: a[:N], batch))
    mesh_step = accumjax.make_train_step(_loss, mesh=mesh, axis_name="data")
    with pytest.raises(ValueError, match=r"replicates the state.*Drop mesh= and axis_name="):
        mesh_step(state, jax.tree.map(lambda a: a[:N], batch))


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
    # sharded batch fails ("Use .at[...].get(out_sharding=)"); the per-device window takes
    # each device's gradient inside a shard_map, where the lookup is local.
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
    with jax.set_mesh(mesh):
        params = linen.init(jax.random.key(0), ids[:1])["params"]
        params = jax.device_put(params, NamedSharding(mesh, P()))
        tx = accumjax.accumulate(optax.sgd(0.5), K)
        state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)
        step = accumjax.make_train_step(linen_loss)
        for mb in micro:
            state, _ = step(state, mb)
        model = _NNXEmbed(nnx.Rngs(0))
        nnx_state = accumjax.nnx_train_state(model, accumjax.accumulate(optax.sgd(0.5), K))
        nnx_loss = lambda m, b: xent(m(b), b[:, 0]).mean()
        nnx_step = accumjax.make_nnx_train_step(nnx_loss)
        for mb in micro:
            nnx_state, _ = nnx_step(nnx_state, mb)
    assert int(state.step) == 2 and int(nnx_state.step) == 2
    # One device, each window's rows at once: the same SGD steps.
    ref = jax.device_get(linen.init(jax.random.key(0), ids[:1])["params"])
    for w in range(2):
        grads = jax.grad(linen_loss)(ref, ids[w * K * N : (w + 1) * K * N])
        ref = jax.tree.map(lambda p, g: p - 0.5 * g, ref, grads)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx_state.params))
