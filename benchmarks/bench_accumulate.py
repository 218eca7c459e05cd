"""Microstep and window cost of `accumjax.accumulate` against `optax.MultiSteps` and the ideal.

The ideal non-update microstep is a gradient plus an in-place add into an accumulator. A
wrapper's microstep is measured two ways: ``*_update`` (gradient and ``tx.update`` only: what
the wrapper itself costs) and ``*_micro`` (also ``optax.apply_updates``, as a training loop
does on every call), and ``*_train_step`` is ``make_train_step``'s stream step, which does not
touch the parameters on a non-update call. All steps are jitted with their carry donated, and
timed side by side,
for a small microbatch (where the per-call memory passes over the 2.6M parameters show) and a
larger one.
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
MICROBATCHES = (32, 256)
K = 8
NEVER = 2**30  # a K no window reaches: every call is a non-update microstep


def _wrapper_step(tx: optax.GradientTransformation, apply: bool = True):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry):
        params, state, batch = carry
        updates, state = tx.update(jax.grad(common.mlp_loss)(params, batch), state, params)
        return (optax.apply_updates(params, updates) if apply else params), state, batch

    return step


def _train_step(params, tx, batch):
    """``make_train_step``'s stream step (a non-update call leaves params untouched) as a
    ``carry -> carry`` function, and its first carry (the state from ``step.init``)."""
    step = accumjax.make_train_step(common.mlp_loss)

    def run(carry):
        state, batch = carry
        return step(state, batch)[0], batch

    return run, (step.init(params, tx), batch)


@functools.partial(jax.jit, donate_argnums=0)
def _ideal_step(carry):
    params, acc, batch = carry
    grads = jax.grad(common.mlp_loss)(params, batch)
    return params, jax.tree.map(jnp.add, acc, grads), batch


def _run_one(microbatch: int, calls: int, rounds: int) -> dict[str, Any]:
    params = common.mlp_params(DIMS)
    batch = common.batch(microbatch, DIMS[0], DIMS[-1])
    never = {
        "accumjax": accumjax.accumulate(optax.adam(1e-3), NEVER),
        "accumjax_no_detect": accumjax.accumulate(
            optax.adam(1e-3), NEVER, on_nonfinite="propagate"
        ),
        "multisteps": optax.MultiSteps(optax.adam(1e-3), NEVER),
    }
    zeros = jax.tree.map(jnp.zeros_like, params)
    cases: dict[str, Any] = {"ideal": (_ideal_step, (params, zeros, batch))}
    for name, tx in never.items():
        cases[f"{name}_update"] = (_wrapper_step(tx, apply=False), (params, tx.init(params), batch))
        cases[f"{name}_micro"] = (_wrapper_step(tx), (params, tx.init(params), batch))
    for name, tx in list(never.items())[:2]:  # make_train_step's own stream microstep
        cases[f"{name}_train_step"] = _train_step(params, tx, batch)
    windows = {
        "plain_adam": optax.adam(1e-3),
        "accumjax_window": accumjax.accumulate(optax.adam(1e-3), K),
        "multisteps_window": optax.MultiSteps(optax.adam(1e-3), K),
    }
    for name, tx in windows.items():
        cases[name] = (_wrapper_step(tx), (params, tx.init(params), batch))
    seconds = common.time_interleaved(cases, calls=calls, rounds=rounds)
    ms = {k: v * 1e3 for k, v in seconds.items()}
    ratios = {f"{k}_vs_ideal": v / ms["ideal"] for k, v in ms.items() if k.endswith("_update")}
    ratios.update({f"{k}_vs_ideal": v / ms["ideal"] for k, v in ms.items() if k.endswith("_micro")})
    ratios.update(
        {f"{k}_vs_ideal": v / ms["ideal"] for k, v in ms.items() if k.endswith("_train_step")}
    )
    ratios["multisteps_micro_vs_plain_adam"] = ms["multisteps_micro"] / ms["plain_adam"]
    ratios["accumjax_window_vs_multisteps_window"] = ms["accumjax_window"] / ms["multisteps_window"]
    return {"ms_per_call": ms, "ratios": ratios}


def run(calls: int = 2 * K, rounds: int = 7) -> dict[str, Any]:
    params = common.mlp_params(DIMS)
    return {
        "model": {"dims": DIMS, "params": common.n_params(params), "K": K},
        "by_microbatch": {str(m): _run_one(m, calls, rounds) for m in MICROBATCHES},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
