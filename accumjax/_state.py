"""`AccumulationState`, the state of `accumjax.accumulate`, and how the package finds and
checks it: K in its type (`tag_for_every_k`), the state inside an optax combinator's
(`locate`, `accumulation_state_in`), a state made for another K or scaling
(`check_made_for`), a transformation's `Config` (`config_of`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accumjax._scaling as scaling_lib
from accumjax._checks import check_alive
from accumjax._variables import unwrap_variables
from accumjax._window import Window

__all__ = [
    "APPLY_IF_FINITE_NOTE",
    "CONFIG_ATTR",
    "MULTISTEPS_NOTE",
    "AccumulationState",
    "Found",
    "check_made_for",
    "closed_its_window",
    "config_of",
    "every_k_changed",
    "every_k_of_tag",
    "tag_for_every_k",
    "locate",
    "accumulation_state_in",
    "path_string",
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
        schedule (`tag_for_every_k`). A state restored into an `accumjax.accumulate` of another K is
        refused when traced, and by orbax's restore into a target of another K.
      scaling_code: index of the scaling strategy in `accumjax.scaling.SCALINGS`, int32; a
        state is refused by an `accumulate` with another strategy (or another int K).
      update_count: inner updates actually applied, int32; what a K schedule is evaluated at.
      inner_tx_state: the inner optimizer's state.
      max_grad_norm: largest global norm of an applied window gradient, float32.
      grad_norm: global norm of the last applied window's gradient, as handed to the inner
        optimizer (before any clipping the inner optimizer does), float32; 0 before the
        first update.
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


#: The shape of `AccumulationState.every_k_tag` for a K schedule.
_SCHEDULE_TAG = (1, 1)


def tag_for_every_k(every_k: int | None) -> jax.Array:
    """`AccumulationState.every_k_tag` for an int K, or for a schedule (None).

    Example:
      >>> tag_for_every_k(4).shape, tag_for_every_k(None).shape
      ((4,), (1, 1))
    """
    return jnp.zeros(_SCHEDULE_TAG if every_k is None else (every_k,), bool)


def every_k_of_tag(shape: tuple[int, ...]) -> int | None:
    """The int K an `AccumulationState.every_k_tag` of this shape was made for, None for a
    schedule.

    Example:
      >>> every_k_of_tag((4,)), every_k_of_tag((1, 1))
      (4, None)
    """
    if tuple(shape) == _SCHEDULE_TAG:
        return None
    (every_k,) = shape
    return every_k


def every_k_changed(made: int | None, uses: int | None) -> str:
    """Why a state made for K ``made`` does not fit an `accumjax.accumulate` of K ``uses``
    (None: a schedule), and what to write instead.

    Example:
      >>> print(every_k_changed(4, 8).splitlines()[0])
      this optimizer state was made with every_k=4; this accumulate uses every_k=8.
    """
    name = lambda every_k: "an every_k schedule" if every_k is None else f"every_k={every_k}"
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


Found = tuple[tuple[Any, ...], tuple[Any, ...]]  # (keys, nodes): a `locate` result


def locate(state: Any, kind: type = AccumulationState) -> list[Found]:
    """Every outermost node of type ``kind`` in ``state`` (``nnx.Variable``s unwrapped),
    in the order of the state's leaves.

    Args:
      state: an optimizer state (any pytree).
      kind: the type to look for, `AccumulationState` by default.

    Returns:
      A list of ``(keys, nodes)``, one for each node found (a node inside a found one is not
      looked for): ``keys``, the ``jax.tree_util`` key of each step down to it
      (`path_string` writes them as ``"[1].inner_state"``); ``nodes``, the nodes along the way,
      ``state`` first and the node found last (a ``tuple`` for a chain's state, an
      ``optax.MaskedState``, ...).

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = optax.chain(optax.scale(1.0), accumjax.accumulate(optax.sgd(0.1), 4))
      >>> [(path_string(keys), [type(n) for n in nodes[:-1]])
      ...  for keys, nodes in locate(tx.init({"w": jnp.zeros(2)}))]
      [('[1]', [<class 'tuple'>])]
    """
    found: list[Found] = []
    _walk(unwrap_variables(state), (), (), kind, found)
    return found


def path_string(keys: tuple[Any, ...]) -> str:
    """Where `locate`'s ``keys`` lead, as ``jax.tree_util.keystr`` writes it: ``state<where>``
    is the node found.

    Example:
      >>> path_string((jax.tree_util.SequenceKey(1),))
      '[1]'
    """
    return jax.tree_util.keystr(keys)


def _walk(node: Any, path: tuple, within: tuple, kind: type, found: list[Found]) -> None:
    if isinstance(node, kind):
        found.append((path, (*within, node)))
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
    (`accumjax._scaling.compatible`).

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.accumulate(optax.sgd(0.1), 4).init({"w": jnp.zeros(2)})
      >>> check_made_for(state, 8, "mean")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: this optimizer state was made with every_k=4; this accumulate uses every_k=8...
    """
    made_every_k = every_k_of_tag(jnp.shape(state.every_k_tag))
    if made_every_k != every_k:
        raise ValueError(every_k_changed(made_every_k, every_k))
    got_code = scaling_lib.concrete_value(state.scaling_code)
    made = None if got_code is None else scaling_lib.SCALINGS[int(got_code)]
    if made is not None and not scaling_lib.compatible(made, scaling):
        raise ValueError(
            f"this state was made with scaling={made!r}; this accumulate uses scaling={scaling!r}."
        )


def accumulation_state_in(state: Any) -> AccumulationState:
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
        paths = ", ".join(f"state{path_string(keys)}" for keys, _ in found)
        raise ValueError(
            f"this {type(state).__name__} holds {len(found)} accumjax AccumulationStates, at "
            f"{paths}: pass the one you mean "
            f"(e.g. accumjax.stats(state{path_string(found[0][0])}))."
        )
    ((keys, nodes),) = found
    for wrapper in map(type, nodes[:-1]):
        if wrapper in _DOUBLE_COUNTING:
            name, note = _DOUBLE_COUNTING[wrapper]
            raise ValueError(
                f"the accumjax AccumulationState at state{path_string(keys)} sits inside {name}'s "
                f"state ({wrapper.__name__}). {note}"
            )
    return nodes[-1]


#: The attribute of an `accumjax.accumulate` transformation's ``update`` that holds its
#: `accumjax._config.Config` (set by ``accumulate``).
CONFIG_ATTR = "_accumjax_config"


def config_of(tx: Any) -> Any:
    """The `accumjax._config.Config` of an `accumjax.accumulate` transformation, or None
    for any other transformation.

    Example:
      >>> import optax, accumjax
      >>> from accumjax._state import config_of
      >>> config_of(accumjax.accumulate(optax.sgd(0.1), 4)).every_k, config_of(optax.sgd(0.1))
      (4, None)
    """
    return getattr(getattr(tx, "update", None), CONFIG_ATTR, None)


def closed_its_window(state: AccumulationState) -> jax.Array:
    """Whether the ``update`` call that returned ``state`` closed its window (the window is
    empty again), applied or not: the moment a loss scale adjusts and BatchNorm windows close
    in a loop of the user's own."""
    return state.window.micro_step == 0
