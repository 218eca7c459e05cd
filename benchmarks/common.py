"""Shared pieces of the benchmarks: an MLP, a parameter-dominated model, interleaved timing,
machine description."""

from __future__ import annotations

import functools
import itertools
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

MiB = 1024 * 1024


def mlp_params(dims: Sequence[int], seed: int = 0) -> dict[str, jax.Array]:
    """Weights of a ReLU MLP with the given layer widths (He-scaled normal, zero biases)."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)) * np.sqrt(2.0 / a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def mlp_loss(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of a ReLU MLP."""
    x, y = batch
    n = len(params) // 2
    h = x
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def batch(n: int, dim: int, classes: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
    return x, jnp.asarray(rng.integers(0, classes, n), jnp.int32)


# The parameter-dominated model of issue 37 (the shape of large-model fine-tuning): 8 dense
# 1024x1024 tanh layers without biases (32 MiB of float32 parameters), small activations:
# 16 rows per microbatch (per device on a mesh).
DENSE_LAYERS, DENSE_WIDTH, DENSE_ROWS = 8, 1024, 16


def dense_params(seed: int = 0) -> dict[str, jax.Array]:
    """Kernels of the parameter-dominated model: ``w0`` ... ``w7``, each ``DENSE_WIDTH`` square,
    normal with variance ``1 / DENSE_WIDTH``."""
    rng = np.random.default_rng(seed)
    shape = (DENSE_WIDTH, DENSE_WIDTH)
    scale = 1 / np.sqrt(DENSE_WIDTH)
    return {
        f"w{i}": jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
        for i in range(DENSE_LAYERS)
    }


def dense_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of the parameter-dominated model (``tanh(h @ w)`` per layer) against
    ``batch["y"]``."""
    h = batch["x"]
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def dense_batch(n: int, seed: int = 1) -> dict[str, jax.Array]:
    """``n`` rows of inputs and targets for the parameter-dominated model."""
    rng = np.random.default_rng(seed)
    x, y = (rng.normal(size=(n, DENSE_WIDTH)).astype(np.float32) for _ in range(2))
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def n_params(tree: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def time_interleaved(
    cases: dict[str, tuple[Callable[[Any], Any], Any]],
    *,
    calls: int = 8,
    rounds: int = 7,
) -> dict[str, float]:
    """Median seconds per call of each case, measured in interleaved rounds.

    Each case is ``(step, carry)``: ``carry = step(carry)`` is called ``calls`` times per round
    (its buffers may be donated). Rounds alternate between cases so that machine noise hits
    them alike; the figure of a case is its fastest round's mean time per call (other jobs
    on the machine only ever add time, so the fastest round is the least disturbed one).
    """
    carries = {}
    for name, (step, carry) in cases.items():  # compile and warm up
        carries[name] = jax.block_until_ready(step(copy(carry)))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (step, _) in cases.items():
            carry = carries[name]
            start = time.perf_counter()
            for _ in range(calls):
                carry = step(carry)
            jax.block_until_ready(carry)
            samples[name].append((time.perf_counter() - start) / calls)
            carries[name] = carry
    return {name: float(np.min(s)) for name, s in samples.items()}


def interleaved_samples(
    cases: dict[str, tuple[Callable[[Any], Any], Any]], *, rounds: int = 15
) -> dict[str, list[float]]:
    """Seconds of each ``carry = step(carry)`` call of each case, one per interleaved round
    (blocked on before the clock stops): round ``r`` of every case ran side by side.

    Each case is warmed up with two calls (the second on the first's output, so that a step
    whose outputs are laid out unlike its first inputs is compiled for both) before any is
    timed.
    """
    carries = {}
    for name, (step, carry) in cases.items():
        carries[name] = jax.block_until_ready(step(jax.block_until_ready(step(copy(carry)))))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (step, _) in cases.items():
            start = time.perf_counter()
            carries[name] = jax.block_until_ready(step(carries[name]))
            samples[name].append(time.perf_counter() - start)
    return samples


def time_interleaved_spread(
    cases: dict[str, tuple[Callable[[Any], Any], Any]],
    *,
    rounds: int = 15,
) -> dict[str, dict[str, float]]:
    """Seconds per ``carry = step(carry)`` call of each case: fastest, median and slowest of
    ``rounds`` interleaved rounds (`interleaved_samples`).

    As `time_interleaved`, with the spread kept: rounds alternate between cases so that
    machine noise hits them alike.
    """
    samples = interleaved_samples(cases, rounds=rounds)
    return {
        name: {
            "min_s": float(np.min(s)),
            "median_s": float(np.median(s)),
            "max_s": float(np.max(s)),
            "rounds": len(s),
        }
        for name, s in samples.items()
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()[:1]],
    }


def optax_microbatch_step(loss: Callable[..., Any], tx: Any, microbatch_size: int) -> Any:
    """A jitted ``(params, opt_state), batch -> (params, opt_state)`` step that averages the
    gradients of ``microbatch_size``-row microbatches with ``optax.microbatch`` (the
    reference for scan mode)."""
    grad_fn = optax.microbatch(
        jax.grad(loss),
        argnums=1,
        microbatch_size=microbatch_size,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry: Any, batch: Any) -> Any:
        params, opt_state = carry
        updates, opt_state = tx.update(grad_fn(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step
