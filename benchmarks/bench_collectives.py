"""Collectives per accumulation window, replicated data parallel and FSDP, on 8 devices.

Runs on 8 host CPU devices by default (``--xla_force_host_platform_device_count=8`` is added
to ``XLA_FLAGS`` before JAX starts, so run it as its own process)::

    python -m benchmarks.bench_collectives          # from the repository root, CPU

On a machine with 8 accelerators (e.g. 8 GPUs), measure on the real devices: with
``ACCUMJAX_BENCH_DEVICES=native`` the host-device flag is not added and JAX picks its default
backend (it must see exactly 8 devices)::

    ACCUMJAX_BENCH_DEVICES=native python -m benchmarks.bench_collectives   # 8 GPUs

The collective counts come from the compiled HLO (``accumjax.collectives.count_collectives``):
instructions in the program and instructions executed per step (loop bodies times their
trip count).

Per-device memory and collectives at N = 2, 4 and 8 devices on a parameter-dominated model
(FSDP, each ``reduce_scatter`` layout, beside a plain ``jit`` + ``lax.scan`` step) are
``benchmarks.bench_memory``'s.

1. accumjax scan mode with ``mesh=``/``axis_name=`` (the step runs under ``jit`` on that
   mesh; its state from ``step.init``, replicated there) against a naive ``shard_map`` whose
   scan ``pmean``s every microbatch gradient (all-reduces only).
2. ``sharded``: plain ``jit`` on arrays sharded over a ``jax.make_mesh`` mesh (no
   ``shard_map`` written by the user), parameters replicated (``P()``) or FSDP-sharded
   (``P("data", None)``), batch ``P("data")``. Side by side, per layout:

   * ``accumjax_scan``: ``make_train_step(mode="scan")``, one call per window (state from
     the step's ``step.init(params, tx)``); the reference of the time ratios.
   * ``accumjax_stream``: ``make_train_step(mode="stream")``, K calls per window, on the
     window ``step.init`` builds for parameters on a mesh (an ``accumjax.window.DeviceWindow``,
     one partial sum per data shard: each call adds its devices' gradient locally, the
     closing call all-reduces once; an FSDP-sharded kernel's gradient is reduce-scattered
     into its shards on every call).
   * ``accumjax_stream_jit``: ``accumjax.accumulate`` in a user's jitted per-microbatch step,
     state ``tx.init(params)`` (the per-call behaviour: XLA reduces every call's gradient).
   * ``multisteps_jit``: ``optax.MultiSteps`` in the same per-microbatch step.
   * ``naive_scan``: a jitted ``lax.scan`` that sums ``jax.grad`` over the microbatches
     (XLA reduces each microbatch's gradient).

   For each: all-reduce / reduce-scatter / all-gather executed per window (a conditional
   counts its costliest branch). A K-call window is K - 1 calls counted with loops of unknown
   trip count left out (the at-most-once window close of accumjax stream, and of
   ``accumjax.accumulate``'s ``update`` in the user's step) plus one closing call counted
   with them run once; ``optax.MultiSteps`` has no such loop (its per-call count times K).
   The same counts for collectives of at least ``GRADIENT_BYTES`` bytes
   (``per_window_gradient_sized``) leave out the few scalars a step reduces on every call
   (accumjax stream's loss and window counts: one small all-reduce per call), so that a
   window's gradient reductions can be read apart from them. Then per-device memory of one
   call (argument, output, temp: ``memory_analysis``), and the wall time of a window (K
   calls, or one scan call; blocked on at its end): fastest, median and slowest of
   interleaved rounds, and the fastest and median as ratios to ``accumjax_scan``. No step
   donates its buffers.
"""

from __future__ import annotations

import os

# 8 host CPU devices (set before JAX starts), unless told to use the machine's own devices.
if os.environ.get("ACCUMJAX_BENCH_DEVICES", "host") != "native":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import accumjax
from accumjax.window import DeviceWindow
from benchmarks import common

DIMS = (64, 256, 256, 10)
K = 8
PER_DEVICE = 64


def _loss(params, batch):
    return common.mlp_loss(params, (batch["x"], batch["y"]))


def _naive_step(mesh: Mesh, tx: optax.GradientTransformation):
    """A scan whose body all-reduces each microbatch gradient (a direct port of pmean-per-step)."""

    def per_device(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            g = jax.lax.pmean(jax.grad(_loss)(params, mb), "data")
            return jax.tree.map(lambda a, b: a + b / K, acc, g), None

        zeros = jax.tree.map(lambda p: p * 0, params)  # pmean output is replicated too
        grads, _ = jax.lax.scan(body, zeros, micro)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rep, data = PartitionSpec(), PartitionSpec("data")
    return jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, data), out_specs=(rep, rep))
    )


OPS = ("all-reduce", "reduce-scatter", "all-gather")


def _memory(compiled: Any) -> dict[str, float]:
    """Per-device argument, output and temp memory of a compiled SPMD program, in MiB (and
    the argument and temp bytes)."""
    m = compiled.memory_analysis()
    parts = {
        "argument_mib": m.argument_size_in_bytes / common.MiB,
        "output_mib": m.output_size_in_bytes / common.MiB,
        "temp_mib": m.temp_size_in_bytes / common.MiB,
    }
    return {
        **parts,
        "total_mib": sum(parts.values()),
        "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }


# A collective whose result holds fewer bytes carries a few scalars (metrics, window counts),
# not a gradient (the smallest gradient here, one 10-entry bias, is 40 bytes and is reduced
# with the others in one variadic collective).
GRADIENT_BYTES = 64


def _call_counts(compiled: Any, min_bytes: int = 0) -> dict[str, dict[str, int]]:
    """Collectives executed by one call: every call's (a loop of unknown trip count, such as
    the stream window's close, left out) and a closing call's (such a loop run once); only
    those whose result holds at least ``min_bytes`` bytes."""

    def count(trips: int) -> dict[str, int]:
        c = accumjax.collectives.count_collectives(
            compiled, per_execution=True, default_trip_count=trips, min_bytes=min_bytes
        )
        return {op: c[op] for op in OPS}

    return {"every_call": count(0), "closing_call": count(1)}


def _window_counts(calls: dict[str, dict[str, int]], n_calls: int) -> dict[str, int]:
    """Collectives per window of ``n_calls`` calls: all but the last skip the window close
    (a loop of unknown trip count, run once by the closing call). Without such a loop (one
    scan call, ``optax.MultiSteps``' ``cond``) this is the per-call count times ``n_calls``."""
    return {op: (n_calls - 1) * calls["every_call"][op] + calls["closing_call"][op] for op in OPS}


def _per_microbatch_step(tx: optax.GradientTransformation):
    """A jitted step fed one microbatch per call: gradient, ``tx.update``, apply."""

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _naive_scan(tx: optax.GradientTransformation):
    """A jitted scan summing ``jax.grad`` over the microbatches (batch laid out ``(K, rows)``),
    then one update: under a mesh XLA reduces every microbatch's gradient."""

    @jax.jit
    def step(params, opt_state, batch):
        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(_loss)(params, mb)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(body, zeros, batch)
        grads = jax.tree.map(lambda g: g / K, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _param_spec(x: Any, fsdp: bool) -> PartitionSpec:
    if fsdp and x.ndim == 2 and x.shape[0] % jax.device_count() == 0:
        return PartitionSpec("data", None)
    return PartitionSpec()


def _window_of(step: Any, microbatches: list[Any]) -> Any:
    """``carry -> carry`` over one window: ``step(carry, mb)`` for each microbatch in turn."""

    def window(carry: Any) -> Any:
        for mb in microbatches:
            carry = step(carry, mb)
        return carry

    return window


def _times(spread: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Milliseconds per window (fastest, median, slowest) and the fastest and median as
    ratios to ``accumjax_scan``'s."""
    ref = spread["accumjax_scan"]
    return {
        name: {
            "min_ms": t["min_s"] * 1e3,
            "median_ms": t["median_s"] * 1e3,
            "max_ms": t["max_s"] * 1e3,
            "rounds": t["rounds"],
            "min_vs_scan": t["min_s"] / ref["min_s"],
            "median_vs_scan": t["median_s"] / ref["median_s"],
        }
        for name, t in spread.items()
    }


TIMING_ROUNDS = 41


def sharded_table(kind: str = "explicit", rounds: int = TIMING_ROUNDS) -> dict[str, Any]:
    """Collectives and time per window and per-device memory under ``jit`` on a mesh (see the
    module docstring); ``kind`` is the mesh's axis type ("explicit", ``jax.make_mesh``'s
    default in jax 0.10, or "auto"). Both give the same counts here."""
    n = jax.device_count()
    types = (AxisType.Auto,) if kind == "auto" else (AxisType.Explicit,)
    mesh = jax.make_mesh((n,), ("data",), axis_types=types)
    host_params = common.mlp_params(DIMS)
    x, y = common.batch(n * K * PER_DEVICE, DIMS[0], DIMS[-1])
    tx = optax.adam(1e-3)
    rows: dict[str, Any] = {}
    with jax.set_mesh(mesh):
        data = NamedSharding(mesh, PartitionSpec("data"))
        window = jax.device_put({"x": x, "y": y}, data)
        rows_per_call = n * PER_DEVICE
        micros = [
            jax.device_put(
                {
                    "x": x[i * rows_per_call : (i + 1) * rows_per_call],
                    "y": y[i * rows_per_call : (i + 1) * rows_per_call],
                },
                data,
            )
            for i in range(K)
        ]
        micro = micros[0]
        stacked = jax.device_put(
            {"x": x.reshape(K, -1, x.shape[1]), "y": y.reshape(K, -1)},
            NamedSharding(mesh, PartitionSpec(None, "data")),
        )
        for layout in ("replicated", "fsdp"):
            fsdp = layout == "fsdp"
            params = {
                k: jax.device_put(v, NamedSharding(mesh, _param_spec(v, fsdp)))
                for k, v in host_params.items()
            }
            acc_tx = accumjax.accumulate(tx, K)
            ms_tx = optax.MultiSteps(tx, every_k_schedule=K)
            scan = accumjax.make_train_step(_loss, mode="scan", donate=False)
            stream = accumjax.make_train_step(_loss, mode="stream", donate=False)
            scan_state = scan.init(params, acc_tx)  # no accumulator
            # On mesh parameters, one partial sum per data shard (a DeviceWindow).
            stream_state = stream.init(params, acc_tx)
            assert isinstance(stream_state.opt_state.window, DeviceWindow)
            acc_step = _per_microbatch_step(acc_tx)
            ms_step = _per_microbatch_step(ms_tx)
            naive = _naive_scan(tx)
            acc_carry = (params, acc_tx.init(params))
            ms_carry = (params, ms_tx.init(params))
            naive_carry = (params, tx.init(params))
            # name: (compiled, calls per window, window function, its first carry)
            cases = {
                "accumjax_scan": (
                    scan.lower(scan_state, window).compile(),
                    1,
                    lambda s, _scan=scan: _scan(s, window)[0],
                    scan_state,
                ),
                "accumjax_stream": (
                    stream.lower(stream_state, micro).compile(),
                    K,
                    _window_of(lambda s, mb, _stream=stream: _stream(s, mb)[0], micros),
                    stream_state,
                ),
                "accumjax_stream_jit": (
                    acc_step.lower(*acc_carry, micro).compile(),
                    K,
                    _window_of(lambda c, mb, _f=acc_step: _f(*c, mb), micros),
                    acc_carry,
                ),
                "multisteps_jit": (
                    ms_step.lower(*ms_carry, micro).compile(),
                    K,
                    _window_of(lambda c, mb, _f=ms_step: _f(*c, mb), micros),
                    ms_carry,
                ),
                "naive_scan": (
                    naive.lower(*naive_carry, stacked).compile(),
                    1,
                    lambda c, _f=naive: _f(*c, stacked),
                    naive_carry,
                ),
            }
            spread = common.time_interleaved_spread(
                {name: (fn, carry) for name, (_, _, fn, carry) in cases.items()}, rounds=rounds
            )
            times = _times(spread)
            rows[layout] = {}
            for name, (c, calls, _, _) in cases.items():
                per_call = _call_counts(c)
                # Each call of a K-call window but the last skips the at-most-once close.
                per_window = _window_counts(per_call, calls)
                rows[layout][name] = {
                    "calls_per_window": calls,
                    "per_window": per_window,
                    "per_window_gradient_sized": _window_counts(
                        _call_counts(c, GRADIENT_BYTES), calls
                    ),
                    "per_call_executed": per_call,
                    "per_call_in_program": {
                        op: accumjax.collectives.count_collectives(c)[op] for op in OPS
                    },
                    "memory_per_device": _memory(c),
                    "time_per_window": times[name],
                }
    return {
        "mesh_axis_type": kind,
        "devices": n,
        "backend": jax.default_backend(),
        "K": K,
        "dims": list(DIMS),
        "per_device_rows": PER_DEVICE,
        "gradient_bytes": GRADIENT_BYTES,
        **rows,
    }


GATHER_DIMS = (256, 1024, 1024, 64)  # 1.4M parameters, batch 512


def gather_params_memory() -> dict[str, Any]:
    """FSDP scan mode on 8 devices: per-device temp MiB with ``gather_params="window"`` (one
    all-gather per window) and ``"microbatch"`` (one per microbatch), and whether the two give
    the same parameters bit for bit."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
    host_params = common.mlp_params(GATHER_DIMS)
    x, y = common.batch(512, GATHER_DIMS[0], GATHER_DIMS[-1])
    out: dict[str, Any] = {"dims": list(GATHER_DIMS), "batch": 512, "K": K}
    new_params = {}
    with jax.set_mesh(mesh):
        params = {
            k: jax.device_put(v, NamedSharding(mesh, _param_spec(v, True)))
            for k, v in host_params.items()
        }
        batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, PartitionSpec("data")))
        for gather in ("window", "microbatch"):
            step = accumjax.make_train_step(_loss, mode="scan", gather_params=gather, donate=False)
            state = step.init(params, accumjax.accumulate(optax.adam(1e-3), K))
            compiled = step.lower(state, batch).compile()
            out[f"temp_mib_{gather}"] = compiled.memory_analysis().temp_size_in_bytes / common.MiB
            new_params[gather] = step(state, batch)[0].params
    out["bit_identical"] = all(
        bool(jnp.all(new_params["window"][k] == new_params["microbatch"][k])) for k in params
    )
    return out


def run() -> dict[str, Any]:
    assert jax.device_count() == 8, (
        f"{jax.device_count()} {jax.default_backend()} devices; the benchmark needs 8 "
        "(without ACCUMJAX_BENCH_DEVICES=native it forces 8 host CPU devices)"
    )
    mesh = Mesh(jax.devices(), ("data",))
    params = common.mlp_params(DIMS)
    x, y = common.batch(8 * K * PER_DEVICE, DIMS[0], DIMS[-1])
    batch = {"x": x, "y": y}
    tx = optax.adam(1e-3)
    ours = accumjax.make_train_step(_loss, mode="scan", mesh=mesh, axis_name="data", donate=False)
    state = ours.init(params, accumjax.accumulate(tx, K))  # scan mode reads K from the optimizer
    naive = _naive_step(mesh, tx)
    ours_hlo = ours.lower(state, batch).compile()
    naive_hlo = naive.lower(params, tx.init(params), batch).compile()
    count = functools.partial(accumjax.collectives.count_collectives)
    return {
        "devices": jax.device_count(),
        "K": K,
        "accumjax_scan": {
            "in_program": count(ours_hlo)["all-reduce"],
            "per_window": count(ours_hlo, per_execution=True)["all-reduce"],
        },
        "naive_pmean_per_microbatch": {
            "in_program": count(naive_hlo)["all-reduce"],
            "per_window": count(naive_hlo, per_execution=True)["all-reduce"],
        },
        "sharded": sharded_table(),
        "gather_params": gather_params_memory(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
