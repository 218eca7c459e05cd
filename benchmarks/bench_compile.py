"""Trace and compile time of the scan step against ``optax.microbatch`` (and its run time and
XLA memory), at K=8, on two transformer LMs and an MLP.

Variants:

* ``accumjax_scan``: ``accumjax.make_train_step(loss, mode="scan")`` with
  ``accumulate(adam, K)`` (the default ``on_nonfinite="skip_microbatch"``: non-finite
  microbatches are looked for, and a window whose sum is not finite is computed again).
* ``accumjax_scan_propagate``: the same with ``on_nonfinite="propagate"`` (nothing re-run).
* ``optax_microbatch``: ``optax.microbatch(jax.grad(loss), ..., accumulator=MEAN)`` then Adam.

Models: ``transformer`` (the character-level GPT of issue 18: 2 layers, d=64, 64 tokens),
``transformer_small`` (the transformer benchmark of docs/limits.md, `bench_transformer`'s "small":
4 layers, d=256, 256 tokens), ``mlp`` (256-1024-1024-10, batch 512) and ``dense`` (the
parameter-dominated model of issue 37, ``common.dense_loss``: 8 dense 1024x1024 tanh layers,
32 MiB of float32 parameters, 16 rows per microbatch, batch 128).

Compile time is ``step.lower(...)`` (trace and lower to StableHLO) plus ``.compile()`` (XLA),
wall clock, of a freshly built ``jax.jit`` after ``jax.clear_caches()`` with the persistent
compilation cache off, measured in interleaved rounds (one warm-up round is not counted);
each variant's ratio to ``optax_microbatch`` is taken per round (the rounds pair them), and
the median and the spread (min, max) are reported. Run time per step is measured the same
way: one call per variant per interleaved round (``common.interleaved_samples``), ratios
paired by round. Memory is XLA's compile-time figure (``compiled.memory_analysis()``),
deterministic.
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
from benchmarks.bench_transformer import LM, SIZES

K = 8
VARIANTS = ("accumjax_scan", "accumjax_scan_propagate", "optax_microbatch")
MODELS = ("transformer", "transformer_small", "mlp", "dense")
# A character-level GPT: 2 layers, d=64, 64 tokens (4 rows per microbatch at K=8).
LM_SIZE = dict(vocab=65, d=64, layers=2, heads=4, mlp=256, seq=64, batch=32)
MLP_DIMS = (256, 1024, 1024, 10)
MLP_BATCH = 512


def _tx() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def _lm(size: dict[str, int]) -> tuple[Callable[[Any, Any], jax.Array], Any, Any]:
    """``(loss, params, batch)`` of a transformer LM of ``size``."""
    model = LM(**{k: v for k, v in size.items() if k != "batch"})
    rng = np.random.default_rng(0)
    shape = (size["batch"], size["seq"] + 1)
    tokens = jnp.asarray(rng.integers(0, size["vocab"], shape), jnp.int32)
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
        build = lambda: accumjax.make_train_step(loss, mode="scan")
        state = build().init(params, tx)  # the scan-mode state every fresh step takes
        out[name] = Variant(build, state, True)
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
    memory = {v: c.memory_analysis() for v, c in compiled.items()}
    return {
        "compile_s": {v: _spread(s) for v, s in total.items()},
        "trace_and_lower_s": {v: _spread(s) for v, s in lower.items()},
        "compile_vs_optax_microbatch": {v: _spread(r) for v, r in ratios.items()},
        "temp_bytes": {v: int(m.temp_size_in_bytes) for v, m in memory.items()},
        "argument_bytes": {v: int(m.argument_size_in_bytes) for v, m in memory.items()},
    }


def _spread(values: Any) -> dict[str, float]:
    stats = (("median", np.median), ("min", np.min), ("max", np.max))
    return {k: float(f(values)) for k, f in stats}


def _run_times(variants: dict[str, Variant], batch: Any, rounds: int) -> dict[str, Any]:
    """Milliseconds per step over interleaved rounds, and ratios to optax.microbatch paired by
    round: median (min, max)."""
    cases = {name: (_runner(v, batch), v.carry) for name, v in variants.items()}
    seconds = common.interleaved_samples(cases, rounds=rounds)
    samples = {k: np.asarray(s) for k, s in seconds.items()}
    ref = samples["optax_microbatch"]
    return {
        "ms_per_step": {v: _spread(s * 1e3) for v, s in samples.items()},
        "time_vs_optax_microbatch": {v: _spread(s / ref) for v, s in samples.items()},
    }


def _runner(variant: Variant, batch: Any) -> Callable[[Any], Any]:
    """``carry -> new carry``: one step of a freshly built ``variant``."""
    step = variant.build()
    if variant.metrics:
        return lambda carry: step(carry, batch)[0]
    return lambda carry: step(carry, batch)


def _model(model: str) -> tuple[Callable[[Any, Any], jax.Array], Any, Any]:
    if model == "mlp":
        return _mlp()
    if model == "dense":
        return common.dense_loss, common.dense_params(), common.dense_batch(K * common.DENSE_ROWS)
    return _lm(LM_SIZE if model == "transformer" else SIZES["small"])


def _run_model(model: str, rounds: int, time_rounds: int) -> dict[str, Any]:
    """Compile times, run time and memory of every variant on ``model``."""
    loss, params, batch = _model(model)
    variants = _variants(loss, params, batch)
    out = _compile_times(variants, batch, rounds) | _run_times(variants, batch, time_rounds)
    temp, args = out["temp_bytes"], out["argument_bytes"]
    return out | {
        "params": common.n_params(params),
        "temp_vs_optax_microbatch": {v: b / temp["optax_microbatch"] for v, b in temp.items()},
        "argument_vs_optax_microbatch": {v: b / args["optax_microbatch"] for v, b in args.items()},
    }


def run(rounds: int = 5, time_rounds: int = 15) -> dict[str, Any]:
    """Compile time, run time and XLA memory of every variant on every model."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        models = {m: _run_model(m, rounds, time_rounds) for m in MODELS}
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    return {
        "K": K,
        "models": models,
        "transformer": LM_SIZE,
        "transformer_small": SIZES["small"],
        "mlp": {"dims": MLP_DIMS, "batch": MLP_BATCH},
        "dense": {
            "layers": common.DENSE_LAYERS,
            "width": common.DENSE_WIDTH,
            "batch": K * common.DENSE_ROWS,
        },
        "rounds": rounds,
        "time_rounds": time_rounds,
    }


def table(r: dict[str, Any]) -> str:
    """A markdown table: per model and variant, compile time and its ratio, run time and its
    ratio (median, min-max), XLA temp and argument memory."""
    lines = [
        "| model | variant | trace+compile s | / `optax.microbatch` | ms/step | "
        "/ `optax.microbatch` | XLA temp MiB | argument MiB |",
        "|---" * 8 + "|",
    ]
    fmt = lambda d, f: f"{d['median']:{f}} ({d['min']:{f}}-{d['max']:{f}})"
    for model, m in r["models"].items():
        for v in VARIANTS:
            lines.append(
                f"| {model} | {v} | {fmt(m['compile_s'][v], '.2f')} "
                f"| {fmt(m['compile_vs_optax_microbatch'][v], '.2f')} "
                f"| {fmt(m['ms_per_step'][v], '.1f')} "
                f"| {fmt(m['time_vs_optax_microbatch'][v], '.2f')} "
                f"| {m['temp_bytes'][v] / common.MiB:.2f} "
                f"| {m['argument_bytes'][v] / common.MiB:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    result = run()
    print(json.dumps(result, indent=2))
    print(table(result))
