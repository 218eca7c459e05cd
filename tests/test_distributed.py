"""Tests for accumjax.distributed (pmap replication, mesh sharding) and the train step's
one-all-reduce-per-window property; count_collectives itself: tests/test_collectives.py."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _assertions import collective_counts
from conftest import with_subprocess_warnings
from jax.sharding import Mesh, PartitionSpec

import accumjax
from accumjax.collectives import count_collectives
from accumjax.distributed import data_sharding, replicate, unreplicate

HERE = Path(__file__).parent
K = 4


def test_replicate_unreplicate_and_data_sharding():
    tree = {"w": jnp.arange(3.0), "s": jnp.int32(2)}
    rep = replicate(tree, 4)
    assert rep["w"].shape == (4, 3) and rep["s"].shape == (4,)
    np.testing.assert_array_equal(unreplicate(rep)["w"], tree["w"])
    assert replicate(tree)["w"].shape[0] == jax.local_device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert data_sharding(mesh, "data").spec == PartitionSpec("data")
    with pytest.raises(ValueError, match="not an axis"):
        data_sharding(mesh, "model")


def test_unreplicate_takes_leaf_zero_of_pmap_outputs_numpy_and_replicated_arrays():
    # Where flax.jax_utils.unreplicate differs (see the comment in unreplicate): a leaf on
    # several devices that is not split one row per device.
    n = jax.device_count()
    out = jax.pmap(lambda x: {"w": x * 2, "s": x.sum()})(jnp.arange(3.0 * n).reshape(n, 3))
    got = unreplicate(out)
    np.testing.assert_array_equal(got["w"], [0.0, 2.0, 4.0])
    assert got["s"].shape == () and float(got["s"]) == 3.0
    np.testing.assert_array_equal(unreplicate(np.arange(6.0).reshape(2, 3)), [0.0, 1.0, 2.0])
    mesh = Mesh(np.array(jax.devices()), ("data",))
    stacked = replicate({"w": jnp.arange(3.0)}, 4)
    everywhere = jax.device_put(stacked, jax.sharding.NamedSharding(mesh, PartitionSpec()))
    np.testing.assert_array_equal(unreplicate(everywhere)["w"], [0.0, 1.0, 2.0])
    rows = jax.device_put(jnp.arange(2.0 * n).reshape(2 * n, 1), data_sharding(mesh, "data"))
    np.testing.assert_array_equal(unreplicate(rows), [0.0])


def test_replicate_gives_num_devices_copies_whatever_the_device_count():
    # flax.jax_utils.replicate(tree, jax.local_devices()[:n]) returns min(n, devices) copies.
    n = 2 * jax.local_device_count()
    rep = replicate({"w": jnp.ones(3), "step": 0}, n)
    assert rep["w"].shape == (n, 3) and rep["step"].shape == (n,)
    assert replicate({"w": jnp.ones(3)}, 0)["w"].shape == (0, 3)


# ----------------------------------------------------------------------- one all-reduce per window


def _problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.zeros(3)}
    batch = {
        "x": jnp.asarray(rng.normal(size=(8 * K * 2, 5)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(8 * K * 2, 3)), jnp.float32),
    }
    return params, batch


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _naive_step(mesh, tx):
    """Reference anti-pattern: average the gradients across devices for every microbatch."""

    def step(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)
        varying = jax.lax.pcast(params, "data", to="varying")

        def body(acc, mb):
            g = jax.lax.pmean(jax.grad(_loss)(varying, mb), "data")
            return jax.tree.map(jnp.add, acc, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        acc, _ = jax.lax.scan(body, zeros, micro)
        updates, opt_state = tx.update(jax.tree.map(lambda a: a / K, acc), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    spec = PartitionSpec()
    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(spec, spec, PartitionSpec("data")),
            out_specs=(spec, spec),
        )
    )


def _all_reduce_lines(lowered):
    text = lowered.compile().as_text()
    return [line for line in text.splitlines() if re.search(r"\sall-reduce(-start)?\(", line)]


def _once_per_window(lowered):
    """One all-reduce per window and no other collective: the gradient, with each
    microbatch's decision in it (no all-reduce per microbatch). Only a window whose
    devices rejected a microbatch runs again (a loop of at most one trip) and reduces once
    more."""
    clean = count_collectives(lowered, per_execution=True, default_trip_count=0)
    assert clean == collective_counts(all_reduce=1)
    again = count_collectives(lowered, per_execution=True, default_trip_count=1)
    assert again == collective_counts(all_reduce=2)


def test_scan_step_all_reduces_once_per_window_vs_naive():
    assert jax.device_count() >= 8
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params, batch = _problem()
    tx = optax.sgd(0.1, momentum=0.9)
    step = accumjax.make_train_step(_loss, mode="scan", axis_name="data", mesh=mesh)
    state = step.init(params, accumjax.accumulate(tx, K))
    lowered = step.lower(state, batch)
    _once_per_window(lowered)
    ours = count_collectives(lowered, per_execution=True, min_bytes=64, default_trip_count=0)
    # The window's all-reduce carries the gradients of both parameters (and the loss, weights
    # and verdicts); the second is the re-run's, for a window with a refused microbatch.
    lines = [line for line in _all_reduce_lines(lowered) if "f32[5,3]" in line]
    assert len(lines) == 2 and all("f32[3]" in line for line in lines)

    naive_step = _naive_step(mesh, tx)
    naive = naive_step.lower(params, tx.init(params), batch)
    naive_counts = count_collectives(naive, per_execution=True)
    # XLA keeps the naive all-reduce inside the loop: one instruction, run K times.
    assert naive_counts["all-reduce"] == K
    assert naive_counts["all-reduce"] > ours["all-reduce"]

    # Same update: averaging the sum once equals averaging every microbatch (sgd is linear;
    # float32 sums in a different order, a few ulps).
    new_state, _ = step(jax.tree.map(jnp.copy, state), batch)
    naive_params, _ = naive_step(params, tx.init(params), batch)
    for key in params:
        np.testing.assert_allclose(new_state.params[key], naive_params[key], rtol=1e-5, atol=1e-6)


class _BNModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        x = accumjax.AccumBatchNorm(use_running_average=False)(x)  # closed by the step
        return nn.Dense(3)(x)


def test_scan_step_with_model_state_and_float16_reduces_once_per_window():
    # The gradients, weights and counts go in one psum and the BatchNorm windows' pooled sums
    # (every layer) in another; XLA combines the two into one all-reduce. float16 adds none:
    # the loss scale follows the window's reduced count.
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    _, batch = _problem()
    model = _BNModel()
    variables = model.init(jax.random.key(0), batch["x"][:2])
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(params, model_state, batch):
        pred, new_state = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((pred - batch["y"]) ** 2), new_state

    step = accumjax.make_train_step(
        loss_fn, mode="scan", axis_name="data", mesh=mesh, mixed_precision="float16"
    )
    state = step.init(params, accumjax.accumulate(optax.adam(1e-3), K), model_state=model_state)
    _once_per_window(step.lower(state, batch))


def test_pmap_scan_step_all_reduces_once_per_window():
    n = 8
    assert jax.device_count() >= n
    params, batch = _problem()
    step = accumjax.make_train_step(_loss, mode="scan", axis_name="data")
    state = step.init(params, accumjax.accumulate(optax.sgd(0.1), K))  # replicated by pmap's
    assert state.step.shape == (jax.local_device_count(),)
    local = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
    _once_per_window(step.lower(state, local))


def test_stream_step_reduces_the_gradient_only_in_the_window_end_branch():
    # A stream call on the mesh= path: its metrics and counts in one small all-reduce, the
    # gradient (kept per device by step.init's state) in the window end (a loop run at most
    # once per call).
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params, batch = _problem()
    microbatch = jax.tree.map(lambda x: x[:16], batch)
    tx = accumjax.accumulate(optax.sgd(0.1), K, axis_name="data")  # the axis is the step's
    step = accumjax.make_train_step(_loss, axis_name="data", mesh=mesh)
    state = step.init(params, tx)
    lowered = step.lower(state, microbatch)
    every = count_collectives(lowered, per_execution=True, default_trip_count=0)
    assert every == collective_counts(all_reduce=1)  # the call's loss and counts
    closing = count_collectives(lowered, per_execution=True, default_trip_count=1)
    assert closing == collective_counts(2)
    gradient_lines = [line for line in _all_reduce_lines(lowered) if "f32[5,3]" in line]
    (line,) = gradient_lines  # both parameters' partial sums, once
    assert "f32[3]" in line
    # float16 adds none: an overflow is a skipped microbatch, counted in the call's one
    # reduction, and the loss scale is adjusted once per window from that count.
    f16 = accumjax.make_train_step(_loss, axis_name="data", mesh=mesh, mixed_precision="float16")
    counted = count_collectives(f16.lower(f16.init(params, tx), microbatch))
    assert counted == collective_counts(all_reduce=2)


# ----------------------------------------------------------------------------- multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUTS = ("mesh", "fsdp")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """One pair of jax.distributed workers trains every layout (a launch costs more than a
    layout's training); (per layout, the two processes' results, or why there are none) and
    the single-process reference."""
    sys.path.insert(0, str(HERE))
    try:
        import _mp_worker as worker
    finally:
        sys.path.remove(str(HERE))
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    # conftest's autouse fixture sets these per test, after a module fixture runs: the
    # workers get the same deprecation errors from here.
    env["PYTHONWARNINGS"] = with_subprocess_warnings(env.get("PYTHONWARNINGS"))
    prefixes = [tmp_path_factory.mktemp("two_process") / f"out{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_mp_worker.py"),
                str(i),
                str(port),
                str(prefixes[i]),
                ",".join(LAYOUTS),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    failure = None
    logs = []
    for i, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, err = proc.communicate()
            failure = failure or f"worker {i} timed out after 120 s; stderr:\n{err[-4000:]}"
        logs.append(err)
    for i, proc in enumerate(procs):
        if proc.returncode != 0:
            failure = failure or f"worker {i} failed ({proc.returncode}):\n{logs[i][-4000:]}"

    # Reference in this process: the same scan-mode steps on one device, whole batch.
    x, y, params = worker.problem()
    step = accumjax.make_train_step(worker.loss_fn, mode="scan")
    state = step.init(params, worker.make_tx())
    losses = []
    for _ in range(worker.NUM_STEPS):
        state, metrics = step(state, {"x": jnp.asarray(x), "y": jnp.asarray(y)})
        losses.append(float(metrics["loss"]))
    results = {
        layout: [np.load(f"{prefix}-{layout}.npz") for prefix in prefixes]
        for layout in LAYOUTS
        if failure is None
    }
    return results, failure, state.params, losses, worker.NUM_STEPS


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_process_scan_matches_single_process(two_process_run, layout):
    results, failure, params, losses, num_steps = two_process_run
    if failure is not None:
        pytest.fail(failure)
    results = results[layout]
    for key in ("w", "b"):
        # Both processes hold the same replicated parameters, bit for bit.
        np.testing.assert_array_equal(results[0][key], results[1][key])
        # Per-device sums all-reduced across processes vs one sequential float32 sum:
        # a few ulps after 3 momentum steps.
        np.testing.assert_allclose(results[0][key], params[key], rtol=1e-5, atol=1e-6)
    assert int(results[0]["step"]) == num_steps
    # The loss is global: both processes report the whole batch's (float32 sums, another
    # order).
    np.testing.assert_array_equal(results[0]["loss"], results[1]["loss"])
    np.testing.assert_allclose(results[0]["loss"], losses, rtol=1e-5)
