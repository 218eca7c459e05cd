"""Token-weighted accumulation: the exact gradient of a token-mean loss over ragged batches.

Sequence models usually average their loss over the *tokens* of a batch. When a big batch is
split into microbatches of different token counts (padding masks, length bucketing), each
microbatch's loss is the mean over its own tokens, and averaging those K means
(``scaling="mean"``, as ``optax.MultiSteps`` does) over-weights the tokens of short microbatches.

``accumulate(..., scaling="weighted")`` with ``update(..., weight=n_tokens)`` accumulates
``sum_i n_i g_i`` and divides by ``sum_i n_i``: exactly the gradient of the token-mean loss of the
whole accumulated batch. This script checks that against a float64 full-batch computation, first
with the optimizer on its own, then with a train step from
``make_train_step(loss_fn, weight_fn=...)``, which reads K and the scaling from the state's
optimizer (``tx=accumulate(inner, K, scaling="weighted")``) and takes each microbatch's weight
from ``weight_fn(microbatch)``.

Run: python examples/token_weighted_sequence.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax

VOCAB, DIM = 32, 16  # vocabulary size, embedding width
K, SEQS, MAX_LEN = 4, 8, 64  # 4 microbatches of 8 sequences, padded to 64 tokens

# --- Data: random token sequences of variable length, bucketed by length --------------------
# Length bucketing is common in practice and makes token counts differ a lot between
# microbatches: microbatch i holds sequences of about 16 * (i + 1) tokens.
rng = np.random.default_rng(0)
tokens = rng.integers(0, VOCAB, size=(K, SEQS, MAX_LEN + 1))
lengths = np.stack([rng.integers(4 + 15 * i, 16 * (i + 1) + 1, size=SEQS) for i in range(K)])
# mask[i, s, t] is 1 where token t of sequence s in microbatch i has a next token to predict.
mask = (np.arange(MAX_LEN)[None, None, :] < lengths[..., None]).astype(np.float32)
inputs, targets = tokens[..., :-1], tokens[..., 1:]
n_tokens = mask.sum(axis=(1, 2))
print("tokens per microbatch:", n_tokens.astype(int).tolist())


# --- Model: embedding -> tanh -> linear next-token logits -----------------------------------
@jax.jit  # one compiled program, not one per initializer and operation
def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "embed": jax.random.normal(k1, (VOCAB, DIM)),
        "out": jax.random.normal(k2, (DIM, VOCAB)) / jnp.sqrt(DIM),
        "bias": jnp.zeros(VOCAB),
    }


def token_losses(params, x, y):
    """Cross-entropy of every (padded) token position."""
    h = jnp.tanh(params["embed"][x])
    logits = h @ params["out"] + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def microbatch_loss(params, x, y, m):
    """What a training loop computes per microbatch: the mean over its own tokens."""
    return jnp.sum(token_losses(params, x, y) * m) / jnp.sum(m)


grad_fn = jax.jit(jax.grad(microbatch_loss))


def accumulated_gradient(scaling):
    """Feeds the K microbatch gradients to `accumulate` and returns what the optimizer sees.

    ``optax.identity()`` as the inner optimizer makes the window's update *be* the scaled
    accumulated gradient, so we can inspect it.
    """
    tx = accumjax.accumulate(optax.identity(), K, scaling=scaling)
    state = tx.init(params)
    update = jax.jit(tx.update)  # one compiled program, not one per operation
    for i in range(K):
        g = grad_fn(params, inputs[i], targets[i], mask[i])
        # The weighted strategy needs each microbatch's weight: its number of tokens.
        kwargs = {"weight": n_tokens[i]} if scaling == "weighted" else {}
        updates, state = update(g, state, params, **kwargs)
    assert bool(accumjax.has_updated(state)), "the K-th call should close the window"
    return updates


params = init_params(jax.random.key(0))
weighted = accumulated_gradient("weighted")
mean = accumulated_gradient("mean")

# --- Reference: the token-mean loss over the whole batch, in float64 -------------------------
with jax.enable_x64(True):
    params64 = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    # Treat the K microbatches as one batch of K * SEQS sequences.
    full = [a.reshape(K * SEQS, MAX_LEN) for a in (inputs, targets, mask.astype(np.float64))]
    reference = grad_fn(params64, *full)  # traced again, for float64
    reference = jax.tree.map(np.asarray, reference)


def max_abs_diff(a, b):
    diffs = jax.tree.map(lambda x, y: np.max(np.abs(np.asarray(x, np.float64) - y)), a, b)
    return float(max(jax.tree.leaves(diffs)))


scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(reference))
err_weighted = max_abs_diff(weighted, reference)
err_mean = max_abs_diff(mean, reference)
print(f"largest reference gradient entry:       {scale:.3e}")
print(f'max |weighted - full batch| (float64):   {err_weighted:.3e}   scaling="weighted"')
print(f'max |mean     - full batch| (float64):   {err_mean:.3e}   scaling="mean"')

# "weighted" matches the full batch to float32 round-off; "mean" is off by orders of magnitude.
assert err_weighted < 1e-5 * scale, "weighted accumulation should match the full-batch gradient"
assert err_mean > 1000 * err_weighted, "mean scaling should be visibly biased on ragged batches"


# --- The same with a train step: K and scaling="weighted" stated once, in the optimizer ----------
# With optax.sgd(LR) as the inner optimizer, the window's update is -LR times the gradient it saw;
# a large LR makes the step dwarf the float32 rounding of the parameters it is added to.
LR = 1000.0


def loss_fn(params, batch):
    return microbatch_loss(params, batch["x"], batch["y"], batch["mask"])


# weight_fn gives each microbatch's weight: its number of tokens.
step = accumjax.make_train_step(loss_fn, weight_fn=lambda batch: jnp.sum(batch["mask"]))
# The step builds its state with arrays of its own (it donates them; `params` stay usable).
state = step.init(params, accumjax.accumulate(optax.sgd(LR), K, scaling="weighted"))
for i in range(K):  # stream mode: one microbatch per call, the update on the K-th
    state, metrics = step(state, {"x": inputs[i], "y": targets[i], "mask": mask[i]})
assert bool(metrics["updated"]) and int(state.step) == 1
step_grads = jax.tree.map(lambda before, after: (before - after) / LR, params, state.params)
err_step = max_abs_diff(step_grads, reference)
print(f"max |train step - full batch| (float64):  {err_step:.3e}   make_train_step(weight_fn=...)")
assert err_step < 1e-5 * scale, "the weighted train step should match the full-batch gradient"
print("weighted scaling reproduces the full-batch token-mean gradient: True")
