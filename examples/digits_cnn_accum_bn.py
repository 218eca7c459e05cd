"""A BatchNorm CNN trained with batch 256 as 8 accumulated microbatches of 32.

Gradient accumulation lets a small device train with a big batch: here each optimizer update
sees 256 images, fed as 8 microbatches of 32 to a step built by
`make_train_step(loss_fn, mode="stream")` for a state whose optimizer is
`accumjax.accumulate(optax.adam(...), 8)`: Adam is applied once every 8 calls. K is stated once,
in the optimizer; the step reads it from there. A plain BatchNorm would update its running
statistics 8 times per update from noisy 32-image microbatches; `accumjax.AccumBatchNorm` only
pools the microbatches' statistics, and the train step closes its window together with the
optimizer's: the running statistics move once per update, with those of all 256 images (and not
at all for a window the optimizer skips).

We train the same model twice, from the same initialization, on the same batches, for the same
number of updates: with batch 256 at once (K=1) and as 8 x 32 (K=8), on scikit-learn's bundled
8x8 digits, and check that:

- after the first update the running BatchNorm statistics of both runs agree (the pooled
  statistics of 8 microbatches are those of the full batch);
- both reach a high test accuracy, within 2 percentage points of each other.

Run: python examples/digits_cnn_accum_bn.py  (--quick: 30 updates per run, for the tests)
"""

import sys

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import accumjax

BATCH, MICRO = 256, 32  # logical batch, microbatch
UPDATES = 30 if "--quick" in sys.argv[1:] else 150  # optimizer updates per run
SEED = 0

# --- Data: 1797 grey 8x8 digits, as NHWC float32 in [0, 1] -------------------------------------
digits = load_digits()
images = (digits.images / 16.0).astype(np.float32)[..., None]
x_train, x_test, y_train, y_test = train_test_split(
    images, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target
)


def batches(seed=SEED):
    """Endless stream of shuffled batches of 256; the same sequence for both runs."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x_train))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[start : start + BATCH]
            yield {"image": x_train[idx], "label": y_train[idx]}


# --- Model: conv -> conv -> AccumBatchNorm -> relu -> pool -> dense ---------------------------
class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.Conv(32, (3, 3))(x)
        # Same arguments as flax.linen.BatchNorm. No accum_steps: make_train_step closes the
        # layer's window once per optimizer window, so the model does not need to know K.
        x = accumjax.AccumBatchNorm(momentum=0.9, name="bn")(x, use_running_average=not train)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


model = CNN()
# The initialization both runs start from (jitted: one compiled program, not one per initializer).
variables = jax.jit(lambda key, x: model.init(key, x, train=False))(
    jax.random.key(SEED), x_train[:1]
)
# Evaluation mode: AccumBatchNorm normalizes with its running statistics (jitted: one compiled
# program for both runs, not one per operation).
predict = jax.jit(lambda variables, x: model.apply(variables, x, train=False))


def train(k):
    """Trains from scratch; returns (test accuracy, running BN stats after the first update)."""
    # accumulate(adam, K) adds up K microbatch gradients and applies Adam to their mean on every
    # K-th call (K=1: plain Adam). This is the only place K is stated.
    tx = accumjax.accumulate(optax.adam(3e-3), k)

    # With model state the loss takes and returns it: (params, model_state, batch) ->
    # (loss, new_model_state). The loss is the mean over the (micro)batch it is given.
    def loss_fn(params, model_state, batch):
        logits, new_model_state = model.apply(
            {"params": params, **model_state}, batch["image"], train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, new_model_state

    # One call = one microbatch; parameters (and running BN statistics) change on every K-th
    # call, when the window closes.
    step = accumjax.make_train_step(loss_fn, mode="stream")
    # The step builds the state it takes (laid out for stream mode: the open window's partial
    # gradient sum lives in the state between calls).
    state = step.init(
        variables["params"],
        tx,
        model_state={"batch_stats": variables["batch_stats"]},  # non-trainable state
        apply_fn=model.apply,
    )

    first_stats = None
    data = batches()
    micro = BATCH // k
    for i in tqdm(range(UPDATES), desc=f"K={k}", ncols=80):
        batch = next(data)
        for j in range(k):  # the same 256 images, as k slices
            microbatch = jax.tree.map(lambda a, j=j: a[j * micro : (j + 1) * micro], batch)
            state, metrics = step(state, microbatch)
        assert bool(metrics["updated"]) and int(state.step) == i + 1
        if i == 0:  # copy now: the step donates (reuses) the input state's buffers
            first_stats = jax.tree.map(np.array, state.model_state["batch_stats"]["bn"])

    logits = np.asarray(predict({"params": state.params, **state.model_state}, x_test))
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    return accuracy, first_stats


acc_full, stats_full = train(k=1)  # batch 256 at once
acc_accum, stats_accum = train(k=BATCH // MICRO)  # 8 microbatches of 32

# The BatchNorm layer's input depends only on the parameters and the data, which are the same
# for both runs before the first update, so its pooled statistics must match the full batch's
# up to float32 round-off. (A second BatchNorm deeper in the network would see inputs
# normalized with per-microbatch statistics, which legitimately differ.)
mean_diff = float(np.max(np.abs(stats_full["mean"] - stats_accum["mean"])))
var_diff = float(np.max(np.abs(stats_full["var"] - stats_accum["var"])))
print(f"running BN stats after the first update: max |mean diff| = {mean_diff:.2e}, ", end="")
print(f"max |var diff| = {var_diff:.2e}")
print(f"test accuracy, batch 256 at once:         {acc_full:.2%}")
print(f"test accuracy, 8 x 32 accumulated:        {acc_accum:.2%}")

assert mean_diff < 1e-5 and var_diff < 1e-5, "pooled BN statistics should equal full-batch ones"
assert acc_full > 0.9 and acc_accum > 0.9, "both runs should learn the digits"
assert abs(acc_full - acc_accum) <= 0.02, "accumulated training should match full-batch training"
print("accumulated training matches full-batch training: True")
