"""How the devices agree about a microbatch whose rows they share (internal).

On a mesh every device decides the same about each whole microbatch, as one device holding
all its rows would (`accumjax.window.inspect_microbatch`): each device casts its `votes`, the
devices sum them in one all-reduce, and `accepted` reads the sum. A policy that reads the
gradient's values reads the `whole_gradient`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from accumjax.scaling import Scaling

__all__ = ["accepted", "votes", "weigh", "whole_gradient"]


def votes(scaling: Scaling, refused: jax.Array, weight: jax.Array) -> jax.Array:
    """A device's votes about a microbatch, to be summed over the devices (float32[2]): it
    refuses its rows, and it refuses rows that weigh nothing (``"weighted"``: their mean may
    be NaN, and they add nothing)."""
    idle = weight == 0 if scaling == "weighted" else jnp.zeros((), bool)
    return jnp.stack([refused & ~idle, refused & idle]).astype(jnp.float32)


def accepted(scaling: Scaling, summed: jax.Array, weight: jax.Array) -> jax.Array:
    """Whether the devices' summed `votes` (and summed weight) accept a microbatch: no device
    refused rows that weigh something, and rows that weigh nothing only decide when the whole
    microbatch weighs nothing, as on one device.

    Example (two devices, the second's rows weigh nothing and gave a NaN; then that device
    alone, the whole microbatch weighing nothing):
      >>> import jax.numpy as jnp
      >>> from accumjax._agreement import accepted, votes
      >>> kept = votes("weighted", jnp.bool_(False), jnp.float32(3.0))
      >>> idle = votes("weighted", jnp.bool_(True), jnp.float32(0.0))
      >>> bool(accepted("weighted", kept + idle, 3.0)), bool(accepted("weighted", idle, 0.0))
      (True, False)
    """
    if scaling != "weighted":
        return summed[0] == 0
    return (summed[0] == 0) & ((weight > 0) | (summed[1] == 0))


def whole_gradient(
    scaling: Scaling, grads: Any, weight: jax.Array, axis_name: str, votes: jax.Array
) -> tuple[Any, jax.Array, jax.Array]:
    """Inside a map over ``axis_name``: the whole microbatch's gradient from each device's
    gradient of its rows, as one device would compute it: their mean (``"mean"``,
    ``"count"``), sum (``"sum"``) or weighted mean (``"weighted"``; a device of weight 0
    adds nothing), with ``votes`` and ``weight`` summed over the devices in the same
    all-reduce. Returns ``(whole, summed votes, summed weight)``."""
    weighted = scaling == "weighted"
    part = lambda g: weigh(weight, g) if weighted else g
    total, votes, weight = jax.lax.psum((jax.tree.map(part, grads), votes, weight), axis_name)
    devices = jax.lax.axis_size(axis_name)
    by = weight if weighted else jnp.float32(1 if scaling == "sum" else devices)
    by = jnp.where(by > 0, by, 1.0)
    return jax.tree.map(lambda g: g / by.astype(g.dtype), total), votes, weight


def weigh(factor: jax.Array, g: jax.Array) -> jax.Array:
    """``factor * g``, and exactly 0 where ``factor`` is 0 (``g`` may be NaN there: a device
    whose rows weigh nothing computes a mean over no rows)."""
    return jnp.where(factor > 0, factor.astype(g.dtype) * g, jnp.zeros((), g.dtype))
