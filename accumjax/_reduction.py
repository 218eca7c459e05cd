"""The window's cross-device reductions (internal): the one reduction of a sum's leaves as
their `accumjax._layout.LeafLayout` says (`reduce_leaves`, `cross_device_reduce`), values
packed into one all-reduce, the norm of a sum whose leaves are shards, and the gathers between
shards and full-size leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp

from accumjax._layout import REPLICATED, LeafLayout
from accumjax._norms import abs_squared, global_norm

__all__ = [
    "cross_device_reduce",
    "gathered",
    "own_shard",
    "pack_flat",
    "psum_together",
    "reduce_leaves",
    "sharded_norm",
    "unpack_flat",
]


def pack_flat(parts: Any, dtype: Any) -> jax.Array:
    """The leaves of ``parts`` (a pytree of arrays) as one flat ``dtype`` vector: what travels
    in one all-reduce (`unpack_flat` cuts it back)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(parts)]
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves] or [jnp.zeros(0, dtype)])


def unpack_flat(flat: jax.Array, like: Any, dtype: Any = None) -> Any:
    """`pack_flat` undone: ``flat`` cut into the structure and shapes of ``like``, each leaf in
    ``dtype`` (None: its own type, at least float32), real unless that type is complex."""
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for x in leaves:
        size, shape = int(jnp.size(x)), jnp.shape(x)
        own = jnp.result_type(jnp.float32, x) if dtype is None else jnp.dtype(dtype)
        part = flat[offset : offset + size].reshape(shape)
        part = part if jnp.issubdtype(own, jnp.complexfloating) else jnp.real(part)
        out.append(part.astype(own))
        offset += size
    return jax.tree.unflatten(treedef, out)


def _packed_dtype(*like: Any) -> jnp.dtype:
    """The dtype values packed into one all-reduce travel in: the common type of ``like``
    (arrays or dtypes), at least float32, so counts below 2**24 stay exact."""
    return jnp.dtype(jnp.result_type(jnp.float32, *like))


def psum_together(parts: dict[str, Any], axis: str) -> dict[str, Any]:
    """Sums the named ``parts`` (pytrees of arrays of any shapes) across ``axis`` in one
    all-reduce: their leaves travel as one flat vector of their common type
    (`_packed_dtype`), in the dict's order, and come back under their names in their own
    structures and (floating) types.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> summed = jax.vmap(lambda x: psum_together({"x": x, "y": [2 * x]}, "i"), axis_name="i")(
      ...     jnp.arange(3.0))
      >>> summed["x"][0].tolist(), summed["y"][0][0].tolist()
      (3.0, 6.0)
    """
    values = list(parts.values())
    dtype = _packed_dtype(*jax.tree.leaves(values))
    return dict(
        zip(parts, unpack_flat(jax.lax.psum(pack_flat(values, dtype), axis), values), strict=True)
    )


def cross_device_reduce(
    grad_sum: Any, scalars: Any, axis_name: str, layouts: Sequence[LeafLayout] | None
) -> tuple[Any, Any]:
    """The window's one reduction: `reduce_leaves` at the window's close, the leaves still
    partial on each device reduced as their `LeafLayout` says (a grouped ``psum`` with the
    ``scalars``, a pytree of scalars and small arrays, which travel in the all-reduced
    leaves' dtype where they share one real floating dtype of 32 bits or more, else in
    float32 (`_packed_dtype`); a ``psum_scatter`` into shards), those reduced every
    microbatch left as they are.
    ``layouts``: each leaf's `LeafLayout`, in the order of ``jax.tree.leaves(grad_sum)``
    (None: every leaf all-reduced). Returns the reduced sum and the summed scalars (their
    structure and shapes, float32).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def on_device(x):
      ...     return cross_device_reduce({"g": x}, {"count": jnp.ones(())}, "i", None)
      >>> total, scalars = jax.vmap(on_device, axis_name="i")(jnp.ones((2, 3)))
      >>> total["g"][0].tolist(), float(scalars["count"][0])
      ([2.0, 2.0, 2.0], 2.0)
    """
    leaves, treedef = jax.tree.flatten(grad_sum)
    plan = [REPLICATED] * len(leaves) if layouts is None else list(layouts)
    dtypes = {jnp.dtype(leaves[i].dtype) for i in _all_reduced(plan, per_microbatch=False)}
    wide = len(dtypes) == 1 and all(
        jnp.issubdtype(d, jnp.floating) and d.itemsize >= 4 for d in dtypes
    )
    dtype = _packed_dtype(*(dtypes if wide else ()))
    leaves, stacked = reduce_leaves(leaves, axis_name, plan, pack_flat(scalars, dtype))
    return jax.tree.unflatten(treedef, leaves), unpack_flat(stacked, scalars, jnp.float32)


def _all_reduced(layouts: Sequence[LeafLayout], per_microbatch: bool) -> list[int]:
    """The indices of the ``layouts`` whose `Reduction` all-reduces, on every microbatch
    (``per_microbatch``) or at the window's close."""
    return [
        i
        for i, leaf in enumerate(layouts)
        if leaf.reduction.per_microbatch is per_microbatch and not leaf.reduction.scatters
    ]


def reduce_leaves(
    leaves: list[Any],
    axis_name: str,
    layouts: Sequence[LeafLayout],
    scalars: Any = None,
    *,
    per_microbatch: bool = False,
) -> tuple[list[Any], Any]:
    """One device's ``leaves`` reduced across ``axis_name`` as their ``layouts`` (each leaf's
    `LeafLayout`, in order) say: each leaf whose `Reduction` runs now (on a microbatch's
    gradient before it is added with ``per_microbatch``, else at the window's close) is
    all-reduced, in one grouped ``psum`` with ``scalars`` (a pytree that travels with them),
    or reduce-scattered on its ``optimizer`` dimension into this device's shard; the others
    are left as they are. Every cross-device reduction of a gradient goes through it.
    Returns the leaves and the summed scalars.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from accumjax._layout import REPLICATED, zero_layout
      >>> zero1 = zero_layout(0)  # reduce-scattered on dimension 0 once a window
      >>> def on_device(x):
      ...     (total, shard), count = reduce_leaves([x, x], "i", [REPLICATED, zero1], jnp.ones(()))
      ...     return total, shard, count
      >>> total, shard, count = jax.vmap(on_device, axis_name="i")(jnp.ones((2, 4)))
      >>> total[0].tolist(), shard[0].tolist(), float(count[0])
      ([2.0, 2.0, 2.0, 2.0], [2.0, 2.0], 2.0)
    """
    leaves = list(leaves)
    summed = _all_reduced(layouts, per_microbatch)
    reduced, scalars = jax.lax.psum(([leaves[i] for i in summed], scalars), axis_name)
    for i, x in zip(summed, reduced, strict=True):
        leaves[i] = x
    for i, leaf in enumerate(layouts):
        kind = leaf.reduction
        if kind.per_microbatch is per_microbatch and kind.scatters:
            dim = cast(int, leaf.optimizer)
            leaves[i] = jax.lax.psum_scatter(
                leaves[i], axis_name, scatter_dimension=dim, tiled=True
            )
    return leaves, scalars


def sharded_norm(
    grad_sum: Any, axis_name: str | None, dims: Sequence[int | None] | None
) -> jax.Array:
    """Global norm of a reduced sum whose leaves split on ``dims`` (one dimension a leaf, in
    the order of ``jax.tree.leaves(grad_sum)``, None for a replicated leaf; or None for all
    replicated) are this device's shards of the full-size leaves."""
    if axis_name is None or dims is None:
        return global_norm(grad_sum)
    leaves = jax.tree.leaves(grad_sum)
    replicated = global_norm([x for x, d in zip(leaves, dims, strict=True) if d is None])
    shards = global_norm([x for x, d in zip(leaves, dims, strict=True) if d is not None])
    return jnp.sqrt(abs_squared(replicated) + jax.lax.psum(abs_squared(shards), axis_name))


def gathered(tree: Any, axis_name: str, dims: Sequence[int | None] | None) -> Any:
    """The full-size leaves of a tree whose leaves split on ``dims`` (as `sharded_norm` takes
    them) are this device's shards."""
    if dims is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    gathered = [
        x if d is None else jax.lax.all_gather(x, axis_name, axis=d, tiled=True)
        for x, d in zip(leaves, dims, strict=True)
    ]
    return jax.tree.unflatten(treedef, gathered)


def own_shard(tree: Any, axis_name: str | None, dims: Sequence[int | None] | None) -> Any:
    """`gathered` undone: of each leaf split on ``dims`` (full-size here, the same on every
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

    out = [shard(x, d) for x, d in zip(leaves, dims, strict=True)]
    return jax.tree.unflatten(treedef, out)
