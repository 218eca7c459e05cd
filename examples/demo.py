"""accumjax in one command: K microbatches train like one big batch, to round-off.

An MLP learns scikit-learn's bundled 8x8 digits (no download, no network) twice, from the
same initial parameters, on the same batches, for the same number of updates:

- full batch: ``make_train_step(loss_fn, mode="scan")`` with a plain ``optax.adam``;
- accumulated: the same step with ``accumjax.accumulate(optax.adam(...), K)``, which splits
  each batch into K microbatches inside one compiled program and applies Adam once per batch.

It prints, every few epochs, both runs' training loss and the largest absolute difference
between their parameters (float32 round-off, ~1e-6), then both test accuracies, and XLA's
compile-time temporary memory of the two steps (the accumulated step holds the activations
of one microbatch, not of the whole batch). It exits with status 1 if the parameters differ by
more than TOLERANCE (1e-4).

The model has no BatchNorm on purpose: a BatchNorm layer normalizes each microbatch with its
own statistics, so its forward pass (and gradient) legitimately differs from the full batch's;
see examples/digits_cnn_accum_bn.py for accumjax.AccumBatchNorm.

Run:
    python examples/demo.py                  # K=8: batch 448 as 8 x 56; ~20 s on a CPU
    python examples/demo.py --k 4 --epochs 10
    python examples/demo.py --quick          # a few updates (used by the tests)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import accumjax

Batch = dict[str, jax.Array]
Params = Any  # a pytree of arrays
LossFn = Callable[[Params, Batch], jax.Array]
EvalFn = Callable[[Params, Batch], tuple[jax.Array, jax.Array]]
SEED = 0
TRAIN_SIZE = 1347  # 75% of the 1797 digits; the other 450 are the test set
LEARNING_RATE = 3e-3
# Both runs compute the same mean gradient, but add its terms in a different order (K
# microbatch sums, then the sum of those, against one sum over the whole batch), so they
# differ by float32 round-off, ~1e-7 relative. Adam divides each gradient entry by its own
# running magnitude, which magnifies the relative round-off of near-zero entries, so the
# parameters differ by ~1e-6 (about 1e-3 of one Adam step of size LEARNING_RATE). A real
# accumulation bug is off by more than LEARNING_RATE after one update (measured: 6e-3 for a
# dropped microbatch, 3e-2 for an update per microbatch).
TOLERANCE = 1e-4


class MLP(nn.Module):
    """64 pixels -> 128 -> 128 -> 10 logits.

    GELU, not ReLU: round-off can flip a ReLU input that sits at 0 from one side to the other
    in one run only, a jump in its gradient; a smooth activation keeps the runs ~1e-6 apart.
    """

    width: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.gelu(nn.Dense(self.width)(x))
        x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def load_data() -> tuple[Batch, Batch]:
    """Digits as flat float32 pixels in [0, 1]: (train, test), 1347 and 450 images."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target
    )
    train = {"x": jnp.asarray(x_tr), "y": jnp.asarray(y_tr)}
    return train, {"x": jnp.asarray(x_te), "y": jnp.asarray(y_te)}


def batches(train: Batch, batch_size: int, seed: int = SEED) -> Iterator[Batch]:
    """Endless shuffled batches; one epoch is every full batch of one permutation."""
    rng = np.random.default_rng(seed)
    n = len(train["y"])
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield {"x": train["x"][idx], "y": train["y"][idx]}


def make_loss_fn(model: MLP) -> LossFn:
    """The mean cross-entropy over whatever (micro)batch it is given."""

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def make_evaluate(model: MLP) -> EvalFn:
    """A jitted ``evaluate(params, data) -> (mean loss, accuracy)``."""

    @jax.jit
    def evaluate(params: Params, data: Batch) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": params}, data["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == data["y"])

    return evaluate


def max_abs_diff(a: Params, b: Params) -> float:
    """The largest ``|a - b|`` over all leaves of two parameter trees."""
    return float(_max_abs_diff(a, b))


@jax.jit  # one compiled program, not one per operation and leaf shape
def _max_abs_diff(a: Params, b: Params) -> jax.Array:
    diffs = jax.tree.leaves(jax.tree.map(lambda u, v: jnp.max(jnp.abs(u - v)), a, b))
    return jnp.max(jnp.stack(diffs))


@dataclass
class Run:
    """One training run: its state and its jitted step."""

    state: accumjax.TrainState
    step: Any  # accumjax.make_train_step(...)


def new_run(model: MLP, params: Params, tx: optax.GradientTransformation) -> Run:
    """A run from ``params``: ``step.init`` builds the state the step takes, with arrays of
    its own (the step donates (reuses) its input state's buffers, so two states must not
    share arrays; ``params`` stay usable)."""
    # mode="scan": each call takes the whole batch and runs its K microbatches (rows i, i + K,
    # ...) in one compiled loop. K is read from the optimizer (a plain optax one: K = 1).
    step = accumjax.make_train_step(make_loss_fn(model), mode="scan")
    return Run(step.init(params, tx, apply_fn=model.apply), step)


def temp_mib(run: Run, batch: Batch) -> float:
    """XLA's compile-time temporary memory of one step call, in MiB.

    Temporaries are what accumulation shrinks: activations and per-microbatch gradients.
    ``accumjax.planner.compiled_memory_bytes`` adds the arguments and outputs (state and batch).
    """
    analysis = run.step.lower(run.state, batch).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def train_both(
    full: Run, accum: Run, args: argparse.Namespace, train: Batch, evaluate: EvalFn
) -> tuple[list[str], float]:
    """Trains both runs side by side on the same batches, in place.

    Returns the table rows and the largest parameter difference seen.
    """
    header = f"{'epoch':>5}  {'loss full':>10}  {'loss K=' + str(args.k):>10}  {'max |dparam|':>12}"
    rows, worst = [header, "-" * len(header)], 0.0
    updates_per_epoch = len(train["y"]) // args.batch
    report_every, total = max(1, args.epochs // 10), args.epochs * updates_per_epoch
    data = batches(train, args.batch)
    for update in tqdm(range(1, total + 1), desc="training", unit="update", ncols=80):
        batch = next(data)
        for run in (full, accum):
            run.state, _ = run.step(run.state, batch)
        epoch, rest = divmod(update, updates_per_epoch)
        if rest == 0 and (epoch % report_every == 0 or update == total):
            diff = max_abs_diff(full.state.params, accum.state.params)
            worst = max(worst, diff)
            losses = [float(evaluate(run.state.params, train)[0]) for run in (full, accum)]
            rows.append(f"{epoch:>5}  {losses[0]:>10.4f}  {losses[1]:>10.4f}  {diff:>12.2e}")
    return rows, worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8, help="microbatches per update (default 8)")
    parser.add_argument("--batch", type=int, default=448, help="full batch size (default 448)")
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (default 30)")
    parser.add_argument("--quick", action="store_true", help="train 2 epochs only (smoke test)")
    args = parser.parse_args(argv)
    if args.k < 1 or args.batch % args.k:
        parser.error(f"--k must be >= 1 and divide --batch={args.batch}, got {args.k}")
    if not 1 <= args.batch <= TRAIN_SIZE:
        parser.error(f"--batch must be in [1, {TRAIN_SIZE}] (the training set), got {args.batch}")
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.quick:
        args.epochs = 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train, test = load_data()
    model = MLP()
    evaluate = make_evaluate(model)
    # Jitted: one compiled program, not one per initializer and operation.
    params = jax.jit(model.init)(jax.random.key(SEED), train["x"][:1])["params"]
    full = new_run(model, params, optax.adam(LEARNING_RATE))  # one batch per update
    accum = new_run(model, params, accumjax.accumulate(optax.adam(LEARNING_RATE), args.k))
    example = next(batches(train, args.batch))
    full_mib, accum_mib = temp_mib(full, example), temp_mib(accum, example)

    micro, per_epoch = args.batch // args.k, len(train["y"]) // args.batch
    print(f"digits MLP: full batch {args.batch} vs K={args.k} microbatches of {micro}")
    print(f"{args.epochs} epochs of {per_epoch} updates each, Adam, float32\n")
    rows, worst = train_both(full, accum, args, train, evaluate)
    print("\n".join(rows))

    acc_full, acc_accum = (float(evaluate(run.state.params, test)[1]) for run in (full, accum))
    print(f"\ntest accuracy: full batch {acc_full:.2%}, K={args.k} accumulated {acc_accum:.2%}")
    print(
        f"XLA temp memory per step: full batch {full_mib:.2f} MiB, K={args.k} microbatches "
        f"{accum_mib:.2f} MiB ({full_mib / max(accum_mib, 1e-9):.1f}x less)"
    )
    ok = worst <= TOLERANCE and int(full.state.step) == int(accum.state.step)
    print(f"accumulated training matches full-batch training (max |dparam| <= {TOLERANCE:g}): {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
