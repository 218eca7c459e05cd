"""`AccumulationState`, the state `accumulate` keeps (this module is the one that exports it),
and the free functions on it, as optax's read theirs (``optax.MultiSteps.has_updated``):
`should_update`, `has_updated`, `accumulated_gradients` and `stats` read it, `reset` empties
the open window. Each accepts the state as the user
holds it: plain, wrapped in ``nnx.Variable``s by an ``nnx.Optimizer`` (``opt.opt_state``), or
inside the state of an optax combinator around ``accumulate`` that holds exactly one.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import accumjax._scaling as scaling_lib
import accumjax._state as state_lib
import accumjax._window as window_lib
from accumjax._layout import REPLICATED, accumulator_bytes, partial_sums_shape
from accumjax._moved import REMOVED_IN, forward_moved
from accumjax._state import AccumulationState

__all__ = [
    "AccumulationState",
    "AccumulationStats",
    "accumulated_gradients",
    "has_updated",
    "reset",
    "should_update",
    "stats",
]


# Exported by 0.4, internal now: resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)


class AccumulationStats(NamedTuple):
    """What `stats` reports about an `AccumulationState`.

    Attributes:
      every_k: K of the current window, as ``accumulate(inner, every_k)`` states it (the
        property ``accumulation_steps``, its 0.5 name, still reads it, with a
        ``DeprecationWarning``).
      current_step: calls seen in the current window.
      total_cycles: inner updates applied so far.
      max_grad_norm: largest norm of an applied window gradient.
      overflow_detected: whether any non-finite microbatch has been seen (open window
        included).
      num_nonfinite: how many.
      skipped_microbatches: microbatches left out of their window (open window included).
      skipped_windows: windows closed without an update.
      num_parameters: number of scalars the window sums, as many as the parameters (a
        Python int).
      memory_bytes: bytes of the window's sums (a Python int), every device's together
        (their global size): the accumulator the state holds between calls, or, for a
        scan-mode train state, whose window opens and closes inside one call, the sums the
        step makes as its layout plan lays them out (`stats`' ``layout``; one
        parameter-shaped sum in the accumulator dtype without). Laid out by a train step on
        N devices along the data axis, an accumulator full-size on each device (replicated,
        ZeRO-1, FSDP with ``reduce_scatter="window"``) counts N full-size partial sums, one
        split over them (ZeRO-2, FSDP) one: each device holds ``memory_bytes / N`` (less
        where another mesh axis splits it too). A parameter-shaped window
        (``TrainState.create``'s, ``tx.init``'s) counts its one sum, however it is placed.

    Both sizes are None for a scan-mode optimizer state on its own (it holds no sum to
    measure, nor the parameters): pass the train state, ``accumjax.stats(state)``.
    """

    every_k: jax.Array
    current_step: jax.Array
    total_cycles: jax.Array
    max_grad_norm: jax.Array
    overflow_detected: jax.Array
    num_nonfinite: jax.Array
    skipped_microbatches: jax.Array
    skipped_windows: jax.Array
    num_parameters: int | None
    memory_bytes: int | None

    @property
    def accumulation_steps(self) -> jax.Array:
        """``every_k`` under its 0.5 name, with a ``DeprecationWarning`` (removed in 0.6)."""
        warnings.warn(
            "AccumulationStats.accumulation_steps is deprecated and will be removed in "
            f"accumjax {REMOVED_IN}: read every_k (the K of accumulate(inner, every_k)).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.every_k


def should_update(state: Any) -> jax.Array:
    """Whether the next ``update`` call closes the window (and may apply an update).

    Args:
      state: an `AccumulationState`, or a state holding exactly one: an NNX optimizer's
        ``opt_state``, an optax combinator's state (``optax.chain``, ``optax.masked``, ...).

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 1).init({"w": jnp.zeros(2)})
      >>> bool(accumjax.should_update(state))
      True
    """
    state = state_lib.accumulation_state_in(state)
    return state.window.micro_step + 1 >= state.every_k


def has_updated(state: Any) -> jax.Array:
    """Whether the last ``update`` call applied an inner update (as ``MultiSteps.has_updated``).

    A window closed without an update (every microbatch skipped, a non-finite sum, or
    ``"skip_window"`` after a non-finite microbatch) reports False.

    Args:
      state: as `should_update` takes it.

    Returns:
      A boolean scalar array, False between windows.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 1)
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> bool(accumjax.has_updated(state))
      True
    """
    return state_lib.accumulation_state_in(state).updated


def accumulated_gradients(state: Any) -> Any:
    """The window's gradient so far, scaled as the strategy says (zeros if nothing was added).

    This is what ``inner`` would receive if the window closed now, in the accumulator dtype:
    for the whole batch, whatever the layout (a train step's window kept per data shard,
    `accumjax.window.DeviceWindow`, is summed over its shards).

    Args:
      state: as `should_update` takes it.

    Returns:
      A pytree like the parameters, or ``None`` for a scan-mode state (which holds no open
      window).

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 4)  # "mean": of the microbatches added
      >>> state = tx.init({"w": jnp.zeros(())})
      >>> _, state = tx.update({"w": jnp.array(2.0)}, state)
      >>> _, state = tx.update({"w": jnp.array(4.0)}, state)
      >>> accumjax.accumulated_gradients(state)["w"]
      Array(3., dtype=float32)
    """
    state = state_lib.accumulation_state_in(state)
    window = state.window
    total = window_lib.window_sum(window)
    if total is None:
        return None
    by = lambda scaling: window_lib.denominator(scaling, state.every_k, window.weight_sum)
    denom = jax.lax.switch(
        state.scaling_code, [functools.partial(by, s) for s in scaling_lib.SCALINGS]
    )
    return scaling_lib.divided(total, scaling_lib.nonzero_denominator(denom))


def reset(state: Any) -> Any:
    """Empties the current window and keeps the inner state, counters and K.

    Args:
      state: an `AccumulationState`, or an optax combinator's state holding exactly one
        (``optax.chain``, ``optax.masked``, ...; see `accumulation_state_in`).

    Returns:
      ``state`` with its `AccumulationState`'s window empty: a zero accumulator,
      ``micro_step == 0`` and zero window counts.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = optax.chain(optax.scale(1.0), accumjax.accumulate(optax.sgd(0.1), 4))
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> int(accumjax.reset(state)[1].window.micro_step)
      0
    """
    state_lib.accumulation_state_in(state)  # exactly one, where it can be used
    is_acc = lambda x: isinstance(x, AccumulationState)
    empty = lambda acc: acc._replace(window=window_lib.emptied_window(acc.window))
    return jax.tree.map(lambda x: empty(x) if is_acc(x) else x, state, is_leaf=is_acc)


def stats(state: Any, layout: Any = None) -> AccumulationStats:
    """Summarises an `AccumulationState` (steps, updates, norms, skips, accumulator size).

    Args:
      state: an `AccumulationState` (or a state holding exactly one, as for `has_updated`), or a
        train state (`accumjax.TrainState`, `accumjax.NNXTrainState`) whose optimizer is an
        `accumjax.accumulate`: its sizes are known for every layout, scan mode's included.
      layout: for a scan-mode train state on a mesh, the layout plan its step runs it with,
        ``step.layout(state)`` (an `accumjax.sharded.MeshLayout`): where the sums the step
        makes lie; None: one device's. A window the state holds (stream mode) is measured
        as it lies: ``step.init`` laid it out by that plan. A plan made for other
        parameters or another number of devices is refused (``ValueError``).

    The counts (``num_nonfinite``, ``overflow_detected``, ``skipped_microbatches``) cover every
    microbatch seen so far, the open window's included, so a non-finite microbatch shows in
    the call right after it. They count microbatches: on a mesh, under ``pmap`` and in a
    ``shard_map`` of your own every device decides the same about each whole microbatch, so
    every device reports the counts one device would.

    Returns:
      An `AccumulationStats`; its sizes are Python ints (static), the rest arrays.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 8).init({"w": jnp.zeros((4, 4))})
      >>> s = accumjax.stats(state)
      >>> int(s.every_k), s.num_parameters, s.memory_bytes
      (8, 16, 64)
      >>> scan = accumjax.make_train_step(lambda p, b: jnp.sum(p["w"] * b), mode="scan")
      >>> train_state = scan.init({"w": jnp.zeros((4, 4))}, accumjax.accumulate(optax.sgd(0.1), 8))
      >>> s = accumjax.stats(train_state)  # no accumulator in the state: sized from params
      >>> s.num_parameters, s.memory_bytes
      (16, 64)
      >>> accumjax.stats(train_state, scan.layout(train_state)).memory_bytes  # one device
      64
    """
    if layout is not None and not hasattr(layout, "leaves"):
        raise TypeError(
            "stats(layout=...) takes the layout plan a train step runs the state with, "
            f"step.layout(state), or None; got {type(layout).__name__} {layout!r}."
        )
    params, tx = getattr(state, "params", None), getattr(state, "tx", None)
    if layout is not None and params is not None:
        _check_plan_fits(layout, params)
    state = state_lib.accumulation_state_in(getattr(state, "opt_state", state))
    window = state.window
    # The closed windows' counts plus the open window's, so a NaN shows at once.
    nonfinite = window_lib.saturating_add(state.nonfinite_count, window.window_nonfinite)
    return AccumulationStats(
        every_k=state.every_k,
        current_step=window.micro_step,
        total_cycles=state.update_count,
        max_grad_norm=state.max_grad_norm,
        overflow_detected=nonfinite > 0,
        num_nonfinite=nonfinite,
        skipped_microbatches=window_lib.saturating_add(
            state.skipped_microbatches, window.window_skipped
        ),
        skipped_windows=state.skipped_windows,
        **_sizes(window, params, tx, layout),
    )


def _devices_along(leaf: Any, axis: str) -> int | None:
    """How many devices ``leaf`` (a concrete array) lies on along the mesh axis ``axis``: 1
    off a mesh, None when it cannot tell (a tracer)."""
    try:
        sharding = leaf.sharding
    except Exception:  # a tracer: no placement to read
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return 1 if len(sharding.device_set) == 1 else None
    return int(dict(mesh.shape).get(axis, 1))


def _check_plan_fits(layout: Any, params: Any) -> None:
    """Refuses a layout plan made for other parameters or another number of devices."""
    leaves = jax.tree.leaves(params)
    fix = "pass step.layout(state) for this state, made by the step that runs it"
    if len(leaves) != len(layout.leaves):
        raise ValueError(
            f"stats(layout=...): the plan has {len(layout.leaves)} parameter leaves, the "
            f"state {len(leaves)}: {fix}."
        )
    devices = next((n for n in (_devices_along(x, layout.axis) for x in leaves) if n), None)
    if devices is not None and devices != layout.shards:
        raise ValueError(
            f"stats(layout=...): the plan splits over {layout.shards} devices along "
            f"{layout.axis!r}, the state's parameters lie on {devices}: {fix}."
        )


def _sizes(window: Any, params: Any, tx: Any, layout: Any) -> dict[str, int | None]:
    """``num_parameters`` and ``memory_bytes`` of a window: its sums' as held, or for a
    scan-mode window (none) the sums the step makes for ``params`` and ``tx`` as ``layout``
    lays them out (one device's without; None, None without ``params`` and ``tx``)."""
    if window[0] is not None:
        per_shard = isinstance(window, window_lib.DeviceWindow)
        held = jax.tree.leaves(window[0])
        shapes = [partial_sums_shape(x.shape)[1] if per_shard else tuple(x.shape) for x in held]
        return {
            "num_parameters": sum(math.prod(shape) for shape in shapes),
            "memory_bytes": sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in held),
        }
    config = state_lib.config_of(tx)
    if params is None or config is None:
        return {"num_parameters": None, "memory_bytes": None}
    leaves = jax.tree.leaves(params)
    plan = (REPLICATED,) * len(leaves) if layout is None else tuple(layout.leaves)
    shards = 1 if layout is None else int(layout.shards)
    dtype = config.accumulator_dtype
    itemsize = lambda p: jnp.dtype(window_lib.sum_dtype(p.dtype, dtype)).itemsize
    return {
        "num_parameters": sum(math.prod(p.shape) for p in leaves),
        "memory_bytes": sum(
            accumulator_bytes(tuple(p.shape), itemsize(p), leaf, shards)
            for p, leaf in zip(leaves, plan, strict=True)
        ),
    }
