"""`AccumulationState`, the state of `accumjax.accumulate`, and the free functions on it.

The state is a pytree of arrays the user owns (checkpoint it like any other optax state).
The functions read it as optax's free functions read theirs (``optax.MultiSteps.has_updated``):
`should_update`, `has_updated`, `accumulated_gradients` and `stats`; `reset` empties the open
window. Each accepts the state as the user holds it: plain, wrapped in ``nnx.Variable``s by an
``nnx.Optimizer`` (``opt.opt_state``), or inside the state of an optax combinator around
``accumulate`` (``optax.chain``, ``optax.masked``, ``optax.inject_hyperparams``, ...) that holds
exactly one `AccumulationState` (`locate` finds it). One inside ``optax.apply_if_finite`` or
``optax.MultiSteps`` is refused: those count microbatches a second time (`APPLY_IF_FINITE_NOTE`,
`MULTISTEPS_NOTE`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax._window as window_lib
from accumjax import scaling as scaling_lib
from accumjax._checks import check_alive
from accumjax._variables import unwrap_variables
from accumjax._window import Window

__all__ = [
    "APPLY_IF_FINITE_NOTE",
    "CONFIG_ATTR",
    "MULTISTEPS_NOTE",
    "AccumulationState",
    "AccumulationStats",
    "Located",
    "accumulated_gradients",
    "check_made_for",
    "config_of",
    "has_updated",
    "k_changed",
    "k_of_tag",
    "k_tag",
    "locate",
    "reset",
    "should_update",
    "stats",
    "unwrap",
]


class AccumulationState(NamedTuple):
    """State of `accumulate`: a pytree of arrays the user owns (checkpoint it like any other).

    Field names are distinct from those of optax's own states, so
    ``optax.tree_utils.tree_get(state, name)`` finds them inside any chain.

    Attributes:
      window: the open `accumjax.window.Window` (sum, weight sum, calls, skipped counts).
      every_k: K of the current window (from the schedule), int32.
      every_k_tag: K in the state's type, so that ``jit`` sees it at trace time: ``False``
        repeated K times (shape ``(K,)``, K bytes) for an int K, shape ``(1, 1)`` for a
        schedule (`k_tag`). A state restored into an `accumjax.accumulate` of another K is
        refused when traced, and by orbax's restore into a target of another K.
      scaling_code: index of the scaling strategy in `accumjax.scaling.SCALINGS`, int32; a
        state is refused by an `accumulate` with another strategy (or another int K).
      update_count: inner updates actually applied, int32; what a K schedule is evaluated at.
      inner_tx_state: the inner optimizer's state.
      max_grad_norm: largest global norm of an applied window gradient, float32.
      grad_norm: global norm of the last applied window's gradient as the inner optimizer
        saw it (after adaptive gradient clipping, when the train step does that), float32;
        0 before the first update.
      nonfinite_count: microbatches with a NaN/Inf gradient or an invalid weight so far.
      skipped_microbatches: microbatches left out of their window so far (any reason).
      skipped_windows: windows closed without an update so far.
      updated: whether the last call applied an inner update.
      added: whether the last call's microbatch went into its window (False when it was
        skipped: non-finite, an invalid weight, ``skip_fn``); in scan mode, whether the
        window's update was applied. `sync_batch_norm` reads it.
    """

    window: Window
    every_k: jax.Array
    every_k_tag: jax.Array
    scaling_code: jax.Array
    update_count: jax.Array
    inner_tx_state: Any
    max_grad_norm: jax.Array
    grad_norm: jax.Array
    nonfinite_count: jax.Array
    skipped_microbatches: jax.Array
    skipped_windows: jax.Array
    updated: jax.Array
    added: jax.Array


class AccumulationStats(NamedTuple):
    """What `stats` reports about an `AccumulationState`.

    Attributes:
      accumulation_steps: K of the current window.
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
      memory_bytes: bytes of the window's sum (a Python int): the accumulator the state
        holds between calls (every data shard's partial sums together for a
        `accumjax.window.DeviceWindow`), or, for a scan-mode train state, whose window
        opens and closes inside one call, one parameter-shaped sum in the accumulator
        dtype, as the step makes it.

    Both sizes are None for a scan-mode optimizer state on its own (it holds no sum to
    measure, nor the parameters): pass the train state, ``accumjax.stats(state)``.
    """

    accumulation_steps: jax.Array
    current_step: jax.Array
    total_cycles: jax.Array
    max_grad_norm: jax.Array
    overflow_detected: jax.Array
    num_nonfinite: jax.Array
    skipped_microbatches: jax.Array
    skipped_windows: jax.Array
    num_parameters: int | None
    memory_bytes: int | None


#: The shape of `AccumulationState.every_k_tag` for a K schedule.
_SCHEDULE_TAG = (1, 1)


def k_tag(every_k: int | None) -> jax.Array:
    """`AccumulationState.every_k_tag` for an int K, or for a schedule (None).

    Example:
      >>> k_tag(4).shape, k_tag(None).shape
      ((4,), (1, 1))
    """
    return jnp.zeros(_SCHEDULE_TAG if every_k is None else (every_k,), bool)


def k_of_tag(shape: tuple[int, ...]) -> int | None:
    """The int K an `AccumulationState.every_k_tag` of this shape was made for, None for a
    schedule.

    Example:
      >>> k_of_tag((4,)), k_of_tag((1, 1))
      (4, None)
    """
    if tuple(shape) == _SCHEDULE_TAG:
        return None
    (k,) = shape
    return k


def k_changed(made: int | None, uses: int | None) -> str:
    """Why a state made for K ``made`` does not fit an `accumjax.accumulate` of K ``uses``
    (None: a schedule), and what to write instead.

    Example:
      >>> print(k_changed(4, 8).splitlines()[0])
      this optimizer state was made with every_k=4; this accumulate uses every_k=8.
    """
    name = lambda k: "an every_k schedule" if k is None else f"every_k={k}"
    resume = "the same schedule" if made is None else f"accumjax.with_every_k(tx, {made})"
    return (
        f"this optimizer state was made with {name(made)}; this accumulate uses {name(uses)}.\n"
        f"Resume it with the K it was made with ({resume}), or start a state for the new K "
        "at a window boundary, keeping the inner optimizer's: "
        "tx.init(params)._replace(inner_tx_state=state.inner_tx_state)."
    )


#: Why ``optax.apply_if_finite`` around `accumulate` is refused (the train step and the
#: functions that read the state say it).
APPLY_IF_FINITE_NOTE = (
    "optax.apply_if_finite drops a non-finite microbatch before accumulate sees it: the "
    "windows shift against the data and the skip is never counted (stats' "
    "skipped_microbatches, num_nonfinite). accumulate skips a non-finite microbatch itself, "
    "counts it and keeps its window aligned: drop apply_if_finite and use "
    "accumjax.accumulate(inner, K, on_nonfinite='skip_microbatch') (the default; "
    "'skip_window' drops the whole window)."
)

#: Why ``optax.MultiSteps`` around or inside `accumulate` is refused.
MULTISTEPS_NOTE = (
    "optax.MultiSteps accumulates too: around or inside accumulate(inner, K) each update "
    "takes K x K' microbatches (accumulate's K times MultiSteps' K'), and stats counts the "
    "windows of one of them only. Drop MultiSteps: accumjax.accumulate(inner, K) alone "
    "takes K microbatches per update."
)

#: Optimizer states that count microbatches a second time around an `AccumulationState`:
#: the combinator that makes each, and why.
_DOUBLE_COUNTING = {
    optax.ApplyIfFiniteState: ("optax.apply_if_finite", APPLY_IF_FINITE_NOTE),
    optax.MultiStepsState: ("optax.MultiSteps", MULTISTEPS_NOTE),
}


class Located(NamedTuple):
    """A node `locate` found in an optimizer state.

    Attributes:
      path: where it is, as ``jax.tree_util.keystr`` writes it (``"[1].inner_state"``):
        ``state<path>`` is the node.
      node: the node itself.
      within: the nodes around it, outermost first (a ``tuple`` for a chain's state, an
        ``optax.MaskedState``, ...); empty for the state itself.
      keys: the key of each step down from them (``jax.tree_util`` key entries).
    """

    path: str
    node: Any
    within: tuple[Any, ...]
    keys: tuple[Any, ...]


def locate(state: Any, kind: type = AccumulationState) -> list[Located]:
    """Every outermost node of type ``kind`` in ``state`` (``nnx.Variable``s unwrapped),
    in the order of the state's leaves.

    Args:
      state: an optimizer state (any pytree).
      kind: the type to look for, `AccumulationState` by default.

    Returns:
      A list of `Located`; a node inside a found one is not looked for.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = optax.chain(optax.scale(1.0), accumjax.accumulate(optax.sgd(0.1), 4))
      >>> [(at.path, [type(c) for c in at.within]) for at in locate(tx.init({"w": jnp.zeros(2)}))]
      [('[1]', [<class 'tuple'>])]
    """
    found: list[Located] = []
    _walk(unwrap_variables(state), (), (), kind, found)
    return found


def _walk(node: Any, path: tuple, within: tuple, kind: type, found: list[Located]) -> None:
    if isinstance(node, kind):
        found.append(Located(jax.tree_util.keystr(path), node, within, path))
        return
    if isinstance(node, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if jax.tree_util.treedef_is_leaf(treedef):
        return
    for key, child in children:
        _walk(child, (*path, *key), (*within, node), kind, found)


def check_made_for(state: AccumulationState, every_k: int | None, scaling: str) -> None:
    """Refuses ``state`` if it was made for another K (read from its type, so at trace time
    too) or, where its code is concrete, for an incompatible scaling
    (`accumjax.scaling.compatible`).

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 4).init({"w": jnp.zeros(2)})
      >>> check_made_for(state, 8, "mean")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: this optimizer state was made with every_k=4; this accumulate uses every_k=8...
    """
    made_k = k_of_tag(jnp.shape(state.every_k_tag))
    if made_k != every_k:
        raise ValueError(k_changed(made_k, every_k))
    got_code = scaling_lib.concrete_value(state.scaling_code)
    made = None if got_code is None else scaling_lib.SCALINGS[int(got_code)]
    if made is not None and not scaling_lib.compatible(made, scaling):
        raise ValueError(
            f"this state was made with scaling={made!r}; this accumulate uses scaling={scaling!r}."
        )


def unwrap(state: Any) -> AccumulationState:
    """The `AccumulationState` inside ``state``: itself, Flax NNX's variable-wrapped copy, or
    the one inside an optax combinator's state (``optax.chain``, ``optax.masked``, ...);
    refused when a train step donated its arrays.

    Raises:
      TypeError: if ``state`` holds no `AccumulationState`.
      ValueError: if it holds several (each is named), or its one sits inside
        ``optax.apply_if_finite`` or ``optax.MultiSteps`` (which count microbatches a second
        time).
    """
    check_alive(state, "state")
    state = unwrap_variables(state)
    if isinstance(state, AccumulationState):
        return state
    found = locate(state)
    if not found:
        multi = locate(state, optax.MultiStepsState)
        use = " (in place of optax.MultiSteps(inner, K))" if multi else ""
        raise TypeError(
            f"expected an accumjax AccumulationState, got {type(state).__name__}, which holds "
            f"none: pass the state of tx = accumjax.accumulate(inner, K){use} (tx.init(params)), "
            "or the optax state that holds it."
        )
    if len(found) > 1:
        where = ", ".join(f"state{at.path}" for at in found)
        raise ValueError(
            f"this {type(state).__name__} holds {len(found)} accumjax AccumulationStates, at "
            f"{where}: pass the one you mean (e.g. accumjax.stats(state{found[0].path}))."
        )
    (at,) = found
    for wrapper in map(type, at.within):
        if wrapper in _DOUBLE_COUNTING:
            name, note = _DOUBLE_COUNTING[wrapper]
            raise ValueError(
                f"the accumjax AccumulationState at state{at.path} sits inside {name}'s "
                f"state ({wrapper.__name__}). {note}"
            )
    return at.node


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
    state = unwrap(state)
    return state.window.micro_step + 1 >= state.every_k


def has_updated(state: Any) -> jax.Array:
    """Whether the last ``update`` call applied an inner update (as ``MultiSteps.has_updated``).

    A window closed without an update (every microbatch skipped, a non-finite sum, or
    ``"skip_window"`` after a non-finite microbatch) reports False.

    Args:
      state: an `AccumulationState`, or a state holding exactly one: an NNX optimizer's
        ``opt_state``, an optax combinator's state (``optax.chain``, ``optax.masked``, ...).

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 1)
      >>> _, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> bool(accumjax.has_updated(state))
      True
    """
    return unwrap(state).updated


def accumulated_gradients(state: Any) -> Any:
    """The window's gradient so far, scaled as the strategy says (zeros if nothing was added).

    This is what ``inner`` would receive if the window closed now, in the accumulator dtype:
    for the whole batch, whatever the layout (a train step's window kept per data shard,
    `accumjax.window.DeviceWindow`, is summed over its shards).

    Args:
      state: an `AccumulationState`, or a state holding exactly one: an NNX optimizer's
        ``opt_state``, an optax combinator's state (``optax.chain``, ``optax.masked``, ...).

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
    state = unwrap(state)
    window = state.window
    total = window_lib.window_sum(window)
    if total is None:
        return None
    by = lambda scaling: window_lib.denominator(scaling, state.every_k, window.weight_sum)
    denom = jax.lax.switch(
        state.scaling_code, [functools.partial(by, s) for s in scaling_lib.SCALINGS]
    )
    safe = jnp.where(denom > 0, denom, 1.0)
    return jax.tree.map(lambda a: a / safe.astype(a.dtype), total)


def reset(state: Any) -> Any:
    """Empties the current window and keeps the inner state, counters and K.

    Args:
      state: an `AccumulationState`, or an optax combinator's state holding exactly one
        (``optax.chain``, ``optax.masked``, ...; see `unwrap`).

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
    unwrap(state)  # exactly one, where it can be used
    is_acc = lambda x: isinstance(x, AccumulationState)
    empty = lambda acc: acc._replace(window=window_lib.empty_like(acc.window))
    return jax.tree.map(lambda x: empty(x) if is_acc(x) else x, state, is_leaf=is_acc)


def stats(state: Any) -> AccumulationStats:
    """Summarises an `AccumulationState` (steps, updates, norms, skips, accumulator size).

    Args:
      state: an `AccumulationState` (or a state holding exactly one, as for `has_updated`), or a
        train state (`accumjax.TrainState`, `accumjax.NNXTrainState`) whose optimizer is an
        `accumjax.accumulate`: its sizes are known for every layout, scan mode's included.

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
      >>> int(s.accumulation_steps), s.num_parameters, s.memory_bytes
      (8, 16, 64)
      >>> scan = accumjax.make_train_step(lambda p, b: jnp.sum(p["w"] * b), mode="scan")
      >>> train_state = scan.init({"w": jnp.zeros((4, 4))}, accumjax.accumulate(optax.sgd(0.1), 8))
      >>> s = accumjax.stats(train_state)  # no accumulator in the state: sized from params
      >>> s.num_parameters, s.memory_bytes
      (16, 64)
    """
    params, tx = getattr(state, "params", None), getattr(state, "tx", None)
    state = unwrap(getattr(state, "opt_state", state))
    window = state.window
    # The closed windows' counts plus the open window's, so a NaN shows at once.
    nonfinite = window_lib.saturating_add(state.nonfinite_count, window.window_nonfinite)
    return AccumulationStats(
        accumulation_steps=state.every_k,
        current_step=window.micro_step,
        total_cycles=state.update_count,
        max_grad_norm=state.max_grad_norm,
        overflow_detected=nonfinite > 0,
        num_nonfinite=nonfinite,
        skipped_microbatches=window_lib.saturating_add(
            state.skipped_microbatches, window.window_skipped
        ),
        skipped_windows=state.skipped_windows,
        **_sizes(window, params, tx),
    )


#: The attribute of an `accumjax.accumulate` transformation's ``update`` that holds its
#: `accumjax.accumulation.Config` (set by ``accumulate``).
CONFIG_ATTR = "_accumjax_config"


def config_of(tx: Any) -> Any:
    """The `accumjax.accumulation.Config` of an `accumjax.accumulate` transformation, or None
    for any other transformation.

    Example:
      >>> import optax, accumjax
      >>> from accumjax.accumulation_state import config_of
      >>> config_of(accumjax.accumulate(optax.sgd(0.1), 4)).every_k, config_of(optax.sgd(0.1))
      (4, None)
    """
    return getattr(getattr(tx, "update", None), CONFIG_ATTR, None)


def _sizes(window: Any, params: Any, tx: Any) -> dict[str, int | None]:
    """``num_parameters`` and ``memory_bytes`` of a window: its sums', or for a scan-mode
    window (none) the sum the step makes for ``params`` and ``tx`` (None, None without)."""
    held = jax.tree.leaves(window[0])  # a window kept per data shard holds one sum a shard
    if window[0] is not None:
        per_shard = isinstance(window, window_lib.DeviceWindow)
        return {
            "num_parameters": sum(math.prod(x.shape[1:] if per_shard else x.shape) for x in held),
            "memory_bytes": sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in held),
        }
    config = config_of(tx)
    if params is None or config is None:
        return {"num_parameters": None, "memory_bytes": None}
    leaves = jax.tree.leaves(params)
    dtype = config.policy.accumulator_dtype
    return {
        "num_parameters": sum(math.prod(p.shape) for p in leaves),
        "memory_bytes": sum(
            math.prod(p.shape) * jnp.dtype(window_lib.sum_dtype(p.dtype, dtype)).itemsize
            for p in leaves
        ),
    }
