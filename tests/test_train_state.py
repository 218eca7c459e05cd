"""TrainState (accumjax.train_state): the state laid out for the step's mode.

``step.init`` builds the state a step takes; ``TrainState.create`` the portable one
(``tx.init``). A scan-mode window opens and closes inside one call, so a scan-mode state
holds no accumulator: the compiled scan step's arguments are the parameters, the inner
optimizer's state and the batch (XLA's compile-time ``memory_analysis``, replicated and FSDP
on 8 host devices). A stream state on a mesh keeps one partial sum per device, read as the
whole batch's. Each mode refuses the other's layout, and `accumjax.with_mode` converts one
(a checkpoint of accumjax 0.2, whose scan states held the accumulator).
"""

import _reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

K = 4
N = 8


def _problem(width=512):
    return reference.mlp_problem(N * K, (256, width, 256), (0.05, 0.05))


def _init(params, mode="scan", k=K, **kwargs):
    """The state ``make_train_step(mode=mode)`` builds for ``params`` (and the step)."""
    step = accumjax.make_train_step(reference.mlp_loss, mode=mode, donate=False, **kwargs)
    return step.init(params, accumjax.accumulate(optax.adam(1e-3), k)), step


def _create(params, k=K):
    """``TrainState.create``'s portable layout: ``opt_state = tx.init(params)``."""
    tx = accumjax.accumulate(optax.adam(1e-3), k)
    return accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)


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
    state, step = _init(params)
    assert state.opt_state.window.grad_sum is None
    memory = step.lower(state, batch).compile().memory_analysis()
    needed = _device_bytes((params, state.opt_state.inner_tx_state, batch))
    # The bound: scalars (step, counters, the rng-free metrics) fit in the 64 KiB;
    # the accumulator state used to hold is 1/3 of params + adam (+33%), far above 1.02x.
    assert memory.argument_size_in_bytes <= 1.02 * needed + 64 * 1024
    # Stream mode keeps its open window: one parameter copy more per device (one partial
    # sum a device; an FSDP parameter's shard).
    stream, _ = _init(params, "stream")
    extra = _device_bytes(stream.opt_state) - _device_bytes(state.opt_state)
    assert extra == _device_bytes(params)


def test_scan_state_trains_as_a_converted_stream_state_and_holds_no_accumulator():
    params, batch = _problem(width=32)
    state, step = _init(params)
    converted = accumjax.with_mode(_create(params), "scan")
    for _ in range(2):
        state, _ = step(state, batch)
        converted, _ = step(converted, batch)
    assert state.opt_state.window.grad_sum is None
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(converted), strict=True):
        np.testing.assert_array_equal(a, b)  # the same program: bit for bit
    # No accumulator in the state: stats of the optimizer state alone cannot size the
    # window (None, not 0); of the train state it sizes the sum the step makes from params.
    assert accumjax.stats(state.opt_state).memory_bytes is None
    assert accumjax.stats(state).memory_bytes == 4 * sum(x.size for x in jax.tree.leaves(params))
    assert accumjax.accumulated_gradients(state.opt_state) is None


def test_each_mode_refuses_the_other_layout_and_names_the_fix():
    params, batch = _problem(width=8)
    (scan_state, _), (stream_state, _) = _init(params), _init(params, "stream")
    with pytest.raises(ValueError, match=r"holds a stream-mode accumulator.*step\.init"):
        accumjax.make_train_step(reference.mlp_loss, mode="scan")(stream_state, batch)
    with pytest.raises(ValueError, match=r"holds a stream-mode accumulator.*step\.init"):
        accumjax.make_train_step(reference.mlp_loss, mode="scan")(_create(params), batch)
    with pytest.raises(ValueError, match=r"built for scan mode.*step\.init"):
        accumjax.make_train_step(reference.mlp_loss, mode="stream")(scan_state, batch)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match=r"no accumulator.*tx\.init"):
        scan_state.apply_gradients(grads=grads)


class _WithAMode(accumjax.TrainState):
    mode: str = struct.field(pytree_node=False, default="")


def test_create_takes_no_mode_and_names_step_init():
    # 0.3 deprecated TrainState.create(mode=...), 0.4 removed it: the step builds its state.
    params, _ = _problem(width=8)
    tx = accumjax.accumulate(optax.adam(1e-3), K)
    with pytest.raises(TypeError, match=r"takes no mode.*step\.init\(params, tx"):
        accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")
    # A subclass's own field of that name is a field like any other.
    state = _WithAMode.create(apply_fn=None, params=params, tx=tx, mode="scan")
    assert state.mode == "scan" and state.opt_state.window.grad_sum is not None  # tx.init's


def test_with_mode_converts_create_and_init_states_and_refuses_an_open_window():
    params, batch = _problem(width=8)
    on_one = accumjax.with_mode(_init(params)[0], "stream").opt_state.window
    for key, acc in on_one.grad_sum.items():  # what tx.init makes
        np.testing.assert_array_equal(acc, np.zeros_like(params[key]))
    stream, step = _init(params, "stream")
    assert accumjax.with_mode(stream, "stream") is stream
    assert accumjax.with_mode(stream, "scan").opt_state.window.grad_sum is None  # a boundary
    opened, _ = step(stream, jax.tree.map(lambda x: x[:N], batch))
    with pytest.raises(ValueError, match=r"middle of a window.*micro_step == 1"):
        accumjax.with_mode(opened, "scan")
    plain = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    assert accumjax.with_mode(plain, "scan") is plain  # no window to lay out
    traced = jax.jit(lambda s: accumjax.with_mode(s, "scan"))(stream)
    assert traced.opt_state.window.grad_sum is None


def test_a_checkpoint_with_the_accumulator_converts_for_scan_mode(tmp_path):
    """A 0.2 scan-mode checkpoint held the accumulator: restored as saved, then converted."""
    params, batch = _problem(width=32)  # the scan step of the test above: compiled once
    old = _create(params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "old", old)
    template = jax.eval_shape(lambda: _create(params))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "old", template)
    restored = accumjax.with_mode(old.replace(**vars(restored)), "scan")  # static fields kept
    fresh, step = _init(params)
    resumed, _ = step(restored, batch)
    fresh, _ = step(fresh, batch)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_window_kept_per_data_shard_reads_as_the_whole_batch_and_is_refused_by_tx_update():
    # step.init on 8 devices keeps one partial sum per device; what accumulated_gradients and
    # stats report is the whole batch's, the values of the same run on one device.
    params, batch = _problem(width=8)
    mesh = jax.make_mesh((N,), ("data",))
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    step = accumjax.make_train_step(reference.mlp_loss, donate=False)
    runs = {}
    for where, placed in (
        ("one", params),
        ("mesh", jax.device_put(params, NamedSharding(mesh, P()))),
    ):
        state = step.init(placed, tx)
        for i in range(3):
            rows = jax.tree.map(lambda x, i=i: x[i * N : (i + 1) * N], batch)
            if where == "mesh":
                rows = jax.device_put(rows, NamedSharding(mesh, P("data")))
            state, _ = step(state, rows)
        runs[where] = state
    one, meshed = runs["one"], runs["mesh"]
    assert meshed.opt_state.window.partial_sums["w1"].shape == (N, 256, 8)
    want, got = (accumjax.accumulated_gradients(s.opt_state) for s in (one, meshed))
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 sums, another order
    s_one, s_mesh = accumjax.stats(one.opt_state), accumjax.stats(meshed.opt_state)
    assert s_mesh._replace(memory_bytes=0) == s_one._replace(memory_bytes=0)
    assert s_mesh.memory_bytes == N * s_one.memory_bytes  # every device's partial sums
    grads = jax.tree.map(jnp.ones_like, meshed.params)
    with pytest.raises(ValueError, match=r"per data shard.*tx\.init\(params\)"):
        meshed.apply_gradients(grads=grads)
    with pytest.raises(ValueError, match=r"pmap.*step\.init\(params, tx\)"):
        pmap_step = accumjax.make_train_step(reference.mlp_loss, axis_name="data")
        pmap_step(
            accumjax.replicate(one, N), jax.tree.map(lambda x: x[: N * N].reshape(N, N, -1), batch)
        )
