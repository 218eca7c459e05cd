"""Which BatchNorm windows an optimizer closes (internal).

A state's BatchNorm statistics are recognized by their names: a step-driven layer
(``accum_steps=None``) keeps ``momentum`` beside its accumulators, and its window is closed by
whoever drives the optimizer (`accumjax.close_batch_norm_windows`, called by the train step
or by `accumjax.sync_batch_norm` in a loop of your own); a self-closing layer
(``accum_steps=K``) closes its own window and is refused where an optimizer decides the
windows. An evaluation of a step-driven window that was never closed warns, so a loop that
forgets to close it is never silently wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.typing import Array

from accumjax._batch_norm_math import ACCUMULATOR_NAMES, MOMENTUM_NAME, STEP_DRIVEN_NAMES

__all__ = ["check_no_self_closing", "is_step_driven", "self_closing_paths", "warn_if_open"]


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
