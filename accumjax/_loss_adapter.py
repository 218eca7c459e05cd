"""The loss adapter (internal): a user's ``loss_fn`` as the gradient function the loop runs.

`make_grad_fn` wraps every form ``loss_fn`` may take (with or without model state, aux
outputs and a PRNG key), casts the parameters to the compute dtype for mixed precision (the
batch is passed as given: a float mask or weight is not rounded), scales the loss for
float16 and hands back unscaled gradients in the parameters' own dtypes, with clear errors
for outputs that do not match ``has_aux``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from accumjax._scaling import device_losses_add
from accumjax.loss_scale import DynamicLossScale, scale_loss, unscale_grads

__all__ = ["GradFn", "cast_floats", "device_loss_scale", "make_grad_fn"]

GradFn = Callable[..., tuple[Any, Any, Any, Any]]


def cast_floats(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating leaves cast to ``dtype`` (None: unchanged); others kept.

    jmp's ``cast_to_half``/``cast_to_full`` do this (jmp is not a dependency);
    ``optax.tree.cast`` casts every leaf, integer inputs (token ids) included, so it is not
    used here.

    Example:
      >>> import jax.numpy as jnp
      >>> out = cast_floats({"x": jnp.ones(2), "ids": jnp.arange(2)}, jnp.bfloat16)
      >>> out["x"].dtype, out["ids"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _unpack(out: Any, has_aux: bool, with_model_state: bool) -> tuple[Any, Any, Any]:
    """Splits a loss_fn output into ``(loss, new_model_state, aux)``."""
    hint = (
        "loss_fn must return loss, or (loss, aux) with has_aux=True"
        if not with_model_state
        else "with model state loss_fn must return (loss, new_model_state), or "
        "(loss, (new_model_state, aux)) with has_aux=True"
    )
    if not with_model_state and not has_aux:
        if isinstance(out, tuple):
            raise TypeError(f"loss_fn returned a tuple; pass has_aux=True. ({hint})")
        return out, None, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"loss_fn returned {type(out).__name__}; {hint}.")
    if not with_model_state:
        return out[0], None, out[1]
    if not has_aux:
        return out[0], out[1], None
    if not (isinstance(out[1], tuple) and len(out[1]) == 2):
        raise TypeError(f"loss_fn's second output is not (new_model_state, aux); {hint}.")
    return out[0], out[1][0], out[1][1]


def _check_loss(loss: Any) -> jax.Array:
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"loss_fn must return a floating scalar loss, got {loss.dtype}{list(loss.shape)} "
            "(did you forget has_aux=True, or a .mean()?)."
        )
    return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))


def _check_model_state(new: Any, old: Any, has_aux: bool) -> Any:
    if jax.tree.structure(new) != jax.tree.structure(old):
        hint = (
            ""
            if has_aux
            else " If loss_fn returns (loss, (new_model_state, aux)), pass has_aux=True."
        )
        raise TypeError(
            "loss_fn returned a new model state whose structure differs from state.model_state: "
            f"{jax.tree.structure(new)} vs {jax.tree.structure(old)}.{hint}"
        )

    def kept(n: Any, o: Any) -> Any:  # the very array when its dtype is kept (an unchanged
        n = jnp.asarray(n)  # leaf stays recognizable: `accumjax._loop.loss_and_grads`)
        dtype = jnp.result_type(o)
        return n if n.dtype == dtype else n.astype(dtype)

    return jax.tree.map(kept, new, old)


def _warn_half_master_weights(params: Any, compute_dtype: Any) -> None:
    """Warns when mixed precision (``compute_dtype``) is given 16-bit floating parameters: they
    are the master weights, so the updates and the optimizer state (Adam's moments) would be
    16-bit too, where mixed precision keeps them float32."""
    if compute_dtype is None:
        return
    half = [
        f"params{jax.tree_util.keystr(path)} ({jnp.result_type(x)})"
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x).itemsize <= 2
    ]
    if not half:
        return
    more = f" and {len(half) - 1} more" if len(half) > 1 else ""
    name = jnp.dtype(compute_dtype).name
    warnings.warn(
        f"mixed_precision={name!r} was given 16-bit parameters, {half[0]}{more}: mixed "
        "precision keeps float32 master weights (the step computes with a 16-bit copy), but "
        "these are the master weights themselves, so the updates and the optimizer state "
        "(Adam's moments) are 16-bit too. Keep the parameters float32 "
        "(jax.tree.map(lambda p: p.astype(jnp.float32), params), or param_dtype=jnp.float32 "
        "in Flax layers) and let mixed_precision cast them.",
        UserWarning,
        stacklevel=2,
    )


def make_grad_fn(loss_fn: Callable[..., Any], has_aux: bool, compute_dtype: Any) -> GradFn:
    """``grad_fn(params, model_state, batch, key, loss_scale) -> (loss, model_state, aux, grads)``.

    ``loss_fn`` sees the parameters' floating leaves in ``compute_dtype`` (None: as they
    are) and the batch as given; 16-bit parameters with a ``compute_dtype`` are warned about
    (they would be the master weights). Gradients are unscaled and in the parameters' own dtypes
    (float64 stays float64, complex stays complex); ``key`` (or None) is passed to
    ``loss_fn`` as its last argument.
    """

    def scaled_loss(params, model_state, batch, key, loss_scale):
        args = (cast_floats(params, compute_dtype),)
        if model_state is not None:
            args += (model_state,)
        args += (batch,)  # as given: its dtypes are the user's (masks, weights, inputs)
        out = loss_fn(*args) if key is None else loss_fn(*args, key)
        loss, new_model_state, aux = _unpack(out, has_aux, model_state is not None)
        loss = _check_loss(loss)
        if model_state is not None:
            new_model_state = _check_model_state(new_model_state, model_state, has_aux)
        scaled = loss if loss_scale is None else scale_loss(loss_scale, loss)
        return scaled, (loss, new_model_state, aux)

    def grad_fn(params, model_state, batch, key, loss_scale):
        _warn_half_master_weights(params, compute_dtype)
        grad = jax.grad(scaled_loss, has_aux=True)
        grads, (loss, new_model_state, aux) = grad(params, model_state, batch, key, loss_scale)
        if loss_scale is not None:
            grads = unscale_grads(loss_scale, grads)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        return loss, new_model_state, aux, grads

    return grad_fn


def device_loss_scale(
    loss_scale: DynamicLossScale | None, scaling: str, axis_name: str | None
) -> DynamicLossScale | None:
    """The loss scale one device's float16 backward runs with: on a mapped axis, its share of
    the whole microbatch's (the scale over the devices' number, unless the losses are summed
    over the devices' rows), so that its rows' float16 gradients are as large as on one device
    holding them all, and overflow where one device would (the shares are then summed in
    float32). Without a loss scale or a mapped axis, ``loss_scale`` as it is.

    Example (four devices along ``"data"``, mean losses):
      >>> import jax, jax.numpy as jnp, accumjax
      >>> ls = accumjax.dynamic_loss_scale(2.0**15)
      >>> share = jax.vmap(
      ...     lambda _: device_loss_scale(ls, "mean", "data").loss_scale, axis_name="data"
      ... )(jnp.arange(4))
      >>> share.tolist()
      [8192.0, 8192.0, 8192.0, 8192.0]
    """
    if loss_scale is None or axis_name is None or device_losses_add(scaling):
        return loss_scale
    share = loss_scale.loss_scale / jax.lax.axis_size(axis_name)
    return loss_scale._replace(loss_scale=share)
