"""Gradient accumulation as an optax transformation: `accumulate` and free functions on its state.

``accumulate(inner, K)`` collects K microbatch gradients and hands their scaled sum to ``inner``
once per window, so K small microbatches give the update of one big batch. It is a drop-in
replacement for ``optax.MultiSteps`` with these differences:

- ``inner`` runs only at the end of a window (under ``lax.cond``), not on every call followed by
  a select, so a non-update microstep costs a gradient, a norm and an add, and the inner state
  is untouched bit for bit between updates.
- The accumulator keeps a plain sum (never narrower than float32 by default) and divides once,
  by the strategy's denominator (see `accumjax.scaling`).
- A non-finite microbatch is detected, counted and (by default) left out; it still advances the
  window, so windows stay aligned with the data (``optax.MultiSteps`` with ``skip_not_finite``
  instead pretends the call never happened).
- With ``axis_name`` the window's sum is all-reduced once per window, inside the update branch.

Reference: ``optax.MultiSteps``; the seed behaviour is the TensorFlow GradientAccumulator library
(andreped/GradientAccumulator), whose optimizer wrapper runs the inner optimizer every step and
thereby advances Adam/momentum state on non-update steps, which this module does not do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from accumjax import scaling as scaling_lib

OnNonfinite = Literal["skip_microbatch", "skip_window", "propagate"]
ON_NONFINITE: tuple[str, ...] = ("skip_microbatch", "skip_window", "propagate")
Schedule = Callable[[jax.Array], jax.typing.ArrayLike]


class AccumulationState(NamedTuple):
    """State of `accumulate`: a pytree of arrays the user owns (checkpoint it like any other).

    Attributes:
      micro_step: calls seen in the current window (skipped microbatches included), int32.
      every_k: K of the current window (from the schedule), int32.
      update_count: inner updates actually applied, int32; what a K schedule is evaluated at.
      acc_grads: the running sum ``sum_i w_i g_i`` of the window, in the accumulator dtype.
      weight_sum: sum of the weights of the microbatches added in the window (their count
        unless ``scaling="weighted"``), float32.
      fixed_denominator: K for ``"mean"``, 1 for ``"sum"``, 0 where ``weight_sum`` divides.
      inner_state: the inner optimizer's state.
      window_max_norm: largest finite microbatch gradient norm (before clipping) in the window.
      max_grad_norm: largest finite microbatch gradient norm seen so far.
      nonfinite_count: microbatches with a NaN/Inf gradient (or invalid weight) so far, int32.
      window_nonfinite: whether the current window has seen one.
      updated: whether the last call applied an inner update.
    """

    micro_step: jax.Array
    every_k: jax.Array
    update_count: jax.Array
    acc_grads: Any
    weight_sum: jax.Array
    fixed_denominator: jax.Array
    inner_state: Any
    window_max_norm: jax.Array
    max_grad_norm: jax.Array
    nonfinite_count: jax.Array
    window_nonfinite: jax.Array
    updated: jax.Array


class AccumulationStats(NamedTuple):
    """What `stats` reports about an `AccumulationState`.

    Attributes:
      accumulation_steps: K of the current window.
      current_step: calls seen in the current window.
      total_cycles: inner updates applied so far.
      max_grad_norm: largest finite microbatch gradient norm seen so far.
      overflow_detected: whether any non-finite microbatch has been seen.
      num_nonfinite: how many.
      num_parameters: number of scalars accumulated (a Python int).
      memory_bytes: bytes held by the accumulator (a Python int).
    """

    accumulation_steps: jax.Array
    current_step: jax.Array
    total_cycles: jax.Array
    max_grad_norm: jax.Array
    overflow_detected: jax.Array
    num_nonfinite: jax.Array
    num_parameters: int
    memory_bytes: int


def _validate_every_k(every_k: int | Schedule) -> Schedule:
    if callable(every_k):
        first = scaling_lib.concrete_value(every_k(jnp.zeros((), jnp.int32)))
        if first is not None and first < 1:
            raise ValueError(f"every_k schedule must return K >= 1; it returned {first} at step 0.")
        return every_k
    if isinstance(every_k, bool) or not isinstance(every_k, int):
        raise TypeError(f"every_k must be an int >= 1 or a callable schedule, got {every_k!r}.")
    if every_k < 1:
        raise ValueError(f"every_k must be >= 1, got {every_k}.")
    k = every_k
    return lambda _: k


def _k_at(schedule: Schedule, update_count: jax.Array) -> jax.Array:
    # A traced schedule cannot be checked at trace time; K < 1 is read as 1.
    return jnp.maximum(jnp.asarray(schedule(update_count), jnp.int32), 1)


def _accumulator_dtype(leaf_dtype: Any, accumulator_dtype: Any) -> Any:
    if accumulator_dtype is None:
        return leaf_dtype
    return jnp.promote_types(leaf_dtype, accumulator_dtype)


def _check_grads(grads: Any, acc_grads: Any) -> None:
    expected = jax.tree.structure(acc_grads)
    got = jax.tree.structure(grads)
    if got != expected:
        raise ValueError(
            f"grads pytree structure differs from the one accumulate was initialised with:\n"
            f"  expected {expected}\n  got      {got}"
        )
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), a in zip(leaves, jax.tree.leaves(acc_grads), strict=True):
        name = jax.tree_util.keystr(path)
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            raise TypeError(f"grads{name} has dtype {g.dtype}; gradients must be floating point.")
        if g.shape != a.shape:
            raise ValueError(f"grads{name} has shape {g.shape}, expected {a.shape}.")


def _global_norm(tree: Any) -> jax.Array:
    """Global L2 norm of a pytree, reduced in float32 (or wider) whatever the leaf dtype."""
    squares = [
        jnp.sum(jnp.square(jnp.abs(x).astype(jnp.promote_types(x.dtype, jnp.float32))))
        for x in jax.tree.leaves(tree)
    ]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32))).astype(jnp.float32)


def _updates_placeholder(inner, grads, inner_state, params, extra_args) -> Any:
    """A pytree shaped like ``inner``'s updates for the loop carry, its values never used.

    The incoming gradients serve when their shapes and dtypes fit (no new buffer to fill);
    otherwise zeros of the right shapes.
    """
    shapes = jax.eval_shape(
        lambda g, s, p: inner.update(g, s, p, **extra_args)[0], grads, inner_state, params
    )
    spec = lambda x: (jnp.shape(x), jnp.result_type(x))
    if jax.tree.structure(shapes) == jax.tree.structure(grads) and all(
        spec(a) == spec(b)
        for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(grads), strict=True)
    ):
        return grads
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Schedule,
    *,
    scaling: scaling_lib.Scaling = "mean",
    max_norm: float | None = None,
    on_nonfinite: OnNonfinite = "skip_microbatch",
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates K microbatch gradients and applies ``inner`` once per window.

    Each ``update`` call takes one microbatch's gradient. Calls that do not close the window
    return zero updates; the K-th returns ``inner``'s update for the scaled sum. Use it wherever
    an optax optimizer goes (``optax.apply_updates(params, updates)`` after every call).

    Args:
      inner: any optax transformation. It sees the scaled accumulated gradient (cast to the
        incoming gradients' dtype, so its output dtype is what it would be without wrapping)
        once per window, and its update count equals the number of real updates.
      every_k: K, an int >= 1, or a schedule ``update_count -> K`` (as
        ``optax.MultiSteps.every_k_schedule``) evaluated after each applied update.
      scaling: ``"mean"``, ``"sum"``, ``"count"`` or ``"weighted"`` (see `accumjax.scaling`).
        ``"weighted"`` needs ``update(..., weight=w)`` on every call.
      max_norm: if set, each microbatch gradient's global norm is clipped to this before it is
        added (per-microbatch clipping, as in DP-SGD style training).
      on_nonfinite: what a microbatch with a NaN/Inf gradient does: ``"skip_microbatch"`` (not
        added, counted, the window goes on; pair with ``"count"`` so the step does not shrink),
        ``"skip_window"`` (the whole window is dropped: no update, inner state untouched) or
        ``"propagate"`` (added as is, as a plain optimizer would).
      accumulator_dtype: the accumulator's minimum precision: a leaf accumulates in
        ``promote_types(param dtype, accumulator_dtype)``, so bf16/f16 gradients sum in float32
        and float64 ones stay float64. ``None`` uses the parameters' dtypes.
      axis_name: a mapped axis (``pmap``/``shard_map``) over which the window's sum, weights and
        non-finite flags are all-reduced once, at the end of the window; each device then
        applies the same update. ``"mean"`` divides by K times the axis size.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an `AccumulationState`.

    Raises:
      ValueError, TypeError: for K < 1 or not an int, an unknown ``scaling`` or
        ``on_nonfinite``, ``max_norm <= 0``; at trace time for grads whose structure, shape or
        dtype do not match the parameters, and a missing, negative or non-finite ``weight``.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), every_k=2)
      >>> params = {"w": jnp.zeros(3)}
      >>> state = tx.init(params)
      >>> for g in (jnp.ones(3), 3 * jnp.ones(3)):
      ...     updates, state = tx.update({"w": g}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"]
      Array([-0.2, -0.2, -0.2], dtype=float32)
    """
    schedule = _validate_every_k(every_k)
    scaling = scaling_lib.validate_scaling(scaling)
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}.")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 or None, got {max_norm}.")
    inner = optax.with_extra_args_support(inner)
    detect = on_nonfinite != "propagate"

    def init_fn(params: Any) -> AccumulationState:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            if not jnp.issubdtype(jnp.asarray(p).dtype, jnp.inexact):
                raise TypeError(
                    f"params{jax.tree_util.keystr(path)} has dtype {jnp.asarray(p).dtype}; "
                    "accumulate needs floating-point parameters."
                )
        acc = jax.tree.map(
            lambda p: jnp.zeros(
                jnp.shape(p), _accumulator_dtype(jnp.asarray(p).dtype, accumulator_dtype)
            ),
            params,
        )
        update_count = jnp.zeros((), jnp.int32)
        k = _k_at(schedule, update_count)
        zero_f = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: donatable
        return AccumulationState(
            micro_step=jnp.zeros((), jnp.int32),
            every_k=k,
            update_count=update_count,
            acc_grads=acc,
            weight_sum=zero_f(),
            fixed_denominator=scaling_lib.fixed_denominator(scaling, k),
            inner_state=inner.init(params),
            window_max_norm=zero_f(),
            max_grad_norm=zero_f(),
            nonfinite_count=jnp.zeros((), jnp.int32),
            window_nonfinite=jnp.zeros((), jnp.bool_),
            updated=jnp.zeros((), jnp.bool_),
        )

    def add_microbatch(grads: Any, state: AccumulationState, weight: Any) -> AccumulationState:
        w, w_ok = scaling_lib.microbatch_weight(scaling, weight)
        norm = _global_norm(grads)
        finite = jnp.isfinite(norm)
        ok = finite & w_ok
        factor = None if scaling != "weighted" else jnp.where(w_ok, w, jnp.nan)
        if max_norm is not None:
            clip = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
            factor = clip if factor is None else factor * clip

        def add(a: jax.Array, g: jax.Array) -> jax.Array:
            g = g.astype(a.dtype)
            new = a + (g if factor is None else factor.astype(a.dtype) * g)
            return jnp.where(ok, new, a) if detect else new

        added = ok if detect else jnp.ones((), jnp.bool_)
        finite_norm = jnp.where(finite, norm, 0.0)
        return state._replace(
            micro_step=numerics.safe_increment(state.micro_step),
            acc_grads=jax.tree.map(add, state.acc_grads, grads),
            weight_sum=state.weight_sum + jnp.where(added, w, 0.0),
            window_max_norm=jnp.maximum(state.window_max_norm, finite_norm),
            max_grad_norm=jnp.maximum(state.max_grad_norm, finite_norm),
            nonfinite_count=state.nonfinite_count + (~ok).astype(jnp.int32),
            window_nonfinite=state.window_nonfinite | ~ok,
        )

    def end_window(grads, state: AccumulationState, params, extra_args):
        """Reduces the window, applies ``inner`` if the window is usable, and empties it."""
        acc, weight_sum = state.acc_grads, state.weight_sum
        nonfinite, fixed = state.window_nonfinite, state.fixed_denominator
        if axis_name is not None:
            acc, weight_sum, n_bad = jax.lax.psum(
                (acc, weight_sum, nonfinite.astype(jnp.int32)), axis_name
            )
            nonfinite = n_bad > 0
            fixed = fixed * jax.lax.psum(1, axis_name) if scaling == "mean" else fixed
        denom = scaling_lib.denominator(fixed, weight_sum)
        apply = (weight_sum > 0) & ~(nonfinite & (on_nonfinite == "skip_window"))
        g = jax.tree.map(lambda a, x: (a / denom.astype(a.dtype)).astype(x.dtype), acc, grads)
        updates, new_inner = inner.update(g, state.inner_state, params, **extra_args)
        # Keep the state's dtypes (an f16 param with f32 grads would promote adam's moments),
        # so the state is a fixed pytree type under scan/jit carries. This branch runs once per
        # window, so selecting (rather than a nested cond) costs nothing per microbatch.
        keep = lambda new, old: jnp.where(apply, new, old).astype(jnp.asarray(old).dtype)
        inner_state = jax.tree.map(keep, new_inner, state.inner_state)
        update_count = jnp.where(
            apply, numerics.safe_increment(state.update_count), state.update_count
        )
        k = _k_at(schedule, update_count)
        return updates, reset(state)._replace(
            every_k=k,
            update_count=update_count,
            fixed_denominator=scaling_lib.fixed_denominator(scaling, k),
            inner_state=inner_state,
            updated=apply,
        )

    def update_fn(grads, state: Any, params=None, *, weight=None, **extra_args):
        _check_grads(grads, state.acc_grads)
        state = add_microbatch(grads, state, weight)._replace(updated=jnp.zeros((), jnp.bool_))
        placeholder = _updates_placeholder(inner, grads, state.inner_state, params, extra_args)

        # A loop that runs once at the end of a window and not at all otherwise: unlike
        # lax.cond, XLA updates a while loop's carry in place, so the inner state and the
        # accumulator are not copied on every microbatch.
        def body(carry):
            _, state, _ = carry
            updates, state = end_window(grads, state, params, extra_args)
            return updates, state, jnp.zeros((), jnp.bool_)

        emit = state.micro_step >= state.every_k
        carry = (placeholder, state, emit)
        updates, state, _ = jax.lax.while_loop(lambda c: c[2], body, carry)
        # Zeros unless an update was applied. Outside the loop this select fuses with the
        # caller's apply_updates (or vanishes when updates are unused) instead of costing a
        # separate pass that writes zeros on every microbatch.
        updates = jax.tree.map(lambda u: jnp.where(state.updated, u, jnp.zeros_like(u)), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def should_update(state: AccumulationState) -> jax.Array:
    """Whether the next ``update`` call closes the window (and may apply an update).

    Args:
      state: an `AccumulationState`.

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 1).init({"w": jnp.zeros(2)})
      >>> bool(accumjax.should_update(state))
      True
    """
    return state.micro_step + 1 >= state.every_k


def has_updated(state: AccumulationState) -> jax.Array:
    """Whether the last ``update`` call applied an inner update (as ``MultiSteps.has_updated``).

    A window closed without an update (every microbatch skipped, or ``"skip_window"`` after a
    non-finite microbatch) reports False.

    Args:
      state: an `AccumulationState`.

    Returns:
      A boolean scalar array.
    """
    return state.updated


def accumulated_gradients(state: AccumulationState) -> Any:
    """The window's gradient so far, scaled as the strategy says (zeros if nothing was added).

    This is what ``inner`` would receive if the window closed now (before any cross-device
    reduction, and in the accumulator dtype).

    Args:
      state: an `AccumulationState`.

    Returns:
      A pytree like the parameters.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 4, scaling="count")
      >>> state = tx.init({"w": jnp.zeros(())})
      >>> _, state = tx.update({"w": jnp.array(2.0)}, state)
      >>> _, state = tx.update({"w": jnp.array(4.0)}, state)
      >>> accumjax.accumulated_gradients(state)["w"]
      Array(3., dtype=float32)
    """
    denom = scaling_lib.denominator(state.fixed_denominator, state.weight_sum)
    safe = jnp.where(denom > 0, denom, 1.0)
    return jax.tree.map(lambda a: a / safe.astype(a.dtype), state.acc_grads)


def reset(state: AccumulationState) -> AccumulationState:
    """Empties the current window and keeps the inner state, counters and K.

    Args:
      state: an `AccumulationState`.

    Returns:
      The state with a zero accumulator, ``micro_step == 0`` and cleared window statistics.
    """
    return state._replace(
        micro_step=jnp.zeros_like(state.micro_step),
        acc_grads=jax.tree.map(jnp.zeros_like, state.acc_grads),
        weight_sum=jnp.zeros_like(state.weight_sum),
        window_max_norm=jnp.zeros_like(state.window_max_norm),
        window_nonfinite=jnp.zeros_like(state.window_nonfinite),
    )


def stats(state: AccumulationState) -> AccumulationStats:
    """Summarises an `AccumulationState` (steps, updates, norms, overflows, accumulator size).

    Args:
      state: an `AccumulationState`.

    Returns:
      An `AccumulationStats`; its sizes are Python ints (static), the rest arrays.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 8).init({"w": jnp.zeros((4, 4))})
      >>> s = accumjax.stats(state)
      >>> int(s.accumulation_steps), s.num_parameters, s.memory_bytes
      (8, 16, 64)
    """
    leaves = jax.tree.leaves(state.acc_grads)
    return AccumulationStats(
        accumulation_steps=state.every_k,
        current_step=state.micro_step,
        total_cycles=state.update_count,
        max_grad_norm=state.max_grad_norm,
        overflow_detected=state.nonfinite_count > 0,
        num_nonfinite=state.nonfinite_count,
        num_parameters=sum(int(x.size) for x in leaves),
        memory_bytes=sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves),
    )
