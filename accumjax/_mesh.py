"""Where a train step runs on a mesh: its data axis and the `MeshLayout` of one call.

A `MeshLayout` holds the mesh, its data axis (the batch's leading dimension is split over it) and
each parameter leaf's row of the layout plan (`accumjax._layout`), from the step's
``mesh=``/``axis_name=`` or from the arrays themselves (`layout_of`). This module also lays
out what the plan says: partition specs, the parameters gathered or placed inside a trace,
the optimizer state under ZeRO, and a stream-mode window kept per data shard
(`device_window`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

import accumjax._window as window_lib
from accumjax._checks import check_mesh_axis
from accumjax._layout import LeafLayout, leaf_layout, optimizer_dims, partial_sum_count
from accumjax._reduction import gathered

__all__ = [
    "MeshLayout",
    "ONE_MESH",
    "REPLICATED_SPEC",
    "check_one_mesh",
    "data_axis",
    "device_window",
    "field_specs",
    "gather_params",
    "layout_of",
    "mesh_difference",
    "mesh_of",
    "moved_axis",
    "names",
    "optimizer_state_specs",
    "lay_out",
    "sharding_of",
    "state_specs",
]

AnyMesh = Mesh | AbstractMesh
T = TypeVar("T")
#: The ``shard_map`` spec of a value every device holds whole.
REPLICATED_SPEC = PartitionSpec()

#: The rule a step's refusals of arrays on several meshes state (`check_one_mesh` and the step
#: object's checks of where its inputs lie, `accumjax._host`).
ONE_MESH = "a step's arrays must lie on one mesh"


class MeshLayout(NamedTuple):
    """Where a step's batch and parameters lie (static, hashable).

    Attributes:
      mesh: the mesh (a ``Mesh``, or an ``AbstractMesh`` inside another ``jit``).
      axis: the data axis: the batch's leading dimension is split over it.
      treedef: the parameters' tree structure.
      leaves: per parameter leaf, its `accumjax._layout.LeafLayout` (the layout plan).
      specs: per parameter leaf, its partition spec over every mesh axis (a tuple).
      opt_specs: with a ZeRO layout, per leaf of the inner optimizer's state, its partition
        spec (`optimizer_state_specs`); None to leave the state where it lies.
    """

    mesh: AnyMesh
    axis: str
    treedef: Any
    leaves: tuple[LeafLayout, ...]
    specs: tuple[tuple[Any, ...], ...] = ()
    opt_specs: tuple[PartitionSpec | None, ...] | None = None

    @property
    def param_dims(self) -> tuple[int | None, ...]:
        """Per leaf, the parameter's dimension split over the axis (None: replicated)."""
        return tuple(leaf.param for leaf in self.leaves)

    @property
    def accumulator_dims(self) -> tuple[int | None, ...]:
        """Per leaf, the window accumulator's dimension split over the axis (None: replicated)."""
        return tuple(leaf.accumulator for leaf in self.leaves)

    @property
    def optimizer_dims(self) -> tuple[int | None, ...]:
        """Per leaf, the reduced gradient's and optimizer state's split dimension."""
        return optimizer_dims(self.leaves)

    @property
    def zero_sharded(self) -> bool:
        """Whether a replicated parameter's optimizer state is split over the axis."""
        return any(leaf.param is None and leaf.optimizer is not None for leaf in self.leaves)

    def accumulator_specs(self) -> Any:
        """The window accumulator's partition specs over the data axis, for ``shard_map``."""
        dims = self.accumulator_dims
        return jax.tree.unflatten(self.treedef, [_spec(d, self.axis) for d in dims])

    def optimizer_specs(self) -> Any:
        """The reduced gradient's partition specs over the data axis, for ``shard_map``."""
        return jax.tree.unflatten(self.treedef, [_spec(d, self.axis) for d in self.optimizer_dims])

    def local_sums(self, params: Any, dims: tuple[int | None, ...]) -> Any:
        """Inside ``shard_map``, the shapes of one device's window sums of ``params`` (its
        local parameters): each parameter's full-size shape, split over the data axis on
        ``dims``."""
        out = []
        leaves = self.treedef.flatten_up_to(params)
        for x, leaf, dim in zip(leaves, self.leaves, dims, strict=True):
            shape = list(jnp.shape(x))
            if leaf.param is not None:
                shape[leaf.param] *= self.shards
            if dim is not None:
                shape[dim] //= self.shards
            out.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x)))
        return jax.tree.unflatten(self.treedef, out)

    def global_specs(self, dims: tuple[int | None, ...]) -> Any:
        """Per leaf, its full partition spec with the data axis moved to ``dims``."""
        out = [moved_axis(spec, self.axis, dim) for spec, dim in zip(self.specs, dims, strict=True)]
        return jax.tree.unflatten(self.treedef, out)

    @property
    def shards(self) -> int:
        """How many data shards (devices along the data axis) there are."""
        return int(self.mesh.shape[self.axis])

    def param_specs(self) -> Any:
        """The parameters' partition specs over the data axis, for ``shard_map``."""
        return jax.tree.unflatten(self.treedef, [_spec(d, self.axis) for d in self.param_dims])

    def window_specs(self) -> window_lib.DeviceWindow:
        """The ``shard_map`` specs of a `accumjax.window.DeviceWindow`: each device its own
        partial sums (a parameter split over the axis: its shard of the one reduced sum), its
        counters replicated (`field_specs`)."""
        sums = [
            PartitionSpec(self.axis) if d is None else _spec(d + 1, self.axis)
            for d in self.accumulator_dims
        ]
        return field_specs(window_lib.DeviceWindow, jax.tree.unflatten(self.treedef, sums))


def field_specs(cls: type[T], first: Any, rest: Any = REPLICATED_SPEC) -> T:
    """The ``shard_map`` specs of a NamedTuple ``cls`` whose first field is a sum (a
    `accumjax._window.Window`, `accumjax._window.DeviceWindow` or `accumjax._window.Closed`):
    ``first`` for it, ``rest`` for every other field, by name.

    Example:
      >>> from accumjax._window import Window
      >>> field_specs(Window, "split", "replicated")  # doctest: +NORMALIZE_WHITESPACE
      Window(grad_sum='split', weight_sum='replicated', micro_step='replicated',
             window_nonfinite='replicated', window_skipped='replicated')
    """
    fields = cast(Any, cls)._fields
    return cls(**{fields[0]: first}, **dict.fromkeys(fields[1:], rest))


def _spec(dim: int | None, axis: str) -> PartitionSpec:
    return PartitionSpec() if dim is None else PartitionSpec(*([None] * dim), axis)


def names(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def moved_axis(spec: Any, axis: str, dim: int | None, ndim: int = 0) -> PartitionSpec:
    """``spec`` (padded with None to ``ndim`` entries) with the mesh axis ``axis`` moved to
    dimension ``dim``, outermost there (None: off the spec); its other axes stay where they are.

    Example:
      >>> moved_axis(PartitionSpec("data", "model"), "data", 1)
      P(None, ('data', 'model'))
      >>> moved_axis(PartitionSpec("data"), "data", None, ndim=2)
      P(None, None)
    """
    entries = [tuple(n for n in names(e) if n != axis) for e in spec]
    entries += [()] * (ndim - len(entries))
    if dim is not None:
        entries[dim] = (axis, *entries[dim])
    return PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in entries))


def sharding_of(x: Any) -> Any:
    """The sharding of an array, a ``jax.ShapeDtypeStruct`` or a traced value (its type's,
    whose mesh is abstract), or None.

    Example:
      >>> import jax.numpy as jnp
      >>> type(sharding_of(jnp.ones(2))).__name__
      'SingleDeviceSharding'
    """
    if isinstance(x, jax.core.Tracer):
        return getattr(jax.typeof(x), "sharding", None)
    return getattr(x, "sharding", None)


def mesh_of(tree: Any) -> AnyMesh | None:
    """The one mesh that the leaves of ``tree`` lie on (a concrete ``Mesh`` where any leaf is
    concrete; one of more than one device where there is one), or None (no mesh, or
    several). A one-device mesh is a mesh: the step runs there as on N devices.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh_of({"w": jnp.ones(2)}) is None  # one device, no mesh
      True
      >>> one = jax.make_mesh((1,), ("data",))
      >>> dict(mesh_of({"w": jax.device_put(jnp.ones(2), NamedSharding(one, P()))}).shape)
      {'data': 1}
    """
    meshes = {getattr(sharding_of(x), "mesh", None) for x in jax.tree.leaves(tree)}
    meshes = {m for m in meshes if m is not None and m.axis_names}  # not jit's empty mesh
    for kind in (Mesh, AbstractMesh):
        found = {m for m in meshes if isinstance(m, kind)}
        found = {m for m in found if m.size > 1} or found
        if found:
            return found.pop() if len(found) == 1 else None
    return None


def data_axis(mesh: AnyMesh, axis: str | None = None) -> str | None:
    """The data axis of ``mesh``: ``axis`` when given, else its only axis of more than one
    device, or the only axis of a one-device mesh (None when there is none of either).

    Raises:
      ValueError: naming the fix when ``axis`` is not an axis of the mesh, or when the mesh
        has several axes of more than one device and ``axis`` is None.

    Example:
      >>> import jax
      >>> data_axis(jax.make_mesh((1,), ("data",)))  # one device: the same axis as on N
      'data'
    """
    if axis is not None:
        check_mesh_axis(axis, mesh)
        return axis
    big = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    if len(big) > 1:
        raise ValueError(
            f"the mesh {dict(mesh.shape)} has several axes of more than one device, and which "
            "one the batch is split over is not known here: name it, "
            "make_train_step(..., mesh=mesh, axis_name='data')."
        )
    if big:
        return big[0]
    return mesh.axis_names[0] if len(mesh.axis_names) == 1 else None


def _batch_axis(batch: Any) -> tuple[AnyMesh, str] | None:
    """The mesh and the one axis the batch's leading dimension is split over, or None."""
    leaves = jax.tree.leaves(batch)
    sharding = sharding_of(leaves[0]) if leaves else None
    if not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    axes = list(names(spec[0])) if len(spec) else []
    if len(axes) > 1:
        raise NotImplementedError(
            "under jit, accumjax splits a batch over one mesh axis (the data axis); the batch "
            f"is sharded over {axes}. Shard it over one axis."
        )
    return (sharding.mesh, axes[0]) if axes else None


def _split_dim(path: str, leaf: Any, axis: str) -> int | None:
    """The dimension of a parameter split over the data axis ``axis`` (None: replicated)."""
    spec = getattr(sharding_of(leaf), "spec", ())
    for axes in map(names, spec):
        if axis in axes and len(axes) > 1:
            raise NotImplementedError(
                f"params{path} has a dimension split over {axes} together: the train step "
                f"supports parameters split over the data axis {axis!r} or over other axes, "
                "one axis per dimension."
            )
    return next((dim for dim, entry in enumerate(spec) if axis in names(entry)), None)


def layout_of(
    params: Any,
    batch: Any,
    *,
    optimizer_sharding: str = "replicated",
    reduce_scatter: str = "microbatch",
    mesh: AnyMesh | None = None,
    axis: str | None = None,
) -> MeshLayout | None:
    """The `MeshLayout` of a call, or None when it runs off any mesh.

    Args:
      params: the parameters (arrays, ``jax.ShapeDtypeStruct`` leaves or traced values).
      batch: the batch; its first leaf's sharding names the data axis.
      mesh, axis: the step's own mesh and data axis (``make_train_step(mesh=...,
        axis_name=...)``), or None to read them from the arrays.
      optimizer_sharding, reduce_scatter: the plan's choices (`accumjax._layout.leaf_layout`).

    Returns:
      A `MeshLayout` (a one-device mesh too: the step runs there as on N devices), or None (no
      mesh, or a batch that is not split and no data axis known).

    Raises:
      NotImplementedError: for a batch split over several mesh axes, or a parameter
        dimension split over the data axis together with another.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> import accumjax._mesh as mesh_lib
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> batch = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("data")))
      >>> params = jax.device_put(jnp.ones((2, 3)), NamedSharding(mesh, P("data", None)))
      >>> layout = mesh_lib.layout_of({"w": params}, batch)
      >>> layout.axis, layout.param_dims, layout.shards
      ('data', (0,), 2)
    """
    if mesh is None:
        found = _batch_axis(batch)
        if found is None:
            mesh = mesh_of((params, batch))
            axis = None if mesh is None else data_axis(mesh)
        else:
            mesh, axis = found
    else:
        axis = data_axis(mesh, axis)
    if mesh is None or axis is None:
        return None
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    dims = tuple(_split_dim(jax.tree_util.keystr(p), leaf, axis) for p, leaf in paths)
    shards = int(mesh.shape[axis])
    specs, leaves = [], []
    for (_, leaf), dim in zip(paths, dims, strict=True):
        shape = tuple(jnp.shape(leaf))
        spec = tuple(getattr(sharding_of(leaf), "spec", ()) or ())
        spec = spec + (None,) * (len(shape) - len(spec))
        specs.append(spec)
        leaves.append(
            leaf_layout(
                dim,
                shape,
                spec,
                shards,
                optimizer_sharding=optimizer_sharding,
                reduce_scatter=reduce_scatter,
            )
        )
    return MeshLayout(
        mesh=mesh, axis=axis, treedef=treedef, leaves=tuple(leaves), specs=tuple(specs)
    )


def mesh_difference(a: AnyMesh, b: AnyMesh) -> str:
    """What differs between two meshes, for messages: their axis names, shape, axis types,
    devices or device order (two meshes may print alike and differ in the last two).

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import AxisType, Mesh
      >>> devices = np.array(jax.devices()[:1])
      >>> mesh_difference(Mesh(devices, ("data",)), Mesh(devices, ("batch",)))
      "axis names ('data',) vs ('batch',)"
      >>> explicit = Mesh(devices, ("data",), axis_types=(AxisType.Explicit,))
      >>> mesh_difference(Mesh(devices, ("data",)), explicit)
      'axis types (Auto,) vs (Explicit,)'
    """
    found = []
    if a.axis_names != b.axis_names:
        found.append(f"axis names {a.axis_names} vs {b.axis_names}")
    if tuple(a.axis_sizes) != tuple(b.axis_sizes):
        found.append(f"shape {dict(a.shape)} vs {dict(b.shape)}")
    types = lambda m: (
        "(" + ", ".join(t.name for t in m.axis_types) + ("," * (len(m.axis_types) == 1)) + ")"
    )
    if len(a.axis_types) == len(b.axis_types) and tuple(a.axis_types) != tuple(b.axis_types):
        found.append(f"axis types {types(a)} vs {types(b)}")
    if isinstance(a, Mesh) and isinstance(b, Mesh):
        ids = lambda m: [int(i) for i in m.device_ids.flat]
        if set(ids(a)) != set(ids(b)):
            found.append(f"devices {sorted(ids(a))} vs {sorted(ids(b))}")
        elif ids(a) != ids(b):
            found.append(f"device order {ids(a)} vs {ids(b)}")
    return "; ".join(found) or "nothing accumjax can name (two distinct mesh objects)"


def check_one_mesh(params: Any, batch: Any) -> None:
    """Refuses parameters and a batch on different meshes of the same devices, saying what
    differs (`mesh_difference`; JAX would say "Mesh for all inputs should be equal" inside
    the loss).

    Example:
      >>> import jax.numpy as jnp
      >>> check_one_mesh({"w": jnp.ones(2)}, jnp.ones(2))  # one device: nothing to say
    """
    meshes = {}
    for root, tree in (("params", params), ("batch", batch)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            mesh = getattr(sharding_of(leaf), "mesh", None)
            if mesh is not None and mesh.size > 1:
                meshes.setdefault(root, (jax.tree_util.keystr(path), mesh))
    if len(meshes) < 2:
        return
    (p_path, p_mesh), (b_path, b_mesh) = meshes["params"], meshes["batch"]
    concrete = isinstance(p_mesh, Mesh) and isinstance(b_mesh, Mesh)
    if concrete and set(p_mesh.device_ids.flat) != set(b_mesh.device_ids.flat):
        return  # other devices: named by the step's own check of where its arrays lie
    differ = (
        p_mesh != b_mesh
        if concrete
        else (p_mesh.axis_names, p_mesh.axis_sizes)
        != (
            b_mesh.axis_names,
            b_mesh.axis_sizes,
        )
    )
    if differ:
        raise ValueError(
            f"params{p_path} lie on a mesh {dict(p_mesh.shape)} and batch{b_path} on a mesh "
            f"{dict(b_mesh.shape)} of the same devices, which differ in "
            f"{mesh_difference(p_mesh, b_mesh)}: {ONE_MESH}. Put the batch on the parameters' "
            "mesh (NamedSharding(mesh, P('data')))."
        )


def gather_params(params: Any, layout: MeshLayout) -> Any:
    """Inside ``shard_map``: the full-size parameters from this device's shards (all-gather)."""
    return gathered(params, layout.axis, layout.param_dims)


# ----------------------------------------------------------------------------- stream mode


def _zeros(shape: tuple[int, ...], dtype: Any, mesh: AnyMesh | None, spec: Any) -> jax.Array:
    """Zeros laid out as ``spec`` on ``mesh``, eagerly or inside a trace (an ``Explicit``
    axis is resharded, an ``Auto`` one constrained: a nested ``jit``'s ``out_shardings``
    would be dropped under ``jax.set_mesh``)."""
    zeros = jnp.zeros(shape, dtype)
    if mesh is None:
        return zeros
    sharding = NamedSharding(mesh, spec)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] == jax.sharding.AxisType.Explicit for e in spec for a in names(e)):
        return jax.sharding.reshard(zeros, sharding)
    return jax.lax.with_sharding_constraint(zeros, sharding)


def lay_out(tree: Any, mesh: AnyMesh, specs: Any) -> Any:
    """``tree`` laid out as ``specs`` (a tree of ``PartitionSpec``, or a tuple of them or
    None, one per leaf) on ``mesh`` inside a trace: resharded on an ``Explicit`` mesh,
    constrained on an ``Auto`` one."""
    leaves, treedef = jax.tree.flatten(tree)
    if not isinstance(specs, tuple):
        specs = tuple(
            jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec) or s is None)
        )
    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
    out = []
    for x, spec in zip(leaves, specs, strict=True):
        if spec is None or not isinstance(x, jax.Array | jax.core.Tracer):
            out.append(x)
            continue
        sharding = NamedSharding(mesh, spec)
        out.append(
            jax.sharding.reshard(x, sharding)
            if explicit
            else jax.lax.with_sharding_constraint(x, sharding)
        )
    return jax.tree.unflatten(treedef, out)


def optimizer_state_specs(
    init: Any, params: Any, layout: MeshLayout
) -> tuple[PartitionSpec | None, ...] | None:
    """Per leaf of ``init(params)`` (an optimizer state), its partition spec when each
    parameter is laid out as its optimizer dimension of ``layout`` says (`state_specs`: Adam's
    moments split like the gradient); None off a concrete mesh."""
    if not isinstance(layout.mesh, Mesh):
        return None
    specs = jax.tree.leaves(
        layout.global_specs(layout.optimizer_dims), is_leaf=lambda s: isinstance(s, PartitionSpec)
    )
    return state_specs(init, layout.mesh, params, specs)


def state_specs(
    init: Any, mesh: Mesh, params: Any, specs: list[PartitionSpec]
) -> tuple[PartitionSpec | None, ...]:
    """Per leaf of ``init(params)``, its partition spec when each parameter leaf lies as
    ``specs`` says: traced on an ``Explicit`` copy of ``mesh`` (whatever mesh the caller set),
    so that sharding in types derives it."""
    explicit = (jax.sharding.AxisType.Explicit,) * len(mesh.axis_names)
    explicit_mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=explicit)
    leaves, treedef = jax.tree.flatten(params)
    typed = [
        jax.ShapeDtypeStruct(
            jnp.shape(x), jnp.result_type(x), sharding=NamedSharding(explicit_mesh, spec)
        )
        for x, spec in zip(leaves, specs, strict=True)
    ]
    with jax.set_mesh(explicit_mesh):
        shapes = jax.eval_shape(init, jax.tree.unflatten(treedef, typed))
    return tuple(getattr(x.sharding, "spec", None) for x in jax.tree.leaves(shapes))


def device_window(
    params: Any,
    accumulator_dtype: Any,
    mesh: AnyMesh | None,
    axis: str | None,
    dims: tuple[int | None, ...] | None = None,
) -> window_lib.DeviceWindow:
    """An empty `accumjax.window.DeviceWindow` for ``params``, laid out by the layout plan:
    per leaf, on a leading axis, the sums its accumulator's row holds
    (`accumjax._layout.partial_sum_count`): one per data shard (the devices along ``axis`` of
    ``mesh``; one without a mesh), each split like its parameter, or, for an accumulator
    split over the data axis (``dims``: the plan's `MeshLayout.accumulator_dims`; by default
    `layout_of`'s without other choices: a parameter split over that axis), one split there.

    Example:
      >>> import jax.numpy as jnp
      >>> w = device_window({"w": jnp.zeros(3)}, jnp.float32, None, None)
      >>> w.partial_sums["w"].shape, w.weight_sum.shape
      ((1, 3), ())
    """
    shards = 1 if mesh is None or axis is None else int(mesh.shape[axis])
    leaves, treedef = jax.tree.flatten(params)
    if dims is None:
        on_mesh = mesh is not None and axis is not None
        plan = layout_of(params, None, mesh=mesh, axis=axis) if on_mesh else None
        dims = (None,) * len(leaves) if plan is None else plan.accumulator_dims

    def sums(p: Any, dim: int | None) -> jax.Array:
        spec = tuple(getattr(sharding_of(p), "spec", ()) or ())
        spec = spec + (None,) * (len(p.shape) - len(spec))
        if dim is not None and axis is not None:
            spec = tuple(axis if i == dim else e for i, e in enumerate(spec))
        held = partial_sum_count(dim, shards)  # the plan's sums of this leaf, on the leading axis
        dtype = window_lib.sum_dtype(p.dtype, accumulator_dtype)
        lead = axis if held > 1 else None
        return _zeros((held, *p.shape), dtype, mesh, PartitionSpec(lead, *spec))

    replicated = lambda dtype: _zeros((), dtype, mesh, PartitionSpec())  # distinct: donatable
    return window_lib.DeviceWindow(
        partial_sums=jax.tree.unflatten(
            treedef, [sums(p, d) for p, d in zip(leaves, dims, strict=True)]
        ),
        weight_sum=replicated(jnp.float32),
        micro_step=replicated(jnp.int32),
        window_nonfinite=replicated(jnp.int32),
        window_skipped=replicated(jnp.int32),
    )
