"""All-reduces per accumulation window: accumjax scan mode against a naive per-microbatch pmean.

Runs on 8 host CPU devices (set before JAX starts, so run it as its own process). The figures
come from the compiled HLO (``accumjax.count_collectives``): instructions in the program and
instructions executed per step (loop bodies times their trip count).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import functools
from typing import Any

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

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
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
