"""Runs every benchmark and writes ``benchmarks/results/results.json`` and PNG plots.

    python -m benchmarks.run_all                       # from the repository root
    python -m benchmarks.run_all --quick --only accuracy collectives   # a smoke run

Timings are ratios measured side by side in one run (this machine is noisy); memory and
collective counts come from XLA and are deterministic. ``--quick`` (one call per case, one
round) and ``--only`` print the results and write nothing, so the published figures stay those
of a full run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import bench_accumulate, bench_accuracy, bench_scan, common

RESULTS = Path(__file__).parent / "results"


def _collectives() -> dict[str, Any]:
    """Runs bench_collectives in its own process: it needs 8 host devices set before JAX starts."""
    root = Path(__file__).parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_collectives"],
        cwd=root,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout)


def _bar(ax, labels, values, title, ylabel, fmt="{:.2f}"):
    bars = ax.bar(
        labels, values, color=["#4c72b0" if "accumjax" in s else "#999999" for s in labels]
    )
    for b, v in zip(bars, values, strict=True):
        ax.annotate(
            fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom"
        )
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=20)


def plot(results: dict[str, Any]) -> list[Path]:
    paths = []
    by_mb = results["accumulate"]["by_microbatch"]
    scan = results["scan"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = ["ideal", "accumjax_update", "multisteps_update", "accumjax_micro", "multisteps_micro"]
    width = 0.38
    for i, (mb, res) in enumerate(by_mb.items()):
        ms = res["ms_per_call"]
        xs = [j + i * width for j in range(len(names))]
        axes[0].bar(xs, [ms[n] / ms["ideal"] for n in names], width, label=f"microbatch {mb}")
    axes[0].set_xticks([j + width / 2 for j in range(len(names))], names, rotation=20)
    axes[0].set(title="Non-update microstep (2.6M-param MLP)", ylabel="time / ideal")
    axes[0].legend()
    for i, (mb, res) in enumerate(by_mb.items()):
        ms = res["ms_per_call"]
        vals = [ms[n] / ms["multisteps_window"] for n in ("accumjax_window", "multisteps_window")]
        axes[1].bar([i * 3, i * 3 + 1], vals, color=["#4c72b0", "#999999"])
        axes[1].annotate(f"mb {mb}: {vals[0]:.2f}", (i * 3, vals[0]), ha="center", va="bottom")
    axes[1].set_xticks([0, 1, 3, 4], ["accumjax", "MultiSteps"] * 2)
    axes[1].set(title="K=8 window (accumjax blue)", ylabel="time / MultiSteps")
    names = ["full_batch", "accumjax_scan", "optax_microbatch", "naive_scan"]
    _bar(
        axes[2],
        names,
        [scan["ms_per_step"][n] / scan["ms_per_step"]["full_batch"] for n in names],
        "Scan step, K=8 (256-2048x3-256, batch 1024)",
        "time / full batch",
    )
    fig.tight_layout()
    paths.append(RESULTS / "speed.png")
    fig.savefig(paths[-1], dpi=90)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    mem = scan["temp_mib_vs_k"]
    for name in ("accumjax_scan", "optax_microbatch"):
        axes[0].plot(mem["K"], mem[name], marker="o", label=name)
    axes[0].axhline(scan["full_batch_temp_mib"], color="gray", ls="--", label="full batch")
    axes[0].set_xscale("log", base=2)
    axes[0].set(title="XLA temp memory vs K (batch 1024)", xlabel="K", ylabel="MiB")
    axes[0].legend()
    err = results["accuracy"]
    for name, values in err["normalized_max_error"].items():
        axes[1].plot(err["K"][1:], values[1:], marker="o", label=name)
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set(
        title="float32 accumulation vs float64 mean",
        xlabel="K",
        ylabel="max |error| / mean |exact|",
    )
    axes[1].legend()
    fig.tight_layout()
    paths.append(RESULTS / "memory_accuracy.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close("all")
    return paths


BENCHMARKS = ("accumulate", "scan", "accuracy", "collectives")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run_all",
        description="Run the accumjax benchmarks (a full run writes benchmarks/results/).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one timed call per case and one round: checks that everything runs; the "
        "timings are meaningless and nothing is written",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS,
        metavar="NAME",
        help=f"run only these benchmarks ({', '.join(BENCHMARKS)}); nothing is written",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    names = args.only or BENCHMARKS
    timing = {"calls": 1, "rounds": 1} if args.quick else {}
    runners = {
        "accumulate": lambda: bench_accumulate.run(**timing),
        "scan": lambda: bench_scan.run(**timing),
        "accuracy": bench_accuracy.run,
        "collectives": _collectives,
    }
    start = time.time()
    results: dict[str, Any] = {"machine": common.machine()}
    for name in names:
        results[name] = runners[name]()
    results["seconds"] = time.time() - start
    if args.quick or args.only:
        print(json.dumps(results, indent=2))
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    paths = plot(results)
    print(json.dumps({k: v for k, v in results.items() if k != "accuracy"}, indent=2))
    print("wrote", RESULTS / "results.json", *paths)


if __name__ == "__main__":
    main()
