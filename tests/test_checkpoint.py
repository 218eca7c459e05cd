"""restore_checkpoint (accumjax.checkpoint): a checkpoint restores on another number of devices.

A stream window kept per data shard is saved with every device's partial sum; restored on 4,
1 or 8 devices (from 8, 8 and 1), mid-window and at a window boundary, replicated and FSDP,
training goes on to the parameters of the run that was never interrupted. Scan-mode states
hold no window and restore through orbax's own route too. Reference: the uninterrupted run
on one device.
"""

import functools

import _reference as reference
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

K = 4
ROWS = 16  # a stream call's rows: 2 per device on 8


def _problem():
    rng = np.random.default_rng(0)
    params = reference.mlp_params(rng, (8, 16, 2), (0.5, 0.5))
    x = rng.normal(size=(2 * K * ROWS, 8)).astype(np.float32)
    return params, {"x": x, "y": np.sin(x[:, :2])}


def _mesh(n):
    assert jax.device_count() >= 8
    return None if n == 1 else jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _place(tree, mesh, specs):
    if mesh is None:
        return tree
    return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


def _batches(batch, mode, mesh):
    rows = ROWS if mode == "stream" else K * ROWS
    parts = [
        jax.tree.map(lambda a, i=i: a[i : i + rows], batch) for i in range(0, len(batch["x"]), rows)
    ]
    return (
        parts
        if mesh is None
        else [jax.device_put(p, NamedSharding(mesh, P("data"))) for p in parts]
    )


FSDP = {"w1": P("data", None), "w2": P(None, None), "b1": P()}
# One optimizer object and one step per mode for the module: a run on the same devices and
# layout as an earlier one reuses its compiled program (the optimizer is static in the state).
ADAM = accumjax.accumulate(optax.adam(1e-2), K)


@functools.cache
def _step(mode, optimizer_sharding="replicated"):
    return accumjax.make_train_step(
        reference.mlp_loss, mode=mode, donate=False, optimizer_sharding=optimizer_sharding
    )


def _run(mode, fsdp, tmp_path, save_on, save_after, load_on, tx, layouts=("replicated",) * 2):
    """Train on ``save_on`` devices, save after ``save_after`` calls, restore on ``load_on``
    devices and finish: the final parameters. ``layouts``: the ``optimizer_sharding`` of
    the step that saves and of the one that restores."""
    params, batch = _problem()
    specs = FSDP if fsdp else {}
    step = _step(mode, layouts[0])
    mesh = _mesh(save_on)
    state = step.init(_place(params, mesh, specs), tx)
    calls = _batches(batch, mode, mesh)
    for b in calls[:save_after]:
        state, _ = step(state, b)
    path = tmp_path / f"{mode}-{fsdp}-{save_on}-{save_after}-{load_on}"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
    step = _step(mode, layouts[1])
    new_mesh = _mesh(load_on)
    target = step.init(_place(params, new_mesh, specs), tx)
    restored = accumjax.restore_checkpoint(path, target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.shape == want.shape and got.sharding == want.sharding  # the target's layout
    for b in _batches(batch, mode, new_mesh)[save_after:]:
        restored, metrics = step(restored, b)
    return restored, metrics


@pytest.fixture(scope="module")
def uninterrupted():
    """The whole run on one device, per mode (the reference)."""
    params, batch = _problem()
    out = {}
    for mode in ("stream", "scan"):
        step = _step(mode)
        state = step.init(params, ADAM)
        for b in _batches(batch, mode, None):
            state, _ = step(state, b)
        out[mode] = state.params
    return out


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
@pytest.mark.parametrize(
    "save_on,load_on,save_after", [(8, 4, 2), (8, 1, 2), (1, 8, 2), (8, 4, K), (1, 8, K)]
)
def test_a_stream_checkpoint_restores_on_another_number_of_devices(
    uninterrupted, tmp_path, fsdp, save_on, load_on, save_after
):
    # Mid-window (after 2 of K calls: the partial sums move) and at a boundary (after K).
    restored, metrics = _run("stream", fsdp, tmp_path, save_on, save_after, load_on, ADAM)
    assert int(restored.step) == 2 and metrics["loss"].shape == ()
    for key, want in uninterrupted["stream"].items():
        # The partial sums regrouped: float32 sums in another order (rtol 1e-6 of the issue;
        # adam's normalisation keeps the relative error at the sum's).
        np.testing.assert_allclose(restored.params[key], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "save_on,load_on,layouts",
    [
        (8, 4, ("zero1", "zero1")),
        (8, 1, ("zero1", "zero1")),
        (8, 8, ("replicated", "zero1")),
        (8, 4, ("zero1", "replicated")),
    ],
)
def test_a_zero1_stream_checkpoint_restores_mid_window_across_devices_and_layouts(
    uninterrupted, tmp_path, save_on, load_on, layouts
):
    # The optimizer state split over "data" (ZeRO-1) is read into the target's layout: split
    # over 4 or 8 devices, whole on 1, or replicated; the open window's partial sums move.
    restored, _ = _run("stream", False, tmp_path, save_on, 2, load_on, ADAM, layouts)
    mu = restored.opt_state.inner_tx_state[0].mu["w1"]  # (8, 16): splits over 4 and 8
    split = tuple(getattr(mu.sharding, "spec", ()))[:1] == ("data",)
    assert split == (layouts[1] == "zero1" and load_on > 1)
    for key, want in uninterrupted["stream"].items():
        np.testing.assert_allclose(restored.params[key], want, rtol=1e-6, atol=1e-7)


def test_a_zero2_stream_checkpoint_restores_mid_window_on_8_then_4_then_1_devices(
    uninterrupted, tmp_path
):
    # ZeRO-2 keeps one window sum split over the devices (its row of the layout plan): saved
    # mid-window on 8 devices (after 1 of K calls), restored on 4, saved mid-window again
    # (after 3), restored on 1, finished there.
    params, batch = _problem()
    step, state, done = _step("stream", "zero2"), None, 0
    full_bytes = 4 * sum(x.size for x in params.values())  # one float32 sum of each leaf
    for devices, calls in ((8, 1), (4, 2), (1, 5)):
        mesh = _mesh(devices)
        target = step.init(_place(params, mesh, {}), ADAM)
        if state is None:
            state = target
        else:
            path = tmp_path / f"zero2-{devices}"
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(path, state)
            state = accumjax.restore_checkpoint(path, target)
            for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
                assert got.shape == want.shape and got.sharding == want.sharding
        sums = state.opt_state.window.partial_sums
        assert sums["w1"].shape == (1, 8, 16)  # one sum, split over the devices
        assert accumjax.stats(state).memory_bytes == full_bytes
        for b in _batches(batch, "stream", mesh)[done : done + calls]:
            state, _ = step(state, b)
        done += calls
    assert state is not None and int(state.step) == 2
    for key, want in uninterrupted["stream"].items():
        np.testing.assert_allclose(state.params[key], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("save_on,load_on", [(8, 4), (1, 8)])
def test_a_scan_checkpoint_restores_on_another_number_of_devices(
    uninterrupted, tmp_path, save_on, load_on
):
    restored, _ = _run("scan", True, tmp_path, save_on, 1, load_on, ADAM)
    for key, want in uninterrupted["scan"].items():
        np.testing.assert_allclose(restored.params[key], want, rtol=1e-6, atol=1e-7)


def test_windows_move_between_layouts_and_an_open_one_is_not_dropped(tmp_path):
    params, batch = _problem()
    tx = accumjax.accumulate(optax.sgd(0.1), K)
    stream, scan = _step("stream"), _step("scan")
    created = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)  # one sum
    calls = _batches(batch, "stream", None)
    opened, _ = stream(created, calls[0])
    opened, _ = stream(opened, calls[1])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "open", opened)
        checkpointer.save(tmp_path / "closed", created)
    # tx.init's one sum into step.init's per-shard sums on 8 devices: the same window.
    target = stream.init(_place(params, _mesh(8), {}), tx)
    moved = accumjax.restore_checkpoint(tmp_path / "open", target)
    want = accumjax.accumulated_gradients(opened.opt_state)
    got = accumjax.accumulated_gradients(moved.opt_state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert accumjax.stats(moved.opt_state) == accumjax.stats(opened.opt_state)._replace(
        memory_bytes=accumjax.stats(moved.opt_state).memory_bytes
    )
    # A scan-mode state has no window: a closed one is dropped, an open one is refused.
    into_scan = accumjax.restore_checkpoint(tmp_path / "closed", scan.init(params, tx))
    assert into_scan.opt_state.window.grad_sum is None
    with pytest.raises(ValueError, match=r"open \(micro_step == 2\).*stream-mode state"):
        accumjax.restore_checkpoint(tmp_path / "open", scan.init(params, tx))


def test_abstract_targets_and_what_cannot_be_restored(tmp_path):
    params, _ = _problem()
    tx = accumjax.accumulate(optax.adam(1e-2), K)
    step = accumjax.make_train_step(reference.mlp_loss)
    mesh = _mesh(8)
    state = step.init(_place(params, mesh, {}), tx)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "c", state)
    # step.init on shapes: nothing allocated, an orbax target on the mesh.
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        params,
    )
    abstract = step.init(shapes, tx)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    with ocp.StandardCheckpointer() as checkpointer:  # orbax's own route, same devices
        same = checkpointer.restore(tmp_path / "c", abstract)
    np.testing.assert_array_equal(same.params["w1"], state.params["w1"])
    # jax.eval_shape of the same call names an abstract mesh: give the concrete one.
    evaluated = jax.eval_shape(lambda p: step.init(p, tx), _place(params, mesh, {}))
    with pytest.raises(ValueError, match=r"abstract mesh.*mesh=mesh"):
        accumjax.restore_checkpoint(tmp_path / "c", evaluated)
    restored = accumjax.restore_checkpoint(tmp_path / "c", evaluated, mesh=mesh)
    np.testing.assert_array_equal(restored.params["w1"], state.params["w1"])
    other = dict(params, w1=np.zeros((8, 3), np.float32))  # another model
    with pytest.raises(ValueError, match=r"state\.params\['w1'\].*\(8, 16\).*\(8, 3\)"):
        accumjax.restore_checkpoint(tmp_path / "c", step.init(other, tx))
    # Another K: the optimizer's K is in its state's type; restore_checkpoint names it.
    with pytest.raises(
        ValueError,
        match=r"(?s)does not fit.*made with every_k=4; this accumulate uses every_k=8.*"
        r"with_every_k\(tx, 4\)",
    ):
        accumjax.restore_checkpoint(tmp_path / "c", step.init(params, accumjax.with_every_k(tx, 8)))


def _without_k_tag(tree):
    """``tree`` as an accumjax without `AccumulationState.every_k_tag` saved it."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return {f: _without_k_tag(getattr(tree, f)) for f in tree._fields if f != "every_k_tag"}
    return tree


def test_a_checkpoint_saved_without_the_k_tag_restores_when_its_k_fits(tmp_path):
    params, batch = _problem()
    step = _step("stream")
    state, _ = step(step.init(params, ADAM), _batches(batch, "stream", None)[0])  # mid-window
    fields = ("step", "params", "model_state", "loss_scale")
    saved = {f: getattr(state, f) for f in fields} | {"opt_state": _without_k_tag(state.opt_state)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "old", saved)
    restored = accumjax.restore_checkpoint(tmp_path / "old", step.init(params, ADAM))
    assert restored.opt_state.every_k_tag.shape == (K,)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    with pytest.raises(ValueError, match=r"made with every_k=4; this accumulate uses every_k=8"):
        accumjax.restore_checkpoint(
            tmp_path / "old", step.init(params, accumjax.with_every_k(ADAM, 8))
        )
