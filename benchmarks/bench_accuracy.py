"""Accuracy of the float32 accumulator over K = 1..4096 microbatches against float64.

accumjax keeps a float32 sum and divides once; ``optax.MultiSteps`` keeps a float32 running
mean (``acc += (g - acc) / (n + 1)``). Both are compared with the float64 mean of the same
float32 gradients; the figure is the largest absolute error over 4096 coordinates divided by
the mean magnitude of the exact mean (a relative error that a near-zero coordinate cannot blow
up).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax

KS = (1, 4, 16, 64, 256, 1024, 4096)
SIZE = 4096


def _final_update(tx: optax.GradientTransformation, grads: jax.Array) -> jax.Array:
    """The update after len(grads) calls of a scale(1) wrapper: the window's mean gradient."""
    params = {"g": jnp.zeros(grads.shape[1:], jnp.float32)}

    def body(state, g):
        _updates, state = tx.update({"g": g}, state, params)
        return state, None

    state, _ = jax.lax.scan(body, tx.init(params), grads[:-1])
    updates, _ = tx.update({"g": grads[-1]}, state, params)
    return updates["g"]


def run() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    # Gradients with a non-zero mean and unit noise, as real per-coordinate gradients have.
    all_grads = (rng.normal(size=(max(KS), SIZE)) + rng.uniform(0.5, 2.0, size=SIZE)).astype(
        np.float32
    )
    rows: dict[str, list[float]] = {"accumjax": [], "multisteps": []}
    for k in KS:
        grads = all_grads[:k]
        exact = grads.astype(np.float64).mean(axis=0)
        for name, tx in (
            ("accumjax", accumjax.accumulate(optax.scale(1.0), k)),
            ("multisteps", optax.MultiSteps(optax.scale(1.0), k)),
        ):
            got = np.asarray(jax.jit(lambda g, tx=tx: _final_update(tx, g))(jnp.asarray(grads)))
            rows[name].append(float(np.max(np.abs(got - exact)) / np.mean(np.abs(exact))))
    return {"K": list(KS), "normalized_max_error": rows, "coordinates": SIZE}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
