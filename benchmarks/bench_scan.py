"""Scan-mode train step against the full-batch step, ``optax.microbatch`` and a naive scan.

Time is measured side by side; memory is XLA's own figure for the compiled step
(``compiled.memory_analysis().temp_size_in_bytes``), which is deterministic.

Three models: an activation-heavy MLP (256-2048x3-256, batch 1024), a small convnet (time
only), and the parameter-dominated model of ``common`` (8 dense 1024x1024 tanh layers, 32 MiB
of float32 parameters, 16 rows per microbatch: ``param_dominated``), where the scan step runs
with the default policy and with ``on_nonfinite="propagate"``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

import accumjax
from benchmarks import common

DIMS = (256, 2048, 2048, 2048, 256)  # activation-heavy: 256-2048x3-256
BATCH = 1024
K = 8
MEMORY_KS = (1, 2, 4, 8, 16, 32)


def _loss(params, batch):
    return common.mlp_loss(params, (batch["x"], batch["y"]))


def _tx():
    return optax.adam(1e-3)


def _state(step, params, k: int) -> accumjax.TrainState:
    """The state of the scan-mode ``step`` whose optimizer accumulates k microbatches (scan
    mode reads K from it; the state holds no accumulator)."""
    return step.init(params, accumjax.accumulate(_tx(), k))


def _full_batch_step(loss=_loss):
    tx = _tx()

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry, batch):
        params, opt_state = carry
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _optax_microbatch_step(k: int):
    return common.optax_microbatch_step(_loss, _tx(), BATCH // k)


def _naive_scan_step(k: int):
    """lax.scan that returns every microbatch gradient, then averages (what a quick port does).

    Contiguous microbatches; accumjax uses strided ones (rows i, i + k, ...), which is the same
    computation on one device.
    """
    tx = _tx()

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry, batch):
        params, opt_state = carry
        micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        _, grads = jax.lax.scan(lambda c, mb: (c, jax.grad(_loss)(params, mb)), None, micro)
        grads = jax.tree.map(lambda g: g.mean(0), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _conv_loss(params, batch):
    """A small convnet (two 3x3 convs, dense head) on 8x8 images, mean cross-entropy."""
    h = batch["x"]
    for name in ("c0", "c1"):
        h = jax.lax.conv_general_dilated(h, params[name], (1, 1), "SAME", dimension_numbers=_NHWC)
        h = jax.nn.relu(h)
    logits = h.reshape(h.shape[0], -1) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv_case(calls: int, rounds: int) -> dict[str, float]:
    """Scan mode with and without unrolling on a convnet, against the full-batch step."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "c0": jax.random.normal(keys[0], (3, 3, 1, 16)) * 0.3,
        "c1": jax.random.normal(keys[1], (3, 3, 16, 32)) * 0.1,
        "head": jax.random.normal(keys[2], (8 * 8 * 32, 10)) * 0.02,
    }
    x = jax.random.normal(keys[3], (256, 8, 8, 1))
    batch = {"x": x, "y": jax.numpy.arange(256) % 10}
    cases: dict[str, Any] = {}
    for name, k, unroll in (("full_batch", 1, 1), ("scan", K, 1), ("scan_unrolled", K, True)):
        step = accumjax.make_train_step(_conv_loss, mode="scan", unroll=unroll)
        cases[name] = (lambda st, step=step: step(st, batch)[0], _state(step, params, k))
    seconds = common.time_interleaved(cases, calls=calls, rounds=rounds)
    return {k: v * 1e3 for k, v in seconds.items()}


def _param_dominated(calls: int, rounds: int) -> dict[str, Any]:
    """The parameter-dominated model at K=8: ms per step and XLA temp MiB of the scan step
    (default policy and ``propagate``), ``optax.microbatch`` and the full-batch step."""
    params = common.dense_params()
    batch = common.dense_batch(K * common.DENSE_ROWS)
    carry = (params, _tx().init(params))
    steps = {
        "full_batch": _full_batch_step(common.dense_loss),
        "optax_microbatch": common.optax_microbatch_step(
            common.dense_loss, _tx(), common.DENSE_ROWS
        ),
    }
    cases: dict[str, Any] = {name: (lambda c, s=s: s(c, batch), carry) for name, s in steps.items()}
    memory = {name: _temp_mib(s, carry, batch) for name, s in steps.items()}
    for name, policy in (
        ("accumjax_scan", "skip_microbatch"),
        ("accumjax_scan_propagate", "propagate"),
    ):
        step = accumjax.make_train_step(common.dense_loss, mode="scan")
        state = step.init(params, accumjax.accumulate(_tx(), K, on_nonfinite=policy))
        cases[name] = (lambda st, step=step: step(st, batch)[0], state)
        memory[name] = _temp_mib(step, state, batch)
    seconds = common.time_interleaved(cases, calls=calls, rounds=rounds)
    ms = {k: v * 1e3 for k, v in seconds.items()}
    return {
        "model": {
            "layers": common.DENSE_LAYERS,
            "width": common.DENSE_WIDTH,
            "params": common.n_params(params),
            "batch": K * common.DENSE_ROWS,
            "K": K,
        },
        "ms_per_step": ms,
        "time_vs_optax_microbatch": {k: v / ms["optax_microbatch"] for k, v in ms.items()},
        "temp_mib": memory,
        "temp_vs_optax_microbatch": {k: v / memory["optax_microbatch"] for k, v in memory.items()},
    }


def _temp_mib(step, *args) -> float:
    analysis = step.lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / common.MiB


def run(calls: int = 3, rounds: int = 5) -> dict[str, Any]:
    params = common.mlp_params(DIMS)
    x, y = common.batch(BATCH, DIMS[0], DIMS[-1])
    batch = {"x": x, "y": y}
    accum_step = accumjax.make_train_step(_loss, mode="scan")
    state = _state(accum_step, params, K)
    carry = (params, _tx().init(params))
    steps = {
        "full_batch": _full_batch_step(),
        "optax_microbatch": _optax_microbatch_step(K),
        "naive_scan": _naive_scan_step(K),
    }
    cases: dict[str, Any] = {name: (lambda c, s=s: s(c, batch), carry) for name, s in steps.items()}
    cases["accumjax_scan"] = (lambda st: accum_step(st, batch)[0], state)
    seconds = common.time_interleaved(cases, calls=calls, rounds=rounds)
    ms = {k: v * 1e3 for k, v in seconds.items()}

    memory = {name: _temp_mib(s, carry, batch) for name, s in steps.items()}
    memory["accumjax_scan"] = _temp_mib(accum_step, state, batch)
    memory_vs_k: dict[str, list[float]] = {"accumjax_scan": [], "optax_microbatch": []}
    for k in MEMORY_KS:
        memory_vs_k["accumjax_scan"].append(
            _temp_mib(accum_step, _state(accum_step, params, k), batch)
        )
        memory_vs_k["optax_microbatch"].append(_temp_mib(_optax_microbatch_step(k), carry, batch))
    conv = _conv_case(calls, rounds)
    return {
        "param_dominated": _param_dominated(calls, rounds),
        "model": {"dims": DIMS, "params": common.n_params(params), "batch": BATCH, "K": K},
        "conv_ms_per_step": conv,
        "conv_ratios": {k: v / conv["full_batch"] for k, v in conv.items()},
        "ms_per_step": ms,
        "ratios": {
            "accumjax_scan_vs_full_batch": ms["accumjax_scan"] / ms["full_batch"],
            "optax_microbatch_vs_full_batch": ms["optax_microbatch"] / ms["full_batch"],
            "naive_scan_vs_full_batch": ms["naive_scan"] / ms["full_batch"],
        },
        "temp_mib": memory,
        "temp_mib_vs_k": {"K": list(MEMORY_KS), **memory_vs_k},
        "full_batch_temp_mib": memory["full_batch"],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
