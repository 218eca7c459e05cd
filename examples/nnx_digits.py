"""A Flax NNX MLP with accumulated BatchNorm and dropout, batch 128 as 4 microbatches of 32.

`accumjax.make_nnx_train_step(loss_fn, mode="scan")` trains an `nnx.Module` directly: the loss
takes the model, `loss_fn(model, batch, key)`, and the state is the model split by the step,
`step.init(model, tx)`, into parameters (`nnx.Param`) and everything else (`nnx.BatchStat`,
...), laid out for the step's mode. K is stated once, in
`tx = accumjax.accumulate(optax.adam(...), K)`. With scan mode one call takes the whole batch
of 128 and loops over its 4 microbatches (rows i, i + 4, i + 8, ...) inside one compiled
program; Adam is applied once per call.

`accumjax.NNXAccumBatchNorm` only pools its microbatches' statistics; the step closes its
window with the optimizer's, so the running statistics move once per update, with those of all
128 examples. Every microbatch gets its own dropout key: `fold_in` of the seed, the update count
and the microbatch index, passed to the loss as its last argument.

We train the same model twice, from the same initialization, on the same batches, for the same
number of updates: with batch 128 at once (K=1) and as 4 x 32 (K=4), on scikit-learn's 8x8
digits, and check that

- after the first update the running BatchNorm statistics of both runs agree (the pooled
  statistics of 4 microbatches are those of the whole batch);
- both reach a high test accuracy, within 2 percentage points of each other.

Run: python examples/nnx_digits.py  (--quick: 8 epochs, for the tests)
"""

import sys

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import accumjax
from accumjax.nnx_train_step import make_nnx_train_step, nnx_update

BATCH, MICRO = 128, 32  # examples per update, per microbatch
EPOCHS = 8 if "--quick" in sys.argv[1:] else 25
SEED = 0

# --- Data: 1797 grey 8x8 digits as 64 features in [0, 1] ----------------------------------------
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    (digits.data / 16.0).astype(np.float32),
    digits.target,
    test_size=0.25,
    random_state=SEED,
    stratify=digits.target,
)


def batches(seed=SEED):
    """The shuffled batches of 128 of every epoch; the same sequence for both runs."""
    rng = np.random.default_rng(seed)
    for _ in range(EPOCHS):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[start : start + BATCH]
            yield {"x": x_train[idx], "y": y_train[idx]}


# --- Model: Linear -> NNXAccumBatchNorm -> relu -> Dropout -> Linear ----------------------------
class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        # Same arguments as nnx.BatchNorm. No accum_steps: the train step closes the window.
        self.norm = accumjax.NNXAccumBatchNorm(128, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)  # no rngs of its own: the key comes with the call
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = self.dropout(nnx.relu(self.norm(self.hidden(x))), rngs=rngs)
        return self.out(x)


def loss_fn(model, batch, key):
    """The mean loss of one microbatch; ``key`` is this microbatch's dropout key."""
    logits = model(batch["x"], rngs=key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# Evaluation: the model viewed in inference mode (running BatchNorm statistics, no dropout),
# jitted: one compiled program for both runs, not one per operation.
predict = nnx.jit(lambda model, x: nnx.view(model, use_running_average=True, deterministic=True)(x))


def train(k):
    """Trains from scratch; returns (test accuracy, running BN stats after the first update)."""
    model = MLP(nnx.Rngs(SEED))
    # accumulate(adam, K): K microbatch gradients summed, Adam applied to their mean once per
    # window (K=1: plain Adam). The only place K is stated.
    step = make_nnx_train_step(loss_fn, mode="scan")  # one call = one batch = one update
    state = step.init(model, accumjax.accumulate(optax.adam(3e-3), k))  # copies of the arrays
    first_stats = None
    for i, batch in enumerate(batches()):
        state, metrics = step(state, batch, jax.random.key(SEED))
        assert bool(metrics["updated"]) and int(state.step) == i + 1
        if i == 0:  # copy now: the step donates (reuses) the input state's buffers
            norm = state.model_state["norm"]
            first_stats = {name: np.array(norm[name][...]) for name in ("mean", "var")}
    # Evaluation: write the state back into the model, and predict in inference mode.
    nnx_update(model, state)
    accuracy = float(np.mean(np.argmax(np.asarray(predict(model, x_test)), -1) == y_test))
    return accuracy, first_stats


acc_full, stats_full = train(k=1)  # batch 128 at once
acc_accum, stats_accum = train(k=BATCH // MICRO)  # 4 microbatches of 32

# The norm's input depends only on the parameters and the data, equal for both runs before the
# first update, so its pooled statistics must match the whole batch's up to float32 round-off.
diff = {name: float(np.max(np.abs(stats_full[name] - stats_accum[name]))) for name in stats_full}
print(
    f"running BN stats after the first update: max |mean diff| = {diff['mean']:.2e}, "
    f"max |var diff| = {diff['var']:.2e}"
)
print(f"test accuracy, K=1 (batch 128 at once):   {acc_full:.2%}")
print(f"test accuracy, K=4 (4 x 32 accumulated):  {acc_accum:.2%}")

assert max(diff.values()) < 1e-5, "pooled BN statistics should equal full-batch ones"
assert acc_full > 0.9 and acc_accum > 0.9, "both runs should learn the digits"
assert abs(acc_full - acc_accum) <= 0.02, "accumulated training should match full-batch training"
print("accumulated training matches full-batch training: True")
