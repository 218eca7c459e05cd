"""TrainState (accumjax.train_state): the optimizer state laid out for the step's mode.

A scan-mode window opens and closes inside one call, so a scan-mode state holds no
accumulator: the compiled scan step's arguments are the parameters, the inner optimizer's
state and the batch (XLA's compile-time ``memory_analysis``, replicated and FSDP on 8 host
devices). Each mode refuses the other's layout, and `accumjax.with_mode` converts one (a
checkpoint of accumjax 0.2, whose scan states held the accumulator).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

K = 4
N = 8


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _problem(width=512):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(256, width)).astype(np.float32) * 0.05,
        "b1": np.zeros(width, np.float32),
        "w2": rng.normal(size=(width, 256)).astype(np.float32) * 0.05,
    }
    batch = {
        "x": rng.normal(size=(N * K, 256)).astype(np.float32),
        "y": rng.normal(size=(N * K, 256)).astype(np.float32),
    }
    return params, batch


def _state(params, mode="scan", k=K):
    tx = accumjax.accumulate(optax.adam(1e-3), k)
    return accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode=mode)


def _device_bytes(tree):
    """Bytes one device holds of ``tree`` (a sharded leaf's one shard)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("layout", ["one_device", "replicated", "fsdp"])
def test_scan_step_arguments_are_params_inner_state_and_batch(layout):
    params, batch = _problem()
    if layout == "one_device":
        params, batch = jax.device_put((params, batch), jax.devices()[0])
    else:
        assert jax.device_count() >= N
        mesh = jax.make_mesh((N,), ("data",))
        fsdp = layout == "fsdp"
        specs = (
            {"w1": P("data"), "b1": P(), "w2": P("data")} if fsdp else dict.fromkeys(params, P())
        )
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state = _state(params)
    assert state.opt_state.window.grad_sum is None
    step = accumjax.make_train_step(_loss, mode="scan")
    memory = step.lower(state, batch).compile().memory_analysis()
    needed = _device_bytes((params, state.opt_state.inner_tx_state, batch))
    # The bound: scalars (step, counters, the rng-free metrics) fit in the 64 KiB;
    # the accumulator state used to hold is 1/3 of params + adam (+33%), far above 1.02x.
    assert memory.argument_size_in_bytes <= 1.02 * needed + 64 * 1024
    # Stream mode keeps its accumulator: one parameter copy more than the scan state.
    stream = _state(params, "stream")
    extra = _device_bytes(stream.opt_state) - _device_bytes(state.opt_state)
    assert extra == _device_bytes(params)


def test_scan_state_trains_as_the_stream_state_did_and_holds_no_accumulator():
    params, batch = _problem(width=32)
    step = accumjax.make_train_step(_loss, mode="scan", donate=False)
    state = _state(params)
    converted = accumjax.with_mode(_state(params, "stream"), "scan")
    for _ in range(2):
        state, _ = step(state, batch)
        converted, _ = step(converted, batch)
    assert state.opt_state.window.grad_sum is None
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(converted), strict=True):
        np.testing.assert_array_equal(a, b)  # the same program: bit for bit
    assert accumjax.stats(state.opt_state).memory_bytes == 0
    assert accumjax.accumulated_gradients(state.opt_state) is None


def test_each_mode_refuses_the_other_layout_and_names_the_fix():
    params, batch = _problem(width=8)
    scan_state, stream_state = _state(params), _state(params, "stream")
    with pytest.raises(ValueError, match=r"holds a stream-mode accumulator.*with_mode"):
        accumjax.make_train_step(_loss, mode="scan")(stream_state, batch)
    with pytest.raises(ValueError, match=r"built for scan mode.*with_mode\(state, 'stream'\)"):
        accumjax.make_train_step(_loss, mode="stream")(scan_state, batch)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match=r"no accumulator.*mode='stream'"):
        scan_state.apply_gradients(grads=grads)
    with pytest.raises(ValueError, match=r"mode must be one of \('stream', 'scan'\)"):
        _state(params, mode="window")


def test_with_mode_adds_the_stream_window_create_makes_and_refuses_an_open_window():
    params, batch = _problem(width=8)
    on_one = accumjax.with_mode(_state(params), "stream").opt_state.window
    for key, acc in on_one.grad_sum.items():
        np.testing.assert_array_equal(acc, np.zeros_like(params[key]))
    mesh = jax.make_mesh((N,), ("data",))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    params["w1"] = jax.device_put(params["w1"], NamedSharding(mesh, P("data")))
    stream = accumjax.with_mode(_state(params), "stream")
    made = _state(params, "stream")
    for a, b in zip(
        jax.tree.leaves(stream.opt_state), jax.tree.leaves(made.opt_state), strict=True
    ):
        assert a.shape == b.shape and a.sharding == b.sharding  # what create makes
    # On the mesh, each device keeps its own window: a slice per device of a replicated
    # parameter, the shard of one sharded over the batch axis (one parameter copy each).
    assert stream.opt_state.window.grad_sum["b1"].shape == (N, 8)
    assert stream.opt_state.window.grad_sum["w1"].shape == (1, 256, 8)
    assert _device_bytes(stream.opt_state.window.grad_sum) == _device_bytes(params)
    assert accumjax.with_mode(stream, "stream") is stream
    step = accumjax.make_train_step(_loss, mode="stream", donate=False)
    micro = jax.device_put(jax.tree.map(lambda x: x[:N], batch), NamedSharding(mesh, P("data")))
    opened, _ = step(stream, micro)
    with pytest.raises(ValueError, match=r"middle of a window.*micro_step == 1"):
        accumjax.with_mode(opened, "scan")
    plain = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    assert accumjax.with_mode(plain, "scan") is plain  # no window to lay out


def test_a_checkpoint_with_the_accumulator_converts_for_scan_mode(tmp_path):
    """A 0.2 scan-mode checkpoint held the accumulator: restored as saved, then converted."""
    params, batch = _problem(width=16)
    old = _state(params, "stream")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "old", old)
    template = jax.eval_shape(lambda: _state(params, "stream"))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "old", template)
    restored = accumjax.with_mode(old.replace(**vars(restored)), "scan")  # static fields kept
    step = accumjax.make_train_step(_loss, mode="scan", donate=False)
    resumed, _ = step(restored, batch)
    fresh, _ = step(_state(params), batch)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_per_device_window_is_refused_by_tx_update_naming_the_fix():
    # tx.update takes gradients XLA has already reduced; a per-device window (made for the
    # train step's stream mode on a mesh) would take them as one device's partial sum.
    params, _ = _problem(width=8)
    mesh = jax.make_mesh((N,), ("data",))
    state = _state(jax.device_put(params, NamedSharding(mesh, P())), "stream")
    assert state.opt_state.window.weight_sum.shape == (N,)
    assert accumjax.stats(state.opt_state).memory_bytes == N * _device_bytes(state.params)
    grads = jax.tree.map(jnp.ones_like, state.params)
    with pytest.raises(ValueError, match=r"one partial sum per device.*tx.init\(params\)"):
        state.apply_gradients(grads=grads)
    plain = state.replace(opt_state=state.tx.init(state.params))  # the documented fix
    assert int(plain.apply_gradients(grads=grads).opt_state.window.micro_step) == 1


def test_per_device_window_reads_and_converts_like_any_window():
    # accumulated_gradients gives each device's slot over its own denominator; with_mode to
    # scan gives what create(mode="scan") gives (scalar counts), also under jit.
    params, batch = _problem(width=8)
    mesh = jax.make_mesh((N,), ("data",))
    tx = accumjax.accumulate(optax.sgd(0.1), K, scaling="count")
    state = accumjax.TrainState.create(
        apply_fn=None, params=jax.device_put(params, NamedSharding(mesh, P())), tx=tx
    )
    step = accumjax.make_train_step(_loss, donate=False)
    micro = jax.device_put(jax.tree.map(lambda x: x[:N], batch), NamedSharding(mesh, P("data")))
    opened, _ = step(state, micro)
    acc = accumjax.accumulated_gradients(opened.opt_state)
    np.testing.assert_array_equal(acc["w1"], opened.opt_state.window.grad_sum["w1"])  # 1 each
    closed = state  # a window boundary
    scan = accumjax.with_mode(closed, "scan")
    made = accumjax.TrainState.create(apply_fn=None, params=state.params, tx=tx, mode="scan")
    assert jax.tree.structure(scan.opt_state) == jax.tree.structure(made.opt_state)
    for a, b in zip(jax.tree.leaves(scan.opt_state), jax.tree.leaves(made.opt_state), strict=True):
        assert jnp.shape(a) == jnp.shape(b)
    traced = jax.jit(lambda s: accumjax.with_mode(s, "scan"))(closed)
    assert traced.opt_state.window.grad_sum is None
    with pytest.raises(ValueError, match=r"expected \(3, 4\)"):  # not a per-device message
        tx.update({"w": jnp.ones(4)}, tx.init({"w": jnp.zeros((3, 4))}))
    with pytest.raises(ValueError, match=r"axis_name.*per device.*Drop axis_name"):
        pmap_step = accumjax.make_train_step(_loss, axis_name="data")
        pmap_step(accumjax.replicate(state, N), jax.tree.map(lambda x: x.reshape(N, 1, -1), micro))
