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
    """Where `_passes` stands after a microbatch (its loop carry)."""

    stage: jax.Array  # BLIND, INSPECT, ADD or DONE
    t: jax.Array  # microbatches run in this stage's current segment
    j: jax.Array  # INSPECT: the microbatch inspected next
    carry: Carry  # the current segment's
    ys: Any  # the aux of every microbatch as last computed, stacked
    added: jax.Array  # INSPECT's decision about every microbatch: bool[K]
    nonfinite: jax.Array  # how many microbatches INSPECT found non-finite
    norm: jax.Array  # the global norm of the last finished segment's sum


def _passes(ctx: Context, take: Take, start: Carry) -> tuple[Carry, Any]:
    """The window in passes that all run one jitted microbatch step (`_microbatch`: the model's
    gradient is traced and compiled once): ``(carry, stacked aux)``.

    BLIND adds every gradient blindly. Only when the sum is not finite, INSPECT computes each
    microbatch alone and takes the policy's decision on it (the model state following the
    decisions), then ADD adds the accepted microbatches blindly (the others are not computed).
    One ``lax.while_loop`` runs one microbatch per trip (`_trip`); the passes are segments
    of trips, each from an empty window and closed by one norm of it: no pass holds more
    memory than BLIND, and a finite window costs its K trips and one norm. Unrolled, BLIND is
    a ``lax.scan`` of its own (XLA:CPU runs convolutions far slower in a loop).
    """
    axis = ctx.setup.axis_name
    start = pvary(start._replace(window=window_lib.empty_like(start.window)), axis)
    zero = pvary(jnp.zeros((), jnp.int32), axis)
    run = jax.jit(partial(_microbatch, ctx, take))
    ys = _zeros((ctx.k,), jax.eval_shape(run, zero, zero, start)[1], axis)  # the aux
    norm = pvary(jnp.zeros((), jnp.float32), axis)
    stage = jnp.where(window_k(ctx) > 0, BLIND, DONE).astype(jnp.int32) + zero
    added = pvary(jnp.zeros((ctx.k,), bool), axis)
    at = _Passes(stage, zero, zero, start, ys, added, zero, norm)
    unroll = ctx.setup.unroll
    if ctx.n_real is None and (unroll is True or unroll > 1):
        body = lambda carry, i: run(zero + BLIND, i, carry)[:2]
        carry, ys = jax.lax.scan(body, start, jnp.arange(ctx.k, dtype=jnp.int32), unroll=unroll)
        norm = window_lib.global_norm(carry.window.grad_sum)
        stage = jnp.where(jnp.isfinite(norm), DONE, INSPECT).astype(jnp.int32) + zero
        at = at._replace(stage=stage, carry=carry, ys=ys, norm=norm)
    at = jax.lax.while_loop(lambda at: at.stage != DONE, partial(_trip, ctx, run, start), at)
    # Nothing accepted: ADD never ran, the window is empty but for its counts.
    none = ~jnp.any(at.added) & (at.nonfinite > 0)
    carry = window_lib.run_once(none, lambda _: _first(ctx, start, at, ADD), at.carry)
    return carry._replace(sum_norm=jnp.where(none, 0.0, at.norm)), at.ys


def _zeros(lead: tuple[int, ...], shapes: Any, axis_name: str | None) -> Any:
    """Device-varying zeros shaped ``lead + shape`` for each of the ``shapes``."""
    zeros = lambda s: jnp.zeros((*lead, *s.shape), s.dtype)
    return pvary(jax.tree.map(zeros, shapes), axis_name)


def _first(ctx: Context, start: Carry, at: _Passes, stage: Any) -> Carry:
    """The carry a segment of ``stage`` starts from: an empty window (ADD: the skipped
    microbatches counted) and the model state it runs on (INSPECT: the last one's)."""
    add = stage == ADD
    skipped = jnp.where(add, window_k(ctx) - jnp.sum(at.added, dtype=jnp.int32), 0)
    nonfinite = jnp.where(add, at.nonfinite, 0)
    window = start.window._replace(
        micro_step=skipped, window_nonfinite=nonfinite, window_skipped=skipped
    )
    first = start._replace(window=window)
    if start.model_state is not None:  # INSPECT threads it from one microbatch to the next
        threaded = (stage == INSPECT) & (at.j > 0)
        first = first._replace(
            model_state=optax.tree.where(threaded, at.carry.model_state, start.model_state)
        )
    return first


def _trip(ctx: Context, run: Callable[..., Any], start: Carry, at: _Passes) -> _Passes:
    """One microbatch of the current segment; at the segment's end, its norm and the next stage.

    A segment is the whole of BLIND, one microbatch of INSPECT (decided on the window it
    leaves) or the accepted microbatches of ADD (the skipped ones only counted).
    """
    n = window_k(ctx)
    inspect, add = at.stage == INSPECT, at.stage == ADD
    accepted = jnp.sum(at.added, dtype=jnp.int32)
    # ADD's t-th microbatch: the first whose count of accepted ones up to it exceeds t.
    nth_accepted = jnp.argmax(jnp.cumsum(at.added, dtype=jnp.int32) > at.t).astype(jnp.int32)
    i = jnp.where(inspect, at.j, jnp.where(add, nth_accepted, at.t))
    first = _first(ctx, start, at, at.stage)
    carry = optax.tree.where(at.t == 0, first, at.carry)
    carry, aux, weight = run(at.stage, i, carry)
    ys = jax.tree.map(lambda buf, x: buf.at[i].set(x), at.ys, aux)
    t = at.t + 1
    ends = t == jnp.where(inspect, 1, jnp.where(add, accepted, n))
    grad_sum = carry.window.grad_sum
    # The close's norm, if this segment is the last; taken only where a segment ends.
    norm = jax.lax.cond(ends, window_lib.global_norm, lambda _: at.norm, grad_sum)
    weight = None if weight is None else jnp.where(inspect, weight, 1.0)  # INSPECT: i is j
    found = window_lib.inspect_microbatch(ctx.config.policy, grad_sum, weight, norm=norm)
    if carry.model_state is not None:  # INSPECT: the model state follows the decision
        kept = ~inspect | found.added
        carry = carry._replace(
            model_state=optax.tree.where(kept, carry.model_state, first.model_state)
        )
    added = at.added.at[at.j].set(jnp.where(inspect, found.added, at.added[at.j]))
    nonfinite = at.nonfinite + (inspect & found.nonfinite).astype(jnp.int32)
    last = at.j + 1 >= n
    after_inspect = jnp.where(last, jnp.where(jnp.any(added), ADD, DONE), INSPECT)
    blind = jnp.where(found.nonfinite, INSPECT, DONE)  # BLIND's decision is about the sum
    following = jnp.where(inspect, after_inspect, jnp.where(add, DONE, blind))
    stage = jnp.where(ends, following, at.stage)
    j = jnp.where(inspect, at.j + 1, 0)
    t = jnp.where(ends, 0, t)
    stage, j = stage.astype(jnp.int32), j.astype(jnp.int32)
    return _Passes(stage, t, j, carry, ys, added, nonfinite, norm)


def _microbatch(ctx: Context, take: Take, stage: jax.Array, i: jax.Array, carry: Carry) -> Any:
    """Microbatch ``i`` added blindly (as ``"propagate"`` adds it): ``(carry, aux, weight)``.

    Its model state is kept as `accumjax._loop.microbatch` keeps it; in pass INSPECT its
    gradient is added as it is (unweighted), for the decision on it.
    """
    p, mb = take(i)
    computed = gradient(ctx, p, carry.model_state, mb, i)
    blind = ctx._replace(config=ctx.config._replace(policy=_blind(ctx.config.policy)))
    grads, weight = computed[3], computed[4]
    m = window_lib.inspect_microbatch(blind.config.policy, grads, weight, p)  # reads no gradient
    if m.factor is not None:
        m = m._replace(factor=jnp.where(stage == INSPECT, 1.0, m.factor))
    outcome = add_gradient(blind, carry, p, computed, inspected=m)
    return outcome.carry, outcome.aux, weight


def _blind(policy: window_lib.Policy) -> window_lib.Policy:
    """The policy that adds every microbatch as it comes (non-finite ones too)."""
    return policy._replace(on_nonfinite="propagate")


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
