"""Scan mode's window (internal): the K microbatches of one batch, one update.

`scan_step` splits the batch into strided microbatches, runs them in one loop (`window_loop`),
decides about the window (`decide_window`) and closes and applies it (`scan_finish`). With a
runtime ``num_real_microbatches`` the loop stops after the real ones: the padded tail is
neither computed nor counted, and nothing recompiles.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax._loop as loop_lib
import accumjax._window as window_lib
from accumjax._batch_norm_windows import close_model_state
from accumjax._control import run_once
from accumjax._decision import MicrobatchDecision, sum_decision
from accumjax._layout import window_layouts
from accumjax._loop import (
    Context,
    LoopCarry,
    Outcome,
    Step,
    begin,
    close_fields,
    finish,
    follow_decision,
    loss_mean,
    loss_parts,
    mark_varying,
    run_microbatch,
    start_carry,
)
from accumjax._norms import global_norm
from accumjax._split import rows_in_order, strided_microbatches
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = [
    "Close",
    "Run",
    "accepted_loss",
    "close_pass",
    "real_microbatches",
    "sum_decided",
    "scan_finish",
    "scan_step",
    "decide_added",
    "decide_window",
    "window_every_k",
    "window_loop",
]

Take = Callable[[jax.Array], tuple[Any, Any]]  # microbatch index -> (params, rows)


def real_microbatches(n: Any, every_k: int) -> jax.Array | None:
    """``num_real_microbatches`` as an int32 scalar in ``[0, every_k]`` (None: all
    ``every_k``).

    A Python int outside ``[0, every_k]`` is refused; a traced value is clipped into it.

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
    if isinstance(n, int) and not 0 <= n <= every_k:
        raise ValueError(f"num_real_microbatches must be in [0, K={every_k}], got {n}.")
    return jnp.clip(jnp.asarray(n, jnp.int32), 0, every_k)


def _microbatches(ctx: Context, params: Any, batch: Any) -> Take:
    """``i -> (params, rows)`` of microbatch ``i`` (the parameters as its gradient sees them)."""
    rows = strided_microbatches(batch, ctx.static_every_k, ctx.setup.batch_axis)
    gathered = ctx.materialize or (lambda p, i: p)
    return lambda i: (gathered(params, i), rows(i))


Run = Callable[..., Outcome]  # ``run(gate, over=None)``: the window's microbatches, once


def window_loop(ctx: Context, params: Any, start: LoopCarry, batch: Any) -> Run:
    """``run(gate, over=None)``: the window over the K strided microbatches of ``batch``, in a
    loop of K trips (a known trip count, unless ``num_real_microbatches`` bounds it).

    Each microbatch is added as it comes where ``gate`` (a bool vector decided before; None
    for all) and decided about at the window's end from its decision
    (`Context.adds_before_deciding`), or,
    for a policy that reads the gradient's values, decided as it comes (on a mesh the
    devices agree about each one: `accumjax._decision.inspect_microbatch`). With
    `Context.sum_can_decide` the passes that add read no gradient, and ``over`` (a sum no
    longer needed) gives a pass that adds nothing: each gradient is written over it and read
    there (`sum_decided`). The loop body is traced once, however many times ``run`` is called.
    """
    take = _microbatches(ctx, params, batch)

    def one(
        carry: LoopCarry, i: jax.Array, gate: Any, reading: jax.Array
    ) -> tuple[LoopCarry, Outcome]:
        p, mb = take(i)
        if ctx.sum_can_decide:
            outcome = sum_decided(ctx, carry, p, mb, i, gate, reading)
        else:
            outcome = run_microbatch(ctx, carry, p, mb, i, gate=gate)
        return outcome.carry, _marks(ctx, outcome)

    one = jax.jit(one)

    def run(gate: Any, over: Any = None) -> Outcome:
        begin = start
        if over is not None:
            begin = start._replace(window=start.window._replace(grad_sum=over))
        done = _microbatch_loop(ctx, take, one, begin, gate, over is not None)
        if done.aux is not None and ctx.setup.aux_rows:
            done = done._replace(aux=rows_in_order(done.aux))
        return done

    return run


def sum_decided(
    ctx: Context, carry: LoopCarry, params: Any, batch: Any, index: Any, gate: Any, reading: Any
) -> Outcome:
    """One microbatch of a window its sum decides (`Context.sum_can_decide`): added where
    ``gate`` without its gradient being read (the window's sum is), or, ``reading``, written
    over the carry's sum (not read again) and read there as `accumjax._loop.run_microbatch`
    reads it: found non-finite, it keeps no model state and counts in no loss.

    Only the write is this function's own; the decision is
    `accumjax._decision.sum_decision`'s, the window's counters
    `accumjax._window.count_microbatch`'s, the model state and the loss metric
    `accumjax._loop.follow_decision`'s, as for every other microbatch.
    """
    # No weight: `Context.sum_can_decide` holds only without a ``weight_fn``.
    loss, new_model_state, aux, grads, _ = loop_lib.loss_and_grads(
        ctx, params, carry.model_state, batch, index
    )
    gate = jnp.asarray(gate) & ~reading  # a reading pass adds nothing: its weight sum stays 0

    def put(a: jax.Array, g: jax.Array) -> jax.Array:
        g = g.astype(a.dtype)
        return jnp.where(reading, g, jnp.where(gate, a + g, a))

    written = jax.tree.map(put, carry.window.grad_sum, grads)
    norm = global_norm(written)
    counted, kept, decision = sum_decision(ctx.config, norm, gate, reading)
    window = window_lib.count_microbatch(carry.window, written, counted)
    # Unweighted: each microbatch kept counts 1 in the loss metric.
    carry, loss = follow_decision(ctx, carry, window, kept, None, loss, new_model_state)
    nonfinite = counted.nonfinite
    return Outcome(
        carry=carry, loss=loss, aux=aux, added=gate, decision=decision, nonfinite=nonfinite
    )


def _empty(ctx: Context, like: LoopCarry) -> LoopCarry:
    """An empty window shaped like ``like``'s, no loss yet, on ``like``'s model state."""
    zero = jnp.zeros((), jnp.float32)
    window = window_lib.emptied_window(like.window)
    carry = LoopCarry(window=window, model_state=like.model_state, loss_sum=zero, loss_weight=zero)
    return mark_varying(carry, ctx.setup.pmap_axis)


def _loop_over(
    ctx: Context, body: Callable[[Any, jax.Array], tuple[Any, Any]], init: Any
) -> tuple[Any, Any]:
    """``lax.scan(body, init, arange(K))`` (a loop of known trip count K), or, with
    ``ctx.n_real``, a loop that stops after the real microbatches and stacks their outputs
    into K slots (zeros in the padded ones)."""
    if ctx.n_real is None:
        # A constant, not a kernel.
        index = jnp.asarray(np.arange(ctx.static_every_k, dtype=np.int32))
        return jax.lax.scan(body, init, index, unroll=ctx.setup.unroll)
    body = jax.jit(body)  # traced once: for the outputs' shapes, then in the loop
    shapes = jax.eval_shape(body, init, jnp.zeros((), jnp.int32))[1]
    stacked = jax.tree.map(lambda s: jnp.zeros((ctx.static_every_k, *s.shape), s.dtype), shapes)

    def step(i: jax.Array, val: tuple[Any, Any]) -> tuple[Any, Any]:
        carry, ys = body(val[0], i)
        return carry, jax.tree.map(lambda buf, y: buf.at[i].set(y), val[1], ys)

    first = jnp.zeros(
        (), jnp.int32
    )  # an int32 index, not weakly typed: the loop reuses the trace above
    return jax.lax.fori_loop(first, ctx.n_real, step, (init, stacked))


def _marks(ctx: Context, outcome: Outcome) -> Outcome:
    """What a microbatch leaves in the loop's stacked outputs, an `accumjax._loop.Outcome`
    with an empty carry: its aux, and its decision and loss parts (as
    `accumjax._loop.run_microbatch` adds them) when it was added as it came."""
    empty = LoopCarry(model_state=None)
    v = outcome.decision
    if v is None:
        return Outcome(carry=empty, loss=None, aux=outcome.aux)
    loss = jnp.asarray(outcome.loss, jnp.float32)
    losses = jnp.stack(loss_parts(ctx, v.weight, loss))
    return Outcome(carry=empty, loss=None, aux=outcome.aux, decision=v, losses=losses)


def _pass(carry: LoopCarry, marks: Outcome) -> Outcome:
    """A pass's `accumjax._loop.Outcome`: its carry and its microbatches' stacked `_marks`."""
    return marks._replace(carry=carry)


def _microbatch_loop(
    ctx: Context, take: Take, one: Callable[..., Any], start: LoopCarry, gate: Any, reading: bool
) -> Outcome:
    """One microbatch opens the window when K is 1 (no loop, no zeros); otherwise a
    ``lax.scan`` adds all K to a zero accumulator (``one`` is its body).

    Every microbatch runs in the same loop body: computed outside the loop, the first one's
    activations are not shared with the loop's, and at K=2 (where XLA inlines a one-trip
    loop) both microbatches' activations are alive at once.
    """
    if ctx.static_every_k == 1 and ctx.n_real is None:
        p, mb = take(jnp.zeros((), jnp.int32))
        first = ctx.reduce is None  # a reduced accumulator is not shaped like a gradient
        start = start if first else _empty(ctx, start)
        outcome = run_microbatch(ctx, start, p, mb, 0, first=first)
        marks = jax.tree.map(lambda a: a[None], _marks(ctx, outcome))
        return _pass(outcome.carry, marks)
    gates = jnp.ones(ctx.static_every_k, bool) if gate is None else gate
    reads = jnp.asarray(reading)  # traced: every pass runs the same loop body

    def body(carry: LoopCarry, i: jax.Array) -> tuple[LoopCarry, Any]:
        return one(carry, i, gates[i] if ctx.adds_before_deciding else None, reads)

    carry, marks = _loop_over(ctx, body, _empty(ctx, start))
    return _pass(carry, marks)


def accepted_loss(losses: jax.Array, accepted: jax.Array) -> jax.Array:
    """The window's weighted mean loss over the microbatches the devices accepted, from each
    one's summed loss parts (`accumjax._loop.Outcome.losses`; NaN if none was accepted)."""
    loss_sum, loss_weight = jnp.sum(jnp.where(accepted[:, None], losses, 0.0), axis=0)
    return loss_mean(loss_sum, loss_weight)


def window_every_k(ctx: Context, every_k: Any) -> Any:
    """The K the window is closed with: the real microbatches' number, or ``every_k``."""
    return every_k if ctx.n_real is None else ctx.n_real


#: ``close(carry, decisions, losses) -> (closed, ended)``: a pass's window reduced and decided,
#: and what it ended with, an `accumjax._loop.Outcome` by name: its ``carry.model_state`` the
#: model state closed with the decision (on a mapped axis, BatchNorm windows pooled by
#: `accumjax._batch_norm_windows.close_model_state` after the window's reduction), its ``loss``
#: the window's loss metric and its ``aux`` the aux means reduced with it (or None).
Close = Callable[
    [LoopCarry, MicrobatchDecision | None, jax.Array | None],
    tuple[window_lib.Closed, Outcome],
]


def close_pass(
    ctx: Context,
    every_k: Any,
    carry: LoopCarry,
    decisions: MicrobatchDecision | None,
    losses: jax.Array | None,
    *,
    aux_means: Any = None,
) -> tuple[window_lib.Closed, Outcome]:
    """A pass's window closed (`accumjax._window.close_window`, along ``ctx``'s axis) and
    decided: ``(closed, ended)``, as a `Close` returns them, ``closed`` without extras
    (``partial(close_pass, ctx, every_k)`` is a `Close`).

    Inside a call's ``shard_map`` (``ctx.layout``) the pass's loss parts, its per-microbatch
    ``losses`` and ``aux_means`` travel in the window's one reduction, summed over the
    devices, and the window is reduced as the layout plan says for the policy
    (`accumjax._layout.window_layouts`); elsewhere (one device, ``pmap``) the loss metric is
    this device's and there are no aux means.

    Args:
      ctx: the step's `accumjax._loop.Context`.
      every_k: the K the window is closed with (`window_every_k`).
      carry: the pass's carry (its window, loss parts and model state).
      decisions: the pass's stacked microbatch decisions, or None.
      losses: each microbatch's loss parts (`accumjax._loop.Outcome.losses`), or None.
      aux_means: the aux leaves the devices average (`accumjax._sharded_steps.split_aux`).

    Returns:
      The closed window and an `accumjax._loop.Outcome` of its closed model state, loss
      metric and summed aux means.
    """
    axis = ctx.axis_name
    scalars = Outcome(carry=carry, loss=None, aux=aux_means, losses=losses)
    extras, layouts, global_counts = None, None, False
    if ctx.layout is not None:  # what the pass produced and the devices sum
        parts = LoopCarry(model_state=None, loss_sum=carry.loss_sum, loss_weight=carry.loss_weight)
        scalars = scalars._replace(carry=parts)
        extras = jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), scalars)
        layouts, global_counts = window_layouts(ctx.layout.leaves, ctx.config.reads)
    closed = window_lib.close_window(
        ctx.config,
        carry.window,
        every_k,
        axis,
        layouts,
        extras=extras,
        global_counts=global_counts,
        decisions=decisions,
    )
    summed: Outcome = scalars if extras is None else closed.extras
    if summed.losses is None:  # the window's loss metric, from the (devices') parts
        loss = loss_mean(summed.carry.loss_sum, summed.carry.loss_weight)
    else:
        loss = accepted_loss(summed.losses, cast(jax.Array, closed.accepted))
    model_state = close_model_state(carry.model_state, closed.apply, axis)
    ended = Outcome(carry=LoopCarry(model_state=model_state), loss=loss, aux=summed.aux)
    return closed._replace(extras=None), ended


def decide_window(
    ctx: Context, first: Outcome, run: Run, close: Close
) -> tuple[window_lib.Closed, Outcome]:
    """A window's decision after its ``first`` pass: ``(closed, ended)``, as ``close`` returns
    them (`Close`).

    With `accumjax._loop.Context.sum_can_decide` the first pass read no gradient: a window
    whose running sum stayed small (`sum_decided`) is decided by it (every microbatch's
    gradient had a finite norm). Only another window runs again, reading each microbatch's
    gradient over the sum's buffer (`window_loop`'s ``over``), and is then decided as
    `decide_added` decides a first pass that read them (then running again to add the
    accepted ones, or all of them when none was refused).
    """
    if not ctx.sum_can_decide:
        return decide_added(ctx, first, run, close)
    closed, ended = close(first.carry, first.decision, first.losses)

    def reread(operand: tuple[window_lib.Closed, Outcome]) -> Any:
        before, _ = operand
        return decide_added(ctx, run(None, over=before.grad_sum), run, close, read=True)

    return run_once(closed.nonfinite_count > 0, reread, (closed, ended))


def decide_added(
    ctx: Context, first: Outcome, run: Run, close: Close, read: bool = False
) -> tuple[window_lib.Closed, Outcome]:
    """A window's decision after its ``first`` pass (``run(None)``): ``(closed, ended)``, as
    ``close`` returns them (`Close`).

    A policy that skips a non-finite microbatch adds every microbatch as it comes; when the
    devices refused one (and accepted another), the window runs again, adding only the
    accepted ones, each as it comes: a second pass only for such a window, in
    `accumjax._control.run_once` (no loop on the data; on a GPU one conditional). After a
    pass that ``read`` the gradients and added none, a window none of whose microbatches
    was refused runs again too (every policy), adding them all, its loss metric as read.
    """
    closed, ended = close(first.carry, first.decision, first.losses)
    skips = ctx.config.on_nonfinite == "skip_microbatch"
    if first.decision is None or not (skips or read) or ctx.static_every_k == 1:
        return closed, ended
    all_finite = closed.nonfinite_count == 0

    def again(operand: tuple[window_lib.Closed, Outcome]) -> Any:
        before, read_end = operand
        second = run(before.accepted)
        after, end = close(second.carry, None, None)
        counts = ("nonfinite_count", "skipped_count", "accepted")
        after = after._replace(**{name: getattr(before, name) for name in counts})
        if read:  # the loss metric (and aux means) as the first pass that read them has it
            pick = lambda a, b: jnp.where(all_finite, a, b)
            loss = pick(read_end.loss, end.loss)
            end = end._replace(loss=loss, aux=jax.tree.map(pick, read_end.aux, end.aux))
        return after, end

    redo = ~all_finite if skips else jnp.zeros((), bool)
    redo = (redo | all_finite) if read else redo
    redo = redo & jnp.any(cast(jax.Array, closed.accepted))
    return run_once(redo, again, (closed, ended))


def scan_finish(
    ctx: Context,
    state: TrainState,
    acc: AccumulationState,
    closed: window_lib.Closed,
    *,
    model_state: Any,
    loss: jax.Array,
    aux: Any,
) -> tuple[TrainState, dict]:
    """Applies a closed scan-mode window when it is usable and builds the new state.

    Args:
      ctx: the step's `accumjax._loop.Context`.
      state: the train state the step started from.
      acc: its `AccumulationState`.
      closed: the window after its one reduction, decided (`accumjax._window.Closed`).
      model_state: the model state after the window's microbatches, its BatchNorm windows
        closed with the decision.
      loss: the window's loss metric.
      aux: the per-microbatch aux, stacked, or None.

    Returns:
      The new train state and the step's metrics.
    """
    window = acc.window._replace(window_nonfinite=closed.nonfinite_count)
    opt = acc._replace(window=window, updated=jnp.zeros((), bool))
    if ctx.n_real is not None:  # "sum_over_k" divides by the real microbatches
        opt = opt._replace(every_k=ctx.n_real)
    fields = LoopCarry(
        params=state.params, opt=opt, model_state=model_state, loss_scale=ctx.loss_scale
    )
    fields = close_fields(ctx, fields, closed, model_state_closed=True)
    # The state's own (stream) window is handed back untouched: its buffer is donated to
    # the output instead of a fresh zero accumulator being allocated every step.
    updated = fields.opt.updated
    fields = fields._replace(opt=fields.opt._replace(window=acc.window, added=updated))
    if state.model_state is not None:  # a skipped window leaves all model state as it was
        kept = optax.tree.where(fields.opt.updated, fields.model_state, state.model_state)
        fields = fields._replace(model_state=kept)
    zero = jnp.zeros((), jnp.float32)
    carry = LoopCarry(window=window, model_state=model_state, loss_sum=zero, loss_weight=zero)
    outcome = Outcome(carry=carry, loss=loss, aux=aux)
    skipped, nonfinite = closed.skipped_count, closed.nonfinite_count
    return finish(ctx, state, fields, outcome, skipped=skipped, nonfinite=nonfinite)


def scan_step(setup: loop_lib.Setup) -> Step:
    """``step(state, batch, rng=None, num_real_microbatches=None)``: the whole batch per call,
    K strided microbatches (the first ``num_real_microbatches`` of them, when given)."""

    def step(
        state: TrainState, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> tuple[TrainState, dict]:
        ctx, acc = begin(setup, state, rng)
        ctx = ctx._replace(n_real=real_microbatches(num_real_microbatches, ctx.static_every_k))
        params = mark_varying(state.params, setup.pmap_axis)
        run = window_loop(ctx, params, start_carry(state, acc), batch)
        first = run(None)
        # The state's K (traced): with a constant K, XLA:CPU moves the division by it into a
        # gradient-sized buffer of its own (docs/limits.md).
        every_k = window_every_k(ctx, acc.every_k)
        closed, ended = decide_window(ctx, first, run, partial(close_pass, ctx, every_k))
        model_state = ended.carry.model_state
        return scan_finish(
            ctx, state, acc, closed, model_state=model_state, loss=ended.loss, aux=first.aux
        )

    return step
