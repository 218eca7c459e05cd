"""Collectives per accumulation window, replicated data parallel and FSDP, on 8 devices.

Runs on 8 host CPU devices (set before JAX starts, so run it as its own process). The figures
come from the compiled HLO (``accumjax.count_collectives``): instructions in the program and
instructions executed per step (loop bodies times their trip count).

1. accumjax scan mode with ``mesh=``/``axis_name=`` (``shard_map``) against a naive
   ``shard_map`` whose scan ``pmean``s every microbatch gradient (all-reduces only).
2. ``sharded``: plain ``jit`` on arrays sharded over a ``jax.make_mesh`` mesh (no
   ``shard_map`` written by the user), parameters replicated (``P()``) or FSDP-sharded
   (``P("data", None)``), batch ``P("data")``: all-reduce / reduce-scatter / all-gather per
   window and per-device memory (argument + output + temp, ``memory_analysis``) for accumjax
   scan mode, ``accumjax.accumulate`` and ``optax.MultiSteps`` in a jitted per-microbatch step
   (K calls: the per-call counts times K; memory is one call's), and a jitted ``lax.scan``
   that sums ``jax.grad`` over the microbatches (XLA reduces each microbatch's gradient).
"""

from __future__ import annotations

import os

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
    """Per-device argument, output and temp memory of a compiled SPMD program, in MiB."""
    m = compiled.memory_analysis()
    parts = {
        "argument_mib": m.argument_size_in_bytes / common.MiB,
        "output_mib": m.output_size_in_bytes / common.MiB,
        "temp_mib": m.temp_size_in_bytes / common.MiB,
    }
    return {**parts, "total_mib": sum(parts.values())}


def _counts(compiled: Any, calls: int = 1) -> dict[str, int]:
    """Collectives executed per window: per call (a conditional's costliest branch, an unknown
    loop once) times the calls a window takes."""
    c = accumjax.count_collectives(compiled, per_execution=True, default_trip_count=1)
    return {op: c[op] * calls for op in OPS}


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


def sharded_table(kind: str = "explicit") -> dict[str, Any]:
    """Collectives per window and per-device memory under ``jit`` on a mesh (see the module
    docstring); ``kind`` is the mesh's axis type ("explicit", ``jax.make_mesh``'s default in
    jax 0.10, or "auto"). Both give the same counts here."""
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
        micro = jax.device_put({"x": x[: n * PER_DEVICE], "y": y[: n * PER_DEVICE]}, data)
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
            state = accumjax.TrainState.create(
                apply_fn=None,  # type: ignore[arg-type]
                params=params,
                tx=accumjax.accumulate(tx, K),
            )
            scan = accumjax.make_train_step(_loss, mode="scan", donate=False)
            acc_tx = accumjax.accumulate(tx, K)
            ms_tx = optax.MultiSteps(tx, every_k_schedule=K)
            compiled = {
                "accumjax_scan": (scan.lower(state, window).compile(), 1),  # type: ignore[attr-defined]
                "accumjax_stream_jit": (
                    _per_microbatch_step(acc_tx)
                    .lower(params, acc_tx.init(params), micro)
                    .compile(),
                    K,
                ),
                "multisteps_jit": (
                    _per_microbatch_step(ms_tx).lower(params, ms_tx.init(params), micro).compile(),
                    K,
                ),
                "naive_scan": (
                    _naive_scan(tx).lower(params, tx.init(params), stacked).compile(),
                    1,
                ),
            }
            rows[layout] = {
                name: {
                    "calls_per_window": calls,
                    "per_window": _counts(c, calls),
                    "per_call_in_program": {op: accumjax.count_collectives(c)[op] for op in OPS},
                    "memory_per_device": _memory(c),
                }
                for name, (c, calls) in compiled.items()
            }
    return {"mesh_axis_type": kind, "devices": n, "K": K, "dims": list(DIMS), **rows}


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
            state = accumjax.TrainState.create(
                apply_fn=None,  # type: ignore[arg-type]
                params=params,
                tx=accumjax.accumulate(optax.adam(1e-3), K),
            )
            step = accumjax.make_train_step(_loss, mode="scan", gather_params=gather, donate=False)
            compiled = step.lower(state, batch).compile()  # type: ignore[attr-defined]
            out[f"temp_mib_{gather}"] = compiled.memory_analysis().temp_size_in_bytes / common.MiB
            new_params[gather] = step(state, batch)[0].params
    out["bit_identical"] = all(
        bool(jnp.all(new_params["window"][k] == new_params["microbatch"][k])) for k in params
    )
    return out


def run() -> dict[str, Any]:
    assert jax.device_count() == 8, jax.device_count()
    mesh = Mesh(jax.devices(), ("data",))
    params = common.mlp_params(DIMS)
    x, y = common.batch(8 * K * PER_DEVICE, DIMS[0], DIMS[-1])
    batch = {"x": x, "y": y}
    tx = optax.adam(1e-3)
    state = accumjax.TrainState.create(
        apply_fn=None,  # type: ignore[arg-type]
        params=params,
        tx=accumjax.accumulate(tx, K),  # scan mode reads K from the optimizer
    )
    ours = accumjax.make_train_step(_loss, mode="scan", mesh=mesh, axis_name="data", donate=False)
    naive = _naive_step(mesh, tx)
    ours_hlo = ours.lower(state, batch, None).compile()  # type: ignore[attr-defined]
    naive_hlo = naive.lower(params, tx.init(params), batch).compile()
    count = functools.partial(accumjax.count_collectives)
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
