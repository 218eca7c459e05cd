"""The steps under ``jit`` with sharded arrays: one gradient reduction per window.

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

import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from accumjax import window as window_lib

__all__ = [
    "Layout",
    "device_axes",
    "layout_of",
    "per_device_window",
    "window_specs",
]


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
            "under jit, accumjax splits a batch over one mesh axis (a per-device window "
            f"follows it); the batch is sharded over {names}. Shard it over one axis."
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
                f"params{path} is sharded over {others}: the sharded steps (scan mode, and "
                "stream mode with a per-device window) support parameters replicated or "
                f"sharded over the batch axis {axis!r} only."
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


# ----------------------------------------------------------------------------- stream mode


def device_axes(mesh: Mesh | AbstractMesh, spec: Any) -> tuple[str, ...]:
    """The mesh axes (of more than one device) a leaf sharded as ``spec`` is not split over:
    those its per-device window sums are kept along."""
    used = {name for entry in spec for name in _names(entry)}
    return tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)


def _params_mesh(params: Any) -> Mesh | None:
    """The one multi-device mesh every parameter leaf is sharded on, or None."""
    meshes = {getattr(getattr(x, "sharding", None), "mesh", None) for x in jax.tree.leaves(params)}
    if len(meshes) != 1:
        return None
    mesh = meshes.pop()
    return mesh if isinstance(mesh, Mesh) and mesh.size > 1 else None


def _zeros(mesh: Mesh, spec: PartitionSpec, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros made where they live (no host or one-device copy of the whole array)."""
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))
    return make()


def per_device_window(params: Any, accumulator_dtype: Any) -> tuple[Any, jax.Array] | None:
    """A stream-mode window whose sums and counts each device keeps for itself, as honest
    global arrays, and the per-device ``added`` flags; None unless the parameters lie on a
    mesh with exactly one axis of more than one device (the batch's).

    Each sum leaf gets a leading axis split over the mesh axes its parameter is replicated
    over (`device_axes`): one parameter copy per device (a parameter sharded over the batch
    axis keeps its shard, reduced microbatch by microbatch). The counts and flags have one
    entry per device. A checkpoint saves every device's partial window.
    """
    mesh = _params_mesh(params)
    if mesh is None or len(device_axes(mesh, ())) != 1:
        return None  # off a mesh, or several axes: which one the batch is split over is unknown

    def sum_leaf(p: Any) -> jax.Array:
        spec = tuple(p.sharding.spec)
        axes = device_axes(mesh, spec)
        n = math.prod(mesh.shape[a] for a in axes)
        dtype = window_lib.sum_dtype(p.dtype, accumulator_dtype)
        return _zeros(mesh, PartitionSpec(axes or None, *spec), (n, *p.shape), dtype)

    axes = device_axes(mesh, ())
    n, spec = math.prod(mesh.shape[a] for a in axes), PartitionSpec(axes)
    counts = [_zeros(mesh, spec, (n,), dtype) for dtype in (jnp.float32, jnp.int32, jnp.int32)]
    micro_step = jnp.zeros((), jnp.int32)
    window = window_lib.Window(jax.tree.map(sum_leaf, params), counts[0], micro_step, *counts[1:])
    return window, _zeros(mesh, spec, (n,), jnp.bool_)


def window_specs(layout: Layout) -> Any:
    """The ``shard_map`` specs of a per-device window on ``layout``: each device its own
    slice of the sums and counts (``micro_step`` is shared)."""
    all_axes = device_axes(layout.mesh, ())
    specs = [
        PartitionSpec(device_axes(layout.mesh, spec) or None, *spec)
        for spec in layout.treedef.flatten_up_to(layout.param_specs())
    ]
    count = PartitionSpec(all_axes)
    return window_lib.Window(
        jax.tree.unflatten(layout.treedef, specs),
        *cast(tuple[jax.Array, ...], (count, PartitionSpec(), count, count)),
    )
