"""Runs every benchmark and writes ``benchmarks/results/results.json`` and PNG plots.

    python -m benchmarks.run_all                          # from the repository root
    python -m benchmarks.run_all --quick                  # fewer timing rounds
    python -m benchmarks.run_all --only transformer       # one benchmark, merged into results.json
    python -m benchmarks.run_all --only compile,nonfinite --quick --rounds 10   # several
    python -m benchmarks.run_all --device gpu --out OUT   # on a GPU: results in OUT

``--device auto`` (the default) uses a GPU when JAX sees one; on a GPU the transformer
benchmark also records the device's memory statistics (``memory_stats()``) and the absolute
step times are those of the GPU, and the transformer is the ``large`` one. ``--device cpu``
forces the CPU backend. ``--out`` writes ``results.json`` and the plots to another folder
than ``benchmarks/results`` (a GPU run beside the committed CPU figures);
``benchmarks/gpu.sh OUT`` is that command, ready for a GPU machine (``gpu.sh --quick OUT``: the
compile and non-finite benchmarks only, with few rounds). ``--rounds N`` sets the timed rounds of
the compile and non-finite benchmarks (their compile rounds stay 5, 2 with ``--quick``). The
collectives benchmark runs on 8 host CPU devices on every machine, and the memory benchmark
(``bench_memory``: compile-only, per-device XLA memory and collectives on 1 and on 2, 4 and 8
host CPU devices) in processes of its own on the CPU. After each benchmark what has finished
is written to ``results.partial.json`` beside ``results.json`` (removed when the run ends), so
a run cut off by a time limit keeps it without touching ``results.json``.

Timings are ratios measured side by side in one run (this machine is noisy); memory and
collective counts come from XLA and are deterministic.
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
import jax
import matplotlib.pyplot as plt

from benchmarks import (
    bench_accumulate,
    bench_accuracy,
    bench_compile,
    bench_memory,
    bench_nonfinite,
    bench_scan,
    bench_transformer,
    common,
)

RESULTS = Path(__file__).parent / "results"
NAMES = (
    "accumulate",
    "scan",
    "accuracy",
    "collectives",
    "memory",
    "transformer",
    "compile",
    "nonfinite",
)


def _collectives() -> dict[str, Any]:
    """Runs bench_collectives in its own process: it needs 8 host devices set before JAX starts."""
    root = Path(__file__).parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_collectives"],
        cwd=root,
        env={
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",  # 8 host devices, also on a GPU machine
        },
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


def plot(results: dict[str, Any], out: Path = RESULTS) -> list[Path]:
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
    paths.append(out / "speed.png")
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
    paths.append(out / "memory_accuracy.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close("all")
    return paths


def plot_transformer(result: dict[str, Any], out: Path = RESULTS) -> Path:
    """Temp memory vs K (one line per variant, plus the floor) and time vs optax.microbatch."""
    ks = result["K"]
    timed = "time_vs_optax_microbatch" in result
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(14 if timed else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for name, values in result["temp_mib"].items():
        ax.plot(ks, values, marker="o", label=name, lw=2.5 if name == "accumjax_scan" else 1.2)
    ax.plot(ks, result["floor_mib"], "k--", label="floor (acc + grad + activations)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    m = result["model"]
    ax.set(
        title=f"Transformer LM ({m['params'] / 1e6:.1f}M params, batch {m['batch']}x{m['seq']}): "
        "XLA temp memory",
        xlabel="K (microbatches per update)",
        ylabel="MiB",
    )
    ax.legend(fontsize=8)
    if timed:
        ax = axes[0][1]
        for name, values in result["time_vs_optax_microbatch"].items():
            ax.plot(ks, values, marker="o", label=name, lw=2.5 if name == "accumjax_scan" else 1.2)
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_xscale("log", base=2)
        ax.set(title="Time per update / optax.microbatch", xlabel="K", ylabel="ratio")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "transformer_memory.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_compile(result: dict[str, Any], out: Path = RESULTS) -> Path:
    """Scan-mode trace+compile time and run time against optax.microbatch, per model: bars at
    the median ratio, whiskers from the fastest to the slowest round."""
    models = list(result["models"])
    variants = bench_compile.VARIANTS
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    panels = (
        ("compile_vs_optax_microbatch", "Trace + compile time / optax.microbatch"),
        ("time_vs_optax_microbatch", "Run time per step / optax.microbatch"),
    )
    width = 0.8 / len(variants)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, v in enumerate(variants):
            ratios = [result["models"][m][key][v] for m in models]
            med = [r["median"] for r in ratios]
            below = [r["median"] - r["min"] for r in ratios]
            err = [below, [r["max"] - r["median"] for r in ratios]]
            xs = [i + (j - 1) * width for i in range(len(models))]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=v)
        ax.axhline(1.0, color="gray", ls=":")
        ax.set_xticks(range(len(models)), models)
        ax.set(title=f"{title}, K={result['K']}", ylabel="ratio (median, min-max)")
        ax.legend(fontsize=8)
    axes[0].axhline(1.3, color="red", ls="--", lw=0.8)
    fig.tight_layout()
    path = out / "compile_time.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _select_device(device: str) -> None:
    """Picks the backend before JAX initialises one."""
    if device == "cpu":
        jax.config.update("jax_platforms", "cpu")
    elif device == "gpu" and jax.default_backend() != "gpu":
        raise SystemExit(f"--device gpu, but JAX's default backend is {jax.default_backend()}.")


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Runs the accumjax benchmarks.")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one timed call and round for accumulate/scan, fewer transformer rounds "
        "(a smoke run: its timings are not to be published)",
    )
    parser.add_argument(
        "--size", choices=sorted(bench_transformer.SIZES), default=None, help="transformer size"
    )
    parser.add_argument(
        "--only",
        type=_only,
        default=("all",),
        help="run these benchmarks (comma-separated, of " + ", ".join(NAMES) + ") and merge them "
        "into an existing results.json",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds of the compile and nonfinite benchmarks (default 15 and 21; 3 and 5 "
        "with --quick)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="where results.json and the plots go"
    )
    return parser.parse_args(argv)


def _only(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in ("all", *NAMES)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: choose from all, " + ", ".join(NAMES))
    return names


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    _select_device(args.device)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    gpu = jax.default_backend() == "gpu"
    size = args.size or ("large" if gpu and not args.quick else "small")
    timing = {"calls": 1, "rounds": 1} if args.quick else {}
    runs = {
        "accumulate": lambda: bench_accumulate.run(**timing),
        "scan": lambda: bench_scan.run(**timing),
        "accuracy": bench_accuracy.run,
        "collectives": _collectives,
        "memory": bench_memory.run,
        "transformer": lambda: bench_transformer.run(size, rounds=2 if args.quick else 6),
        "compile": lambda: bench_compile.run(
            rounds=2 if args.quick else 5, time_rounds=args.rounds or (3 if args.quick else 15)
        ),
        "nonfinite": lambda: bench_nonfinite.run(rounds=args.rounds or (5 if args.quick else 21)),
    }
    every = "all" in args.only
    path = out / "results.json"
    results: dict[str, Any] = {}
    if not every and path.exists():
        results = json.loads(path.read_text())
    start = time.time()
    machine = {**common.machine(), "gpu": gpu}
    partial = out / "results.partial.json"  # what a run cut off by a time limit keeps
    for name, fn in runs.items():
        if every or name in args.only:
            began = time.time()
            results[name] = fn()
            if not every:  # merged into results from another run: its machine, its seconds
                results[name]["machine"] = machine
                results[f"seconds_{name}"] = time.time() - began
            partial.write_text(json.dumps(results, indent=2) + "\n")
    if every:
        results["machine"] = machine
        results["seconds"] = time.time() - start
    path.write_text(json.dumps(results, indent=2) + "\n")
    partial.unlink(missing_ok=True)
    paths = []
    if all(k in results for k in ("accumulate", "scan", "accuracy")):
        paths += plot(results, out)
    if "transformer" in results:
        paths.append(plot_transformer(results["transformer"], out))
        print(bench_transformer.table(results["transformer"]))
    if "compile" in results:
        paths.append(plot_compile(results["compile"], out))
        print(bench_compile.table(results["compile"]))
    if "nonfinite" in results:
        print(bench_nonfinite.table(results["nonfinite"]))
    if "memory" in results:
        print(bench_memory.table(results["memory"]))
    skip = ("accuracy", "memory", "transformer", "compile", "nonfinite")
    print(json.dumps({k: v for k, v in results.items() if k not in skip}, indent=2))
    print("wrote", path, *paths)


if __name__ == "__main__":
    main()
