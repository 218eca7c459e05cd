"""The window's cross-device reductions (internal): what the reduction does to each leaf of
a sum (`LeafReduction`), the one reduction (`cross_device_reduce`), the norm of a sum whose
leaves are shards, and the gathers between shards and whole leaves.
"""

from __future__ import annotations

import enum
from typing import Any, cast

import jax
import jax.numpy as jnp

from accumjax._norms import global_norm

__all__ = [
    "REDUCED",
    "WHOLE",
    "LeafReduction",
    "Reduced",
    "gathered",
    "global_norm",
    "own_shard",
    "cross_device_reduce",
    "reduced_scatter",
    "sharded_norm",
]


class Reduced(enum.Enum):
    """A leaf of a window's sum that is reduced already when the window closes."""

    SHARD = "shard"  # a reduced shard (reduce-scattered microbatch by microbatch)
    WHOLE = "whole"  # reduced and whole


REDUCED = Reduced.SHARD
WHOLE = Reduced.WHOLE

#: What `cross_device_reduce` does to one leaf of a sum: None, a ``psum``; a dimension, a
#: ``psum_scatter`` along it (each device keeps its shard); a `Reduced`, nothing.
LeafReduction = int | Reduced | None


def reduced_scatter(dims: Any, like: Any) -> Any:
    """The ``scatter`` of `close_window` for a sum reduced microbatch by microbatch: `REDUCED`
    for the leaves split over the axis (``dims``, a pytree like ``like``, or None for none),
    `WHOLE` for the others.

    Example (a kernel split on its first dimension, a bias replicated):
      >>> import jax.numpy as jnp
      >>> from accumjax._reduction import reduced_scatter
      >>> like = {"b": jnp.zeros(2), "w": jnp.zeros((4, 2))}
      >>> reduced_scatter({"b": None, "w": 0}, like)
      {'b': <Reduced.WHOLE: 'whole'>, 'w': <Reduced.SHARD: 'shard'>}
    """
    leaves, treedef = jax.tree.flatten(like)
    split = [None] * len(leaves) if dims is None else treedef.flatten_up_to(dims)
    return jax.tree.unflatten(treedef, [WHOLE if d is None else REDUCED for d in split])


def cross_device_reduce(
    grad_sum: Any, scalars: list[jax.Array], axis_name: str, scatter: Any
) -> tuple[Any, list[jax.Array]]:
    """The window's one reduction: a grouped ``psum`` of the leaves still partial on each
    device and the scalars (which travel in the accumulator's dtype when it is float32 or
    float64, so counts stay exact below 2**24), and a ``psum_scatter`` of the leaves sharded
    over the axis. Returns the reduced sum and the summed scalars (float32, their shapes)."""
    leaves, treedef = jax.tree.flatten(grad_sum)
    dims = [None] * len(leaves) if scatter is None else treedef.flatten_up_to(scatter)
    summed = [i for i, d in enumerate(dims) if d is None]
    scattered = [i for i, d in enumerate(dims) if d is not None and not isinstance(d, Reduced)]
    dtypes = {jnp.dtype(leaves[i].dtype) for i in summed}
    dtype = dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 4:
        dtype = jnp.dtype(jnp.float32)
    parts = [jnp.ravel(x).astype(dtype) for x in scalars]
    stacked = jnp.concatenate(parts or [jnp.zeros(0, dtype)])
    reduced, stacked = jax.lax.psum(([leaves[i] for i in summed], stacked), axis_name)
    for i, x in zip(summed, reduced, strict=True):
        leaves[i] = x
    for i in scattered:
        leaves[i] = jax.lax.psum_scatter(
            leaves[i], axis_name, scatter_dimension=cast(int, dims[i]), tiled=True
        )
    out, offset = [], 0
    for x in scalars:
        size = int(jnp.size(x))
        out.append(stacked[offset : offset + size].reshape(jnp.shape(x)).astype(jnp.float32))
        offset += size
    return jax.tree.unflatten(treedef, leaves), out


def sharded_norm(grad_sum: Any, axis_name: str | None, scatter: Any) -> jax.Array:
    """Global norm of a reduced sum whose leaves marked in ``scatter`` (a dimension or
    `Reduced.SHARD`) are this device's shards of the whole."""
    if axis_name is None or scatter is None:
        return global_norm(grad_sum)
    leaves, treedef = jax.tree.flatten(grad_sum)
    dims = treedef.flatten_up_to(scatter)
    shard = lambda d: d is not None and d is not Reduced.WHOLE
    whole = global_norm([x for x, d in zip(leaves, dims, strict=True) if not shard(d)])
    shards = global_norm([x for x, d in zip(leaves, dims, strict=True) if shard(d)])
    return jnp.sqrt(jnp.square(whole) + jax.lax.psum(jnp.square(shards), axis_name))


def gathered(tree: Any, axis_name: str, dims: Any) -> Any:
    """The whole of a tree whose leaves split on ``dims`` are this device's shards."""
    if dims is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    gathered = [
        x if d is None else jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
        for x, d in zip(leaves, treedef.flatten_up_to(dims), strict=True)
    ]
    return jax.tree.unflatten(treedef, gathered)


def own_shard(tree: Any, axis_name: str | None, dims: Any) -> Any:
    """`gathered` undone: of each leaf split on ``dims`` (whole here, the same on every
    device), this device's shard along its dimension (no axis or no ``dims``: ``tree``)."""
    if axis_name is None or dims is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    index = jax.lax.axis_index(axis_name)
    devices = jax.lax.axis_size(axis_name)

    def shard(x: jax.Array, d: int | None) -> jax.Array:
        if d is None:
            return x
        size = x.shape[d] // devices
        return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=d)

    out = [shard(x, d) for x, d in zip(leaves, treedef.flatten_up_to(dims), strict=True)]
    return jax.tree.unflatten(treedef, out)
