"""Checkpoint in the middle of an accumulation window and resume bit for bit.

`accumjax.accumulate` keeps everything it needs (the partial gradient sum, the position in the
window, the inner optimizer's state) in an ordinary pytree, `AccumulationState`. Save it with the
parameters, and a run interrupted after 2 of 4 microbatches resumes exactly where it stopped:
the final parameters are bit-identical to those of an uninterrupted run.

Run: python examples/checkpoint_resume.py
"""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import accumjax

K = 4  # microbatches per optimizer update
WINDOWS = 3  # optimizer updates in the whole run
STOP_AT = K + 2  # interrupt after one full window and 2 of the next window's 4 microbatches
N_IN, N_OUT, MICRO = 6, 2, 16


def microbatch(i):
    """Microbatch number i of the run; indexed by step so a resumed run sees the same data."""
    rng = np.random.default_rng(i)
    x = rng.normal(size=(MICRO, N_IN)).astype(np.float32)
    y = (x @ np.arange(N_IN * N_OUT).reshape(N_IN, N_OUT) / 10).astype(np.float32)
    return x, y


def init_params():
    return {"w": jnp.zeros((N_IN, N_OUT)), "b": jnp.zeros(N_OUT)}


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# The optimizer: Adam, applied once every K microbatches.
tx = accumjax.accumulate(optax.adam(1e-2), K)


@jax.jit
def train_microstep(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train(params, opt_state, steps):
    for i in steps:
        params, opt_state = train_microstep(params, opt_state, *microbatch(i))
    return params, opt_state


# --- 1. The uninterrupted reference run ------------------------------------------------------
params = init_params()
reference, _ = train(params, tx.init(params), range(K * WINDOWS))

# --- 2. The same run, interrupted mid-window and saved ----------------------------------------
params = init_params()
params, opt_state = train(params, tx.init(params), range(STOP_AT))
updates_done = int(accumjax.stats(opt_state).total_cycles)
micro_step = int(opt_state.window.micro_step)  # microbatches in the open window
print(f"stopped after {STOP_AT} microbatches: micro_step={micro_step} of {K}, ", end="")
print(f"{updates_done} update(s) applied")

with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "ckpt"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": params, "opt_state": opt_state, "step": STOP_AT})
    checkpointer.wait_until_finished()
    del params, opt_state  # forget everything, as a new process would

    # --- 3. Resume: build the abstract structure, restore into it, continue ------------------
    # A fresh process knows the model and optimizer, not the values: jax.eval_shape gives the
    # shapes and dtypes of the state (ShapeDtypeStructs) without computing anything, and orbax
    # restores the saved arrays into that structure (AccumulationState included).
    def fresh_state():
        params = init_params()
        return {"params": params, "opt_state": tx.init(params), "step": 0}

    target = jax.eval_shape(fresh_state)
    restored = checkpointer.restore(path, target)
    checkpointer.close()

params, opt_state = restored["params"], restored["opt_state"]
assert isinstance(opt_state, accumjax.AccumulationState)
print(f"restored: micro_step={int(opt_state.window.micro_step)}, step={int(restored['step'])}")
resumed, _ = train(params, opt_state, range(int(restored["step"]), K * WINDOWS))

# --- 4. Compare bit for bit --------------------------------------------------------------------
identical = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference), strict=True)
)
moved = float(jnp.max(jnp.abs(reference["w"])))
print(f"final |w| max: {moved:.4f} (the parameters did train)")
print(f"bit-identical: {identical}")
assert moved > 0 and identical, "resumed run differs from the uninterrupted one"
