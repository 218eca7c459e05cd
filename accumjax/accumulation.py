"""Gradient accumulation as an optax transformation: `accumulate` and `with_every_k`.

``accumulate(inner, K)`` collects K microbatch gradients and hands their scaled sum to
``inner`` once per window, a drop-in replacement for ``optax.MultiSteps``: ``inner`` runs only
when a window closes (its state is untouched bit for bit in between), the accumulator keeps a
plain sum divided once (`accumjax.scaling`), and a non-finite microbatch is counted and left
out while it still advances the window.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

import accumjax._scaling as scaling_lib
import accumjax._state as state_lib
import accumjax._window as window_lib
import accumjax._window_end as window_end
from accumjax._checks import (
    check_callable,
    check_choice,
    check_int,
    check_real,
    raise_on_unknown_kwargs,
)
from accumjax._config import (
    ON_NONFINITE,
    Config,
    OnNonfinite,
    Schedule,
    SkipFn,
    check_microbatch_transform,
    scheduled_k,
    transform_state,
)
from accumjax._control import run_once
from accumjax._moved import forward_moved
from accumjax._multisteps import (
    MULTISTEPS_ARGS,
    Transformation,
    check_inner,
    check_skip_fn,
)
from accumjax._state import CONFIG_ATTR
from accumjax._window_end import updates_placeholder

__all__ = ["accumulate", "with_every_k"]


# Exported by 0.4, internal or exported by another public module now (`AccumulationState`:
# accumjax.accumulation_state): resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)

# ----------------------------------------------------------------------------- validation


def _check_every_k(every_k: Any) -> int | Schedule:
    if not callable(every_k):
        return check_int("every_k", every_k)
    first = scheduled_k(every_k, jnp.zeros((), jnp.int32))
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
        memory cost (more under FSDP, where it gathers the gradient full-size:
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
    raise_on_unknown_kwargs("accumulate", multisteps, MULTISTEPS_ARGS)
    if every_k is None:
        raise TypeError("accumulate needs every_k, K: accumulate(inner, every_k=K).")
    check_inner(inner)
    scaling = _check_policy(scaling, max_norm, on_nonfinite, skip_fn, microbatch_transform)
    config = Config(
        inner=optax.with_extra_args_support(inner),
        every_k=_check_every_k(every_k),
        axis_name=axis_name,
        scaling=scaling,
        max_norm=max_norm,
        on_nonfinite=on_nonfinite,
        skip_fn=skip_fn,
        accumulator_dtype=accumulator_dtype,
        microbatch_transform=microbatch_transform,
    )
    return _transformation(config)


def _transformation(config: Config) -> optax.GradientTransformationExtraArgs:
    def init_fn(params: Any) -> state_lib.AccumulationState:
        _check_params(params)
        transform = config.microbatch_transform
        if transform is not None:
            jax.eval_shape(lambda p: transform_state(transform, p), params)
        return window_end.init_state(config, params)

    def update_fn(grads, state, params=None, *, weight=None, **extra_args):
        state = window_end.check_state(config, state)
        _check_grads(grads, state.window)
        window, micro = window_lib.add_microbatch(
            config, state.window, grads, weight, params, axis_name=config.axis_name
        )
        state = state._replace(window=window, updated=jnp.zeros((), bool), added=micro.added)
        placeholder = updates_placeholder(config, grads, state, params, extra_args)

        def close(operand):
            updates, state, grads, params, extra_args = operand
            updates, state = window_end.close_and_update(
                config,
                state,
                placeholder=updates,
                grads_like=grads,
                params=params,
                extra_args=extra_args,
            )
            return updates, state, grads, params, extra_args

        operand = (placeholder, state, grads, params, extra_args)
        updates, state, *_ = run_once(window_end.window_closes(state), close, operand)
        # Zeros unless an update was applied. Outside the loop this select fuses with the
        # caller's apply_updates (or vanishes when updates are unused).
        updates = jax.tree.map(lambda u: jnp.where(state.updated, u, jnp.zeros_like(u)), updates)
        return updates, state

    setattr(update_fn, CONFIG_ATTR, config)
    return Transformation(init=init_fn, update=update_fn)  # pyright: ignore[reportArgumentType]


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
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.with_every_k(accumjax.accumulate(optax.sgd(0.1), 4), 8)
      >>> int(tx.init({"w": jnp.zeros(2)}).every_k)
      8
    """
    config = state_lib.config_of(tx)
    if config is None:
        raise TypeError("with_every_k needs a transformation made by accumjax.accumulate.")
    return _transformation(config._replace(every_k=_check_every_k(every_k)))
