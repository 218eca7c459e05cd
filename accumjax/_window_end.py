"""The `accumulate` transformation's state (`init_state`, `check_state`) and its window end:
`close_and_update` (the transformation's ``update``) and `close_and_apply` (the train step's,
which updates the parameters in the same loop), the one place that acts on a closed window.
It reads the transformation's static `accumjax._config.Config`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import accumjax._scaling as scaling_lib
import accumjax._window as window_lib
from accumjax._config import Config
from accumjax._control import run_once, select_once
from accumjax._multisteps import check_inner_state
from accumjax._state import check_made_for, tag_for_every_k
from accumjax.accumulation_state import AccumulationState

__all__ = [
    "check_state",
    "close_and_apply",
    "close_and_update",
    "init_state",
    "updates_placeholder",
    "window_closes",
]


def check_state(config: Config, state: Any) -> AccumulationState:
    """``state`` if it is this transformation's `AccumulationState`, else a clear error.

    A state made for another K (a checkpoint resumed under another ``every_k``) is refused
    from its type (`AccumulationState.every_k_tag`), so at trace time under ``jit`` too; one
    made with another scaling when its (concrete) code says so (``"mean"``, ``"count"`` and
    ``"sum_over_k"`` states are one state: `accumjax._scaling.compatible`; under ``jit`` the
    code is traced: `make_train_step` checks it on its first call).
    """
    if not isinstance(state, AccumulationState):
        raise TypeError(
            "accumulate's update needs the AccumulationState made by its own init, got "
            f"{type(state).__name__} (a plain optax state? pass state=tx.init(params))."
        )
    check_made_for(state, config.static_every_k, config.scaling)
    return state


def init_state(
    config: Config, params: Any, inner_tx_state: Any = None, *, accumulator: bool = True
) -> AccumulationState:
    """A fresh `AccumulationState` for ``params``: an empty window like the parameters, and
    ``inner_tx_state`` (by default ``config.inner.init(params)``, refused if it holds an
    ``optax.MultiSteps`` or another `accumulate` state: either would accumulate a second time).

    ``accumulator=False`` leaves the window's sum out (``grad_sum=None``): the state of
    `accumjax.make_train_step`'s scan mode, whose accumulator lives inside the step.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> from accumjax._state import config_of
      >>> config = config_of(accumjax.accumulate(optax.sgd(0.1), 4))
      >>> init_state(config, {"w": jnp.zeros(2)}, accumulator=False).window.grad_sum is None
      True
    """
    update_count = jnp.zeros((), jnp.int32)
    zero_f = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: donatable
    zero_i = lambda: jnp.zeros((), jnp.int32)
    window = window_lib.init_window(params if accumulator else None, config.accumulator_dtype)
    if inner_tx_state is None:
        inner_tx_state = config.inner.init(params)
        check_inner_state(inner_tx_state)
    return AccumulationState(
        window=window,
        every_k=config.every_k_at(update_count),
        every_k_tag=tag_for_every_k(config.static_every_k),
        scaling_code=jnp.asarray(scaling_lib.SCALINGS.index(config.scaling), jnp.int32),
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
    `accumjax._control.run_once`, so the inner state is updated in place and left bit for bit
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
    closed = window_lib.close_window(config, state.window, state.every_k, config.axis_name)
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
    out, inner_state, *_, norms = run_once(closed.apply, update, operand)
    return out, _after_close(config, state, closed, inner_state, norms)


def close_and_apply(
    config: Config,
    state: AccumulationState,
    params: Any,
    axis_name: str | None,
    *,
    closed: window_lib.Closed | None = None,
    every_step: bool = False,
    split: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
) -> tuple[Any, AccumulationState]:
    """Closes the full window and, if it is usable, applies ``inner``'s update to ``params``.

    The train-step path: as `close_and_update`, but the parameters are updated inside the
    `accumjax._control.run_once` too (in place, untouched when the window is not applied), and
    ``inner`` sees gradients in the parameters' dtypes.

    Args:
      config: the transformation's `Config`.
      state: the state whose window is full.
      params: the parameters.
      axis_name: the step's mapped axis the window is reduced over (the step's, not
        ``config``'s), or None.
      closed: the window already closed (reduced and decided, e.g. inside a ``shard_map``
        around the microbatch loop), or None to close ``state.window`` here.
      every_step: a window closes on every step (scan mode): its update is selected rather
        than branched to on a GPU (`accumjax._control.select_once`).
      split: ``(to_shards, to_param_layout)``: ``inner`` updates ``to_shards(params)`` (ZeRO: split
        like the reduced gradient) and the result goes back through ``to_param_layout``, both in
        the update's loop (so only an applied window gathers); None for ``params`` as is.

    Returns:
      ``(params, state)``: the new parameters and the state with an empty window.
    """
    if closed is None:
        closed = window_lib.close_window(config, state.window, state.every_k, axis_name)
    dtypes = jax.tree.map(_like, params)

    def update(operand: Any) -> Any:
        params, inner_state, closed, norms = operand
        if split is not None:
            params = split[0](params)
        updates, inner_state, scaled, norms = _inner_update(
            config, closed, inner_state, params, dtypes, {}, norms
        )
        new_params = _cast_like(optax.apply_updates(params, updates), params)
        if split is not None:
            # The new shards leave through the gradient's slot of the carry (free once read)
            # where they fit it, rather than a buffer of their own until they are gathered.
            scaled = jax.tree.map(_in_slot, new_params, scaled)
            new_params = split[1](new_params)
        return new_params, inner_state, closed._replace(grad_sum=scaled), norms

    # The parameters travel once: a loop carry holding one buffer twice makes XLA copy it.
    operand = (params, state.inner_tx_state, closed, (state.max_grad_norm, state.grad_norm))
    run = select_once if every_step else run_once
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


def _in_slot(new: Any, slot: Any) -> Any:
    """``new`` where it has ``slot``'s shape and dtype, else ``slot``."""
    same = jnp.shape(new) == jnp.shape(slot) and jnp.result_type(new) == jnp.result_type(slot)
    return new if same else slot


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
        window=window_lib.emptied_window(state.window),
        every_k=config.every_k_at(update_count),
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


def updates_placeholder(
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
