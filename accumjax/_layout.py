"""The layout plan of a train step on a mesh: per parameter leaf, where the parameter, its
window accumulator and its optimizer state lie along the data axis, and how its gradient is
reduced across the devices.

Each leaf is a `LeafLayout` (dimensions split over the data axis, None for replicated over
it) and a `Reduction`; the window's reduction (`accumjax._reduction`) reads them. Every
`LeafLayout` is built here. The layouts a user chooses are rows of one table (`leaf_layout`;
a replicated parameter's ZeRO rows: `zero_layout`):

================  =========  ===========  =========  ==============================
layout            parameter  accumulator  optimizer  reduction
================  =========  ===========  =========  ==============================
replicated        full       full         full       all-reduce per window
ZeRO-1            full       full         d          reduce-scatter per window
ZeRO-2            full       d            d          reduce-scatter per microbatch
FSDP              d          d            d          reduce-scatter per microbatch
FSDP ``window``   d          full         d          reduce-scatter per window
================  =========  ===========  =========  ==============================

``full`` is a full-size copy on every device. ``d`` is the parameter's split dimension (FSDP)
or, for ZeRO, its first dimension that divides by the number of devices and no other mesh axis
splits; a leaf with none stays replicated.

A window kept per data shard between calls (`accumjax.window.DeviceWindow`) holds, per leaf,
as many partial sums as its row's accumulator says (`partial_sum_count`: one per device for a
full-size accumulator, one split over the devices for a split one), on a leading axis
(`partial_sums_shape` reads a leaf's shape back; `accumulator_bytes` sizes them).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

from accumjax._checks import check_choice

__all__ = [
    "OPTIMIZER_SHARDINGS",
    "REPLICATED",
    "LeafLayout",
    "Reduction",
    "accumulator_bytes",
    "check_optimizer_sharding",
    "leaf_layout",
    "optimizer_dims",
    "partial_sum_count",
    "partial_sums_shape",
    "reduced_into_one_sum",
    "reduced_per_microbatch",
    "window_layouts",
    "zero_dim",
    "zero_layout",
]

OPTIMIZER_SHARDINGS = ("replicated", "zero1", "zero2")


class Reduction(enum.Enum):
    """How a leaf's gradient is reduced across the data axis: all-reduced or
    reduce-scattered, once a window (when it closes) or every microbatch (before it is added:
    nothing is left for the window's close)."""

    ALL_REDUCE = "all-reduce per window"
    REDUCE_SCATTER_WINDOW = "reduce-scatter per window"
    REDUCE_SCATTER_MICROBATCH = "reduce-scatter per microbatch"
    ALL_REDUCE_MICROBATCH = "all-reduce per microbatch"

    @property
    def per_microbatch(self) -> bool:
        """Whether it runs on every microbatch's gradient before it is added (else on the
        window's sum when it closes)."""
        return self in (Reduction.REDUCE_SCATTER_MICROBATCH, Reduction.ALL_REDUCE_MICROBATCH)

    @property
    def scatters(self) -> bool:
        """Whether it reduce-scatters the gradient into shards along the leaf's ``optimizer``
        dimension (else all-reduces it)."""
        return self in (Reduction.REDUCE_SCATTER_WINDOW, Reduction.REDUCE_SCATTER_MICROBATCH)


class LeafLayout(NamedTuple):
    """Where one parameter leaf's arrays lie along the data axis (static, hashable).

    Attributes:
      param: the parameter's dimension split over the data axis (None: replicated).
      accumulator: the window accumulator's (None: a full-size sum on every device).
      optimizer: the reduced gradient's and the optimizer state's (None: replicated): a
        reduce-scatter's dimension.
      reduction: how the gradient is reduced across the devices.
    """

    param: int | None
    accumulator: int | None
    optimizer: int | None
    reduction: Reduction


#: A leaf replicated over the data axis, its gradient all-reduced once a window.
REPLICATED = LeafLayout(None, None, None, Reduction.ALL_REDUCE)


@overload
def optimizer_dims(layouts: Sequence[LeafLayout]) -> tuple[int | None, ...]: ...
@overload
def optimizer_dims(layouts: None) -> None: ...
def optimizer_dims(layouts: Sequence[LeafLayout] | None) -> tuple[int | None, ...] | None:
    """Per leaf of ``layouts``, the dimension its reduced gradient (and its optimizer state)
    is split on, None where replicated; None for no ``layouts`` (every leaf whole).

    Example:
      >>> zero1 = LeafLayout(None, None, 0, Reduction.REDUCE_SCATTER_WINDOW)
      >>> optimizer_dims([zero1, REPLICATED]), optimizer_dims(None)
      ((0, None), None)
    """
    return None if layouts is None else tuple(leaf.optimizer for leaf in layouts)


def reduced_per_microbatch(leaf: LeafLayout) -> LeafLayout:
    """``leaf`` as a policy that reads each microbatch's whole gradient lays it out: reduced
    every microbatch (reduce-scattered where its optimizer state is split), summed in an
    accumulator laid out like its optimizer state.

    Example:
      >>> from accumjax._layout import LeafLayout, Reduction, reduced_per_microbatch
      >>> zero1 = LeafLayout(None, None, 0, Reduction.REDUCE_SCATTER_WINDOW)
      >>> reduced_per_microbatch(zero1).reduction.value
      'reduce-scatter per microbatch'
    """
    dim = leaf.optimizer
    if dim is None:
        return leaf._replace(accumulator=None, reduction=Reduction.ALL_REDUCE_MICROBATCH)
    return _split_row(leaf.param, dim, per_microbatch=True)


def window_layouts(
    leaves: Sequence[LeafLayout], reads: bool
) -> tuple[tuple[LeafLayout, ...], bool]:
    """How a window on a mesh reduces the plan's ``leaves``: ``(layouts, global_counts)``.
    A policy that reads the gradient (``reads``) reduces each microbatch's whole gradient, its
    decision and counts agreed on by the devices: each leaf `reduced_per_microbatch`, and the
    window's counts are whole-batch values already (``global_counts``). Otherwise the plan's
    leaves as they are, each device counting its own.

    Example:
      >>> layouts, global_counts = window_layouts([REPLICATED], reads=True)
      >>> layouts[0].reduction.value, global_counts
      ('all-reduce per microbatch', True)
    """
    if reads:
        return tuple(reduced_per_microbatch(leaf) for leaf in leaves), True
    return tuple(leaves), False


def reduced_into_one_sum(leaf: LeafLayout) -> LeafLayout:
    """``leaf`` as a window kept as one reduced sum (a stream call's `accumjax.window.Window`
    on a mesh) lays it out: every microbatch reduced before it is added, all-reduced into a
    full-size accumulator, reduce-scattered into a split one.

    Example:
      >>> from accumjax._layout import LeafLayout, Reduction, reduced_into_one_sum
      >>> zero1 = LeafLayout(None, None, 0, Reduction.REDUCE_SCATTER_WINDOW)
      >>> reduced_into_one_sum(zero1).reduction.value
      'all-reduce per microbatch'
    """
    if leaf.accumulator is None:
        return leaf._replace(reduction=Reduction.ALL_REDUCE_MICROBATCH)
    return leaf._replace(reduction=Reduction.REDUCE_SCATTER_MICROBATCH)


def check_optimizer_sharding(value: Any) -> str:
    """``make_train_step(optimizer_sharding=...)`` validated."""
    return check_choice("optimizer_sharding", value, OPTIMIZER_SHARDINGS)


def zero_dim(shape: tuple[int, ...], spec: tuple[Any, ...], shards: int) -> int | None:
    """The dimension a replicated parameter's optimizer state is split on over ``shards``
    devices: the first that divides by ``shards`` and that ``spec`` (its partition spec)
    leaves unsplit; None for none (the leaf stays replicated).

    Example:
      >>> zero_dim((3, 8), (), 4), zero_dim((3,), (), 2), zero_dim((8, 8), ("model",), 2)
      (1, None, 1)
    """
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=True)):
        if entry is None and size % shards == 0 and size >= shards:
            return dim
    return None


def leaf_layout(
    param_dim: int | None,
    shape: tuple[int, ...],
    spec: tuple[Any, ...],
    shards: int,
    *,
    optimizer_sharding: str,
    reduce_scatter: str,
) -> LeafLayout:
    """One leaf's row of the layout table (see the module docstring).

    Args:
      param_dim: the parameter's dimension split over the data axis, or None.
      shape, spec: the parameter's global shape and partition spec.
      shards: the number of devices along the data axis.
      optimizer_sharding: ``"replicated"``, ``"zero1"`` or ``"zero2"``: where a replicated
        parameter's optimizer state (and with ``"zero2"`` its accumulator) lies.
      reduce_scatter: FSDP: ``"microbatch"`` or ``"window"``.

    Returns:
      The `LeafLayout`.

    Example:
      >>> leaf_layout(None, (8, 4), (), 2, optimizer_sharding="zero1",
      ...             reduce_scatter="microbatch").reduction.value
      'reduce-scatter per window'
    """
    if param_dim is not None:
        return _split_row(param_dim, param_dim, per_microbatch=reduce_scatter == "microbatch")
    dim = None if optimizer_sharding == "replicated" else zero_dim(shape, spec, shards)
    return zero_layout(dim, optimizer_sharding)


def zero_layout(optimizer_dim: int | None, optimizer_sharding: str = "zero1") -> LeafLayout:
    """The row of a parameter replicated over the data axis whose optimizer state lies split on
    ``optimizer_dim`` (None: replicated, `REPLICATED`): ZeRO-1 (``"zero1"``: a full-size
    accumulator, reduce-scattered once a window) or ZeRO-2 (``"zero2"``: an accumulator split
    like the state, reduce-scattered every microbatch). `leaf_layout` gives it the dimension
    `zero_dim` finds; an optimizer state the user split himself gives the dimension he placed it
    on (`accumjax._zero.as_placed`: ZeRO-1).

    Example:
      >>> zero_layout(1).reduction.value, zero_layout(None) == REPLICATED
      ('reduce-scatter per window', True)
    """
    if optimizer_dim is None or optimizer_sharding == "replicated":
        return REPLICATED
    return _split_row(None, optimizer_dim, per_microbatch=optimizer_sharding == "zero2")


def _split_row(param: int | None, dim: int, *, per_microbatch: bool) -> LeafLayout:
    """The row of a leaf whose gradient is reduce-scattered on ``dim`` (where its optimizer
    state lies split; ``param``: its parameter's split dimension, or None): every microbatch
    into an accumulator split like it, or once a window from a full-size one."""
    if per_microbatch:
        reduction, accumulator = Reduction.REDUCE_SCATTER_MICROBATCH, dim
    else:
        reduction, accumulator = Reduction.REDUCE_SCATTER_WINDOW, None
    return LeafLayout(param=param, accumulator=accumulator, optimizer=dim, reduction=reduction)


def partial_sum_count(accumulator: int | None, shards: int) -> int:
    """How many parameter-sized sums of one leaf the ``shards`` devices along the data axis
    hold together when its accumulator lies as ``accumulator`` (a `LeafLayout`'s): one per
    device when it is full-size on each, one split over them when it is split. A
    `accumjax.window.DeviceWindow` holds them on its leading axis.

    Example:
      >>> partial_sum_count(None, 8), partial_sum_count(0, 8), partial_sum_count(None, 1)
      (8, 1, 1)
    """
    return shards if accumulator is None else 1


def partial_sums_shape(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """A `accumjax.window.DeviceWindow` leaf's shape read as the plan laid it out: how many
    sums it holds (`partial_sum_count`) and the parameter's shape.

    Example:
      >>> partial_sums_shape((8, 4, 3))
      (8, (4, 3))
    """
    return int(shape[0]), tuple(int(n) for n in shape[1:])


def accumulator_bytes(shape: tuple[int, ...], itemsize: int, leaf: LeafLayout, shards: int) -> int:
    """The bytes of one leaf's window accumulator over the ``shards`` devices of the data axis,
    every device's together (`partial_sum_count` sums of the parameter's ``shape``, ``itemsize``
    bytes a scalar): each device holds ``1 / shards`` of it.

    Example:
      >>> accumulator_bytes((4, 4), 4, REPLICATED, 8), accumulator_bytes((4, 4), 4, LeafLayout(
      ...     param=None, accumulator=0, optimizer=0,
      ...     reduction=Reduction.REDUCE_SCATTER_MICROBATCH), 8)
      (512, 64)
    """
    return partial_sum_count(leaf.accumulator, shards) * math.prod(shape) * itemsize
