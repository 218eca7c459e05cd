"""Scan mode's window (internal): the K microbatches of one batch, one update.

`scan_step` splits the batch (`accumjax._split`: strided rows along each leaf's batch axis),
runs the window loop (`window_loop`) over the microbatches with the window core of
`accumjax._loop`, closes the window once and applies it (`scan_finish`). With a runtime number
of real microbatches (``num_real_microbatches``) the loop stops after them: the padded tail is
neither computed nor counted, without a recompile (a loop whose trip count is that number).
"""

from __future__ import annotations

from collections.abc import Callable
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
    begin,
    close_fields,
    close_model_state,
    finish,
    microbatch,
    pvary,
    start_carry,
)
from accumjax._split import rows_in_order, split
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = [
    "Closing",
    "real_microbatches",
    "scan_finish",
    "scan_step",
    "window_k",
    "window_loop",
    "window_loss",
]

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

    Each microbatch is inspected as it comes, in a loop of K trips (a known trip count, unless
    ``num_real_microbatches`` bounds it), and added when the policy accepts it; on a mesh the
    devices agree about each one (`accumjax.window.inspect_microbatch`), so a non-finite
    microbatch costs what a finite one does and the window is never computed again.
    """
    take = _microbatches(ctx, params, batch)
    carry, aux = _microbatch_loop(ctx, take, start)
    if aux is not None and ctx.setup.aux_rows:
        aux = rows_in_order(aux)
    return carry, aux


def _empty(ctx: Context, like: Carry) -> Carry:
    """An empty window shaped like ``like``'s, no loss yet, on ``like``'s model state."""
    zero = jnp.zeros((), jnp.float32)
    carry = Carry(window_lib.empty_like(like.window), like.model_state, zero, zero)
    return pvary(carry, ctx.setup.axis_name)


def _loop_over(
    ctx: Context, body: Callable[[Any, jax.Array], tuple[Any, Any]], init: Any
) -> tuple[Any, Any]:
    """``lax.scan(body, init, arange(K))`` (a loop of known trip count K), or, with
    ``ctx.n_real``, a loop that stops after the real microbatches and stacks their outputs
    into K slots (zeros in the padded ones)."""
    if ctx.n_real is None:
        index = jnp.asarray(np.arange(ctx.k, dtype=np.int32))  # a constant, not a kernel
        return jax.lax.scan(body, init, index, unroll=ctx.setup.unroll)
    body = jax.jit(body)  # traced once: for the outputs' shapes, then in the loop
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


def window_k(ctx: Context, every_k: Any) -> Any:
    """The K the window is closed with: the real microbatches' number, or ``every_k``."""
    return every_k if ctx.n_real is None else ctx.n_real


class Closing(NamedTuple):
    """A window's microbatches after its one reduction (what a scan step closes with).

    Attributes:
      closed: the reduced and decided window (`accumjax.window.Closed`).
      model_state: the model state after its microbatches, its BatchNorm windows closed
        with the decision.
      loss: the window's loss metric.
      aux: the per-microbatch aux, stacked, or None.
    """

    closed: window_lib.Closed
    model_state: Any
    loss: jax.Array
    aux: Any


def scan_finish(
    ctx: Context, state: TrainState, acc: AccumulationState, closing: Closing
) -> tuple[TrainState, dict]:
    """Applies a closed scan-mode window when it is usable and builds the new state."""
    closed = closing.closed
    window = acc.window._replace(window_nonfinite=closed.nonfinite_count)
    opt = acc._replace(window=window, updated=jnp.zeros((), bool))
    if ctx.n_real is not None:  # "mean" divides by the real microbatches
        opt = opt._replace(every_k=ctx.n_real)
    fields = Fields(state.params, opt, closing.model_state, ctx.loss_scale)
    fields = close_fields(ctx, fields, closed)
    # The state's own (stream) window is handed back untouched: its buffer is donated to
    # the output instead of a fresh zero accumulator being allocated every step.
    updated = fields.opt.updated
    fields = fields._replace(opt=fields.opt._replace(window=acc.window, added=updated))
    if state.model_state is not None:  # a skipped window leaves all model state as it was
        kept = optax.tree.where(fields.opt.updated, fields.model_state, state.model_state)
        fields = fields._replace(model_state=kept)
    zero = jnp.zeros((), jnp.float32)
    outcome = Outcome(Carry(window, closing.model_state, zero, zero), closing.loss, closing.aux)
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
        axis = ctx.config.axis_name
        carry, aux = window_loop(ctx, params, start_carry(state, acc), batch)
        # The state's K (traced): with a constant K, XLA:CPU moved the division by it into a
        # gradient-sized buffer of its own (+0.4 MiB of temp on a 0.6M-parameter MLP).
        every_k = window_k(ctx, acc.every_k)
        closed = window_lib.close_window(ctx.config.policy, carry.window, every_k, axis)
        model_state = close_model_state(carry.model_state, closed.apply, axis)
        return scan_finish(ctx, state, acc, Closing(closed, model_state, window_loss(carry), aux))

    return step
