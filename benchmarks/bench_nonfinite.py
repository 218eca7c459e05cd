"""Time of a scan step whose window holds one non-finite microbatch against a clean one.

The issue asks that "a window with one non-finite microbatch costs at most 2.5x a clean one, at
K=8 and at K=32". Scan mode inspects each microbatch as it comes (one pass over the K
microbatches, a loop of known trip count), so a non-finite window should cost what a clean one
does (before, it cost K + 2 passes: about 7x at K=8, 25x at K=32).

Model: `bench_compile`'s MLP (256-1024-1024-10, batch 512: 64 rows per microbatch at K=8, 16 at
K=32). Step: ``accumjax.make_train_step(loss, mode="scan", donate=False)`` with
``accumulate(adam(1e-3), K)`` (the default ``on_nonfinite="skip_microbatch"``).

Cases, per K:

* ``clean``: the default-policy step on the batch.
* ``nonfinite``: the same step on the same batch with one NaN in row 0 (with strided
  microbatches, rows i, i + K, ..., that is microbatch 0: one non-finite microbatch, skipped).
* ``propagate_clean``: ``on_nonfinite="propagate"`` (nothing looked for) on the clean batch, for
  reference.

Every call takes the same state (``step.init``'s; the step does not donate it) and the output
state is blocked on before the clock stops; each step is compiled and warmed up before any is
timed. All cases of both K run side by side in interleaved rounds, one call each per round
(``common.interleaved_samples``); ``nonfinite / clean`` and ``propagate_clean / clean`` are
taken per round (the rounds pair them), and the median and the spread (min, max) are reported,
with milliseconds per step. A check records that the non-finite window did skip exactly one
microbatch, updated, and left the parameters finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax
from benchmarks import bench_compile, common

KS = (8, 32)
CASES = ("clean", "nonfinite", "propagate_clean")
LIMIT = 2.5  # the bound on nonfinite / clean


def _nan_batch(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``batch`` with one NaN in row 0 (microbatch 0 of every K)."""
    return {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)}


def _step(loss: Callable[..., Any], params: Any, k: int, on_nonfinite: str) -> tuple[Any, Any]:
    """``(step, state)``: a non-donating scan-mode step and its state for K=k."""
    tx = accumjax.accumulate(optax.adam(1e-3), k, on_nonfinite=on_nonfinite)
    step = accumjax.make_train_step(loss, mode="scan", donate=False)
    return step, step.init(params, tx)


def _check(step: Any, state: Any, batch: Any) -> dict[str, Any]:
    """What one step on the non-finite batch did: skipped microbatches, updated, params finite."""
    new, metrics = step(state, batch)
    finite = all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(new.params))
    return {
        "skipped_microbatches": int(new.opt_state.skipped_microbatches),
        "updated": bool(metrics["updated"]),
        "params_finite": finite,
    }


def _spread(values: Any) -> dict[str, float]:
    stats = (("median", np.median), ("min", np.min), ("max", np.max))
    return {k: float(f(values)) for k, f in stats}


def run(rounds: int = 21) -> dict[str, Any]:
    """ms/step of every case at every K, and the ratios to ``clean`` paired by round."""
    loss, params, batch = bench_compile._mlp()
    bad = _nan_batch(batch)
    cases: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    for k in KS:
        step, state = _step(loss, params, k, "skip_microbatch")
        prop, prop_state = _step(loss, params, k, "propagate")
        # each call runs on the same state; the carry is only the output to block on
        cases[f"{k}/clean"] = (lambda _, s=step, st=state: s(st, batch)[0], state)
        cases[f"{k}/nonfinite"] = (lambda _, s=step, st=state: s(st, bad)[0], state)
        cases[f"{k}/propagate_clean"] = (lambda _, s=prop, st=prop_state: s(st, batch)[0], state)
        checks[str(k)] = _check(step, state, bad)
    seconds = {
        name: np.asarray(s) for name, s in common.interleaved_samples(cases, rounds=rounds).items()
    }
    by_k = {}
    for k in KS:
        clean = seconds[f"{k}/clean"]
        by_k[str(k)] = {
            "ms_per_step": {c: _spread(seconds[f"{k}/{c}"] * 1e3) for c in CASES},
            "vs_clean": {c: _spread(seconds[f"{k}/{c}"] / clean) for c in CASES if c != "clean"},
            "check": checks[str(k)],
        }
    return {
        "K": list(KS),
        "model": {
            "dims": bench_compile.MLP_DIMS,
            "batch": bench_compile.MLP_BATCH,
            "nan": "x[0, 0] (microbatch 0)",
        },
        "by_k": by_k,
        "limit": LIMIT,
        "within_limit": all(r["vs_clean"]["nonfinite"]["median"] <= LIMIT for r in by_k.values()),
        "rounds": rounds,
    }


def table(r: dict[str, Any]) -> str:
    """A markdown table: per K and case, ms/step and the ratio to ``clean`` (median, min-max)."""
    lines = [
        f"| K | case | ms/step | / clean (issue: nonfinite <= {r['limit']}) | check |",
        "|---" * 5 + "|",
    ]
    fmt = lambda d, f: f"{d['median']:{f}} ({d['min']:{f}}-{d['max']:{f}})"
    for k, res in r["by_k"].items():
        for c in CASES:
            ratio = fmt(res["vs_clean"][c], ".2f") if c in res["vs_clean"] else "1"
            check = res["check"] if c == "nonfinite" else {}
            note = ", ".join(f"{a}={b}" for a, b in check.items())
            lines.append(f"| {k} | {c} | {fmt(res['ms_per_step'][c], '.2f')} | {ratio} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys

    result = run(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
    print(json.dumps(result, indent=2))
    print(table(result))
