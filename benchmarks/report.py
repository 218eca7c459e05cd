"""Prints the benchmark tables of docs/limits.md from ``benchmarks/results/results.json`` (or the
results file given: ``python -m benchmarks.report OUT/results.json``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any


def table(r: dict) -> str:
    mb = r["accumulate"]["by_microbatch"]
    small, large = (mb[k]["ratios"] for k in sorted(mb, key=int))
    sizes = " / ".join(sorted(mb, key=int))
    scan, coll, acc = r["scan"], r["collectives"], r["accuracy"]
    mem = scan["temp_mib"]
    vs_k = ", ".join(f"{m:.1f}" for m in scan["temp_mib_vs_k"]["accumjax_scan"])
    err = acc["normalized_max_error"]

    def pair(key: str) -> str:
        return f"{small[key]:.2f} / {large[key]:.2f}"

    rows = [
        ("figure (microbatch " + sizes + " where two)", "value"),
        (
            "non-update microstep, `tx.update` only, vs ideal (grad + add)",
            pair("accumjax_update_vs_ideal"),
        ),
        ('same with `on_nonfinite="propagate"`', pair("accumjax_no_detect_update_vs_ideal")),
        ("microstep with `apply_updates`: accumjax vs ideal", pair("accumjax_micro_vs_ideal")),
        (
            "`make_train_step` stream microstep vs ideal: detect / `propagate` (mb 32)",
            f"{small['accumjax_train_step_vs_ideal']:.2f} / "
            f"{small['accumjax_no_detect_train_step_vs_ideal']:.2f}",
        ),
        ("microstep with `apply_updates`: MultiSteps vs ideal", pair("multisteps_micro_vs_ideal")),
        ("MultiSteps microstep vs a plain Adam step", pair("multisteps_micro_vs_plain_adam")),
        ("**K=8 window: accumjax / MultiSteps**", pair("accumjax_window_vs_multisteps_window")),
        (
            "scan step K=8 vs full batch: accumjax / optax.microbatch / naive scan",
            " / ".join(
                f"{scan['ratios'][k]:.2f}"
                for k in (
                    "accumjax_scan_vs_full_batch",
                    "optax_microbatch_vs_full_batch",
                    "naive_scan_vs_full_batch",
                )
            ),
        ),
        (
            "XLA temp MiB: full batch / accumjax scan / optax.microbatch / naive scan",
            f"{mem['full_batch']:.1f} / {mem['accumjax_scan']:.1f} / "
            f"{mem['optax_microbatch']:.1f} / {mem['naive_scan']:.1f}",
        ),
        ("accumjax scan temp MiB for K = " + ", ".join(map(str, scan["temp_mib_vs_k"]["K"])), vs_k),
        (
            "convnet scan step K=8 vs full batch: `unroll=1` / `unroll=True`",
            f"{scan['conv_ratios']['scan']:.2f} / {scan['conv_ratios']['scan_unrolled']:.2f}",
        ),
        (
            f"all-reduces per window ({coll['devices']} devices, K={coll['K']}): accumjax / naive",
            f"{coll['accumjax_scan']['per_window']} / "
            f"{coll['naive_pmean_per_microbatch']['per_window']}",
        ),
        (
            f"float32 mean of K={acc['K'][-1]} gradients, max error / mean: accumjax / MultiSteps",
            f"{err['accumjax'][-1]:.1e} / {err['multisteps'][-1]:.1e}",
        ),
    ]
    dense = scan.get("param_dominated")  # absent from results written before issue 37
    if dense:
        t, m = dense["time_vs_optax_microbatch"], dense["temp_mib"]
        variants = ("accumjax_scan", "accumjax_scan_propagate", "optax_microbatch", "full_batch")
        rows.insert(
            -2,
            (
                "8x1024x1024 tanh model, K=8, XLA temp MiB (time / optax.microbatch): "
                "accumjax default / `propagate` / optax.microbatch / full batch",
                " / ".join(f"{m[v]:.1f} ({t[v]:.2f})" for v in variants),
            ),
        )
    lines = [f"| {a} | {b} |" for a, b in rows]
    lines.insert(1, "|---|---|")
    return "\n".join(lines)


def sharded_table(sharded: dict[str, Any]) -> str:
    """``results["collectives"]["sharded"]`` (``bench_collectives.sharded_table``) as Markdown:
    collectives per window and per-device memory under ``jit`` on an 8-device mesh. Where
    fewer of a kind are gradient-sized (at least ``gradient_bytes``; recorded since
    ``step.init``'s stream window, whose calls each all-reduce a few scalars), that count
    follows in parentheses."""
    lines = [
        f"| {sharded['devices']} devices, K={sharded['K']}, per window | all-reduce | "
        "reduce-scatter | all-gather | MiB per device (arg + out + temp) |",
        "|---|---|---|---|---|",
    ]
    for layout in ("replicated", "fsdp"):
        for name in sharded[layout]:
            r = sharded[layout][name]
            c, m = r["per_window"], r["memory_per_device"]
            big = r.get("per_window_gradient_sized", c)
            n = {
                op: f"{c[op]} ({big[op]} of >= {sharded['gradient_bytes']} B)"
                if big[op] != c[op]
                else str(c[op])
                for op in ("all-reduce", "reduce-scatter", "all-gather")
            }
            calls = f" ({r['calls_per_window']} calls)" if r["calls_per_window"] > 1 else ""
            lines.append(
                f"| {layout}: {name}{calls} | {n['all-reduce']} | {n['reduce-scatter']} | "
                f"{n['all-gather']} | {m['total_mib']:.2f} ({m['argument_mib']:.2f} + "
                f"{m['output_mib']:.2f} + {m['temp_mib']:.2f}) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    default = Path(__file__).parent / "results" / "results.json"
    results = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else default).read_text())
    if all(k in results for k in ("accumulate", "scan", "collectives", "accuracy")):
        print(table(results))
    if "sharded" in results.get("collectives", {}):
        print()
        print(sharded_table(results["collectives"]["sharded"]))
    gather = results.get("collectives", {}).get("gather_params")
    if gather:
        print(
            f"\nFSDP gather_params ({'-'.join(map(str, gather['dims']))} MLP, batch "
            f"{gather['batch']}, K={gather['K']}): temp MiB per device "
            f"{gather['temp_mib_window']:.1f} (window) / {gather['temp_mib_microbatch']:.1f} "
            f"(microbatch), bit-identical params: {gather['bit_identical']}"
        )
    # The tables each benchmark module prints of its own results, in this order.
    for name in ("transformer", "compile", "memory", "nonfinite"):
        if name in results:
            bench = importlib.import_module(f"benchmarks.bench_{name}")
            print()
            print(bench.table(results[name]))
