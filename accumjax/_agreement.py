"""How a microbatch whose rows several devices hold is decided (internal): written once.

On a mesh every device decides the same about each whole microbatch, as one device holding
all its rows would. Each device gives its `MicrobatchDecision` on its rows; the decisions
are summed over the devices (per microbatch, or K at once with the window's reduction) and
`accepted` reads the sum, on one device as on many. A policy that reads the gradient's
values reads the `whole_gradient`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accumjax._scaling import Scaling

__all__ = ["MicrobatchDecision", "accepted", "device_decision", "weigh", "whole_gradient"]


class MicrobatchDecision(NamedTuple):
    """Devices' decisions about a microbatch (or, stacked, about each of a window's), summed
    over the devices that hold its rows: float32 arrays.

    Attributes:
      rejected: how many devices rejected rows that weigh something (a non-finite gradient,
        an invalid weight).
      rejected_weightless: how many devices rejected rows that weigh nothing
        (``"weighted"``: a mean over no rows may be NaN, and such rows add nothing).
      weight: the rows' weight (``"weighted"``; 1 a device otherwise).
    """

    rejected: jax.Array
    rejected_weightless: jax.Array
    weight: jax.Array


def device_decision(scaling: Scaling, rejected: jax.Array, weight: jax.Array) -> MicrobatchDecision:
    """One device's `MicrobatchDecision` about its rows of a microbatch: whether it
    ``rejected`` them, and their ``weight``."""
    rejected_weightless = weight == 0 if scaling == "weighted" else jnp.zeros((), bool)
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
    return MicrobatchDecision(
        f32(rejected & ~rejected_weightless), f32(rejected & rejected_weightless), f32(weight)
    )


def accepted(scaling: Scaling, summed: MicrobatchDecision) -> jax.Array:
    """Whether the devices' summed decisions accept a microbatch (elementwise for stacked
    ones): no device rejected rows that weigh something, and rows that weigh nothing decide
    only when the whole microbatch weighs nothing, as on one device.

    Example (two devices, the second's rows weigh nothing and gave a NaN; then that device
    alone, the whole microbatch weighing nothing):
      >>> import jax, jax.numpy as jnp
      >>> from accumjax._agreement import accepted, device_decision
      >>> kept = device_decision("weighted", jnp.bool_(False), jnp.float32(3.0))
      >>> weightless = device_decision("weighted", jnp.bool_(True), jnp.float32(0.0))
      >>> both = jax.tree.map(jnp.add, kept, weightless)
      >>> bool(accepted("weighted", both)), bool(accepted("weighted", weightless))
      (True, False)
    """
    if scaling != "weighted":
        return summed.rejected == 0
    return (summed.rejected == 0) & ((summed.weight > 0) | (summed.rejected_weightless == 0))


def whole_gradient(
    scaling: Scaling,
    grads: Any,
    weight: jax.Array,
    axis_name: str,
    own: MicrobatchDecision,
    dims: Any = None,
) -> tuple[Any, MicrobatchDecision]:
    """Inside a map over ``axis_name``: the whole microbatch's gradient from each device's
    gradient of its rows, as one device would compute it: their mean (``"mean"``,
    ``"sum_over_k"``), sum (``"sum"``) or weighted mean (``"weighted"``; a device of weight 0 adds
    nothing). The devices' shares are summed in the accumulator's precision (at least
    float32: float16 shares that are each finite stay finite), with the decisions in the same
    reduction.

    Args:
      scaling: the window's scaling.
      grads: this device's gradient of its rows.
      weight: this device's weight (float32).
      axis_name: the mapped axis.
      own: this device's `MicrobatchDecision`.
      dims: None (every leaf all-reduced), or a pytree like ``grads`` holding for each leaf
        the dimension its parameter is split on over ``axis_name``: that leaf is
        reduce-scattered, and its whole gradient comes back as this device's shard.

    Returns:
      ``(whole, summed decision)``.
    """
    weighted = scaling == "weighted"
    wide = lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))
    part = jax.tree.map(lambda g: weigh(weight, wide(g)) if weighted else wide(g), grads)
    leaves, treedef = jax.tree.flatten(part)
    split = [None] * len(leaves) if dims is None else treedef.flatten_up_to(dims)
    summed = [i for i, d in enumerate(split) if d is None]
    reduced, summed_decision = jax.lax.psum(([leaves[i] for i in summed], own), axis_name)
    for i, x in zip(summed, reduced, strict=True):
        leaves[i] = x
    for i, d in enumerate(split):
        if d is not None:
            leaves[i] = jax.lax.psum_scatter(leaves[i], axis_name, scatter_dimension=d, tiled=True)
    devices = jax.lax.axis_size(axis_name)
    by = summed_decision.weight if weighted else jnp.float32(1 if scaling == "sum" else devices)
    by = jnp.where(by > 0, by, 1.0)
    whole = jax.tree.map(lambda g: g / by.astype(g.dtype), jax.tree.unflatten(treedef, leaves))
    return whole, summed_decision


def weigh(factor: jax.Array, g: jax.Array) -> jax.Array:
    """``factor * g``, and exactly 0 where ``factor`` is 0 (``g`` may be NaN there: a device
    whose rows weigh nothing computes a mean over no rows)."""
    return jnp.where(factor > 0, factor.astype(g.dtype) * g, jnp.zeros((), g.dtype))
