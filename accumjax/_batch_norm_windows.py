"""A model state's BatchNorm windows (internal): which close, their close, their pooling.

The statistics are found by their names: step-driven windows (`is_step_driven`), closed by
`close_step_driven_windows` and, at a train step's window end, `close_model_state`;
self-closing ones (`check_no_self_closing`); a plain ``BatchNorm``'s (`warn_plain_batch_norm`).
A model state is pooled across devices here only: windows as `shifted_sums`, and a stream
call's model state on a mesh (`model_state_sums`, `pooled_model_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.typing import Array

from accumjax._batch_norm_math import (
    ACCUMULATOR_NAMES,
    MOMENTUM_NAME,
    STEP_DRIVEN_NAMES,
    Running,
    StatsWindow,
    chan_merge,
    close_stats_window,
    stats_window_of,
    stats_window_values,
)
from accumjax._norms import abs_squared
from accumjax._reduction import psum_together
from accumjax._variables import is_variable, variable_value

__all__ = [
    "array_of",
    "call_sums",
    "check_no_self_closing",
    "close_model_state",
    "close_step_driven_windows",
    "emptied_stats_windows",
    "is_step_driven",
    "merge_pooled",
    "model_state_sums",
    "plain_batch_norm_paths",
    "pooled_model_state",
    "pooled_windows",
    "replace_leaves",
    "self_closing_paths",
    "shifted_sums",
    "warn_if_open",
    "warn_plain_batch_norm",
]


def is_step_driven(node: Any) -> bool:
    """Whether ``node`` is one step-driven layer's statistics (all of its seven leaves).

    Example:
      >>> import jax.numpy as jnp
      >>> is_step_driven({name: jnp.zeros(()) for name in STEP_DRIVEN_NAMES})
      True
      >>> is_step_driven({"mean": jnp.zeros(()), "var": jnp.ones(())})
      False
    """
    return isinstance(node, Mapping) and all(
        key in node and not isinstance(node[key], Mapping) for key in STEP_DRIVEN_NAMES
    )


def self_closing_paths(tree: Any) -> list[str]:
    """Where ``tree`` holds a self-closing layer's statistics (``accum_steps=K``: the
    accumulators without the ``momentum`` of a step-driven layer), as key paths.

    Example:
      >>> import jax.numpy as jnp
      >>> names = ("mean", "var", *ACCUMULATOR_NAMES)
      >>> self_closing_paths({"bn": {name: jnp.zeros(()) for name in names}})
      ["['bn']"]
    """
    names = ("mean", "var", *ACCUMULATOR_NAMES)

    def self_closing(node: Any) -> bool:
        return (
            isinstance(node, Mapping)
            and all(k in node and not isinstance(node[k], Mapping) for k in names)
            and MOMENTUM_NAME not in node
        )

    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=self_closing)[0]
    return [jax.tree_util.keystr(path) for path, node in found if self_closing(node)]


def check_no_self_closing(tree: Any, where: str) -> None:
    """Refuses self-closing layers where an optimizer decides the windows (``where`` names
    the caller): a layer that counts its own calls cannot follow an optimizer that skips a
    microbatch or a window, so the two would drift apart."""
    paths = self_closing_paths(tree)
    if paths:
        raise ValueError(
            f"{where}: the statistics at {', '.join(paths)} belong to AccumBatchNorm("
            "accum_steps=K), which closes its window itself every K calls and cannot follow "
            "the optimizer's window (a skipped microbatch would put it out of phase). State K "
            "once, in accumjax.accumulate, and build the layer with accum_steps=None (the "
            "default): its window then closes with the optimizer's."
        )


def _plain(node: Any) -> bool:
    """Whether ``node`` is a plain ``BatchNorm``'s statistics: ``mean`` and ``var`` without an
    ``AccumBatchNorm``'s window accumulators."""
    return (
        isinstance(node, Mapping)
        and all(k in node and not isinstance(node[k], Mapping) for k in ("mean", "var"))
        and not any(k in node for k in ACCUMULATOR_NAMES)
    )


def plain_batch_norm_paths(tree: Any, before: Any = None) -> list[str]:
    """Where ``tree`` holds a plain ``BatchNorm``'s statistics (``flax.linen.BatchNorm`` or
    ``flax.nnx.BatchNorm``: ``mean`` and ``var`` without an ``AccumBatchNorm``'s window
    accumulators), as key paths; with ``before`` (the same structure: the statistics a forward
    pass started from), only those it replaced (a frozen ``BatchNorm``, evaluated with
    ``use_running_average=True``, hands its arrays back as they were).

    Example:
      >>> import jax.numpy as jnp
      >>> stats = {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}}
      >>> plain_batch_norm_paths(stats), plain_batch_norm_paths(stats, before=stats)
      (["['bn']"], [])
      >>> plain_batch_norm_paths({"bn": {name: jnp.zeros(()) for name in STEP_DRIVEN_NAMES}})
      []
    """
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_plain)[0]
    olds = [] if before is None else jax.tree.leaves(before, is_leaf=_plain)
    if len(olds) != len(found):
        olds = [None] * len(found)  # nothing to compare with: every plain one counts

    def kept(node: Any, old: Any) -> bool:
        same = lambda k: variable_value(node[k]) is variable_value(old[k])
        return _plain(old) and same("mean") and same("var")

    return [
        jax.tree_util.keystr(path)
        for (path, node), old in zip(found, olds, strict=True)
        if _plain(node) and not kept(node, old)
    ]


def warn_plain_batch_norm(
    tree: Any, where: str, every_k: int | None = None, before: Any = None
) -> None:
    """Warns (at trace time) when ``tree``, statistics of a model whose microbatches are
    accumulated (``every_k`` of them a window; None: a schedule or not known), holds a plain
    ``BatchNorm``'s that a forward pass moves (`plain_batch_norm_paths`; ``where`` names the
    caller). Such a layer trains, but its running ``mean``/``var`` move once per microbatch,
    from that microbatch alone.

    Example:
      >>> import warnings, jax.numpy as jnp
      >>> with warnings.catch_warnings(record=True) as seen:
      ...     warnings.simplefilter("always")
      ...     warn_plain_batch_norm({"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}}, "here", 4)
      >>> "AccumBatchNorm" in str(seen[0].message)
      True
    """
    paths = plain_batch_norm_paths(tree, before)
    if not paths:
        return
    many = "K" if every_k is None else f"K={every_k}"
    warnings.warn(
        f"{where}: the statistics at {', '.join(paths)} belong to a plain BatchNorm "
        "(flax.linen.BatchNorm or flax.nnx.BatchNorm), not an accumjax AccumBatchNorm: with "
        f"{many} microbatches accumulated per update, its running mean and var move once per "
        "microbatch, from that microbatch's statistics alone, instead of once per window from "
        "the whole accumulated batch. Use accumjax.AccumBatchNorm (linen) or "
        "accumjax.NNXAccumBatchNorm (NNX) in the model; statistics trained with BatchNorm "
        "carry over with accumjax.convert_batch_norm_variables(variables).",
        UserWarning,
        stacklevel=3,
    )


def _warn_open(calls: Any) -> None:
    warnings.warn(
        f"AccumBatchNorm (accum_steps=None) evaluated with {int(calls)} training call(s) "
        "pooled in a window that was never closed: the running mean/var do not include them. "
        "make_train_step closes the window once per optimizer update; in a loop you write "
        "yourself, call accumjax.sync_batch_norm(new_stats, old_stats, opt_state) after each "
        "optimizer update (or close_batch_norm_windows when the window ends).",
        UserWarning,
        stacklevel=2,
    )


def warn_if_open(step: Array) -> None:
    """Warns, at run time (under ``jit`` too), when ``step`` (a step-driven layer's
    ``acc_step``) shows training calls that no window close has folded in yet.

    An evaluation-mode call of a step-driven layer runs it: a loop that never closes the
    windows would otherwise keep the initial running statistics forever, silently.

    Example:
      >>> import jax.numpy as jnp
      >>> warn_if_open(jnp.zeros((), jnp.int32))  # an empty window: nothing to say
    """
    step = jnp.asarray(step)
    jax.lax.cond(step > 0, lambda: jax.debug.callback(_warn_open, step), lambda: None)


def array_of(value: Any) -> Array:
    """The array held by a leaf (an array, or an ``nnx.Variable`` in an ``nnx.State``)."""
    return jnp.asarray(variable_value(value))


def replace_leaves(node: Mapping[str, Any], values: Mapping[str, Array]) -> Any:
    """A copy of ``node`` (same mapping type, ``nnx.Variable`` leaves kept) with ``values``."""
    new = {
        key: node[key].replace(value) if is_variable(node[key]) else value
        for key, value in values.items()
    }
    mapping_type: Any = type(node)  # dict, FrozenDict or nnx.State
    return mapping_type({**node, **new})


# ---------------------------------------------------------------------------------------------
# A model state pooled across devices
# ---------------------------------------------------------------------------------------------


def shifted_sums(shifts: list[Array], windows: list[StatsWindow]) -> list[tuple[Array, ...]]:
    """Every layer's window as shifted sums ``(n, n * (mean - s), M2 + n * |mean - s|^2)``
    (the second complex where the mean is), with a shift ``s`` equal on every device (the
    running mean): what adds exactly across devices in one all-reduce before
    `pooled_windows`.

    Args:
      shifts: per layer, an array equal on every device (the running mean).
      windows: per layer, this device's window.

    Returns:
      Per layer, its three sums.
    """
    sums = []
    for shift, window in zip(shifts, windows, strict=True):
        delta = window.mean - shift.astype(window.mean.dtype)
        n = window.count
        sums.append((n, n * delta, window.m2 + n * abs_squared(delta)))
    return sums


def pooled_windows(
    summed: list[tuple[Array, ...]], shifts: list[Array], windows: list[StatsWindow]
) -> list[StatsWindow]:
    """The windows whose `shifted_sums` summed across devices are ``summed``, in the order of
    ``windows`` (each keeps its own ``calls``)."""
    pooled = []
    for sums, shift, window in zip(summed, shifts, windows, strict=True):
        likes = (window.count, window.mean, window.m2)  # summed in a type at least theirs
        count, s1, s2 = (x.astype(like.dtype) for x, like in zip(sums, likes, strict=True))
        offset_mean = s1 / jnp.maximum(count, 1)
        mean = shift.astype(offset_mean.dtype) + offset_mean
        m2 = jnp.maximum(s2 - jnp.real(s1 * jnp.conj(offset_mean)), 0)
        pooled.append(StatsWindow(count=count, mean=mean, m2=m2, calls=window.calls))
    return pooled


# A stream-mode step on a mesh pools each call's model state across devices in the call's
# one small all-reduce (with its loss and counts): every device runs the call from empty
# windows (`emptied_stats_windows`), the windows it leaves are this device's statistics of
# the call (`call_sums`, shifted by the running mean, equal everywhere), and their sum across
# devices is merged into the state's windows (`merge_pooled`), as one device would merge the whole
# microbatch's; the other floating leaves are averaged. `model_state_sums` is what the call
# puts into the all-reduce, `pooled_model_state` the global model state from its sums. The
# windows then need no per-device copy between calls.


def _nodes(tree: Any) -> tuple[list[Any], Any, list[int]]:
    nodes, treedef = jax.tree.flatten(tree, is_leaf=is_step_driven)
    return nodes, treedef, [i for i, node in enumerate(nodes) if is_step_driven(node)]


def _stats_window(node: Any) -> StatsWindow:
    """The window of one step-driven layer's statistics, as arrays."""
    return stats_window_of({name: array_of(node[name]) for name in ACCUMULATOR_NAMES})


def emptied_stats_windows(tree: Any) -> Any:
    """``tree`` with every step-driven layer's window empty (its running statistics kept).

    Example:
      >>> import jax.numpy as jnp
      >>> node = {name: jnp.ones(()) for name in STEP_DRIVEN_NAMES}
      >>> float(emptied_stats_windows({"bn": node})["bn"]["acc_count"])
      0.0
    """
    nodes, treedef, where = _nodes(tree)
    for i in where:
        w = _stats_window(nodes[i])
        empty = StatsWindow(
            count=jnp.zeros_like(w.count),
            mean=jnp.zeros_like(w.mean),
            m2=jnp.zeros_like(w.m2),
            calls=w.calls * 0,
        )
        nodes[i] = replace_leaves(nodes[i], stats_window_values(empty))
    return jax.tree.unflatten(treedef, nodes)


def call_sums(tree: Any) -> tuple[list[tuple[Array, ...]], Array]:
    """The statistics one call left in the (emptied) windows of ``tree``, to sum across
    devices: the `shifted_sums` of its step-driven layers (shifted by their running means)
    and each layer's count of calls (one int32 vector, a zero without a layer)."""
    nodes, _, where = _nodes(tree)
    windows = [_stats_window(nodes[i]) for i in where]
    shifts = [array_of(nodes[i]["mean"]) for i in where]
    calls = jnp.stack([w.calls for w in windows] or [jnp.zeros((), jnp.int32)])
    return shifted_sums(shifts, windows), calls


def merge_pooled(before: Any, pooled_sums: tuple[list[tuple[Array, ...]], Any]) -> Any:
    """``before`` with each step-driven window merged with one call's statistics pooled over
    the devices (``pooled_sums``: `call_sums` summed across devices; Chan et al.'s parallel
    update); a layer counts the call when any device did."""
    nodes, treedef, where = _nodes(before)
    sums, called = pooled_sums
    shifts = [array_of(nodes[i]["mean"]) for i in where]
    windows = [_stats_window(nodes[i]) for i in where]
    pooled = pooled_windows(sums, shifts, windows)
    for j, (i, old, new) in enumerate(zip(where, windows, pooled, strict=True)):
        count, mean, m2 = chan_merge(old.count, old.mean, old.m2, new.count, new.mean, new.m2)
        calls = old.calls + (called[j] > 0).astype(old.calls.dtype)
        merged = StatsWindow(
            count=count.astype(old.count.dtype), mean=mean, m2=m2.astype(old.m2.dtype), calls=calls
        )
        nodes[i] = replace_leaves(nodes[i], stats_window_values(merged))
    return jax.tree.unflatten(treedef, nodes)


def _float_leaves(tree: Any) -> tuple[list[int], list[Any]]:
    """The floating leaves of a model state beside its step-driven BatchNorm layers (each
    layer one node), by position among ``jax.tree.flatten(tree, is_leaf=is_step_driven)``."""
    leaves = _nodes(tree)[0]
    where = [
        i
        for i, x in enumerate(leaves)
        if not is_step_driven(x)
        and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        and not jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
    ]
    return where, [leaves[i] for i in where]


def model_state_sums(called: Any) -> dict[str, Any]:
    """What a stream call's model state puts into the call's one all-reduce on a mesh, to
    sum across devices for `pooled_model_state`: its BatchNorm statistics (`call_sums`,
    ``"batch_norm_sums"``) and its other floating leaves (``"float_leaves"``).

    Args:
      called: this device's model state after the call, run from emptied windows
        (`emptied_stats_windows`; None: no model state, which pools one zero).

    Example:
      >>> import jax.numpy as jnp
      >>> bn = {**{name: jnp.zeros(2) for name in STEP_DRIVEN_NAMES}, "acc_step": jnp.ones((), int)}
      >>> sums = model_state_sums({"bn": bn, "scale": jnp.ones(3)})
      >>> [x.shape for x in jax.tree.leaves(sums)]  # the layer's three sums, its calls, scale
      [(2,), (2,), (2,), (1,), (3,)]
    """
    if called is None:
        return {"batch_norm_sums": jnp.zeros(1), "float_leaves": []}
    return {"batch_norm_sums": call_sums(called), "float_leaves": _float_leaves(called)[1]}


def pooled_model_state(
    before: Any, called: Any, summed: dict[str, Any], added: Array, shards: int
) -> Any:
    """The global model state after a stream call on a mesh (None without a model state).

    Args:
      before: the model state the call started from (equal on every device).
      called: this device's model state after the call.
      summed: `model_state_sums` of ``called``, summed across the devices.
      added: whether the microbatch was added (a bool scalar, equal on every device).
      shards: how many devices ``summed`` adds up.

    Returns:
      ``before`` with each step-driven BatchNorm window merged with the call's statistics
      pooled over the devices (`merge_pooled`; nothing when the microbatch was not
      ``added``); every other leaf changed only when the microbatch was ``added`` (as on one
      device): floating leaves to their mean over the devices, others (counts, keys: the
      same on every device) to this device's.
    """
    if called is None:
        return None
    pick = lambda x: jnp.where(added, x, jnp.zeros_like(x))
    bn = jax.tree.map(pick, summed["batch_norm_sums"])
    merged, treedef = jax.tree.flatten(merge_pooled(before, bn), is_leaf=is_step_driven)
    ours = _nodes(called)[0]
    where, _ = _float_leaves(called)
    for i, total in zip(where, summed["float_leaves"], strict=True):
        ours[i] = (total / shards).astype(jnp.result_type(ours[i]))
    out = [
        m if is_step_driven(m) else jnp.where(added, o, m)
        for m, o in zip(merged, ours, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def close_step_driven_windows(stats_tree: Any, apply: Array, axis_name: str | None) -> Any:
    """`accumjax.close_batch_norm_windows` on a checked ``apply`` (a bool scalar array),
    without its checks and warnings: the train step's close (`close_model_state`). With
    ``axis_name``, the windows are first summed across its devices in one all-reduce."""
    nodes, treedef, where = _nodes(stats_tree)
    running = [
        Running(mean=array_of(nodes[i]["mean"]), var=array_of(nodes[i]["var"])) for i in where
    ]
    windows = [_stats_window(nodes[i]) for i in where]
    if axis_name is not None and where:
        shifts = [r.mean for r in running]  # equal on every device: the pooled sums add exactly
        summed = psum_together({"sums": shifted_sums(shifts, windows)}, axis_name)["sums"]
        windows = pooled_windows(summed, shifts, windows)
    for i, old, window in zip(where, running, windows, strict=True):
        momentum = array_of(nodes[i][MOMENTUM_NAME])
        new_running, new_window = close_stats_window(old, window, momentum, apply)
        values = {"mean": new_running.mean, "var": new_running.var}
        nodes[i] = replace_leaves(nodes[i], {**values, **stats_window_values(new_window)})
    return jax.tree.unflatten(treedef, nodes)


def close_model_state(model_state: Any, apply: Array, axis_name: str | None) -> Any:
    """A model state at a window's close: its step-driven BatchNorm windows closed with the
    window's decision ``apply`` (`close_step_driven_windows`, pooled across ``axis_name``);
    with ``axis_name``, its other floating leaves averaged across the devices in one
    all-reduce of their own (integer and PRNG-key leaves never are). None stays None.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> state = {"scale": jnp.arange(2.0), "seen": jnp.arange(2)}
      >>> closed = jax.vmap(lambda s: close_model_state(s, jnp.array(True), "i"), axis_name="i")
      >>> out = closed(state)
      >>> out["scale"].tolist(), out["seen"].tolist()
      ([0.5, 0.5], [0, 1])
    """
    if model_state is None:
        return None
    model_state = close_step_driven_windows(model_state, apply, axis_name)
    if axis_name is None:
        return model_state
    where, floats = _float_leaves(model_state)
    if not where:
        return model_state
    leaves, treedef, _ = _nodes(model_state)
    for i, mean in zip(where, jax.lax.pmean(floats, axis_name), strict=True):
        leaves[i] = mean
    return jax.tree.unflatten(treedef, leaves)
