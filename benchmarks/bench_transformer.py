"""Memory and time of gradient accumulation on a decoder-only transformer LM, against K.

Variants, for each K (microbatches per update) at one fixed global batch:

* ``full_batch``: one plain jitted step on the whole batch (K-independent; the reference).
* ``accumjax_scan``: ``accumjax.make_train_step(mode="scan")``: one call per window.
* ``accumjax_scan_remat``: the same with ``nn.remat`` around every transformer block.
* ``optax_microbatch``: ``optax.microbatch(jax.grad(loss), ..., accumulator=MEAN)`` then Adam.
* ``accumjax_stream``: K calls of a jitted per-microbatch step with
  ``tx=accumjax.accumulate(adam, K)``; its memory is that step's.
* ``multisteps_stream``: the same with ``optax.MultiSteps(adam, K)``.

Memory is XLA's compile-time figure (``compiled.memory_analysis().temp_size_in_bytes``):
deterministic, no run needed. The floor of an accumulation step at K is what any of them
must hold besides its arguments and outputs: one microbatch's activations and gradient
workspace plus the microbatch gradient and the float32 accumulator. It is computed as::

    floor(K) = temp(jit(grad(loss)) on B/K rows) + 2 * param_bytes_f32

(the gradient is that function's *output*, hence not in its temp, but a temporary inside
a step; the accumulator is another parameter-sized float32 buffer). The stream variants
keep their accumulator in the optimizer state (an argument, not temp), so their floor is
``floor(K) - param_bytes_f32``. Remat may go below the floor: the floor assumes the
microbatch's activations are all stored.

Times are the fastest of interleaved rounds, measured side by side per K (see
``common.time_interleaved``); ratios between variants at the same K are the figures to read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax
from accumjax.planner import (
    compiled_memory_bytes,
    scan_step_for_k,  # the one K -> step builder (API switch there)
)
from accumjax.train_state import opt_state_for
from benchmarks import common

KS = (1, 2, 4, 8, 16)
SIZES: dict[str, dict[str, int]] = {
    # ~3.5M params; attention scores and MLP activations dominate memory. "small" is the
    # CPU default (about 9 minutes on 2 idle cores with 6 timing rounds).
    "small": dict(vocab=512, d=256, layers=4, heads=4, mlp=1024, seq=256, batch=16),
    "medium": dict(vocab=512, d=256, layers=4, heads=4, mlp=1024, seq=256, batch=32),
    # for an accelerator (the default with --device gpu)
    "large": dict(vocab=8192, d=512, layers=8, heads=8, mlp=2048, seq=1024, batch=64),
}
VARIANTS = (
    "full_batch",
    "accumjax_scan",
    "accumjax_scan_remat",
    "optax_microbatch",
    "accumjax_stream",
    "multisteps_stream",
)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    d: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.d)(nn.gelu(nn.Dense(self.mlp)(h)))
        return x + h


class LM(nn.Module):
    """Decoder-only LM with learned positions; ``remat`` checkpoints every block."""

    vocab: int
    d: int
    layers: int
    heads: int
    mlp: int
    seq: int
    remat: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))
        x = nn.Embed(self.vocab, self.d)(tokens) + pos[: tokens.shape[1]]
        block = nn.remat(Block) if self.remat else Block
        for i in range(self.layers):
            x = block(self.d, self.heads, self.mlp, name=f"block{i}")(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _model(size: dict[str, int], remat: bool = False) -> LM:
    keys = ("vocab", "d", "layers", "heads", "mlp", "seq")
    return LM(**{k: size[k] for k in keys}, remat=remat)


def _loss_fn(model: LM) -> Callable[[Any, Any], jax.Array]:
    def loss(params: Any, batch: Any) -> jax.Array:
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1])
        labels = tokens[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def _tx() -> optax.GradientTransformation:
    return optax.adam(1e-4)


def _plain_step(loss, tx):
    """A per-(micro)batch step ``(params, opt_state), batch -> (params, opt_state)``."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry, batch):
        params, opt_state = carry
        updates, opt_state = tx.update(jax.grad(loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _mib(nbytes: float) -> float:
    return nbytes / common.MiB


def _split(batch: Any, k: int) -> list[Any]:
    """K microbatches of strided rows (i, i+K, ...), as scan mode takes them."""
    return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def _window(compiled, microbatches):
    def run(carry):
        for mb in microbatches:
            carry = compiled(carry, mb)
        return carry

    return run


def _full_batch_compiled(size, params, batch):
    carry = (params, _tx().init(params))
    return _plain_step(_loss_fn(_model(size)), _tx()).lower(carry, batch).compile()


def _cases_for_k(size, params, batch, k, full_batch):
    """``{variant: (compiled_step, timed_fn, carry)}`` at K."""
    loss, loss_remat = _loss_fn(_model(size)), _loss_fn(_model(size, remat=True))
    carry = (params, _tx().init(params))
    micro = _split(batch, k)
    out: dict[str, tuple[Any, Any, Any]] = {}
    out["full_batch"] = (full_batch, lambda c: full_batch(c, batch), carry)
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=_tx())  # type: ignore[arg-type]
    for name, fn in (("accumjax_scan", loss), ("accumjax_scan_remat", loss_remat)):
        step, state_k = scan_step_for_k(fn, state, k)
        # concrete, to run: the scan-mode optimizer state (no accumulator)
        state_k = state_k.replace(opt_state=opt_state_for(state_k.tx, params, "scan"))
        compiled = step.lower(state_k, batch).compile()
        out[name] = (compiled, lambda s, f=compiled: f(s, batch, None, None)[0], state_k)
    compiled = (
        common.optax_microbatch_step(loss, _tx(), size["batch"] // k).lower(carry, batch).compile()
    )
    out["optax_microbatch"] = (compiled, lambda c, f=compiled: f(c, batch), carry)
    for name, tx in (
        ("accumjax_stream", accumjax.accumulate(_tx(), k)),
        ("multisteps_stream", optax.MultiSteps(_tx(), k)),
    ):
        stream_carry = (params, tx.init(params))
        compiled = _plain_step(loss, tx).lower(stream_carry, micro[0]).compile()
        out[name] = (compiled, _window(compiled, micro), stream_carry)
    return out


def _propagate_temp_bytes(size, params, batch, k) -> int:
    """Temp of the scan step with ``on_nonfinite="propagate"`` (no non-finite re-run path):
    memory only, not timed."""
    tx = accumjax.accumulate(_tx(), k, on_nonfinite="propagate")
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)  # type: ignore[arg-type]
    step, state = scan_step_for_k(_loss_fn(_model(size)), state, k)
    return int(step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes)


def _floor_bytes(size, params, batch, k) -> tuple[int, int]:
    """(temp of a single-microbatch grad function, float32 parameter bytes)."""
    loss = _loss_fn(_model(size))
    micro = _split(batch, k)[0]
    grad_temp = jax.jit(jax.grad(loss)).lower(params, micro).compile().memory_analysis()
    param_bytes = sum(4 * int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return int(grad_temp.temp_size_in_bytes), param_bytes


def _device_memory() -> dict[str, int] | None:
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def run(
    size: str = "small",
    ks: tuple[int, ...] = KS,
    calls: int = 1,
    rounds: int = 6,
    timing: bool = True,
) -> dict[str, Any]:
    """Temp memory and step time of every variant at every K (see the module docstring)."""
    cfg = SIZES[size]
    model = _model(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1)), jnp.int32)
    batch = {"tokens": tokens}
    params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
    temp: dict[str, list[float]] = {v: [] for v in VARIANTS}
    total: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    floor, floor_stream, grad_temp, device_memory, propagate = [], [], [], [], []
    full_batch = _full_batch_compiled(cfg, params, batch)  # K-independent: compiled once
    for k in ks:
        cases = _cases_for_k(cfg, params, batch, k, full_batch)
        for name, (compiled, _, _) in cases.items():
            m = compiled.memory_analysis()
            temp[name].append(_mib(m.temp_size_in_bytes))
            total[name].append(_mib(compiled_memory_bytes(compiled)))
        propagate.append(_mib(_propagate_temp_bytes(cfg, params, batch, k)))
        g, p = _floor_bytes(cfg, params, batch, k)
        grad_temp.append(_mib(g))
        floor.append(_mib(g + 2 * p))
        floor_stream.append(_mib(g + p))
        if timing:
            timed = {name: (fn, carry) for name, (_, fn, carry) in cases.items()}
            seconds = common.time_interleaved(timed, calls=calls, rounds=rounds)
            for name in VARIANTS:
                ms[name].append(seconds[name] * 1e3)
        device_memory.append(_device_memory())
        del cases
    return _summarise(cfg, params, ks, temp, total, ms, floor, floor_stream, grad_temp) | {
        "scan_propagate_temp_mib": propagate,
        "device_memory_after_k": device_memory if any(device_memory) else None,
        "size": size,
        "timing": {"calls": calls, "rounds": rounds} if timing else None,
    }


def _summarise(cfg, params, ks, temp, total, ms, floor, floor_stream, grad_temp):
    def ratio(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b, strict=True)]

    stream = ("accumjax_stream", "multisteps_stream")
    vs_floor = {v: ratio(temp[v], floor_stream if v in stream else floor) for v in VARIANTS}
    out: dict[str, Any] = {
        "model": {**cfg, "params": common.n_params(params)},
        "K": list(ks),
        "temp_mib": temp,
        "total_mib": total,
        "floor_mib": floor,
        "floor_stream_mib": floor_stream,
        "microbatch_grad_temp_mib": grad_temp,
        "temp_vs_floor": vs_floor,
        "temp_vs_optax_microbatch": {v: ratio(temp[v], temp["optax_microbatch"]) for v in temp},
    }
    if ms["full_batch"]:
        out["ms_per_step"] = ms
        out["time_vs_optax_microbatch"] = {v: ratio(ms[v], ms["optax_microbatch"]) for v in ms}
        out["time_vs_full_batch"] = {v: ratio(ms[v], ms["full_batch"]) for v in ms}
    scan, mb = temp["accumjax_scan"], temp["optax_microbatch"]
    targets: dict[str, Any] = {
        "scan_temp_le_optax_microbatch": [a <= b for a, b in zip(scan, mb, strict=True)],
        "scan_temp_within_10pct_of_floor": [r <= 1.10 for r in vs_floor["accumjax_scan"]],
    }
    if ms["full_batch"]:
        targets["scan_time_le_optax_microbatch"] = [
            r <= 1.0 for r in out["time_vs_optax_microbatch"]["accumjax_scan"]
        ]
    out["targets"] = targets
    return out


def table(r: dict[str, Any]) -> str:
    """A markdown table: temp MiB per variant per K, the floor, and time ratios."""
    ks = r["K"]
    head = "| | " + " | ".join(f"K={k}" for k in ks) + " |"
    lines = [head, "|---" * (len(ks) + 1) + "|"]

    def row(label: str, values: list[float], fmt: str = "{:.1f}") -> None:
        lines.append(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |")

    for v in VARIANTS:
        row(f"temp MiB: {v}", r["temp_mib"][v])
    if "scan_propagate_temp_mib" in r:
        row('temp MiB: accumjax_scan, on_nonfinite="propagate"', r["scan_propagate_temp_mib"])
    row("floor MiB (accumulator + microbatch grad + activations)", r["floor_mib"])
    row("floor MiB, stream (accumulator in the state)", r["floor_stream_mib"])
    for v in VARIANTS:
        row(f"temp / floor: {v}", r["temp_vs_floor"][v], "{:.2f}")
    for v in VARIANTS:
        row(f"temp / optax.microbatch: {v}", r["temp_vs_optax_microbatch"][v], "{:.2f}")
    if "ms_per_step" in r:
        for v in VARIANTS:
            row(f"ms per update: {v}", r["ms_per_step"][v], "{:.0f}")
        for v in VARIANTS:
            row(f"time / optax.microbatch: {v}", r["time_vs_optax_microbatch"][v], "{:.2f}")
    for name, met in r["targets"].items():
        lines.append(
            f"| target {name} | " + " | ".join("met" if m else "MISSED" for m in met) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--no-timing", action="store_true", help="memory only (compile, no run)")
    args = parser.parse_args()
    result = run(args.size, timing=not args.no_timing)
    print(json.dumps(result, indent=2))
    print(table(result))
