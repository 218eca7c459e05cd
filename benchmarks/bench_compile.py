"""Trace and compile time of the scan step against ``optax.microbatch`` (and its run time and
XLA memory), at K=8, on a small transformer LM and an MLP.

Variants:

* ``accumjax_scan``: ``accumjax.make_train_step(loss, mode="scan")`` with
  ``accumulate(adam, K)`` (the default ``on_nonfinite="skip_microbatch"``: non-finite
  microbatches are looked for, and a window whose sum is not finite is computed again).
* ``accumjax_scan_propagate``: the same with ``on_nonfinite="propagate"`` (nothing re-run).
* ``optax_microbatch``: ``optax.microbatch(jax.grad(loss), ..., accumulator=MEAN)`` then Adam.

Compile time is ``step.lower(...)`` (trace and lower to StableHLO) plus ``.compile()`` (XLA),
wall clock, of a freshly built ``jax.jit`` after ``jax.clear_caches()`` with the persistent
compilation cache off, measured in interleaved rounds (one warm-up round is not counted);
each variant's ratio to ``optax_microbatch`` is taken per round (the rounds pair them), and
the median and the spread (min, max) are reported. Run time per step is the fastest of
interleaved rounds (``common.time_interleaved``); memory is XLA's compile-time figure
(``compiled.memory_analysis()``), deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax
from benchmarks import common
from benchmarks.bench_transformer import LM

K = 8
VARIANTS = ("accumjax_scan", "accumjax_scan_propagate", "optax_microbatch")
# A character-level GPT: 2 layers, d=64, 64 tokens (4 rows per microbatch at K=8).
LM_SIZE = dict(vocab=65, d=64, layers=2, heads=4, mlp=256, seq=64)
LM_BATCH = 32
MLP_DIMS = (256, 1024, 1024, 10)
MLP_BATCH = 512


def _tx() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def _lm() -> tuple[Callable[[Any, Any], jax.Array], Any, Any]:
    """``(loss, params, batch)`` of the transformer LM."""
    model = LM(**LM_SIZE)
    rng = np.random.default_rng(0)
    shape = (LM_BATCH, LM_SIZE["seq"] + 1)
    tokens = jnp.asarray(rng.integers(0, LM_SIZE["vocab"], shape), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]

    def loss(params: Any, batch: Any) -> jax.Array:
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss, params, {"tokens": tokens}


def _mlp() -> tuple[Callable[[Any, Any], jax.Array], Any, Any]:
    """``(loss, params, batch)`` of the MLP."""
    x, y = common.batch(MLP_BATCH, MLP_DIMS[0], MLP_DIMS[-1])
    loss = lambda params, batch: common.mlp_loss(params, (batch["x"], batch["y"]))
    return loss, common.mlp_params(MLP_DIMS), {"x": x, "y": y}


class Variant(NamedTuple):
    """How to build and run one variant's step."""

    build: Callable[[], Any]  # a fresh jitted step(carry, batch)
    carry: Any  # its concrete input state
    metrics: bool  # whether the step returns (new carry, metrics) rather than the new carry


def _variants(loss: Callable[..., Any], params: Any, batch: Any) -> dict[str, Variant]:
    """Every variant's `Variant` for this model."""
    out: dict[str, Variant] = {}
    for name, on_nonfinite in (
        ("accumjax_scan", "skip_microbatch"),
        ("accumjax_scan_propagate", "propagate"),
    ):
        tx = accumjax.accumulate(_tx(), K, on_nonfinite=on_nonfinite)
        state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx, mode="scan")  # type: ignore[arg-type]
        out[name] = Variant(lambda: accumjax.make_train_step(loss, mode="scan"), state, True)
    rows = jax.tree.leaves(batch)[0].shape[0] // K
    build = lambda: common.optax_microbatch_step(loss, _tx(), rows)
    out["optax_microbatch"] = Variant(build, (params, _tx().init(params)), False)
    return out


def _compile(build: Callable[[], Any], carry: Any, batch: Any) -> tuple[float, float, Any]:
    """``(trace-and-lower seconds, compile seconds, compiled)`` from cold caches."""
    jax.clear_caches()
    step = build()
    start = time.perf_counter()
    lowered = step.lower(carry, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at, compiled


def _compile_times(variants: dict[str, Variant], batch: Any, rounds: int) -> dict[str, Any]:
    """Per-variant compile seconds over interleaved rounds, their ratios to optax.microbatch
    (paired by round), and the last compiled step's memory."""
    lower: dict[str, list[float]] = {v: [] for v in variants}
    total: dict[str, list[float]] = {v: [] for v in variants}
    compiled: dict[str, Any] = {}
    for r in range(rounds + 1):  # round 0 warms up (first-use costs), not counted
        for name, v in variants.items():
            lower_s, compile_s, compiled[name] = _compile(v.build, v.carry, batch)
            if r:
                lower[name].append(lower_s)
                total[name].append(lower_s + compile_s)
    ref = np.asarray(total["optax_microbatch"])
    ratios = {v: np.asarray(s) / ref for v, s in total.items()}

    def spread(values: Any) -> dict[str, float]:
        return {
            k: float(f(values))
            for k, f in (("median", np.median), ("min", np.min), ("max", np.max))
        }

    memory = {v: c.memory_analysis() for v, c in compiled.items()}
    return {
        "compile_s": {v: spread(s) for v, s in total.items()},
        "trace_and_lower_s": {v: spread(s) for v, s in lower.items()},
        "compile_vs_optax_microbatch": {v: spread(r) for v, r in ratios.items()},
        "temp_bytes": {v: int(m.temp_size_in_bytes) for v, m in memory.items()},
        "argument_bytes": {v: int(m.argument_size_in_bytes) for v, m in memory.items()},
    }


def _runner(variant: Variant, batch: Any) -> Callable[[Any], Any]:
    """``carry -> new carry``: one step of a freshly built ``variant``."""
    step = variant.build()
    if variant.metrics:
        return lambda carry: step(carry, batch)[0]
    return lambda carry: step(carry, batch)


def _run_model(model: str, rounds: int, calls: int, time_rounds: int) -> dict[str, Any]:
    """Compile times, run time and memory of every variant on ``model``."""
    loss, params, batch = (_lm if model == "transformer" else _mlp)()
    variants = _variants(loss, params, batch)
    out = _compile_times(variants, batch, rounds)
    cases = {name: (_runner(v, batch), v.carry) for name, v in variants.items()}
    seconds = common.time_interleaved(cases, calls=calls, rounds=time_rounds)
    ref = seconds["optax_microbatch"]
    temp, args = out["temp_bytes"], out["argument_bytes"]
    return out | {
        "params": common.n_params(params),
        "ms_per_step": {v: s * 1e3 for v, s in seconds.items()},
        "time_vs_optax_microbatch": {v: s / ref for v, s in seconds.items()},
        "temp_vs_optax_microbatch": {v: b / temp["optax_microbatch"] for v, b in temp.items()},
        "argument_vs_optax_microbatch": {v: b / args["optax_microbatch"] for v, b in args.items()},
    }


def run(rounds: int = 5, calls: int = 3, time_rounds: int = 5) -> dict[str, Any]:
    """Compile time, run time and XLA memory of every variant on both models."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        models = {m: _run_model(m, rounds, calls, time_rounds) for m in ("transformer", "mlp")}
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    return {
        "K": K,
        "models": models,
        "transformer": {**LM_SIZE, "batch": LM_BATCH},
        "mlp": {"dims": MLP_DIMS, "batch": MLP_BATCH},
        "rounds": rounds,
        "timing": {"calls": calls, "rounds": time_rounds},
    }


def table(r: dict[str, Any]) -> str:
    """A markdown table: per model and variant, compile time and ratios, run time, memory."""
    lines = [
        "| model | variant | trace+compile s, median (min-max) | / optax.microbatch, median "
        "(min-max) | ms/step | / optax | XLA temp MiB | / optax | argument MiB |",
        "|---" * 9 + "|",
    ]
    for model, m in r["models"].items():
        for v in VARIANTS:
            c, q = m["compile_s"][v], m["compile_vs_optax_microbatch"][v]
            lines.append(
                f"| {model} | {v} | {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) "
                f"| {q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) "
                f"| {m['ms_per_step'][v]:.1f} | {m['time_vs_optax_microbatch'][v]:.2f} "
                f"| {m['temp_bytes'][v] / common.MiB:.3f} "
                f"| {m['temp_vs_optax_microbatch'][v]:.3f} "
                f"| {m['argument_bytes'][v] / common.MiB:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    result = run()
    print(json.dumps(result, indent=2))
    print(table(result))
