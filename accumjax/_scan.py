"""Scan mode's window (internal): the K microbatches of one batch, one update.

`scan_step` splits the batch (`accumjax._split`: strided rows along each leaf's batch axis)
and runs the window loop (`window_loop`) over the microbatches with the window core of
`accumjax._loop`, then closes the window once (`scan_finish`). With a runtime number of real
microbatches (``num_real_microbatches``) the loops stop after them: the padded tail is neither
computed nor counted, without a recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from accumjax import window as window_lib
from accumjax._loop import (
    Carry,
    Context,
    Fields,
    Outcome,
    Setup,
    Step,
    begin,
    close_fields,
    finish,
    gradient,
    microbatch,
    pvary,
    start_carry,
)
from accumjax._split import rows_in_order, split
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = ["real_microbatches", "scan_finish", "scan_step", "window_loop", "window_loss"]

Take = Callable[[jax.Array], tuple[Any, Any]]  # microbatch index -> (params, rows)


def real_microbatches(n: Any, k: int) -> jax.Array | None:
    """``num_real_microbatches`` as an int32 scalar in ``[0, k]`` (None: all ``k``).

    A Python int outside ``[0, k]`` is refused; a traced value is clipped into it.

    Example:
      >>> real_microbatches(3, 4)
      Array(3, dtype=int32)
    """
    if n is None:
        return None
    if isinstance(n, bool) or not (
        isinstance(n, int) or jnp.issubdtype(jnp.result_type(n), jnp.integer)
    ):
        raise TypeError(f"num_real_microbatches must be an int (or int array), got {n!r}.")
    if jnp.ndim(n) != 0:
        raise ValueError(f"num_real_microbatches must be a scalar, got shape {jnp.shape(n)}.")
    if isinstance(n, int) and not 0 <= n <= k:
        raise ValueError(f"num_real_microbatches must be in [0, K={k}], got {n}.")
    return jnp.clip(jnp.asarray(n, jnp.int32), 0, k)


def _microbatches(ctx: Context, params: Any, batch: Any) -> Take:
    """``i -> (params, rows)`` of microbatch ``i`` (the parameters as its gradient sees them)."""
    rows = split(batch, ctx.k, ctx.setup.batch_axis)
    whole = ctx.setup.materialize or (lambda p, i: p)
    return lambda i: (whole(params, i), rows(i))


def window_loop(ctx: Context, params: Any, start: Carry, batch: Any) -> tuple[Carry, Any]:
    """The window over the K strided microbatches of ``batch``: ``(carry, stacked aux)``.

    Scan mode holds the whole window's data, so when the policy only looks for non-finite
    values it need not inspect every microbatch: the gradients are added as they come (each
    leaf's add follows its gradient, with no norm pass and no wait for the other leaves),
    and only a window whose sum is not finite (a NaN/Inf or overflowed microbatch: any of
    them makes the sum non-finite) is computed again. The re-run takes the per-microbatch
    decisions in a first loop (`_decisions`) and adds with them in a second, so it holds no
    more memory than the blind loop. The result is the same as inspecting every microbatch
    (short of microbatches whose float32 norms overflow while their values cancel in the sum).
    """
    policy = ctx.config.policy
    take = _microbatches(ctx, params, batch)
    inspects = policy.skip_fn is not None or policy.max_norm is not None
    # At K=1 a re-run would compute the whole batch again; the one check costs a norm pass.
    if not policy.detects or inspects or ctx.k == 1:
        return _ordered(ctx, _microbatch_loop(ctx, take, start))
    blind_policy = policy._replace(on_nonfinite="propagate")
    blind = ctx._replace(config=ctx.config._replace(policy=blind_policy))
    found = _microbatch_loop(blind, take, start)
    finite = jnp.isfinite(window_lib.global_norm(found[0].window.grad_sum))

    def inspect_each(_: Any) -> tuple[Carry, Any]:
        return _microbatch_loop(ctx, take, start, _decisions(ctx, take, start))

    return _ordered(ctx, window_lib.run_once(~finite, inspect_each, found))


def _ordered(ctx: Context, result: tuple[Carry, Any]) -> tuple[Carry, Any]:
    carry, aux = result
    if aux is not None and ctx.setup.aux_rows:
        aux = rows_in_order(aux)
    return carry, aux


def _decisions(ctx: Context, take: Take, start: Carry) -> window_lib.Microbatch:
    """The policy's decision about each of the K microbatches (stacked), nothing added.

    Each gradient only feeds reductions, so one leaf of it is alive at a time; the model state
    follows the decisions as in `accumjax._loop.microbatch`.
    """

    def decide(model_state: Any, i: jax.Array) -> tuple[Any, window_lib.Microbatch]:
        p, mb = take(i)
        _, new_model_state, _, grads, weight = gradient(ctx, p, model_state, mb, i)
        decided = window_lib.inspect_microbatch(ctx.config.policy, grads, weight, p)
        if model_state is not None:
            model_state = optax.tree.where(decided.added, new_model_state, model_state)
        return model_state, decided

    return _loop_over(ctx, decide, start.model_state)[1]


def _loop_over(
    ctx: Context, body: Callable[[Any, jax.Array], tuple[Any, Any]], init: Any
) -> tuple[Any, Any]:
    """``lax.scan(body, init, arange(K))``, or, with ``ctx.n_real``, a loop that stops after
    the real microbatches and stacks their outputs into K slots (zeros in the padded ones)."""
    if ctx.n_real is None:
        return jax.lax.scan(body, init, jnp.arange(ctx.k), unroll=ctx.setup.unroll)
    shapes = jax.eval_shape(body, init, jnp.zeros((), jnp.int32))[1]
    stacked = jax.tree.map(lambda s: jnp.zeros((ctx.k, *s.shape), s.dtype), shapes)

    def step(i: jax.Array, val: tuple[Any, Any]) -> tuple[Any, Any]:
        carry, ys = body(val[0], i)
        return carry, jax.tree.map(lambda buf, y: buf.at[i].set(y), val[1], ys)

    return jax.lax.fori_loop(0, ctx.n_real, step, (init, stacked))


def _microbatch_loop(
    ctx: Context, take: Take, start: Carry, decided: window_lib.Microbatch | None = None
) -> tuple[Carry, Any]:
    """One microbatch opens the window when K is 1 (no loop, no zeros); otherwise a
    ``lax.scan`` adds all K to a zero accumulator (with the ``decided`` decisions, if given:
    K > 1 only, `window_loop` never re-runs a one-microbatch window).

    Every microbatch runs in the same loop body: computed outside the loop, the first one's
    activations are not shared with the loop's, and at K=2 (where XLA inlines a one-trip
    loop) both microbatches' activations are alive at once.
    """
    if ctx.k == 1 and ctx.n_real is None:
        p, mb = take(jnp.zeros((), jnp.int32))
        outcome = microbatch(ctx, start, p, mb, 0, first=True)
        aux = outcome.aux
        return outcome.carry, None if aux is None else jax.tree.map(lambda a: a[None], aux)

    def body(carry: Carry, i: jax.Array) -> tuple[Carry, Any]:
        inspected = None if decided is None else jax.tree.map(lambda d: d[i], decided)
        p, mb = take(i)
        outcome = microbatch(ctx, carry, p, mb, i, inspected=inspected)
        return outcome.carry, outcome.aux

    start = pvary(start._replace(window=window_lib.empty_like(start.window)), ctx.setup.axis_name)
    return _loop_over(ctx, body, start)


def window_loss(carry: Carry) -> jax.Array:
    """The window's weighted mean loss over its added microbatches (NaN if none was)."""
    return jnp.where(carry.loss_weight > 0, carry.loss_sum / carry.loss_weight, jnp.nan)


def window_k(ctx: Context) -> Any:
    """The K the window is closed with: the real microbatches' number, or the optimizer's."""
    return ctx.k if ctx.n_real is None else ctx.n_real


def scan_finish(
    ctx: Context,
    state: TrainState,
    acc: AccumulationState,
    outcome: Outcome,
    closed: window_lib.Closed | None = None,
) -> tuple[TrainState, dict]:
    """Closes a scan-mode window (unless ``closed`` already) and builds the new state."""
    carry = outcome.carry
    opt = acc._replace(window=carry.window, updated=jnp.zeros((), bool))
    if ctx.n_real is not None:  # "mean" divides by the real microbatches
        opt = opt._replace(every_k=ctx.n_real)
    fields = close_fields(ctx, Fields(state.params, opt, carry.model_state, ctx.loss_scale), closed)
    # The state's own (stream) window is handed back untouched: its buffer is donated to
    # the output instead of a fresh zero accumulator being allocated every step.
    updated = fields.opt.updated
    fields = fields._replace(opt=fields.opt._replace(window=acc.window, added=updated))
    if state.model_state is not None:  # a skipped window leaves all model state as it was
        kept = optax.tree.where(fields.opt.updated, fields.model_state, state.model_state)
        fields = fields._replace(model_state=kept)
    return finish(ctx, state, fields, outcome)


def scan_step(setup: Setup) -> Step:
    """``step(state, batch, rng=None, num_real_microbatches=None)``: the whole batch per call,
    K strided microbatches (the first ``num_real_microbatches`` of them, when given)."""

    def step(
        state: TrainState, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> tuple[TrainState, dict]:
        ctx, acc = begin(setup, state, rng)
        ctx = ctx._replace(n_real=real_microbatches(num_real_microbatches, ctx.k))
        params = pvary(state.params, setup.axis_name)
        carry, aux = window_loop(ctx, params, start_carry(state, acc), batch)
        return scan_finish(ctx, state, acc, Outcome(carry, window_loss(carry), aux))

    return step
