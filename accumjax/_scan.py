"""Scan mode's window (internal): the K microbatches of one batch, one update.

`scan_step` splits the batch (`accumjax._split`: strided rows along each leaf's batch axis)
and runs the window loop (`window_loop`) over the microbatches with the window core of
`accumjax._loop`, then closes the window once (`scan_finish`). With a runtime number of real
microbatches (``num_real_microbatches``) the loops stop after them: the padded tail is neither
computed nor counted, without a recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from accumjax import window as window_lib
from accumjax._loop import (
    Carry,
    Context,
    Fields,
    Outcome,
    Setup,
    Step,
    add_gradient,
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
    values it need not decide about every microbatch before adding it: the gradients are
    added as they come (each leaf's add follows its gradient, with no wait for the other
    leaves), and only a window whose sum is not finite (a NaN/Inf or overflowed microbatch:
    any of them makes the sum non-finite) is computed again (`_passes`). The result is the
    same as inspecting every microbatch (short of microbatches whose float32 norms overflow
    while their values cancel in the sum).

    A microbatch that gathers its parameters (``gather_params="microbatch"``) runs
    collectives, so every device must compute the same microbatches: there each one is
    inspected as it comes, since a re-run decided on one device's rows would leave the other
    devices waiting in the gather.
    """
    policy = ctx.config.policy
    take = _microbatches(ctx, params, batch)
    inspects = policy.skip_fn is not None or policy.max_norm is not None
    gathers = ctx.setup.materialize is not None
    # At K=1 a re-run would compute the whole batch again; the one check costs a norm pass.
    if not policy.detects or inspects or gathers or ctx.k == 1:
        return _ordered(ctx, _microbatch_loop(ctx, take, start))
    return _ordered(ctx, _passes(ctx, take, start))


def _ordered(ctx: Context, result: tuple[Carry, Any]) -> tuple[Carry, Any]:
    carry, aux = result
    if aux is not None and ctx.setup.aux_rows:
        aux = rows_in_order(aux)
    return carry, aux


# The passes of `_passes` over a window's microbatches, in order.
BLIND, INSPECT, ADD, DONE = 0, 1, 2, 3


class _Passes(NamedTuple):
    """Where `_passes` stands after a pass (its outer loop's carry)."""

    stage: jax.Array  # the next pass: BLIND, INSPECT, ADD or DONE
    j: jax.Array  # INSPECT: the microbatch the next pass decides about
    carry: Carry  # the last pass's window and model state (INSPECT: the decisions' state)
    ys: Any  # the aux of every microbatch as last computed for itself, stacked
    added: jax.Array  # INSPECT's decision about every microbatch: bool[K]
    nonfinite: jax.Array  # how many microbatches INSPECT found non-finite
    norm: jax.Array  # the global norm of the last pass's sum


class _Plan(NamedTuple):
    """What one pass does with each of the K microbatches (traced values)."""

    use: jax.Array  # bool[K]: its gradient goes into the pass's sum, its model state is kept
    unit: jax.Array  # its gradient goes in unweighted (INSPECT: the decision reads it alone)
    count_nonfinite: jax.Array  # its invalid weight counts as non-finite (not in ADD)


def _passes(ctx: Context, take: Take, start: Carry) -> tuple[Carry, Any]:
    """The window in passes that each run the K microbatches in one loop of K trips (a known
    trip count: no data-dependent control flow per microbatch): ``(carry, stacked aux)``.

    BLIND adds every gradient blindly; its sum's one norm decides. Only when it is not
    finite, INSPECT decides about each microbatch alone, one pass per microbatch (the
    others' gradients are computed and left out), the model state following the decisions;
    then ADD adds the accepted microbatches (the skipped ones only counted; none accepted,
    it leaves the window empty). The passes run in one data-dependent loop over passes (one
    trip for a finite window), so the model's gradient is traced and compiled once; no pass
    holds more memory than BLIND. Every pass starts from an empty window made inside the
    loop, so the loop carries only the last pass's window. Unrolled, BLIND is a loop of its
    own outside (XLA:CPU runs convolutions far slower in a loop).
    """
    axis = ctx.setup.axis_name
    start = _empty(ctx, start)
    zero = pvary(jnp.zeros((), jnp.int32), axis)
    run = jax.jit(partial(_microbatch, ctx, take))
    plan = _plan(BLIND, zero, jnp.zeros((ctx.k,), bool))
    ys = _zeros((ctx.k,), jax.eval_shape(run, plan, zero, start)[1], axis)  # the aux
    norm = pvary(jnp.zeros((), jnp.float32), axis)
    stage = jnp.where(window_k(ctx) > 0, BLIND, DONE).astype(jnp.int32) + zero
    added = pvary(jnp.zeros((ctx.k,), bool), axis)
    at = _Passes(stage, zero, start, ys, added, zero, norm)
    unroll = ctx.setup.unroll
    model_state = start.model_state
    if ctx.n_real is None and (unroll is True or unroll > 1):  # BLIND unrolled, outside
        at = _next(ctx, run, model_state, at, unroll)
    at = jax.lax.while_loop(lambda at: at.stage != DONE, partial(_next, ctx, run, model_state), at)
    return at.carry._replace(sum_norm=at.norm), at.ys


def _empty(ctx: Context, like: Carry, model_state: Any = None) -> Carry:
    """An empty window shaped like ``like``'s (made from its shapes alone: inside a loop it
    is not a loop input), no loss yet, on ``model_state`` (default: ``like``'s)."""
    zero = jnp.zeros((), jnp.float32)
    state = like.model_state if model_state is None else model_state
    carry = Carry(window_lib.empty_like(like.window), state, zero, zero)
    return pvary(carry, ctx.setup.axis_name)


def _zeros(lead: tuple[int, ...], shapes: Any, axis_name: str | None) -> Any:
    """Device-varying zeros shaped ``lead + shape`` for each of the ``shapes``."""
    zeros = lambda s: jnp.zeros((*lead, *s.shape), s.dtype)
    return pvary(jax.tree.map(zeros, shapes), axis_name)


def _plan(stage: jax.Array | int, j: jax.Array, added: jax.Array) -> _Plan:
    """The `_Plan` of a pass of ``stage``: BLIND every microbatch, INSPECT microbatch ``j``
    alone (unweighted), ADD the ``added`` ones."""
    stage = jnp.asarray(stage, jnp.int32)  # not weakly typed: one trace of the pass
    index = np.arange(added.shape[0], dtype=np.int32)  # a constant, not a kernel
    use = jnp.where(stage == INSPECT, index == j, jnp.where(stage == ADD, added, True))
    return _Plan(use, stage == INSPECT, stage != ADD)


def _next(
    ctx: Context, run: Callable[..., Any], model_state: Any, at: _Passes, unroll: Any = 1
) -> _Passes:
    """One pass over the K microbatches, its sum's norm, and the pass that follows.

    ``model_state`` is the one the window started on; INSPECT runs on the model state of
    its decisions, and ADD starts with INSPECT's non-finite microbatches counted (its trips
    count the skipped ones)."""
    inspect, add = at.stage == INSPECT, at.stage == ADD
    plan = _plan(at.stage, at.j, at.added)
    if model_state is not None:
        threaded = inspect & (at.j > 0)
        model_state = optax.tree.where(threaded, at.carry.model_state, model_state)
    first = _empty(ctx, at.carry, model_state)
    counted = jnp.where(add, at.nonfinite, first.window.window_nonfinite)
    first = first._replace(window=first.window._replace(window_nonfinite=counted))
    body = lambda carry, i: _unstack(run(plan, i, carry))
    carry, (aux, weight) = _loop_over(ctx, body, first, unroll)
    ys = jax.tree.map(lambda old, new: _rows_where(plan.use, new, old), at.ys, aux)
    norm = window_lib.global_norm(carry.window.grad_sum)  # one pass over the sum, at its end
    # The decision: BLIND's about the sum (weight 1), INSPECT's about microbatch j.
    weight_j = None if weight is None else jnp.where(inspect, weight[at.j], 1.0)
    found = window_lib.inspect_microbatch(
        ctx.config.policy, carry.window.grad_sum, weight_j, norm=norm
    )
    if carry.model_state is not None:  # INSPECT: the model state follows the decision
        kept = ~inspect | found.added
        carry = carry._replace(
            model_state=optax.tree.where(kept, carry.model_state, first.model_state)
        )
    added = jnp.where(inspect, at.added.at[at.j].set(found.added), at.added)
    nonfinite = at.nonfinite + (inspect & found.nonfinite).astype(jnp.int32)
    last = at.j + 1 >= window_k(ctx)
    after_inspect = jnp.where(last, ADD, INSPECT)
    blind = jnp.where(found.nonfinite, INSPECT, DONE)  # BLIND's decision is about the sum
    stage = jnp.where(inspect, after_inspect, jnp.where(add, DONE, blind)).astype(jnp.int32)
    j = jnp.where(inspect, at.j + 1, 0).astype(jnp.int32)
    return _Passes(stage, j, carry, ys, added, nonfinite, norm)


def _unstack(out: tuple[Carry, Any, Any]) -> tuple[Carry, tuple[Any, Any]]:
    carry, aux, weight = out
    return carry, (aux, weight)


def _rows_where(use: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """``new[i]`` where ``use[i]``, else ``old[i]``, along the leading (microbatch) axis."""
    return jnp.where(use.reshape(use.shape + (1,) * (new.ndim - 1)), new, old)


def _microbatch(ctx: Context, take: Take, plan: _Plan, i: jax.Array, carry: Carry) -> Any:
    """Microbatch ``i`` added blindly (as ``"propagate"`` adds it) when the pass uses it:
    ``(carry, aux, weight)``.

    Its model state is kept as `accumjax._loop.microbatch` keeps it; in pass INSPECT its
    gradient is added as it is (unweighted), for the decision on it. Microbatches a pass does
    not use are computed (a loop of K trips has no branch) and left out.
    """
    p, mb = take(i)
    computed = gradient(ctx, p, carry.model_state, mb, i)
    blind = ctx._replace(config=ctx.config._replace(policy=_blind(ctx.config.policy)))
    grads, weight = computed[3], computed[4]
    m = window_lib.inspect_microbatch(blind.config.policy, grads, weight, p)  # reads no gradient
    use = plan.use[i]
    m = m._replace(
        added=m.added & use,
        nonfinite=m.nonfinite & use & plan.count_nonfinite,
        weight=jnp.where(use, m.weight, 0.0),
    )
    if m.factor is not None:
        m = m._replace(factor=jnp.where(plan.unit, 1.0, m.factor))
    outcome = add_gradient(blind, carry, p, computed, inspected=m)
    return outcome.carry, outcome.aux, weight


def _blind(policy: window_lib.Policy) -> window_lib.Policy:
    """The policy that adds every microbatch as it comes, non-finite ones too, unless the
    pass leaves it out: its ``skip_fn`` never skips, but makes the window select rather
    than add (a left-out gradient may be NaN; a select reads no more memory than the add)."""
    return policy._replace(on_nonfinite="propagate", skip_fn=_never)


def _never(grads: Any, params: Any) -> jax.Array:
    """A ``skip_fn`` that skips nothing (reads neither argument)."""
    del grads, params
    return jnp.zeros((), bool)


def _loop_over(
    ctx: Context, body: Callable[[Any, jax.Array], tuple[Any, Any]], init: Any, unroll: Any = None
) -> tuple[Any, Any]:
    """``lax.scan(body, init, arange(K))`` (a loop of known trip count K), or, with
    ``ctx.n_real``, a loop that stops after the real microbatches and stacks their outputs
    into K slots (zeros in the padded ones)."""
    if ctx.n_real is None:
        unroll = ctx.setup.unroll if unroll is None else unroll
        index = jnp.asarray(np.arange(ctx.k, dtype=np.int32))  # a constant, not a kernel
        return jax.lax.scan(body, init, index, unroll=unroll)
    shapes = jax.eval_shape(body, init, jnp.zeros((), jnp.int32))[1]
    stacked = jax.tree.map(lambda s: jnp.zeros((ctx.k, *s.shape), s.dtype), shapes)

    def step(i: jax.Array, val: tuple[Any, Any]) -> tuple[Any, Any]:
        carry, ys = body(val[0], i)
        return carry, jax.tree.map(lambda buf, y: buf.at[i].set(y), val[1], ys)

    first = jnp.zeros((), jnp.int32)  # a strong int32 index: the loop reuses the trace above
    return jax.lax.fori_loop(first, ctx.n_real, step, (init, stacked))


def _microbatch_loop(ctx: Context, take: Take, start: Carry) -> tuple[Carry, Any]:
    """One microbatch opens the window when K is 1 (no loop, no zeros); otherwise a
    ``lax.scan`` adds all K to a zero accumulator.

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
        p, mb = take(i)
        outcome = microbatch(ctx, carry, p, mb, i)
        return outcome.carry, outcome.aux

    return _loop_over(ctx, body, _empty(ctx, start))


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
    # The loop's last norm is the window's own on one device (with an axis, the sum is reduced).
    norm = carry.sum_norm if ctx.config.axis_name is None else None
    fields = Fields(state.params, opt, carry.model_state, ctx.loss_scale)
    fields = close_fields(ctx, fields, closed, norm=norm)
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
