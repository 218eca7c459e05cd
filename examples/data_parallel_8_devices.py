"""Data parallelism over 8 devices with gradient accumulation and one all-reduce per update.

Each of 8 devices holds a replica of the parameters and a 1/8 slice of the batch, which it splits
into 4 microbatches (strided: microbatch i is the rows i, i + 4, ... of the device's slice).
`make_train_step(loss_fn, mode="scan", mesh=mesh, axis_name="data")` with the optimizer
`accumjax.accumulate(optax.adam(...), 4)` (K is stated once, in the optimizer) sums the 4
microbatch gradients locally and all-reduces the sum *once* per update, instead of once per
microbatch (each microbatch's decision, whether to add it, is agreed in an all-reduce of one
scalars). The update equals a single-device step on the whole batch.

There is no need for 8 real accelerators: XLA can split the host CPU into 8 devices.

Run: python examples/data_parallel_8_devices.py
"""

import os

# Must happen before JAX initializes its backends (i.e. before the first use of jax).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

import accumjax

assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()}"
DEVICES, ACCUM, MICRO = 8, 4, 16  # 8 devices x 4 microbatches x 16 examples = batch 512
BATCH = DEVICES * ACCUM * MICRO
N_IN, HIDDEN = 16, 64
UPDATES = 5

# A 1-D mesh: the batch is sharded over the "data" axis, the parameters replicated.
mesh = Mesh(np.array(jax.devices()), ("data",))

# --- Data and a small MLP regression model ------------------------------------------------------
rng = np.random.default_rng(0)
x = rng.normal(size=(UPDATES, BATCH, N_IN)).astype(np.float32)
y = np.sin(x @ rng.normal(size=(N_IN,))).astype(np.float32)


@jax.jit  # one compiled program, not one per initializer and operation
def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (N_IN, HIDDEN)) / np.sqrt(N_IN),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN,)) / np.sqrt(HIDDEN),
    }


def loss_fn(params, batch):
    """Mean squared error over the (micro)batch it is given."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def new_state(step, k):
    """A fresh state for ``step`` whose optimizer applies Adam once every k microbatches (k=1:
    plain Adam). ``step.init`` lays it out for the step's mode and mesh."""
    params = init_params(jax.random.key(0))
    tx = accumjax.accumulate(optax.adam(1e-2), k)
    return step.init(params, tx)


# --- 1. accumjax: 8 devices x 4 accumulated microbatches ----------------------------------------
# The step reads K (and the accumulation policies) from the state's optimizer.
step = accumjax.make_train_step(loss_fn, mode="scan", mesh=mesh, axis_name="data")
# Place each update's batch sharded over the devices (the step would also shard a host array).
sharding = accumjax.distributed.data_sharding(mesh, "data")
batches = [jax.device_put({"x": x[i], "y": y[i]}, sharding) for i in range(UPDATES)]

state = new_state(step, ACCUM)  # replicated on the step's mesh
# To inspect the collectives below: lower() takes the step's arguments (state, batch).
compiled = step.lower(state, batches[0]).compile()
for batch in batches:
    state, metrics = step(state, batch)
# Metrics are global scalars: the loss is the mean over the whole batch of 512 (all devices,
# all microbatches).
print(f"8-device accumulated run: final loss {float(metrics['loss']):.4f}")

# --- 2. Reference: one device, the whole batch of 512 at once -----------------------------------
reference_step = accumjax.make_train_step(loss_fn, mode="scan")
reference = new_state(reference_step, 1)
for i in range(UPDATES):
    reference, _ = reference_step(reference, {"x": x[i], "y": y[i]})

max_abs_diff = jax.jit(  # one compiled program, not one per operation and leaf shape
    lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(a, b, strict=True)]))
)
diff = float(max_abs_diff(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)))
print(f"max |params(8 devices x 4 microbatches) - params(1 device, full batch)| = {diff:.2e}")


# --- 3. A naive version: all-reduce every microbatch's gradient ---------------------------------
def naive_per_device(params, opt_state, batch):
    """What a straightforward port does: pmean inside the microbatch loop (ACCUM all-reduces)."""
    micro = jax.tree.map(lambda a: a.reshape(ACCUM, -1, *a.shape[1:]), batch)

    def body(acc, mb):
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, mb), "data")  # one all-reduce per step
        return jax.tree.map(jnp.add, acc, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g: g / ACCUM, grads)
    updates, opt_state = optax.adam(1e-2).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


naive_step = jax.jit(
    jax.shard_map(
        naive_per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec("data")),
        out_specs=PartitionSpec(),
        check_vma=False,  # gradients are local until the explicit pmean
    )
)
naive_params = init_params(jax.random.key(0))
naive_opt_state = optax.adam(1e-2).init(naive_params)
naive_compiled = naive_step.lower(naive_params, naive_opt_state, batches[0]).compile()

# per_execution=True counts what runs per call: an all-reduce in a loop body counts once per
# iteration. default_trip_count=0: the clean window, where the loop that runs a window again
# (only when the devices refused a microbatch: a NaN on one device leaves the whole microbatch
# out, as on one device) does not run. Each microbatch's verdict travels in the window's one
# all-reduce, with the gradient: nothing is reduced per microbatch.
count = lambda c, **kw: accumjax.collectives.count_collectives(c, per_execution=True, **kw)[
    "all-reduce"
]
ours = count(compiled, default_trip_count=0)
naive = count(naive_compiled, min_bytes=64)
print(f"gradient all-reduces per update: accumjax {ours}, naive per-microbatch pmean {naive}")
print(f"all-reduces per update, of any size: {ours}")

assert diff < 1e-5, "the data-parallel accumulated step should match the full-batch step"
assert ours < naive, "accumjax should all-reduce less often than the naive version"
print("8-device accumulation matches the single-device full batch: True")
