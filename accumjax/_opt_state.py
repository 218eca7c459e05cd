"""The optimizer state a train step keeps (internal): the two modes (`MODES`), the state's
layout per mode (`opt_state_for`), leaves un-aliased for donation (`unalias`) and the
applied-update counter (`count_update`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from accumjax._checks import check_choice
from accumjax._state import config_of
from accumjax._window_end import init_state

__all__ = ["MODES", "count_update", "opt_state_for", "unalias"]

MODES = ("stream", "scan")


def opt_state_for(tx: optax.GradientTransformation, params: Any, mode: str) -> Any:
    """``tx.init(params)``, laid out for a mode: in scan mode an `accumjax.accumulate` state
    holds no accumulator (its window opens and closes inside one call).

    Args:
      tx: the optimizer.
      params: the parameters (arrays, or ``jax.ShapeDtypeStruct``s).
      mode: ``"stream"`` or ``"scan"``.

    Returns:
      The optimizer state; a scan-mode `accumjax.AccumulationState` has
      ``window.grad_sum=None``, and no parameter-sized buffer is allocated for it.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 4)
      >>> opt_state_for(tx, {"w": jnp.zeros(3)}, "scan").window.grad_sum is None
      True
    """
    check_choice("mode", mode, MODES)
    config = config_of(tx)
    if config is None:
        return tx.init(params)
    return init_state(config, params, accumulator=mode == "stream")


def count_update(counter: jax.Array, applied: Any) -> jax.Array:
    """``counter + 1`` (saturating) where ``applied``, else ``counter``."""
    return jnp.where(applied, optax.safe_increment(counter), counter)


def unalias(tree: Any) -> Any:
    """Copies leaves that are the same array object as an earlier leaf.

    Optimizer ``init`` functions may reuse one zeros array for several fields; a donating
    step cannot donate one buffer twice.
    """
    seen: set[int] = set()

    def copy_repeat(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if id(x) in seen:
            return jnp.copy(x)
        seen.add(id(x))
        return x

    return jax.tree.map(copy_repeat, tree)
