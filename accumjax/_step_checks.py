"""What a train step refuses at trace time (internal): misuse gets a clear error naming the
argument, never a silently wrong run.

`check_step_inputs` runs once per trace, from `accumjax._loop.begin`, for every mode: an
optimizer state holding ``optax.MultiSteps``, an ``rng`` that is not one key or a loss that
takes no key, self-closing BatchNorm layers (which cannot follow the optimizer's window), and
float16 without a loss scale in the state or with ``on_nonfinite="propagate"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from accumjax._batch_norm_windows import check_no_self_closing
from accumjax.window import Policy

__all__ = ["check_key_argument", "check_step_inputs", "positional_limit"]


def check_step_inputs(
    state: Any, policy: Policy, rng: Any, loss_positional: int | None, f16: bool
) -> None:
    """Every trace-time check of a step's inputs (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.MultiSteps(optax.sgd(0.1), 2))
      >>> check_step_inputs(state, Policy(), None, 2, False)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: tx is or contains optax.MultiSteps ...
    """
    _check_no_multisteps(state.opt_state)
    _check_rng(rng)
    check_key_argument(loss_positional, 2 if state.model_state is None else 3, rng)
    if state.model_state is not None:
        check_no_self_closing(state.model_state, "make_train_step")
    if f16:
        _check_float16(state.loss_scale, policy)


def _check_float16(loss_scale: Any, policy: Policy) -> None:
    if loss_scale is None:
        raise ValueError(
            "mixed_precision='float16' keeps its dynamic loss scale in the state, but "
            "state.loss_scale is None: create the state with TrainState.create(..., "
            "loss_scale=accumjax.dynamic_loss_scale()) (or nnx_train_state(..., loss_scale=...)). "
            "A scale made by the step would change the state's structure at its first call, "
            "so a checkpoint would no longer restore into a freshly created state."
        )
    if not policy.detects:
        raise ValueError(
            "mixed_precision='float16' with accumulate(..., on_nonfinite='propagate'): a "
            "float16 overflow would be applied to the parameters and the loss scale never "
            "lowered. Use on_nonfinite='skip_microbatch' (the default) or 'skip_window'."
        )


def _is_multisteps(node: Any) -> bool:
    return isinstance(node, optax.MultiStepsState)


def _check_no_multisteps(opt_state: Any) -> None:
    """Refuses an optimizer state holding an ``optax.MultiStepsState`` (anywhere in it)."""
    if any(map(_is_multisteps, jax.tree.leaves(opt_state, is_leaf=_is_multisteps))):
        raise TypeError(
            "tx is or contains optax.MultiSteps (state.opt_state holds an "
            "optax.MultiStepsState): the train step accumulates by itself and would run it as "
            "a plain optimizer, reporting an update (metrics['updated'], state.step) on every "
            "call while MultiSteps holds its updates back. Use tx=accumjax.accumulate(inner, K) "
            "in place of optax.MultiSteps(inner, K)."
        )


def _describe(value: Any) -> str:
    """``int32[]``, ``key<fry>[3]``: an array's dtype and shape, or a value's type."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{dtype}{list(shape)}"


def _check_rng(rng: Any) -> None:
    """``rng`` is None, one typed key (shape ``()``) or one raw ``uint32`` key (1-D)."""
    if rng is None:
        return
    dtype, ndim = getattr(rng, "dtype", None), getattr(rng, "ndim", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32
    if (typed and ndim == 0) or (raw and ndim == 1):
        return
    what = "rng must be None, one key from jax.random.key(seed), or one raw uint32[2] key "
    what += f"from jax.random.PRNGKey(seed); got {_describe(rng)}"
    if (typed and ndim) or (raw and ndim and ndim > 1):
        raise ValueError(
            f"{what}, a batch of keys. Pass one key: the step derives a key for every "
            "microbatch, device and update from it (fold_in of state.step and the indices)."
        )
    seed = dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    raise TypeError(f"{what}.{' For a seed, pass jax.random.key(seed).' if seed else ''}")


def positional_limit(fn: Callable[..., Any]) -> int | None:
    """The most positional arguments ``fn`` takes, or None (``*args``, or no signature).

    Example:
      >>> positional_limit(lambda params, batch, key=None: 0), positional_limit(print)
      (3, None)
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(kind in positional for kind in kinds)


def check_key_argument(limit: int | None, n_args: int, rng: Any) -> None:
    """Refuses ``rng`` for a loss that takes exactly the ``n_args`` arguments of a call
    without a key (``limit``: `positional_limit` of the loss, None to skip the check)."""
    if rng is not None and limit == n_args:
        raise TypeError(
            f"loss_fn takes no key argument but step(...) was given rng={_describe(rng)}; "
            "add a last parameter `key` to loss_fn or call step(state, batch)."
        )
