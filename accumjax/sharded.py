"""Scan mode under ``jit`` with sharded arrays: one gradient reduction per window.

Under ``jit`` a batch sharded over a mesh axis (``P("data")``) makes XLA reduce the gradient
of every microbatch across devices: the partial sums of a window cannot be kept unreduced
between microbatches in the global view. This module runs the window's microbatch loop in a
``jax.shard_map`` built from the arrays' own shardings, with no ``mesh``/``axis_name``
argument: each device accumulates its rows' gradients locally, and the window is reduced
once, when it closes (`accumjax.window.close_window`): an all-reduce for replicated
parameters, a reduce-scatter for parameters sharded over the batch axis (FSDP / ZeRO), so
the reduced gradient has the parameters' sharding and the optimizer update runs in the
global view on sharded state.

Memory: parameters sharded over the batch axis are all-gathered once per window (XLA keeps
the gathered copy for the whole loop), and each device's window accumulator holds full-size
partial sums until the window closes: that is the price of one reduction per window (see
JAX's "sharding in autodiff" notes on unreduced accumulation and MaxText's gradient
accumulation for the same trade-off).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

__all__ = ["Layout", "layout_of"]


class Layout(NamedTuple):
    """Where a step's batch and parameters lie (static, hashable).

    Attributes:
      mesh: the mesh of the batch's sharding (a ``Mesh``, or an ``AbstractMesh``).
      axis: the mesh axis the batch's leading dimension is split over.
      treedef: the parameters' tree structure.
      dims: per parameter leaf, the dimension sharded over ``axis`` (None: replicated).
    """

    mesh: Mesh | AbstractMesh
    axis: str
    treedef: Any
    dims: tuple[int | None, ...]

    def scatter(self) -> Any:
        """A pytree like the parameters with each leaf's sharded dimension (or None)."""
        return jax.tree.unflatten(self.treedef, self.dims)

    def param_specs(self) -> Any:
        """The parameters' ``PartitionSpec``s over ``axis``, for ``shard_map``."""
        specs = [
            PartitionSpec() if d is None else PartitionSpec(*([None] * d), self.axis)
            for d in self.dims
        ]
        return jax.tree.unflatten(self.treedef, specs)


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _batch_axis(batch: Any) -> tuple[Any, str] | None:
    leaves = jax.tree.leaves(batch)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = sharding.spec
    names = list(_names(spec[0])) if len(spec) else []
    if len(names) > 1:
        raise NotImplementedError(
            f"scan mode splits the batch over one mesh axis; the batch is sharded over {names}."
        )
    return (sharding.mesh, names[0]) if names else None


def _sharded_dim(path: str, leaf: Any, axis: str) -> int | None:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    found = None
    for dim, entry in enumerate(sharding.spec):
        names = _names(entry)
        others = [n for n in names if n != axis]
        if others:
            raise NotImplementedError(
                f"params{path} is sharded over {others}: scan mode under jit supports parameters "
                f"replicated or sharded over the batch axis {axis!r} only."
            )
        if axis in names:
            found = dim
    return found


def layout_of(params: Any, batch: Any) -> Layout | None:
    """The `Layout` of concrete (sharded) arrays, or None when the batch is not split.

    Args:
      params: the parameters (arrays, or ``jax.ShapeDtypeStruct`` with a ``sharding``).
      batch: the batch; its first leaf's sharding decides.

    Returns:
      A `Layout`, or None (one device, an unsharded batch, or no shardings known).

    Raises:
      NotImplementedError: for a batch split over several mesh axes, or parameters sharded
        over an axis other than the batch's.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
      >>> from accumjax import sharded
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> batch = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("data")))
      >>> params = jax.device_put(jnp.ones((2, 3)), NamedSharding(mesh, P("data", None)))
      >>> layout = sharded.layout_of({"w": params}, batch)
      >>> layout.axis, layout.dims
      ('data', (0,))
    """
    found = _batch_axis(batch)
    if found is None:
        return None
    mesh, axis = found
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    dims = tuple(_sharded_dim(jax.tree_util.keystr(p), leaf, axis) for p, leaf in paths)
    return Layout(mesh, axis, treedef, dims)


def gather(params: Any, layout: Layout) -> Any:
    """Inside ``shard_map``: the whole parameters from this device's shards (all-gather)."""
    leaves = layout.treedef.flatten_up_to(params)
    whole = [
        x if d is None else jax.lax.all_gather(x, layout.axis, axis=d, tiled=True)
        for x, d in zip(leaves, layout.dims, strict=True)
    ]
    return jax.tree.unflatten(layout.treedef, whole)


def expand(tree: Any) -> Any:
    """A leading axis of one, so per-device values concatenate along the batch axis."""
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)
