"""Per-device XLA memory and collectives of the scan step on a parameter-dominated model.

Deterministic and compile-only (nothing runs, nothing is timed): every figure is XLA's
``compiled.memory_analysis()`` or a count in the compiled HLO. The model is issue 37's,
``common.dense_loss``: 8 dense 1024x1024 tanh layers (32 MiB of float32 parameters), 16 rows per
microbatch (per device on a mesh), K=8, Adam.

1. **One device**: scan-step temp of each policy (``on_nonfinite`` the default
   ``skip_microbatch``, ``skip_window`` or ``propagate``; the default with ``max_norm=1.0``,
   with a ``skip_fn`` that reads the gradient's global norm, or with a ``microbatch_transform``:
   ``optax.clip_by_global_norm(1.0)`` or per-microbatch AGC) against ``optax.microbatch``'s.
2. **FSDP on N = 2, 4, 8 host CPU devices**: the kernels sharded over the data axis on their
   first dimension (``P("data", None)``, as ``examples/fsdp_8_devices.py``), the batch
   ``P("data")`` (``accumjax.distributed.data_sharding``), on an Explicit mesh
   (``jax.make_mesh``'s default).
   Per device, argument + temp bytes (and the output that does not alias an argument: the
   steps donate their state) of the scan step, default policy and ``propagate``, once per
   ``reduce_scatter=`` layout where ``make_train_step`` takes that argument (``"microbatch"``:
   each microbatch's gradient reduce-scattered into a sharded accumulator; ``"window"``: one
   reduction per window), beside a plain ``jax.jit`` + ``lax.scan`` step: each microbatch's
   gradient added into an accumulator constrained (``jax.lax.with_sharding_constraint``) to
   the parameters' sharding, then ``optax.adam``, state donated, microbatches strided as
   accumjax's. The plain step is compiled on an Auto mesh (where the constraint is what
   places the accumulator: issue 37's reference) and, the same code, on an Explicit mesh.
   The default step also on an Auto mesh (a step that fails to build is reported, not
   fatal). Collectives executed per window, by op and result size
   (``accumjax.collectives.count_collectives``): a clean window's, and where a loop of
   unknown trip count
   (a run-at-most-once re-run of a non-finite window) adds to them, with it run once.

``memory_analysis()`` of an SPMD-partitioned executable is per device: the argument figure is
checked against the bytes of each argument's shard on one device (``argument_check_bytes``:
their difference), and it falls with N.

Each N compiles in its own process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
``JAX_PLATFORMS=cpu``)::

    python -m benchmarks.bench_memory                 # from the repository root: the tables
    python -m benchmarks.bench_memory --json          # the figures as JSON
    python -m benchmarks.bench_memory --host-devices 8   # every N on a sub-mesh of 8 devices

About 45 s on the 2-core CPU machine (sub-meshes of 8 devices give the same figures).
``run_all --only memory`` runs it too (results under ``"memory"``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import accumjax
from benchmarks import common

K = 8
MESH_SIZES = (2, 4, 8)
# One-device policies: name -> accumulate() keyword arguments.
POLICIES: dict[str, dict[str, Any]] = {
    "skip_microbatch (default)": {},
    "skip_window": {"on_nonfinite": "skip_window"},
    "propagate": {"on_nonfinite": "propagate"},
    "max_norm=1.0": {"max_norm": 1.0},
    "skip_fn": {"skip_fn": lambda grads, params: optax.global_norm(grads) > 1e3},
    "microbatch_transform=clip_by_global_norm(1.0)": {
        "microbatch_transform": optax.clip_by_global_norm(1.0)
    },
    "microbatch_transform=adaptive_clip(0.08)": {
        "microbatch_transform": accumjax.adaptive_clip(0.08)
    },
}
MESH_POLICIES = ("skip_microbatch", "propagate")
OPS = ("all-reduce", "reduce-scatter", "all-gather")


def _tx() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def _layouts() -> tuple[str | None, ...]:
    """``make_train_step``'s ``reduce_scatter`` values, or ``(None,)`` where it takes none."""
    if "reduce_scatter" in inspect.signature(accumjax.make_train_step).parameters:
        return ("microbatch", "window")
    return (None,)


def _memory(compiled: Any, args: Any) -> dict[str, int]:
    """Per-device bytes of a compiled step, and how far its argument figure is from the bytes
    of one device's shard of every argument."""
    m = compiled.memory_analysis()
    shards = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(args))
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "argument_check_bytes": int(m.argument_size_in_bytes) - shards,
    }


_COLLECTIVE = re.compile(
    r"=\s*(.*?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
    """Bytes of every array of an HLO result shape."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = {"pred": 8, "bf16": 16}.get(dtype) or int(dtype[1:])
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _collectives(compiled: Any, trips: int) -> dict[str, dict[int, int]]:
    """Collectives executed per window, ``{op: {result bytes: count}}``, with each loop of
    unknown trip count (a run-at-most-once re-run of a window) run ``trips`` times. The sizes
    come from the HLO text; each size's count is ``count_collectives`` at that ``min_bytes``
    less the count at the next larger size."""
    found: dict[str, set[int]] = {}
    for shape, op in _COLLECTIVE.findall(compiled.as_text()):
        found.setdefault(op, set()).add(_shape_bytes(shape))

    def count(op: str, min_bytes: int) -> int:
        counts = accumjax.collectives.count_collectives(
            compiled, per_execution=True, default_trip_count=trips, min_bytes=min_bytes
        )
        return counts.get(op, 0)

    out: dict[str, dict[int, int]] = {}
    for op, sizes in found.items():
        ordered = sorted(sizes)
        at = [count(op, max(s, 1)) for s in ordered] + [0]
        out[op] = {s: at[i] - at[i + 1] for i, s in enumerate(ordered) if at[i] - at[i + 1]}
    return out


def one_device() -> dict[str, Any]:
    """Temp and argument bytes of the scan step for each policy and of optax.microbatch."""
    params = common.dense_params()
    batch = common.dense_batch(K * common.DENSE_ROWS)
    out: dict[str, Any] = {}
    for name, kwargs in POLICIES.items():
        step = accumjax.make_train_step(common.dense_loss, mode="scan")
        state = step.init(params, accumjax.accumulate(_tx(), K, **kwargs))
        out[name] = _memory(step.lower(state, batch).compile(), (state, batch))
    ref = common.optax_microbatch_step(common.dense_loss, _tx(), common.DENSE_ROWS)
    carry = (params, _tx().init(params))
    out["optax.microbatch"] = _memory(ref.lower(carry, batch).compile(), (carry, batch))
    return out


def _plain_step(shardings: Any) -> Any:
    """``jit`` + ``lax.scan``: the batch's rows ``i, i + K, ...`` are microbatch ``i``; each
    microbatch's gradient is added into an accumulator constrained to ``shardings``; then
    Adam. Parameters and optimizer state are donated."""
    tx = _tx()
    constrain = functools.partial(jax.lax.with_sharding_constraint, shardings=shardings)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(acc, mb):
            grads = jax.grad(common.dense_loss)(params, mb)
            return constrain(jax.tree.map(jnp.add, acc, grads)), None

        zeros = constrain(jax.tree.map(jnp.zeros_like, params))
        grads, _ = jax.lax.scan(body, zeros, micro)
        updates, opt_state = tx.update(jax.tree.map(lambda g: g / K, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _fsdp_spec(x: jax.Array, n: int) -> PartitionSpec:
    """FSDP: a kernel is split over "data" on its first dimension if it divides by ``n``."""
    return PartitionSpec("data", None) if x.ndim == 2 and x.shape[0] % n == 0 else PartitionSpec()


def _placed(mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """The model's parameters (FSDP) and a batch of 16 rows per device per microbatch, on
    ``mesh``."""
    n = mesh.size
    params = {
        k: jax.device_put(v, NamedSharding(mesh, _fsdp_spec(v, n)))
        for k, v in common.dense_params().items()
    }
    batch = jax.device_put(
        common.dense_batch(n * K * common.DENSE_ROWS),
        accumjax.distributed.data_sharding(mesh, "data"),
    )
    return params, batch


def _figures(compiled: Any, args: Any) -> dict[str, Any]:
    """Per-device memory, and collectives per window: a clean one's, and with each loop of
    unknown trip count run once (a non-finite window's re-run)."""
    return {
        **_memory(compiled, args),
        "collectives": _collectives(compiled, 0),
        "collectives_rerun": _collectives(compiled, 1),
    }


def _accumjax(mesh: jax.sharding.Mesh, policy: str, layout: str | None) -> dict[str, Any]:
    """`_figures` of the scan step with ``policy`` and ``reduce_scatter=layout`` (the
    default where None) on ``mesh``; ``{"error": ...}`` where it fails to build or compile."""
    extra = {} if layout is None else {"reduce_scatter": layout}
    try:
        with jax.set_mesh(mesh):
            params, batch = _placed(mesh)
            step = accumjax.make_train_step(common.dense_loss, mode="scan", **extra)
            state = step.init(params, accumjax.accumulate(_tx(), K, on_nonfinite=policy))
            return _figures(step.lower(state, batch).compile(), (state, batch))
    except Exception as e:  # recorded in the table: the other steps go on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def fsdp(n: int) -> dict[str, Any]:
    """Per-device memory and collectives per window of each FSDP step on the first ``n``
    devices: accumjax on an Explicit mesh (each policy and layout) and, default policy and
    layout, on an Auto mesh; the plain step on both."""
    devices = jax.devices()[:n]
    meshes = {
        kind: jax.make_mesh((n,), ("data",), axis_types=(kind,), devices=devices)
        for kind in (AxisType.Explicit, AxisType.Auto)
    }
    out: dict[str, Any] = {}
    for policy in MESH_POLICIES:
        for layout in _layouts():
            name = policy if layout is None else f"{policy}, reduce_scatter={layout}"
            out[f"accumjax {name}"] = _accumjax(meshes[AxisType.Explicit], policy, layout)
    out["accumjax skip_microbatch, Auto mesh"] = _accumjax(
        meshes[AxisType.Auto], "skip_microbatch", None
    )
    for kind, mesh in meshes.items():
        with jax.set_mesh(mesh):
            params, batch = _placed(mesh)
            step = _plain_step(jax.tree.map(lambda p: p.sharding, params))
            args = (params, _tx().init(params), batch)
            out[f"plain jit+scan, {kind.name} mesh"] = _figures(step.lower(*args).compile(), args)
    return out


OPTIMIZER_SHARDINGS = ("replicated", "zero1", "zero2")


def _replicated(mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """The model's parameters replicated over "data" (data parallel) and a batch of 16 rows
    per device per microbatch, on ``mesh``."""
    params = jax.device_put(common.dense_params(), NamedSharding(mesh, PartitionSpec()))
    batch = jax.device_put(
        common.dense_batch(mesh.size * K * common.DENSE_ROWS),
        accumjax.distributed.data_sharding(mesh, "data"),
    )
    return params, batch


def _hand_written(mesh: jax.sharding.Mesh, stage: int) -> Any:
    """A hand-written ``shard_map`` step (issue 44's reference): each device sums its rows'
    gradients over K microbatches, then stage 0 (DDP) all-reduces the sum once and runs Adam
    replicated; stage 1 (ZeRO-1) reduce-scatters the sum once, runs Adam on 1/N shards of
    its state and all-gathers the new parameters; stage 2 (ZeRO-2) reduce-scatters each
    microbatch's gradient into a 1/N accumulator, then as stage 1. State donated."""
    n, tx = mesh.size, _tx()
    shard = lambda t: jax.lax.psum_scatter(t, "data", scatter_dimension=0, tiled=True)
    gather = lambda t: jax.lax.all_gather(t, "data", axis=0, tiled=True)

    def local(params: Any, opt: Any, batch: Any) -> Any:
        micro = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(acc: Any, mb: Any) -> Any:
            g = jax.grad(common.dense_loss)(params, mb)
            return jax.tree.map(jnp.add, acc, jax.tree.map(shard, g) if stage == 2 else g), None

        like = jax.tree.map(shard, params) if stage == 2 else params
        zeros = jax.tree.map(lambda a: jax.lax.pcast(jnp.zeros_like(a), "data", to="varying"), like)
        acc, _ = jax.lax.scan(body, zeros, micro)
        if stage == 0:
            grads = jax.tree.map(lambda a: jax.lax.psum(a, "data") / (K * n), acc)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt
        grads = jax.tree.map(lambda a: a / (K * n), acc if stage == 2 else jax.tree.map(shard, acc))
        index = jax.lax.axis_index("data")
        mine = jax.tree.map(lambda p: p.reshape(n, -1, p.shape[1])[index], params)
        updates, opt = tx.update(grads, opt, mine)
        return jax.tree.map(gather, optax.apply_updates(mine, updates)), opt

    whole = PartitionSpec()
    split = lambda a: PartitionSpec("data") if stage and a.ndim == 2 else whole
    params, batch = _replicated(mesh)
    opt = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, split(a))), tx.init(params))
    specs = (jax.tree.map(lambda _: whole, params), jax.tree.map(split, opt))
    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*specs, PartitionSpec("data")),
        out_specs=specs,
        check_vma=False,
    )
    args = (params, opt, batch)
    return _figures(jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile(), args)


def data_parallel(n: int) -> dict[str, Any]:
    """Per-device memory and collectives per window of each data-parallel layout on the first
    ``n`` devices (parameters replicated; Explicit mesh; default policy): accumjax with each
    ``optimizer_sharding`` beside the hand-written DDP, ZeRO-1 and ZeRO-2 steps."""
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    out: dict[str, Any] = {}
    with jax.set_mesh(mesh):
        for choice in OPTIMIZER_SHARDINGS:
            params, batch = _replicated(mesh)
            step = accumjax.make_train_step(
                common.dense_loss, mode="scan", optimizer_sharding=choice
            )
            state = step.init(params, accumjax.accumulate(_tx(), K))
            compiled = step.lower(state, batch).compile()
            out[f"accumjax optimizer_sharding={choice}"] = _figures(compiled, (state, batch))
        for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2")):
            out[f"hand-written {name}"] = _hand_written(mesh, stage)
    return out


def _worker(n: int) -> dict[str, Any]:
    if n == 1:
        return {"one_device": one_device()}
    return {"fsdp": fsdp(n), "data_parallel": data_parallel(n)}


def _spawn(n: int, host_devices: int | None) -> dict[str, Any]:
    """``_worker(n)`` in a fresh process with ``host_devices`` (default ``n``) CPU devices."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={host_devices or n}",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory", "--worker", str(n)],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"bench_memory --worker {n} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def run(host_devices: int | None = None) -> dict[str, Any]:
    """Every figure: one device, then FSDP at each N (each in its own process, on ``N`` host
    devices, or on the first N of ``host_devices``)."""
    return {
        "model": {
            "layers": common.DENSE_LAYERS,
            "width": common.DENSE_WIDTH,
            "params": common.DENSE_LAYERS * common.DENSE_WIDTH**2,
            "rows_per_microbatch_per_device": common.DENSE_ROWS,
            "K": K,
        },
        "host_devices": host_devices,
        "one_device": _spawn(1, host_devices)["one_device"],
        **_by_mesh_size({n: _spawn(n, host_devices) for n in MESH_SIZES}),
    }


def _by_mesh_size(workers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The workers' sections, each keyed by N."""
    return {
        section: {str(n): out[section] for n, out in workers.items()}
        for section in ("fsdp", "data_parallel")
    }


def _mib(b: int) -> str:
    return f"{b / common.MiB:.1f}"


def _size(b: int) -> str:
    if b >= common.MiB:
        return f"{b / common.MiB:g} MiB"
    return f"{b / 1024:g} KiB" if b >= 1024 else f"{b} B"


def _sized(counts: dict[Any, int]) -> str:
    """``{result bytes: count}`` as ``"8x2 MiB + 1x8 B"`` (``"0"`` when empty)."""
    return " + ".join(f"{k}x{_size(int(b))}" for b, k in counts.items()) or "0"


def _memory_rows(title: str, section: dict[str, Any]) -> list[str]:
    """A section's per-device memory table, one row per step, one column per N."""
    sizes = list(section)
    lines = [
        "",
        f"{title}, per device: argument + temp = MiB (output not aliasing an argument MiB)",
        "",
        "| step | " + " | ".join(f"N={n}" for n in sizes) + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]
    for name in section[sizes[0]]:
        cells = []
        for n in sizes:
            m = section[n][name]
            if "error" in m:
                cells.append(f"fails: {m['error'][:90]}")
                continue
            total = m["argument_bytes"] + m["temp_bytes"]
            extra = m["output_bytes"] - m["alias_bytes"]
            cells.append(
                f"{_mib(m['argument_bytes'])} + {_mib(m['temp_bytes'])} = **{_mib(total)}** "
                f"({_mib(extra)})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _collective_rows(title: str, section: dict[str, Any]) -> list[str]:
    """A section's collectives per window, one row per step and N."""
    lines = [
        "",
        f"{title}, collectives per window, count x result size (in brackets where a loop run "
        "at most once, a window's re-run or its update, adds to them: with it run once)",
        "",
        "| step | N | " + " | ".join(OPS) + " | other |",
        "|---" * 6 + "|",
    ]
    for n, steps in section.items():
        for name, m in steps.items():
            if "error" in m:
                continue
            clean, rerun = m["collectives"], m["collectives_rerun"]
            cells = {op: _sized(clean.get(op, {})) for op in {*clean, *rerun}}
            for op in rerun:
                if rerun[op] != clean.get(op):
                    cells[op] += f" [{_sized(rerun[op])}]"
            other = "; ".join(f"{op} {cell}" for op, cell in sorted(cells.items()) if op not in OPS)
            counts = " | ".join(cells.get(op, "0") for op in OPS)
            lines.append(f"| {name} | {n} | {counts} | {other} |")
    return lines


def table(r: dict[str, Any]) -> str:
    """Markdown tables of ``run()``'s figures."""
    one = r["one_device"]
    ref = one["optax.microbatch"]["temp_bytes"]
    lines = [
        "One device, K=8: scan-step temp MiB",
        "",
        "| step | temp MiB | / optax.microbatch | argument MiB |",
        "|---|---|---|---|",
    ]
    for name, m in one.items():
        ratio = m["temp_bytes"] / ref
        lines.append(
            f"| {name} | {_mib(m['temp_bytes'])} | {ratio:.2f} | {_mib(m['argument_bytes'])} |"
        )
    for name, title in (("fsdp", "FSDP"), ("data_parallel", "Data parallel")):
        lines += _memory_rows(title, r[name]) + _collective_rows(title, r[name])
    checks = [
        m["argument_check_bytes"]
        for section in ("fsdp", "data_parallel")
        for v in r[section].values()
        for m in v.values()
        if "error" not in m
    ]
    lines += [
        "",
        "memory_analysis() is per device: argument bytes minus the bytes of one device's shard "
        f"of every argument, over all mesh steps: {min(checks)} to {max(checks)}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--host-devices", type=int, default=None, help="compile every N on a sub-mesh of these"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_worker(args.worker)))
        return
    result = run(args.host_devices)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
