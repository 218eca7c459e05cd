"""One process of the two-process data-parallel test (tests/test_distributed.py).

Run as ``python tests/_mp_worker.py PROCESS_ID PORT OUT_PREFIX LAYOUT[,LAYOUT...]``; the
test sets ``XLA_FLAGS`` for it. Each LAYOUT is trained from the start in turn, in the one
``jax.distributed`` session, and written to ``OUT_PREFIX-LAYOUT.npz``: ``mesh``
(``make_train_step(axis_name=..., mesh=...)``, state replicated) or ``fsdp`` (scan mode under
``jit``: the kernel sharded over the 8 devices of both processes). One pair of processes runs
every layout (a launch costs more than a layout's training). Importing this module only
defines the shared problem.
"""

import sys

import numpy as np

ACCUM_STEPS = 2
NUM_STEPS = 3
GLOBAL_BATCH = 32
LOCAL_DEVICES = 4


def problem():
    """Data and initial parameters, identical in every process and in the test."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, 2)).astype(np.float32)
    params = {
        "w": rng.normal(size=(8, 2)).astype(np.float32),
        "b": np.zeros(2, np.float32),
    }
    return x, y, params


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return ((pred - batch["y"]) ** 2).mean()


def make_tx():
    import optax

    import accumjax

    return accumjax.accumulate(optax.sgd(0.05, momentum=0.9), ACCUM_STEPS)


def main(process_id: int, port: int, out_prefix: str, layouts: list[str]) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert jax.process_count() == 2 and jax.device_count() == 2 * LOCAL_DEVICES
    for layout in layouts:
        train(process_id, layout, f"{out_prefix}-{layout}.npz")
    jax.distributed.shutdown()


def train(process_id: int, layout: str, out: str) -> None:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import accumjax
    from accumjax.distributed import data_sharding

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x, y, params = problem()
    if layout == "fsdp":
        specs = {"w": PartitionSpec("data", None), "b": PartitionSpec()}
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        step = accumjax.make_train_step(loss_fn, mode="scan")
    elif layout == "mesh":
        step = accumjax.make_train_step(loss_fn, mode="scan", axis_name="data", mesh=mesh)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    state = step.init(params, make_tx())
    rows = GLOBAL_BATCH // jax.process_count()
    local = slice(process_id * rows, (process_id + 1) * rows)
    sharding = data_sharding(mesh, "data")
    batch = {
        "x": jax.make_array_from_process_local_data(sharding, x[local], x.shape),
        "y": jax.make_array_from_process_local_data(sharding, y[local], y.shape),
    }
    losses = []
    for _ in range(NUM_STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # global: the whole batch's, on each process
    if layout == "fsdp":  # still sharded over both processes' devices
        assert state.params["w"].sharding.spec[0] == "data", state.params["w"].sharding
        assert state.opt_state.inner_tx_state[0].trace["w"].sharding.spec[0] == "data"
        assert state.opt_state.window.grad_sum is None  # scan mode: no accumulator is kept

    def whole(a):
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    np.savez(
        out,
        w=whole(state.params["w"]),
        b=whole(state.params["b"]),
        step=whole(state.step),
        loss=np.asarray(losses),
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(","))
