"""ZeRO under ``jit`` (internal): a window's update on parameters replicated over the data
axis whose optimizer state is split over it (`accumjax._layout`'s ZeRO rows).

The inner optimizer runs in the global view on the parameters sliced like their reduced
gradient, and the new slices are all-gathered back: inside the update's loop of at most one
trip (`split_params`, scan mode) or around the window's close (`zero_close`, stream mode).
The parameters are pinned in their layout (`pinned`) wherever XLA could otherwise carry them split
through a loop and gather them on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import accumjax._mesh as mesh_lib
from accumjax._layout import zero_layout
from accumjax._loop import LoopCarry
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = [
    "as_placed",
    "optimizer_side",
    "parameter_side",
    "pinned",
    "placed_zero",
    "restore_layout",
    "split_params",
    "zero_close",
]


def optimizer_side(layout: mesh_lib.MeshLayout, params: Any, acc: AccumulationState) -> tuple:
    """A ZeRO window's update inputs in the global view: the parameters split like their
    reduced gradient (a local slice) and the optimizer state laid out as planned."""
    params = mesh_lib.lay_out(params, layout.mesh, layout.global_specs(layout.optimizer_dims))
    return params, acc._replace(inner_tx_state=_planned(layout, acc.inner_tx_state))


def _planned(layout: mesh_lib.MeshLayout, inner: Any) -> Any:
    """The inner optimizer state laid out as the plan says (as it is without a plan)."""
    if layout.opt_specs is None:
        return inner
    return mesh_lib.lay_out(inner, layout.mesh, layout.opt_specs)


def _to_param_layout(layout: mesh_lib.MeshLayout, params: Any) -> Any:
    """The parameters gathered back where they lie, pinned there."""
    specs = layout.global_specs(layout.param_dims)
    return pinned(layout, mesh_lib.lay_out(params, layout.mesh, specs))


def _laid_out_back(
    layout: mesh_lib.MeshLayout, params: Any, opt: Any, accumulating: bool
) -> tuple[Any, Any]:
    """After a ZeRO window's update: ``params`` gathered back where they lie (one all-gather),
    pinned there, and ``opt`` laid out as planned (an `accumulate` state's inner state when
    ``accumulating``, else ``opt`` itself)."""
    if accumulating:
        opt = opt._replace(inner_tx_state=_planned(layout, opt.inner_tx_state))
    else:
        opt = _planned(layout, opt)
    return _to_param_layout(layout, params), opt


def split_params(layout: mesh_lib.MeshLayout) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """`accumjax._loop.Context.split_params` of a ZeRO layout: the parameters (pinned
    where they lie, so that XLA keeps them so in the update's loop carry) sliced like the
    reduced gradient, and the new slices all-gathered back.

    Args:
      layout: the call's `accumjax.sharded.MeshLayout` with a ZeRO plan.

    Returns:
      ``(to_shards, to_param_layout)``, functions of the parameters in the global view (traced).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import accumjax._mesh as mesh_lib
      >>> from accumjax._zero import split_params
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> params = {"w": jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P()))}
      >>> layout = mesh_lib.layout_of(params, None, mesh=mesh, optimizer_sharding="zero1")
      >>> to_shards, to_param_layout = split_params(layout)
      >>> tuple(jax.jit(to_shards)(params)["w"].sharding.spec)
      ('data', None)
      >>> jax.jit(lambda p: to_param_layout(to_shards(p)))(params)["w"].sharding.is_fully_replicated
      True
    """
    mesh, split = layout.mesh, layout.global_specs(layout.optimizer_dims)
    to_shards = lambda p: mesh_lib.lay_out(pinned(layout, p), mesh, split)
    return to_shards, partial(_to_param_layout, layout)


def parameter_side(
    layout: mesh_lib.MeshLayout, state: TrainState, accumulating: bool
) -> TrainState:
    """After a ZeRO window's update: the parameters back where they lie (one all-gather) and
    the optimizer state where it lies (`_laid_out_back`)."""
    params, opt = _laid_out_back(layout, state.params, state.opt_state, accumulating)
    return state.replace(params=params, opt_state=opt)


def zero_close(
    layout: mesh_lib.MeshLayout,
    accumulating: bool,
    close: Callable[[LoopCarry], LoopCarry],
    fields: LoopCarry,
) -> LoopCarry:
    """``close`` with the update on the parameters split like their reduced gradient, and
    the parameters and optimizer state laid out back as they lie."""
    params, opt = optimizer_side(layout, pinned(layout, fields.params), fields.opt)
    return restore_layout(layout, close(fields._replace(params=params, opt=opt)))


def pinned(layout: mesh_lib.MeshLayout, params: Any) -> Any:
    """``params`` constrained where they lie, so that XLA keeps them so in a loop's carry
    (on an ``Explicit`` mesh through `jax.sharding.auto_axes`: under ``jax.set_mesh`` a
    constraint equal to the type is dropped)."""
    specs = jax.tree.leaves(
        layout.global_specs(layout.param_dims), is_leaf=lambda s: isinstance(s, PartitionSpec)
    )
    shardings = [NamedSharding(layout.mesh, spec) for spec in specs]
    leaves = layout.treedef.flatten_up_to(params)
    constrain = partial(jax.lax.with_sharding_constraint, shardings=shardings)
    if jax.sharding.AxisType.Explicit in tuple(layout.mesh.axis_types):
        # Inside `auto_axes` the mesh's axes are Auto: the constraint names them by spec.
        by_spec = partial(jax.lax.with_sharding_constraint, shardings=specs)
        constrain = cast(Any, jax.sharding.auto_axes)(by_spec, out_sharding=shardings)
    return jax.tree.unflatten(layout.treedef, list(constrain(leaves)))


def restore_layout(layout: mesh_lib.MeshLayout, fields: LoopCarry) -> LoopCarry:
    """``fields`` (a window close's `accumjax._loop.LoopCarry`) with the parameters where they
    lie (one all-gather of a ZeRO update) and the optimizer state as planned (`_laid_out_back`)."""
    params, opt = _laid_out_back(layout, fields.params, fields.opt, accumulating=True)
    return fields._replace(params=params, opt=opt)


def placed_zero(inner: Any, params: Any, layout: mesh_lib.MeshLayout) -> dict[Any, int | None]:
    """Where the user split the optimizer state over the data axis beside replicated
    parameters: for each replicated parameter's shape, the dimension its state leaves lie
    split on (None: replicated); empty when no state leaf of such a shape is split."""
    replicated_shapes = {
        tuple(jnp.shape(p))
        for p, d in zip(layout.treedef.flatten_up_to(params), layout.param_dims, strict=True)
        if d is None
    }
    found: dict[Any, int | None] = {}
    for x in jax.tree.leaves(inner):
        shape = tuple(jnp.shape(x))
        if shape not in replicated_shapes:
            continue
        spec = getattr(mesh_lib.sharding_of(x), "spec", ()) or ()
        dims = [i for i, e in enumerate(spec) if layout.axis in mesh_lib.names(e)]
        found[shape] = dims[0] if dims else found.get(shape)
    return found if any(d is not None for d in found.values()) else {}


def as_placed(plan: mesh_lib.MeshLayout, params: Any, placed: dict[Any, int | None]) -> tuple:
    """``plan``'s leaves with each replicated parameter's optimizer dimension as placed: its
    ZeRO-1 row (`accumjax._layout.zero_layout`), replicated where its state is."""
    leaves = []
    for p, leaf in zip(plan.treedef.flatten_up_to(params), plan.leaves, strict=True):
        if leaf.param is None:
            leaf = zero_layout(placed.get(tuple(jnp.shape(p))), "zero1")
        leaves.append(leaf)
    return tuple(leaves)
