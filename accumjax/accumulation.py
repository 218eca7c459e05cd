"""Gradient accumulation as an optax transformation: `accumulate` and its window end.

``accumulate(inner, K)`` collects K microbatch gradients and hands their scaled sum to ``inner``
once per window, so K small microbatches give the update of one big batch. It is a drop-in
replacement for ``optax.MultiSteps`` with these differences:

- ``inner`` runs only at the end of a window, inside `accumjax._window.run_once` (on a CPU a
  loop that runs at most once, updated in place; on a CUDA GPU a conditional, which the
  device decides without a host round trip), so a non-update microstep costs a gradient, a
  norm and an add, and the inner state is untouched bit for bit between updates.
- The accumulator keeps a plain sum (never narrower than float32 by default) and divides once,
  by the strategy's denominator (see `accumjax.scaling`).
- A non-finite microbatch is detected, counted and (by default) left out; it still advances the
  window, so windows stay aligned with the data (``optax.MultiSteps`` with ``skip_not_finite``
  instead pretends the call never happened). The window's sum is checked once more when it
  closes, so finite microbatches whose sum overflows skip the window and are counted too.
- With ``axis_name`` the window's sum is all-reduced once per window, and every device takes
  the same decision about each microbatch (`accumjax._window.inspect_microbatch`).

The state and the free functions that read it (`accumjax.stats`, `accumjax.has_updated`, ...)
are `accumjax.accumulation_state`. `close_and_update` (this transformation's ``update``) and
`close_and_apply` (`accumjax.make_train_step`, which updates the parameters in the same loop)
are the one place that acts on a closed window.

The window logic (add, close, decide) is `accumjax.window`, shared with `make_train_step`'s
stream and scan modes, so a policy means the same thing everywhere.

Reference: ``optax.MultiSteps``; the seed behaviour is the TensorFlow GradientAccumulator library
(andreped/GradientAccumulator), whose optimizer wrapper runs the inner optimizer every step and
thereby advances Adam/momentum state on non-update steps, which this module does not do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

import accumjax._window as window_lib
from accumjax import scaling as scaling_lib
from accumjax._checks import (
    INT32_MAX,
    check_callable,
    check_choice,
    check_int,
    check_real,
    refuse_unknown,
)
from accumjax._control import select_once
from accumjax._multisteps import (
    MULTISTEPS_ARGS,
    Transformation,
    check_inner,
    check_inner_state,
    check_skip_fn,
)
from accumjax._policy import check_microbatch_transform, transform_state
from accumjax._window import ON_NONFINITE, OnNonfinite, Policy, SkipFn
from accumjax.accumulation_state import (
    CONFIG_ATTR,
    AccumulationState,
    check_made_for,
    config_of,
    k_tag,
)

__all__ = [
    "AccumulationState",
    "Config",
    "accumulate",
    "check_state",
    "close_and_apply",
    "close_and_update",
    "config_of",
    "init_state",
    "window_closes",
    "with_every_k",
]

Schedule = Callable[[jax.Array], jax.typing.ArrayLike]


class Config(NamedTuple):
    """Everything static about one `accumulate` transformation (read by `make_train_step`).

    Attributes:
      inner: the inner transformation (with extra-args support).
      every_k: K as given: an int, or a schedule.
      policy: the window `Policy`.
      axis_name: the mapped axis of the once-per-window reduction and of the decisions about
        each microbatch, or None.
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
        return jnp.clip(k, 1, INT32_MAX).astype(jnp.int32)


# ----------------------------------------------------------------------------- validation


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


def _check_policy(
    scaling: Any, max_norm: Any, on_nonfinite: Any, skip_fn: Any, microbatch_transform: Any
) -> scaling_lib.Scaling:
    """Validates the policy's arguments; returns the strategy's name (``"count"``:
    ``"mean"``)."""
    scaling = scaling_lib.validate_scaling(scaling)
    check_choice("on_nonfinite", on_nonfinite, ON_NONFINITE)
    if max_norm is not None:
        check_real("max_norm", max_norm, low=0.0, low_open=True)
    check_callable("skip_fn", skip_fn)
    check_skip_fn(skip_fn)
    check_microbatch_transform(microbatch_transform, max_norm)
    return scaling


def _check_params(params: Any) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.result_type(p)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {dtype}; "
                "accumulate needs floating-point (or complex) parameters."
            )


def _check_grads(grads: Any, window: Any) -> None:
    if isinstance(window, window_lib.DeviceWindow):
        raise ValueError(
            "this AccumulationState keeps its window per data shard (a train step's stream "
            "state, step.init): the step reduces it once per window. tx.update and "
            "apply_gradients take reduced gradients: use opt_state=tx.init(params) (or "
            "TrainState.create) for them."
        )
    acc = window.grad_sum
    if acc is None:
        raise ValueError(
            "this AccumulationState has no accumulator: it was built for "
            "make_train_step(mode='scan'), whose window opens and closes inside one call. "
            "Feeding microbatches one by one needs the accumulator: tx.init(params), "
            "TrainState.create(...), or accumjax.with_mode(state, 'stream')."
        )
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

    A state made for another K (a checkpoint resumed under another ``every_k``) is refused
    from its type (`AccumulationState.every_k_tag`), so at trace time under ``jit`` too; one
    made with another scaling when its (concrete) code says so (``"mean"``, ``"count"`` and
    ``"sum_over_k"`` states are one state: `accumjax.scaling.compatible`; under ``jit`` the
    code is traced: `make_train_step` checks it on its first call).
    """
    if not isinstance(state, AccumulationState):
        raise TypeError(
            "accumulate's update needs the AccumulationState made by its own init, got "
            f"{type(state).__name__} (a plain optax state? pass state=tx.init(params))."
        )
    check_made_for(state, config.static_k, config.policy.scaling)
    return state


# ----------------------------------------------------------------------------- the transformation


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Schedule | None = None,
    *,
    scaling: scaling_lib.Scaling = "mean",
    max_norm: float | None = None,
    on_nonfinite: OnNonfinite = "skip_microbatch",
    skip_fn: SkipFn | None = None,
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | None = None,
    microbatch_transform: optax.GradientTransformation | None = None,
    **multisteps: Any,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates K microbatch gradients and applies ``inner`` once per window.

    Each ``update`` call takes one microbatch's gradient. Calls that do not close the window
    return zero updates; the K-th returns ``inner``'s update for the scaled sum. Use it wherever
    an optax optimizer goes (``optax.apply_updates(params, updates)`` after every call), or as
    the ``tx`` of a `accumjax.TrainState` for `accumjax.make_train_step`, which reads K and the
    policies from it (K is stated once, here). Other optax transforms go inside,
    ``accumulate(optax.chain(..., inner), K)``, and run once per window; `make_train_step`
    refuses an ``accumulate`` inside another combinator (see the composition table of the
    modes guide).

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
      scaling: ``"mean"`` (the mean of the microbatches the window used), ``"sum"``,
        ``"weighted"`` or ``"sum_over_k"`` (the sum over K, skips or not); see
        `accumjax.scaling`. ``"weighted"`` needs ``update(..., weight=w)`` on every call.
        ``"count"`` is deprecated: it is ``"mean"``.
      max_norm: if set, each microbatch gradient's global norm is clipped to this before it is
        added (per-microbatch clipping, as in DP-SGD style training): the same as
        ``microbatch_transform=optax.clip_by_global_norm(max_norm)`` (to float rounding),
        as a scalar factor (on a mesh each device scales its own rows' gradient by it).
      on_nonfinite: what a microbatch with a NaN/Inf gradient does: ``"skip_microbatch"`` (not
        added, counted, the window goes on; ``"mean"`` divides by the microbatches used),
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
        same update. ``"mean"`` divides by the microbatches used times the axis size. Each
        call's microbatch is decided about whole, the same on every device (an all-reduce of
        two scalars; of the gradient for ``max_norm``, ``skip_fn`` and
        ``microbatch_transform``; none with ``"propagate"``).
      microbatch_transform: a stateless optax transformation (its ``init`` state holds no
        array, e.g. `accumjax.adaptive_clip`) applied to each microbatch's gradient before
        it is added: ``update(g_i, empty state, params)``. ``g_i`` is what ``max_norm`` and
        ``skip_fn`` see: the microbatch's gradient as the loss gives it (the gradient of its
        own mean loss; on a mesh, of the whole microbatch, the same on every device), before
        its weight and before the window's division. The window adds ``T(g_i)`` (times its
        weight under ``"weighted"``) and divides the sum as always. GradientAccumulator's
        ``use_agc=True`` clips the gradient of ``loss / K`` instead; since
        ``AGC(g / K, c) == AGC(g, K * c) / K``, its ``clip_factor=c`` is
        ``microbatch_transform=accumjax.adaptive_clip(K * c, eps)`` with ``scaling="mean"``
        (``docs/guides/clipping.md``). It reads the gradient as ``max_norm`` does, at that
        memory cost (more under FSDP, where it gathers the whole gradient:
        ``docs/limits.md``); exclusive with ``max_norm`` (chain the two instead).
      **multisteps: none taken: ``optax.MultiSteps``' argument names (``every_k_schedule``,
        ``use_grad_mean``, ``should_skip_update_fn``) raise a ``TypeError`` naming what to
        write instead.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an `AccumulationState`.

    Raises:
      ValueError, TypeError: naming the argument, for a bad K or schedule, an unknown
        ``scaling`` or ``on_nonfinite``, a ``max_norm`` that is not a finite number > 0, a
        ``microbatch_transform`` that is not a transformation or comes with ``max_norm``, an
        ``inner`` that accumulates too (``optax.MultiSteps``; at ``init``, an inner state
        holding ``MultiSteps``' or another ``accumulate``'s); at ``init`` for a
        ``microbatch_transform`` with state; at trace time for grads whose structure, shape or
        dtype do not match the parameters, a missing, negative or non-finite ``weight``, or a
        state that is not this transformation's (a plain optax state, or one made with another
        K or scaling).
      TypeError: for a missing ``every_k``, and for ``optax.MultiSteps``' names (its
        arguments, ``skip_fn=optax.skip_not_finite``), naming what to write instead; reading
        ``MultiSteps``' attributes (``tx.has_updated``, ...) raises an ``AttributeError`` that
        names where accumjax has them.

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
    refuse_unknown("accumulate", multisteps, MULTISTEPS_ARGS)
    if every_k is None:
        raise TypeError("accumulate needs every_k, K: accumulate(inner, every_k=K).")
    check_inner(inner)
    scaling = _check_policy(scaling, max_norm, on_nonfinite, skip_fn, microbatch_transform)
    policy = Policy(
        scaling, max_norm, on_nonfinite, skip_fn, accumulator_dtype, microbatch_transform
    )
    config = Config(
        inner=optax.with_extra_args_support(inner),
        every_k=_check_every_k(every_k),
        policy=policy,
        axis_name=axis_name,
    )
    return _transformation(config)


def _transformation(config: Config) -> optax.GradientTransformationExtraArgs:
    def init_fn(params: Any) -> AccumulationState:
        _check_params(params)
        transform = config.policy.microbatch_transform
        if transform is not None:
            jax.eval_shape(lambda p: transform_state(transform, p), params)
        return init_state(config, params)

    def update_fn(grads, state, params=None, *, weight=None, **extra_args):
        state = check_state(config, state)
        _check_grads(grads, state.window)
        window, micro = window_lib.add_microbatch(
            config.policy, state.window, grads, weight, params, axis_name=config.axis_name
        )
        state = state._replace(window=window, updated=jnp.zeros((), bool), added=micro.added)
        placeholder = _updates_placeholder(config, grads, state, params, extra_args)

        def close(operand):
            updates, state, grads, params, extra_args = operand
            updates, state = close_and_update(
                config,
                state,
                placeholder=updates,
                grads_like=grads,
                params=params,
                extra_args=extra_args,
            )
            return updates, state, grads, params, extra_args

        operand = (placeholder, state, grads, params, extra_args)
        updates, state, *_ = window_lib.run_once(window_closes(state), close, operand)
        # Zeros unless an update was applied. Outside the loop this select fuses with the
        # caller's apply_updates (or vanishes when updates are unused).
        updates = jax.tree.map(lambda u: jnp.where(state.updated, u, jnp.zeros_like(u)), updates)
        return updates, state

    setattr(update_fn, CONFIG_ATTR, config)
    return Transformation(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def with_every_k(tx: optax.GradientTransformation, every_k: int | Schedule) -> Any:
    """The same `accumulate` transformation with another K (every other option kept).

    A state keeps the K it was made with (in its type, `AccumulationState.every_k_tag`): the
    new transformation refuses ``tx``'s states, naming the K they were made with, and
    ``with_every_k(tx, K)`` of that K resumes them.

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


def init_state(
    config: Config, params: Any, inner_tx_state: Any = None, *, accumulator: bool = True
) -> AccumulationState:
    """A fresh `AccumulationState` for ``params``: an empty window like the parameters, and
    ``inner_tx_state`` (by default ``config.inner.init(params)``, refused if it holds an
    ``optax.MultiSteps`` or another `accumulate` state: either would accumulate a second time).

    ``accumulator=False`` leaves the window's sum out (``grad_sum=None``): the state of
    `accumjax.make_train_step`'s scan mode, whose accumulator lives inside the step."""
    update_count = jnp.zeros((), jnp.int32)
    zero_f = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: donatable
    zero_i = lambda: jnp.zeros((), jnp.int32)
    window = window_lib.init_window(
        params if accumulator else None, config.policy.accumulator_dtype
    )
    if inner_tx_state is None:
        inner_tx_state = config.inner.init(params)
        check_inner_state(inner_tx_state)
    return AccumulationState(
        window=window,
        every_k=config.k_at(update_count),
        every_k_tag=k_tag(config.static_k),
        scaling_code=jnp.asarray(scaling_lib.SCALINGS.index(config.policy.scaling), jnp.int32),
        update_count=update_count,
        inner_tx_state=inner_tx_state,
        max_grad_norm=zero_f(),
        grad_norm=zero_f(),
        nonfinite_count=zero_i(),
        skipped_microbatches=zero_i(),
        skipped_windows=zero_i(),
        updated=jnp.zeros((), bool),
        added=jnp.zeros((), bool),
    )


def window_closes(state: AccumulationState) -> jax.Array:
    """Whether the window is full (its last microbatch has been added)."""
    return state.window.micro_step >= state.every_k


def close_and_update(
    config: Config,
    state: AccumulationState,
    *,
    placeholder: Any,
    grads_like: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, AccumulationState]:
    """Closes the full window and, if it is usable, returns ``inner``'s updates for it.

    The optax path (`accumulate`'s ``update``): reduce once, decide, and run ``inner`` in a
    `accumjax._window.run_once`, so the inner state is updated in place and left bit for bit
    as it was when the window is not applied.

    Args:
      config: the transformation's `Config`.
      state: the state whose window is full.
      placeholder: a pytree shaped like ``inner``'s updates, returned when nothing is applied.
      grads_like: a pytree with the dtypes ``inner`` should see (the incoming gradients).
      params: the parameters, for ``inner``.
      extra_args: extra keyword arguments for ``inner``.

    Returns:
      ``(updates, state)``: the updates are meaningful only when ``state.updated``; the new
      state has an empty window and updated counters.
    """
    closed = window_lib.close_window(config.policy, state.window, state.every_k, config.axis_name)
    dtypes = jax.tree.map(_like, grads_like)

    def update(operand: Any) -> Any:
        out, inner_state, params, closed, extra_args, norms = operand
        updates, inner_state, scaled, norms = _inner_update(
            config, closed, inner_state, params, dtypes, extra_args, norms
        )
        out = _cast_like(updates, out)
        return out, inner_state, params, closed._replace(grad_sum=scaled), extra_args, norms

    norms = (state.max_grad_norm, state.grad_norm)
    operand = (placeholder, state.inner_tx_state, params, closed, extra_args, norms)
    out, inner_state, *_, norms = window_lib.run_once(closed.apply, update, operand)
    return out, _after_close(config, state, closed, inner_state, norms)


def close_and_apply(
    config: Config,
    state: AccumulationState,
    params: Any,
    *,
    closed: window_lib.Closed | None = None,
    every_step: bool = False,
) -> tuple[Any, AccumulationState]:
    """Closes the full window and, if it is usable, applies ``inner``'s update to ``params``.

    The train-step path: as `close_and_update`, but the parameters are updated inside the
    `accumjax._window.run_once` too (in place, untouched when the window is not applied), and
    ``inner`` sees gradients in the parameters' dtypes.

    Args:
      config: the transformation's `Config`.
      state: the state whose window is full.
      params: the parameters.
      closed: the window already closed (reduced and decided, e.g. inside a ``shard_map``
        around the microbatch loop), or None to close ``state.window`` here.
      every_step: a window closes on every step (scan mode): its update is selected rather
        than branched to on a GPU (`accumjax._control.select_once`).

    Returns:
      ``(params, state)``: the new parameters and the state with an empty window.
    """
    if closed is None:
        closed = window_lib.close_window(
            config.policy, state.window, state.every_k, config.axis_name
        )
    dtypes = jax.tree.map(_like, params)

    def update(operand: Any) -> Any:
        params, inner_state, closed, norms = operand
        updates, inner_state, scaled, norms = _inner_update(
            config, closed, inner_state, params, dtypes, {}, norms
        )
        new_params = _cast_like(optax.apply_updates(params, updates), params)
        return new_params, inner_state, closed._replace(grad_sum=scaled), norms

    # The parameters travel once: a loop carry holding one buffer twice makes XLA copy it.
    operand = (params, state.inner_tx_state, closed, (state.max_grad_norm, state.grad_norm))
    run = select_once if every_step else window_lib.run_once
    params, inner_state, _, norms = run(closed.apply, update, operand)
    return params, _after_close(config, state, closed, inner_state, norms)


def _inner_update(
    config: Config,
    closed: window_lib.Closed,
    inner_state: Any,
    params: Any,
    dtypes: Any,
    extra_args: dict[str, Any],
    norms: tuple[jax.Array, jax.Array],
) -> tuple[Any, Any, Any, tuple[jax.Array, jax.Array]]:
    """``inner`` on the scaled window gradient: ``(updates, inner state, scaled gradient,
    norms)``, ``norms`` the running maximum of the window norm and the norm of the gradient
    ``inner`` sees.

    The scaled gradient goes back into the sum's slot of the loop carry: a slot the loop does
    not change would let XLA hoist the division out of the loop, into a second gradient-sized
    buffer. The norms are taken inside the loop too, so the window norm's one use is in there
    (after the loop XLA would copy the gradient into the loop for it).
    """
    scaled = window_lib.scaled_gradient(closed)
    # In the parameters' shapes (a window kept per data shard has a leading axis of one).
    grads = jax.tree.map(lambda g, like: g.reshape(like.shape).astype(like.dtype), scaled, dtypes)
    updates, new_inner = config.inner.update(grads, inner_state, params, **extra_args)
    norms = (jnp.maximum(norms[0], closed.norm), closed.norm.astype(jnp.float32))
    # Keep the state's dtypes (an f16 param with f32 grads would promote adam's moments), so
    # the state is a fixed pytree type under loop carries.
    return updates, _cast_like(new_inner, inner_state), scaled, norms


def _like(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _cast_like(tree: Any, like: Any) -> Any:
    return jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), tree, like)


def _after_close(
    config: Config,
    state: AccumulationState,
    closed: window_lib.Closed,
    inner_state: Any,
    norms: tuple[jax.Array, jax.Array],
) -> AccumulationState:
    """The state after a window closed: empty window, next K, counters, norms."""
    apply = closed.apply
    update_count = jnp.where(apply, optax.safe_increment(state.update_count), state.update_count)
    return state._replace(
        window=window_lib.empty_like(state.window),
        every_k=config.k_at(update_count),
        update_count=update_count,
        inner_tx_state=inner_state,
        max_grad_norm=norms[0],
        grad_norm=norms[1],
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
