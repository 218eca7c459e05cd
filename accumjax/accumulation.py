"""Gradient accumulation as an optax transformation: `accumulate` and free functions on its state.

``accumulate(inner, K)`` collects K microbatch gradients and hands their scaled sum to ``inner``
once per window, so K small microbatches give the update of one big batch. It is a drop-in
replacement for ``optax.MultiSteps`` with these differences:

- ``inner`` runs only at the end of a window, inside a loop that runs at most once
  (`accumjax.window.run_once`: XLA updates a loop's carry in place, where ``lax.cond`` would
  copy the inner state on every microbatch), so a non-update microstep costs a gradient, a
  norm and an add, and the inner state is untouched bit for bit between updates.
- The accumulator keeps a plain sum (never narrower than float32 by default) and divides once,
  by the strategy's denominator (see `accumjax.scaling`).
- A non-finite microbatch is detected, counted and (by default) left out; it still advances the
  window, so windows stay aligned with the data (``optax.MultiSteps`` with ``skip_not_finite``
  instead pretends the call never happened). The window's sum is checked once more when it
  closes, so finite microbatches whose sum overflows skip the window and are counted too.
- With ``axis_name`` the window's sum is all-reduced once per window.

The window logic (add, close, decide) is `accumjax.window`, shared with `make_train_step`'s
stream and scan modes, so a policy means the same thing everywhere.

Reference: ``optax.MultiSteps``; the seed behaviour is the TensorFlow GradientAccumulator library
(andreped/GradientAccumulator), whose optimizer wrapper runs the inner optimizer every step and
thereby advances Adam/momentum state on non-update steps, which this module does not do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from accumjax import scaling as scaling_lib
from accumjax import window as window_lib
from accumjax.window import ON_NONFINITE, OnNonfinite, Policy, SkipFn, Window

__all__ = [
    "AccumulationState",
    "AccumulationStats",
    "accumulate",
    "accumulated_gradients",
    "has_updated",
    "reset",
    "should_update",
    "stats",
    "with_every_k",
]

Schedule = Callable[[jax.Array], jax.typing.ArrayLike]
_INT32_MAX = 2**31 - 1


class AccumulationState(NamedTuple):
    """State of `accumulate`: a pytree of arrays the user owns (checkpoint it like any other).

    Field names are distinct from those of optax's own states, so
    ``optax.tree_utils.tree_get(state, name)`` finds them inside any chain.

    Attributes:
      window: the open `accumjax.window.Window` (sum, weight sum, calls, skipped counts).
      every_k: K of the current window (from the schedule), int32.
      scaling_code: index of the scaling strategy in `accumjax.scaling.SCALINGS`, int32; a
        state is refused by an `accumulate` with another strategy (or another int K).
      update_count: inner updates actually applied, int32; what a K schedule is evaluated at.
      inner_tx_state: the inner optimizer's state.
      max_grad_norm: largest global norm of an applied window gradient, float32.
      nonfinite_count: microbatches with a NaN/Inf gradient or an invalid weight so far.
      skipped_microbatches: microbatches left out of their window so far (any reason).
      skipped_windows: windows closed without an update so far.
      updated: whether the last call applied an inner update.
    """

    window: Window
    every_k: jax.Array
    scaling_code: jax.Array
    update_count: jax.Array
    inner_tx_state: Any
    max_grad_norm: jax.Array
    nonfinite_count: jax.Array
    skipped_microbatches: jax.Array
    skipped_windows: jax.Array
    updated: jax.Array


class AccumulationStats(NamedTuple):
    """What `stats` reports about an `AccumulationState`.

    Attributes:
      accumulation_steps: K of the current window.
      current_step: calls seen in the current window.
      total_cycles: inner updates applied so far.
      max_grad_norm: largest norm of an applied window gradient.
      overflow_detected: whether any non-finite microbatch has been seen.
      num_nonfinite: how many.
      skipped_microbatches: microbatches left out of their window.
      skipped_windows: windows closed without an update.
      num_parameters: number of scalars accumulated (a Python int).
      memory_bytes: bytes held by the accumulator (a Python int).
    """

    accumulation_steps: jax.Array
    current_step: jax.Array
    total_cycles: jax.Array
    max_grad_norm: jax.Array
    overflow_detected: jax.Array
    num_nonfinite: jax.Array
    skipped_microbatches: jax.Array
    skipped_windows: jax.Array
    num_parameters: int
    memory_bytes: int


class Config(NamedTuple):
    """Everything static about one `accumulate` transformation (read by `make_train_step`).

    Attributes:
      inner: the inner transformation (with extra-args support).
      every_k: K as given: an int, or a schedule.
      policy: the window `Policy`.
      axis_name: the mapped axis of the once-per-window reduction, or None.
    """

    inner: optax.GradientTransformationExtraArgs
    every_k: int | Schedule
    policy: Policy
    axis_name: str | None

    @property
    def static_k(self) -> int | None:
        """K when it is an int, else None (a schedule)."""
        return self.every_k if isinstance(self.every_k, int) else None

    def k_at(self, update_count: jax.Array) -> jax.Array:
        """K of the window that starts after ``update_count`` updates, int32 (>= 1)."""
        if isinstance(self.every_k, int):
            return jnp.asarray(self.every_k, jnp.int32)
        k = jnp.asarray(self.every_k(update_count))
        if not jnp.issubdtype(k.dtype, jnp.integer):
            raise TypeError(f"every_k schedule must return an integer K, got dtype {k.dtype}.")
        return jnp.clip(k, 1, _INT32_MAX).astype(jnp.int32)


_CONFIG_ATTR = "_accumjax_config"


# ----------------------------------------------------------------------------- validation


def check_int(name: str, value: Any, low: int = 1) -> int:
    """``value`` as a Python int in ``[low, 2**31 - 1]`` (numpy integers welcome, bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}.")
    value = int(value)
    if not low <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be an int in [{low}, 2**31 - 1], got {value}.")
    return value


def check_positive_real(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number > 0 (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number > 0, got {value!r}.")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}.")
    return number


def _check_every_k(every_k: Any) -> int | Schedule:
    if not callable(every_k):
        return check_int("every_k", every_k)
    first = jnp.asarray(every_k(jnp.zeros((), jnp.int32)))
    if not jnp.issubdtype(first.dtype, jnp.integer):
        raise TypeError(f"every_k schedule must return an integer K, got dtype {first.dtype}.")
    value = scaling_lib.concrete_value(first)
    if value is not None:
        check_int("every_k schedule's K at step 0", int(value))
    return cast(Schedule, every_k)


def _check_policy(scaling: Any, max_norm: Any, on_nonfinite: Any, skip_fn: Any) -> None:
    scaling_lib.validate_scaling(scaling)
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}.")
    if max_norm is not None:
        check_positive_real("max_norm", max_norm)
    if skip_fn is not None and not callable(skip_fn):
        raise TypeError(f"skip_fn must be callable or None, got {type(skip_fn).__name__}.")


def _check_params(params: Any) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(p)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {dtype}; "
                "accumulate needs floating-point (or complex) parameters."
            )


def _check_grads(grads: Any, acc: Any) -> None:
    expected, got = jax.tree.structure(acc), jax.tree.structure(grads)
    if got != expected:
        raise ValueError(
            "grads pytree structure differs from the one accumulate was initialised with:\n"
            f"  expected {expected}\n  got      {got}"
        )
    for (path, g), a in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(acc), strict=True
    ):
        name = jax.tree_util.keystr(path)
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            raise TypeError(f"grads{name} has dtype {g.dtype}; gradients must be floating point.")
        if g.shape != a.shape:
            raise ValueError(f"grads{name} has shape {g.shape}, expected {a.shape}.")


def check_state(config: Config, state: Any) -> AccumulationState:
    """``state`` if it is this transformation's `AccumulationState`, else a clear error.

    A state whose (concrete) K or scaling differs from ``config`` (a checkpoint resumed under
    other settings) is refused; under ``jit`` the values are traced and only the type is
    checked (`make_train_step` checks the values on its first call).
    """
    if not isinstance(state, AccumulationState):
        raise TypeError(
            "accumulate's update needs the AccumulationState made by its own init, got "
            f"{type(state).__name__} (a plain optax state? pass state=tx.init(params))."
        )
    code = scaling_lib.SCALINGS.index(config.policy.scaling)
    got_code = scaling_lib.concrete_value(state.scaling_code)
    if got_code is not None and int(got_code) != code:
        raise ValueError(
            f"this state was made with scaling={scaling_lib.SCALINGS[int(got_code)]!r}; "
            f"this accumulate uses scaling={config.policy.scaling!r}."
        )
    got_k = scaling_lib.concrete_value(state.every_k)
    if config.static_k is not None and got_k is not None and int(got_k) != config.static_k:
        raise ValueError(
            f"this state was made with every_k={int(got_k)}; this accumulate uses "
            f"every_k={config.static_k}. Build it with the same K (or re-init the optimizer)."
        )
    return state


# ----------------------------------------------------------------------------- the transformation


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Schedule,
    *,
    scaling: scaling_lib.Scaling = "mean",
    max_norm: float | None = None,
    on_nonfinite: OnNonfinite = "skip_microbatch",
    skip_fn: SkipFn | None = None,
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates K microbatch gradients and applies ``inner`` once per window.

    Each ``update`` call takes one microbatch's gradient. Calls that do not close the window
    return zero updates; the K-th returns ``inner``'s update for the scaled sum. Use it wherever
    an optax optimizer goes (``optax.apply_updates(params, updates)`` after every call), or as
    the ``tx`` of a `accumjax.TrainState` for `accumjax.make_train_step`, which reads K and the
    policies from it (K is stated once, here).

    A window is applied only when it is usable: its weight sum is > 0, its scaled sum is finite
    (unless ``on_nonfinite="propagate"``) and the policy allows it. Otherwise the inner state is
    left bit for bit as it was, no update is returned, and the window is counted in
    ``skipped_windows``. ``jax.grad`` through ``update`` works (as through ``MultiSteps``).

    Args:
      inner: any optax transformation. It sees the scaled accumulated gradient (cast to the
        incoming gradients' dtype) once per window, and its update count equals the number of
        real updates.
      every_k: K, an int in ``[1, 2**31)`` (numpy integers welcome), or a schedule
        ``update_count -> K`` (as ``optax.MultiSteps.every_k_schedule``) returning an integer,
        evaluated after each applied update.
      scaling: ``"mean"``, ``"sum"``, ``"count"`` or ``"weighted"`` (see `accumjax.scaling`).
        ``"weighted"`` needs ``update(..., weight=w)`` on every call.
      max_norm: if set, each microbatch gradient's global norm is clipped to this before it is
        added (per-microbatch clipping, as in DP-SGD style training).
      on_nonfinite: what a microbatch with a NaN/Inf gradient does: ``"skip_microbatch"`` (not
        added, counted, the window goes on; pair with ``"count"`` so the step does not shrink),
        ``"skip_window"`` (the whole window is dropped) or ``"propagate"`` (added as is and
        not looked for, as a plain optimizer would).
      skip_fn: ``skip_fn(grads, params) -> bool``: skip a microbatch for a reason of your own
        (as ``MultiSteps``' ``should_skip_update_fn``, e.g. a too large norm); it is counted
        in ``skipped_microbatches`` and the window goes on.
      accumulator_dtype: the accumulator's minimum precision: a leaf accumulates in
        ``promote_types(param dtype, accumulator_dtype)``, so bf16/f16 gradients sum in float32
        and float64 ones stay float64. ``None`` uses the parameters' dtypes.
      axis_name: a mapped axis (``pmap``/``shard_map``) over which the window's sum, weights and
        counts are all-reduced once, at the end of the window; each device then applies the
        same update. ``"mean"`` divides by K times the axis size.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an `AccumulationState`.

    Raises:
      ValueError, TypeError: naming the argument, for a bad K or schedule, an unknown
        ``scaling`` or ``on_nonfinite``, a ``max_norm`` that is not a finite number > 0; at
        trace time for grads whose structure, shape or dtype do not match the parameters, a
        missing, negative or non-finite ``weight``, or a state that is not this
        transformation's (a plain optax state, or one made with another K or scaling).

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
    _check_policy(scaling, max_norm, on_nonfinite, skip_fn)
    config = Config(
        inner=optax.with_extra_args_support(inner),
        every_k=_check_every_k(every_k),
        policy=Policy(scaling, max_norm, on_nonfinite, skip_fn, accumulator_dtype),
        axis_name=axis_name,
    )
    return _transformation(config)


def _transformation(config: Config) -> optax.GradientTransformationExtraArgs:
    def init_fn(params: Any) -> AccumulationState:
        _check_params(params)
        return init_state(config, params)

    def update_fn(grads, state, params=None, *, weight=None, **extra_args):
        state = check_state(config, state)
        _check_grads(grads, state.window.grad_sum)
        window, _ = window_lib.add_microbatch(config.policy, state.window, grads, weight, params)
        state = state._replace(window=window, updated=jnp.zeros((), bool))
        placeholder = _updates_placeholder(config, grads, state, params, extra_args)

        def close(operand):
            updates, state, grads, params, extra_args = operand
            updates, state = end_window(config, state, updates, grads, params, extra_args)
            return updates, state, grads, params, extra_args

        operand = (placeholder, state, grads, params, extra_args)
        updates, state, *_ = window_lib.run_once(window_closes(state), close, operand)
        # Zeros unless an update was applied. Outside the loop this select fuses with the
        # caller's apply_updates (or vanishes when updates are unused).
        updates = jax.tree.map(lambda u: jnp.where(state.updated, u, jnp.zeros_like(u)), updates)
        return updates, state

    setattr(update_fn, _CONFIG_ATTR, config)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def config_of(tx: Any) -> Config | None:
    """The `Config` of an `accumulate` transformation, or None for any other transformation."""
    return getattr(getattr(tx, "update", None), _CONFIG_ATTR, None)


def with_every_k(tx: optax.GradientTransformation, every_k: int | Schedule) -> Any:
    """The same `accumulate` transformation with another K (every other option kept).

    Args:
      tx: a transformation made by `accumulate`.
      every_k: the new K or schedule.

    Returns:
      A new ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import optax, accumjax
      >>> tx = accumjax.with_every_k(accumjax.accumulate(optax.sgd(0.1), 4), 8)
      >>> accumjax.accumulation.config_of(tx).every_k
      8
    """
    config = config_of(tx)
    if config is None:
        raise TypeError("with_every_k needs a transformation made by accumjax.accumulate.")
    return _transformation(config._replace(every_k=_check_every_k(every_k)))


def init_state(config: Config, params: Any, inner_tx_state: Any = None) -> AccumulationState:
    """A fresh `AccumulationState` for ``params``: an empty window like the parameters, and
    ``inner_tx_state`` (by default ``config.inner.init(params)``)."""
    update_count = jnp.zeros((), jnp.int32)
    zero_f = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: donatable
    zero_i = lambda: jnp.zeros((), jnp.int32)
    return AccumulationState(
        window=window_lib.init_window(params, config.policy.accumulator_dtype),
        every_k=config.k_at(update_count),
        scaling_code=jnp.asarray(scaling_lib.SCALINGS.index(config.policy.scaling), jnp.int32),
        update_count=update_count,
        inner_tx_state=config.inner.init(params) if inner_tx_state is None else inner_tx_state,
        max_grad_norm=zero_f(),
        nonfinite_count=zero_i(),
        skipped_microbatches=zero_i(),
        skipped_windows=zero_i(),
        updated=jnp.zeros((), bool),
    )


def window_closes(state: AccumulationState) -> jax.Array:
    """Whether the window is full (its last microbatch has been added)."""
    return state.window.micro_step >= state.every_k


def end_window(
    config: Config,
    state: AccumulationState,
    initial: Any,
    grads_like: Any,
    params: Any,
    extra_args: dict[str, Any],
    transform: Callable[[Any, Any], Any] | None = None,
    apply_to_params: bool = False,
    closed: window_lib.Closed | None = None,
) -> tuple[Any, AccumulationState]:
    """Closes the window: reduce once, decide, and run ``inner`` only if the window is usable.

    The update runs in `accumjax.window.run_once`, so the inner state (and, with
    ``apply_to_params``, the parameters) are updated in place, and left untouched bit for bit
    when the window is not applied: no select over them, no second copy.

    Args:
      config: the transformation's `Config`.
      state: the state whose window is full.
      initial: what comes back when nothing is applied: a placeholder shaped like ``inner``'s
        updates, or the parameters with ``apply_to_params``.
      grads_like: a pytree with the dtypes ``inner`` should see (the incoming gradients).
      params: the parameters, for ``inner``.
      extra_args: extra keyword arguments for ``inner``.
      transform: ``transform(grads, params) -> grads`` applied to the window gradient before
        ``inner`` (e.g. adaptive gradient clipping), or None.
      apply_to_params: return the updated parameters instead of the updates.
      closed: the window already closed (reduced and decided, e.g. inside a ``shard_map``
        around the microbatch loop), or None to close ``state.window`` here.

    Returns:
      ``(out, state)``: ``out`` is the updates (meaningful only when ``state.updated``) or the
      new parameters; the new state has an empty window and updated counters.
    """
    if closed is None:
        closed = window_lib.close_window(
            config.policy, state.window, state.every_k, config.axis_name
        )
    dtypes = jax.tree.map(jnp.result_type, grads_like)

    def update(operand: Any) -> Any:
        out, inner_state, given, closed, extra_args, max_norm = operand
        params = out if apply_to_params else given
        scaled = window_lib.scaled_gradient(closed)
        grads = jax.tree.map(lambda g, dtype: g.astype(dtype), scaled, dtypes)
        if transform is not None:
            grads = transform(grads, params)
        updates, new_inner = config.inner.update(grads, inner_state, params, **extra_args)
        # Keep the state's dtypes (an f16 param with f32 grads would promote adam's moments),
        # so the state is a fixed pytree type under loop carries.
        new_inner = jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new_inner, inner_state)
        out = optax.apply_updates(params, updates) if apply_to_params else updates
        out = jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), out, initial)
        # The norm's one use is in here, so XLA computes it before the loop, not after it
        # (which would make it copy the gradient into the loop).
        max_norm = jnp.maximum(max_norm, closed.norm)
        # The sum's slot gets the scaled gradient: a slot the loop does not change would let
        # XLA hoist the division out of the loop, into a second gradient-sized buffer.
        return out, new_inner, given, closed._replace(grad_sum=scaled), extra_args, max_norm

    # With apply_to_params the parameters travel once (as ``out``): a loop carry holding the
    # same buffer twice would force XLA to copy it.
    given = None if apply_to_params else params
    operand = (initial, state.inner_tx_state, given, closed, extra_args, state.max_grad_norm)
    out, inner_state, *_, max_grad_norm = window_lib.run_once(closed.apply, update, operand)
    apply = closed.apply
    update_count = jnp.where(apply, optax.safe_increment(state.update_count), state.update_count)
    return out, state._replace(
        window=window_lib.empty_like(state.window),
        every_k=config.k_at(update_count),
        update_count=update_count,
        inner_tx_state=inner_state,
        max_grad_norm=max_grad_norm,
        nonfinite_count=window_lib.saturating_add(state.nonfinite_count, closed.nonfinite_count),
        skipped_microbatches=window_lib.saturating_add(
            state.skipped_microbatches, closed.skipped_count
        ),
        skipped_windows=window_lib.saturating_add(state.skipped_windows, ~apply),
        updated=apply,
    )


def _updates_placeholder(
    config: Config, grads: Any, state: AccumulationState, params: Any, extra_args: Any
) -> Any:
    """A pytree shaped like ``inner``'s updates for the loop carry, its values never used.

    The incoming gradients serve when their shapes and dtypes fit (no new buffer to fill);
    otherwise zeros of the right shapes.
    """
    shapes = jax.eval_shape(
        lambda g, s, p: config.inner.update(g, s, p, **extra_args)[0],
        grads,
        state.inner_tx_state,
        params,
    )
    spec = lambda x: (jnp.shape(x), jnp.result_type(x))
    if jax.tree.structure(shapes) == jax.tree.structure(grads) and all(
        spec(a) == spec(b)
        for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(grads), strict=True)
    ):
        return grads
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# ----------------------------------------------------------------------------- free functions


def _unwrap(state: Any) -> AccumulationState:
    """The `AccumulationState` inside ``state``: itself, or Flax NNX's variable-wrapped copy."""
    is_variable = lambda x: hasattr(x, "get_value") and hasattr(x, "set_value")
    state = jax.tree.map(
        lambda x: x.get_value() if is_variable(x) else x, state, is_leaf=is_variable
    )
    if not isinstance(state, AccumulationState):
        raise TypeError(f"expected an accumjax AccumulationState, got {type(state).__name__}.")
    return state


def should_update(state: Any) -> jax.Array:
    """Whether the next ``update`` call closes the window (and may apply an update).

    Args:
      state: an `AccumulationState` (or an NNX optimizer's ``opt_state`` holding one).

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 1).init({"w": jnp.zeros(2)})
      >>> bool(accumjax.should_update(state))
      True
    """
    state = _unwrap(state)
    return state.window.micro_step + 1 >= state.every_k


def has_updated(state: Any) -> jax.Array:
    """Whether the last ``update`` call applied an inner update (as ``MultiSteps.has_updated``).

    A window closed without an update (every microbatch skipped, a non-finite sum, or
    ``"skip_window"`` after a non-finite microbatch) reports False.

    Args:
      state: an `AccumulationState` (or an NNX optimizer's ``opt_state`` holding one).

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 1)
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> bool(accumjax.has_updated(state))
      True
    """
    return _unwrap(state).updated


def accumulated_gradients(state: Any) -> Any:
    """The window's gradient so far, scaled as the strategy says (zeros if nothing was added).

    This is what ``inner`` would receive if the window closed now (before any cross-device
    reduction, and in the accumulator dtype).

    Args:
      state: an `AccumulationState` (or an NNX optimizer's ``opt_state`` holding one).

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
    state = _unwrap(state)
    window = state.window
    k = jnp.asarray(state.every_k, jnp.float32)
    denominators = jnp.stack([k, jnp.ones_like(k), window.weight_sum, window.weight_sum])
    denom = denominators[state.scaling_code]
    safe = jnp.where(denom > 0, denom, 1.0)
    return jax.tree.map(lambda a: a / safe.astype(a.dtype), window.grad_sum)


def reset(state: AccumulationState) -> AccumulationState:
    """Empties the current window and keeps the inner state, counters and K.

    Args:
      state: an `AccumulationState`.

    Returns:
      The state with a zero accumulator, ``micro_step == 0`` and zero window counts.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 4)
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> int(accumjax.reset(state).window.micro_step)
      0
    """
    return state._replace(window=window_lib.empty_like(state.window))


def stats(state: Any) -> AccumulationStats:
    """Summarises an `AccumulationState` (steps, updates, norms, skips, accumulator size).

    Args:
      state: an `AccumulationState` (or an NNX optimizer's ``opt_state`` holding one).

    Returns:
      An `AccumulationStats`; its sizes are Python ints (static), the rest arrays.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 8).init({"w": jnp.zeros((4, 4))})
      >>> s = accumjax.stats(state)
      >>> int(s.accumulation_steps), s.num_parameters, s.memory_bytes
      (8, 16, 64)
    """
    state = _unwrap(state)
    leaves = jax.tree.leaves(state.window.grad_sum)
    return AccumulationStats(
        accumulation_steps=state.every_k,
        current_step=state.window.micro_step,
        total_cycles=state.update_count,
        max_grad_norm=state.max_grad_norm,
        overflow_detected=state.nonfinite_count > 0,
        num_nonfinite=state.nonfinite_count,
        skipped_microbatches=state.skipped_microbatches,
        skipped_windows=state.skipped_windows,
        num_parameters=sum(int(x.size) for x in leaves),
        memory_bytes=sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in leaves),
    )
