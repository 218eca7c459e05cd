"""Microstep and window cost of `accumjax.accumulate` against `optax.MultiSteps` and the ideal.

The ideal non-update microstep is a gradient plus an in-place add into an accumulator; a
training loop with a wrapper also calls ``tx.update`` and ``optax.apply_updates`` on every
microbatch. All steps are jitted with their carry donated, and timed side by side.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

import accumjax
from benchmarks import common

DIMS = (512, 1024, 1024, 1024, 10)
MICROBATCH = 32
K = 8
NEVER = 2**30  # a K no window reaches: every call is a non-update microstep


def _wrapper_step(tx: optax.GradientTransformation):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry):
        params, state, batch = carry
        updates, state = tx.update(jax.grad(common.mlp_loss)(params, batch), state, params)
        return optax.apply_updates(params, updates), state, batch

    return step


@functools.partial(jax.jit, donate_argnums=0)
def _ideal_step(carry):
    params, acc, batch = carry
    grads = jax.grad(common.mlp_loss)(params, batch)
    return params, jax.tree.map(jnp.add, acc, grads), batch


def run(calls: int = 2 * K, rounds: int = 7) -> dict[str, Any]:
    params = common.mlp_params(DIMS)
    batch = common.batch(MICROBATCH, DIMS[0], DIMS[-1])
    txs = {
        "accumjax_micro": accumjax.accumulate(optax.adam(1e-3), NEVER),
        "accumjax_micro_no_detect": accumjax.accumulate(
            optax.adam(1e-3), NEVER, on_nonfinite="propagate"
        ),
        "multisteps_micro": optax.MultiSteps(optax.adam(1e-3), NEVER),
        "plain_adam": optax.adam(1e-3),
        "accumjax_window": accumjax.accumulate(optax.adam(1e-3), K),
        "multisteps_window": optax.MultiSteps(optax.adam(1e-3), K),
    }
    cases: dict[str, Any] = {
        "ideal": (_ideal_step, (params, jax.tree.map(jnp.zeros_like, params), batch))
    }
    for name, tx in txs.items():
        cases[name] = (_wrapper_step(tx), (params, tx.init(params), batch))
    seconds = common.time_interleaved(cases, calls=calls, rounds=rounds)
    ms = {k: v * 1e3 for k, v in seconds.items()}
    return {
        "model": {
            "dims": DIMS,
            "params": common.n_params(params),
            "microbatch": MICROBATCH,
            "K": K,
        },
        "ms_per_call": ms,
        "ratios": {
            "accumjax_micro_vs_ideal": ms["accumjax_micro"] / ms["ideal"],
            "accumjax_micro_no_detect_vs_ideal": ms["accumjax_micro_no_detect"] / ms["ideal"],
            "multisteps_micro_vs_ideal": ms["multisteps_micro"] / ms["ideal"],
            "multisteps_micro_vs_plain_adam": ms["multisteps_micro"] / ms["plain_adam"],
            "accumjax_window_vs_multisteps_window": ms["accumjax_window"] / ms["multisteps_window"],
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
