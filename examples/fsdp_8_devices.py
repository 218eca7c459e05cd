"""FSDP over 8 devices with gradient accumulation: plain `jit`, sharded arrays, no shard_map.

The parameters are sharded over the "data" mesh axis on their first dimension (FSDP / ZeRO-3:
each device stores 1/8 of every kernel), the optimizer state follows them (a scan-mode state
holds no accumulator: the step makes its own), and the batch is split over the same axis.
`make_train_step(loss_fn, mode="scan")` takes no mesh and no axis name: under `jit` it reads the
arrays' shardings and runs the 4 microbatches of each device's rows: each microbatch's
gradient of a sharded kernel is reduce-scattered into an accumulator sharded like the kernel
(each device keeps the slice it owns, so no device holds a full-size sum), the kernels are
all-gathered once per window, and one small all-reduce closes the window (biases, the loss and
each microbatch's verdict). The update runs on the sharded optimizer state.

The result agrees with the same scan step on one device, on the whole batch.

There is no need for 8 real accelerators: XLA can split the host CPU into 8 devices.

Run: python examples/fsdp_8_devices.py
"""

import itertools
import os

# Must happen before JAX initializes its backends (i.e. before the first use of jax).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import accumjax

DEVICES, ACCUM, MICRO = 8, 4, 16  # 8 devices x 4 microbatches x 16 examples = batch 512
BATCH = DEVICES * ACCUM * MICRO
assert jax.device_count() == DEVICES, f"expected {DEVICES} CPU devices, got {jax.device_count()}"
DIMS = (64, 256, 256, 10)
UPDATES = 30

# --- Data: scikit-learn's 8x8 digits, 1797 images of 64 pixels, 10 classes ----------------------
digits = load_digits()
images = (digits.data / 16.0).astype(np.float32)
labels = digits.target.astype(np.int32)
order = np.random.default_rng(0).permutation(len(labels))
train, test = order[:1400], order[1400:]
rng = np.random.default_rng(1)
batches = [rng.choice(train, BATCH, replace=False) for _ in range(UPDATES)]
batches = [{"x": images[i], "y": labels[i]} for i in batches]


def init_params():
    rng = np.random.default_rng(0)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(DIMS)):
        params[f"w{i}"] = (rng.normal(size=(a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def logits(params, x):
    n = len(DIMS) - 1
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits(params, batch["x"]), batch["y"]
    ).mean()


def accuracy(params):
    params = jax.device_get(params)  # gather the shards on the host
    return float(np.mean(np.argmax(logits(params, images[test]), -1) == labels[test]))


def spec_of(name, value):
    """FSDP: 2-D kernels whose first dimension divides by 8 are split over "data"."""
    if value.ndim == 2 and value.shape[0] % DEVICES == 0:
        return P("data", None)
    return P()


def new_state(params):
    """The state ``step`` takes (laid out for scan mode), its optimizer state placed like the
    parameters."""
    tx = accumjax.accumulate(optax.adam(1e-3), ACCUM)  # K = 4, stated once
    return step.init(params, tx)


def short(spec):
    """A PartitionSpec without its trailing unsharded dimensions (for printing)."""
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return P(*spec)


step = accumjax.make_train_step(loss_fn, mode="scan", donate=False)
mesh = jax.make_mesh((DEVICES,), ("data",))  # Explicit axes (the default in jax 0.10)


def sharded_run(fsdp, train=True):
    """Trains on the mesh (``train``); returns the state, the last metrics and the compiled
    step."""
    with jax.set_mesh(mesh):
        params = {
            k: jax.device_put(v, NamedSharding(mesh, spec_of(k, v) if fsdp else P()))
            for k, v in init_params().items()
        }
        data = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
        state = new_state(params)  # optimizer state sharded like the params
        compiled = step.lower(state, data[0]).compile()
        metrics = None
        for batch in data if train else ():
            state, metrics = step(state, batch)
    return state, metrics, compiled


# --- 1. FSDP on 8 devices ------------------------------------------------------------------------
state, metrics, compiled = sharded_run(fsdp=True)
print("parameter shardings after training:")
for name, value in state.params.items():
    print(f"  {name:3s} {value.shape!s:11s} {short(value.sharding.spec)}")
    assert short(value.sharding.spec) == short(spec_of(name, value))
mu = state.opt_state.inner_tx_state[0].mu  # Adam's first moment
print(f"optimizer state (Adam's mu['w1']) sharding: {short(mu['w1'].sharding.spec)}")
assert short(mu["w1"].sharding.spec) == P("data")
assert state.opt_state.window.grad_sum is None  # scan mode: the state holds no accumulator

# Collectives of 64 bytes or more: the gradient's and the parameters', on a clean window
# (default_trip_count=0: the loop that runs a window again after a rejected microbatch does not
# run). Each microbatch's gradient of a sharded kernel is reduce-scattered into an accumulator
# sharded like it; each microbatch's decision travels in the window's one small all-reduce
# (biases and scalars).
counts = accumjax.collectives.count_collectives(
    compiled, per_execution=True, default_trip_count=0, min_bytes=64
)
print(
    "collectives per window (K=4): "
    + ", ".join(f"{op} {counts[op]}" for op in ("all-reduce", "reduce-scatter", "all-gather"))
)
assert counts["reduce-scatter"] == 3 * 4 and counts["all-gather"] == 3
assert counts["all-reduce"] <= 1

# --- 2. The same step with replicated parameters (plain data parallel): compiled, not run --------
_, _, replicated_compiled = sharded_run(fsdp=False, train=False)
fsdp_bytes = compiled.memory_analysis().argument_size_in_bytes
replicated_bytes = replicated_compiled.memory_analysis().argument_size_in_bytes
print(
    f"per-device argument memory: FSDP {fsdp_bytes / 1024:.0f} KiB, "
    f"replicated {replicated_bytes / 1024:.0f} KiB ({replicated_bytes / fsdp_bytes:.1f}x)"
)
assert fsdp_bytes < replicated_bytes / 4

# --- 3. Reference: one device, the same scan step on the whole batch ------------------------------
reference = new_state(init_params())
with jax.default_device(jax.devices()[0]):
    for batch in batches:
        reference, ref_metrics = step(reference, batch)

diff = max(
    float(np.max(np.abs(np.asarray(state.params[k]) - np.asarray(reference.params[k]))))
    for k in reference.params
)
fsdp_loss = float(metrics["loss"])  # global: the window's mean over the whole batch
ref_loss = float(ref_metrics["loss"])
fsdp_acc, ref_acc = accuracy(state.params), accuracy(reference.params)
print(f"final window loss: FSDP 8 devices {fsdp_loss:.5f}, one device {ref_loss:.5f}")
print(f"test accuracy: FSDP 8 devices {fsdp_acc:.4f}, one device {ref_acc:.4f}")
print(f"max |params(FSDP, 8 devices) - params(1 device)| = {diff:.2e}")
assert abs(fsdp_loss - ref_loss) < 1e-4
assert abs(fsdp_acc - ref_acc) <= 1 / len(test)  # at most one test image differs
assert diff < 1e-4
print("FSDP accumulation matches the single-device run: True")
