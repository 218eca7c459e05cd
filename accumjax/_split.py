"""How scan mode splits a batch into K strided microbatches (internal).

Microbatch ``i`` is rows ``i, i + K, i + 2K, ...`` (`strided_microbatches`, as
``optax.microbatching.reshape_batch_axis``), so a sharded batch axis stays sharded. A leaf's
batch axis is its ``batch_axis`` (per leaf or for the whole batch; ``None``: not batched,
every microbatch sees it full-size). `rows_in_order` puts per-microbatch outputs back in row
order; `split_advice` is the split rule: the rows divide by K, on a mesh by the devices x K.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["BatchAxis", "check_batch_axis", "rows_in_order", "split_advice", "strided_microbatches"]

# An int (the batch axis of every leaf), or a pytree prefix of the batch with an int or None
# (not batched) at each leaf.
BatchAxis = Any


def split_advice(rows: int, every_k: int = 1, shards: int = 1) -> str | None:
    """None if ``rows`` rows split over ``shards`` devices and then into ``every_k``
    microbatches on each (they divide by ``shards x every_k``), else the split rule they break,
    with the numbers, and after "use" the sizes that would split: the nearest row counts, and,
    when the devices split the rows, the K that would.

    Args:
      rows: the batch's rows (all devices' together).
      every_k: the number of microbatches each device splits its rows into.
      shards: the number of devices the rows are split over.

    Returns:
      None, or the rule and the advice, for the caller's message to follow where the rows are.

    Example:
      >>> split_advice(9, 4)
      '9 rows are not divisible by K=4: use 8 or 12 rows, or a K that divides 9'
      >>> split_advice(66, 1, 8)
      '66 rows on 8 devices are not divisible by 8: use 64 or 72 rows'
      >>> split_advice(72, 4, 8).split(": use ")[1]
      '64 or 96 rows, or a K that divides 9 (the rows each device gets)'
      >>> split_advice(8, 4) is None
      True
    """
    need = shards * every_k
    if rows % need == 0:
        return None
    lower = rows // need * need
    advice = " or ".join(str(r) for r in (lower, lower + need) if r) + " rows"
    if rows % shards == 0:
        each = " (the rows each device gets)" if shards > 1 else ""
        advice += f", or a K that divides {rows // shards}{each}"
    return f"{_rule(rows, every_k, shards)}: use {advice}"


def _rule(rows: int, every_k: int, shards: int) -> str:
    """The split rule ``rows`` rows break, with the numbers."""
    if shards == 1:
        return f"{rows} rows are not divisible by K={every_k}"
    if every_k == 1:
        return f"{rows} rows on {shards} devices are not divisible by {shards}"
    return (
        f"{rows} rows on {shards} devices with K={every_k} are not divisible by devices x K = "
        f"{shards} x {every_k} = {shards * every_k} (each device splits its rows into K "
        "microbatches)"
    )


def check_batch_axis(batch_axis: BatchAxis) -> BatchAxis:
    """``batch_axis`` if every leaf is an int or None, else a ``TypeError`` naming it.

    Example:
      >>> check_batch_axis({"x": 1, "mask": None})
      {'x': 1, 'mask': None}
    """
    for leaf in jax.tree.leaves(batch_axis, is_leaf=lambda x: x is None):
        if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
            raise TypeError(
                "batch_axis must be an int, or a pytree prefix of the batch with an int (the "
                f"leaf's batch axis) or None (not batched) at each leaf; got {leaf!r}."
            )
    return batch_axis


def _axes(batch: Any, batch_axis: BatchAxis) -> list[int | None]:
    """Each batch leaf's batch axis (or None), in ``jax.tree.leaves(batch)`` order."""
    try:
        expanded = jax.tree.map(
            lambda a, sub: jax.tree.map(lambda _: a, sub),
            batch_axis,
            batch,
            is_leaf=lambda x: x is None,
        )
    except ValueError as err:
        raise ValueError(
            f"batch_axis {batch_axis!r} is not a pytree prefix of the batch: {err}"
        ) from err
    axes = []
    for a, x in zip(
        jax.tree.leaves(expanded, is_leaf=lambda x: x is None), jax.tree.leaves(batch), strict=True
    ):
        if a is not None and not -jnp.ndim(x) <= a < jnp.ndim(x):
            raise ValueError(
                f"scan mode: a batch leaf of shape {jnp.shape(x)} has no axis {a} to split "
                "into microbatches; give it batch_axis=None if it is not batched."
            )
        axes.append(None if a is None else a % jnp.ndim(x))
    return axes


def strided_microbatches(
    batch: Any, every_k: int, batch_axis: BatchAxis = 0
) -> Callable[[jax.Array], Any]:
    """``i -> microbatch i`` of ``batch``: rows ``i, i + every_k, ...`` along each leaf's
    batch axis.

    Each batched leaf is reshaped ``(..., B, ...) -> (..., B // every_k, every_k, ...)`` (a
    bitcast: a Fortran-order reshape would pick the same rows but transpose every leaf, a
    copy XLA keeps), and microbatch ``i`` is a dynamic index on the new ``every_k`` axis.
    Leaves whose ``batch_axis`` is None are passed full-size.

    Args:
      batch: the batch (per device).
      every_k: the number of microbatches.
      batch_axis: see the module docstring.

    Returns:
      The function from a microbatch index to the microbatch.

    Raises:
      ValueError: if the batched leaves do not share one batch size, or it is not divisible
        by ``every_k``.

    Example:
      >>> import jax.numpy as jnp
      >>> batch = {"x": jnp.arange(6), "w": jnp.ones(2)}
      >>> take = strided_microbatches(batch, 3, {"x": 0, "w": None})
      >>> take(1)["x"], take(1)["w"]
      (Array([1, 4], dtype=int32), Array([1., 1.], dtype=float32))
    """
    leaves, treedef = jax.tree.flatten(batch)
    axes = _axes(batch, batch_axis)
    sizes = {jnp.shape(x)[a] for x, a in zip(leaves, axes, strict=True) if a is not None}
    if len(sizes) != 1:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(
            "scan mode needs every batched leaf to share one batch size on its batch axis "
            f"(batch_axis={batch_axis!r}); got shapes {shapes}."
        )
    size = sizes.pop()
    advice = split_advice(size, every_k)
    if advice is not None:
        raise ValueError(
            f"scan mode splits the batch (a device's rows, under pmap) into K={every_k} "
            f"microbatches; {advice}."
        )

    def strided(x: jax.Array, a: int | None) -> jax.Array:
        if a is None:
            return x
        shape = jnp.shape(x)
        return jnp.reshape(x, (*shape[:a], size // every_k, every_k, *shape[a + 1 :]))

    rows = [strided(x, a) for x, a in zip(leaves, axes, strict=True)]

    def take(i: jax.Array) -> Any:
        picked = [
            x if a is None else jax.lax.dynamic_index_in_dim(x, i, a + 1, False)
            for x, a in zip(rows, axes, strict=True)
        ]
        return jax.tree.unflatten(treedef, picked)

    return take


def rows_in_order(stacked: Any) -> Any:
    """Per-microbatch outputs ``(K, B // K, ...)`` back in the batch's row order ``(B, ...)``.

    Microbatch ``i``'s row ``j`` is the batch's row ``i + K * j``.

    Example:
      >>> import jax.numpy as jnp
      >>> rows_in_order(jnp.array([[0, 2, 4], [1, 3, 5]]))  # K=2 microbatches of 3 rows
      Array([0, 1, 2, 3, 4, 5], dtype=int32)
    """

    def unstride(a: jax.Array) -> jax.Array:
        if jnp.ndim(a) < 2:
            raise ValueError(
                "aux_rows=True needs every aux leaf to have a leading per-row axis (one entry "
                f"per row of the microbatch); got a leaf of shape {jnp.shape(a)[1:]} per "
                "microbatch."
            )
        every_k, m = jnp.shape(a)[:2]
        return jnp.reshape(jnp.swapaxes(a, 0, 1), (every_k * m, *jnp.shape(a)[2:]))

    return jax.tree.map(unstride, stacked)
