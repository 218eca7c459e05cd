"""Memory and time of gradient accumulation on a decoder-only transformer LM, against K.

Variants, for each K (microbatches per update) at one fixed global batch:

* ``full_batch``: one plain jitted step on the whole batch (K-independent; the reference).
* ``accumjax_scan``: ``accumjax.make_train_step(mode="scan")``: one call per window.
* ``accumjax_scan_remat``: the same with ``nn.remat`` around every transformer block.
* ``accumjax_scan_propagate`` (memory only, not timed): the scan step of
  ``accumulate(adam, K, on_nonfinite="propagate")``, which has no non-finite re-run path.
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

Besides temp, every variant's arguments are recorded (``argument_size_in_bytes``, with
``output_size_in_bytes`` and ``alias_size_in_bytes``, all from the same ``memory_analysis()``)
with the bytes of what they are made of: the parameters, the optimizer state the variant
carries and the batch (from the arrays). The whole footprint of a step is arguments + temp:
every variant donates its state (params and optimizer state, not the batch), so its outputs
alias the donated arguments (``output - alias`` is a few bytes of metrics). The scan variants
take a scan-mode state (the scan step's ``step.init(params, tx)``: no accumulator), so their
arguments are those of the full-batch step; the stream variants carry their accumulator in
the optimizer state (one float32 parameter copy more) and take one microbatch per call.

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
# the variants whose footprint (arguments, outputs, optimizer state) is recorded: the timed
# ones and the propagate scan step (memory only)
MEMORY_VARIANTS = (*VARIANTS[:3], "accumjax_scan_propagate", *VARIANTS[3:])


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


def _tree_bytes(tree: Any) -> int:
    """Bytes of a pytree's leaves (arrays or ``jax.ShapeDtypeStruct``s; ``None`` holds none)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _scan_state(step, params, tx):
    """A concrete scan-mode state (no accumulator), as a user of the scan step builds it."""
    state = step.init(params, tx)
    assert state.opt_state.window.grad_sum is None, "a scan-mode state holds no accumulator"
    return state


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
    """``{variant: (compiled_step, timed_fn, carry)}`` at K (``carry``: the state argument)."""
    loss, loss_remat = _loss_fn(_model(size)), _loss_fn(_model(size, remat=True))
    carry = (params, _tx().init(params))
    micro = _split(batch, k)
    out: dict[str, tuple[Any, Any, Any]] = {}
    out["full_batch"] = (full_batch, lambda c: full_batch(c, batch), carry)
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=_tx())  # type: ignore[arg-type]
    for name, fn in (("accumjax_scan", loss), ("accumjax_scan_remat", loss_remat)):
        step, state_k = scan_step_for_k(fn, state, k)
        state_k = _scan_state(step, params, state_k.tx)  # concrete, to run
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
        stream_carry = (params, tx.init(params))  # the accumulator lives here
        compiled = _plain_step(loss, tx).lower(stream_carry, micro[0]).compile()
        out[name] = (compiled, _window(compiled, micro), stream_carry)
    return out


def _propagate_case(size, params, batch, k):
    """``(compiled_step, state)`` of the scan step with ``on_nonfinite="propagate"`` (no
    non-finite re-run path): memory only, not timed."""
    tx = accumjax.accumulate(_tx(), k, on_nonfinite="propagate")
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=tx)  # type: ignore[arg-type]
    step, state = scan_step_for_k(_loss_fn(_model(size)), state, k)
    state = _scan_state(step, params, state.tx)
    return step.lower(state, batch).compile(), state


def _opt_state(carry: Any) -> Any:
    """The optimizer state in a variant's state argument (a train state or a tuple)."""
    return carry.opt_state if isinstance(carry, accumjax.TrainState) else carry[1]


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
    # footprint, per variant (MEMORY_VARIANTS) and K: MiB from memory_analysis() and the
    # optimizer state's MiB from its arrays
    mem: dict[str, dict[str, list[float]]] = {
        f: {v: [] for v in MEMORY_VARIANTS}
        for f in ("argument_mib", "output_mib", "alias_mib", "temp_mib", "opt_state_mib")
    }
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
        memory_cases = {n: (c, carry) for n, (c, _, carry) in cases.items()}
        memory_cases["accumjax_scan_propagate"] = _propagate_case(cfg, params, batch, k)
        for name, (compiled, carry) in memory_cases.items():
            m = compiled.memory_analysis()
            mem["argument_mib"][name].append(_mib(m.argument_size_in_bytes))
            mem["output_mib"][name].append(_mib(m.output_size_in_bytes))
            mem["alias_mib"][name].append(_mib(m.alias_size_in_bytes))
            mem["temp_mib"][name].append(_mib(m.temp_size_in_bytes))
            mem["opt_state_mib"][name].append(_mib(_tree_bytes(_opt_state(carry))))
        propagate.append(mem["temp_mib"]["accumjax_scan_propagate"][-1])
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
    del mem["temp_mib"]  # temp_mib (VARIANTS) and scan_propagate_temp_mib hold it
    micro_rows = [cfg["batch"] // k for k in ks]
    return _summarise(cfg, params, ks, temp, total, ms, floor, floor_stream, grad_temp) | {
        "scan_propagate_temp_mib": propagate,
        **mem,
        # measured: XLA aliases outputs to donated arguments (every variant donates its state,
        # ``donate_argnums=0`` or ``make_train_step``'s ``donate=True``; never the batch)
        "donates": {v: all(a > 0 for a in mem["alias_mib"][v]) for v in MEMORY_VARIANTS},
        "footprint_parts_mib": {
            "params": _mib(_tree_bytes(params)),
            "adam_state": _mib(_tree_bytes(_tx().init(params))),
            "batch": _mib(_tree_bytes(batch)),
            # the stream variants' argument: one microbatch of B/K rows
            "microbatch": [_mib(_tree_bytes(batch)) * r / cfg["batch"] for r in micro_rows],
        },
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
    if "argument_mib" in r:  # recorded since the footprint was (older results lack it)
        for v in MEMORY_VARIANTS:
            row(f"argument MiB: {v}", r["argument_mib"][v])
        for v in MEMORY_VARIANTS:
            row(f"optimizer state MiB: {v}", r["opt_state_mib"][v])
        parts = r["footprint_parts_mib"]
        row("microbatch MiB (a stream variant's batch argument)", parts["microbatch"], "{:.3f}")
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
    if "footprint_parts_mib" in r:
        parts = r["footprint_parts_mib"]
        donors = [v for v in MEMORY_VARIANTS if r["donates"].get(v)]
        lines.append(
            f"\nparams {parts['params']:.2f} MiB, Adam state {parts['adam_state']:.2f} MiB, "
            f"batch {parts['batch']:.3f} MiB; footprint = arguments + temp (outputs alias the "
            f"donated state: {', '.join(donors) or 'none'})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--no-timing", action="store_true", help="memory only (compile, no run)")
    parser.add_argument(
        "--ks",
        type=lambda s: tuple(int(k) for k in s.split(",")),
        default=KS,
        help="comma-separated Ks (default: %(default)s)",
    )
    args = parser.parse_args()
    result = run(args.size, ks=args.ks, timing=not args.no_timing)
    print(json.dumps(result, indent=2))
    print(table(result))
