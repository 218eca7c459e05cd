"""The accumulation window's state types, as an `accumjax.AccumulationState` holds them.

`Window` is the open window of `accumjax.accumulate` and of a scan-less state;
`DeviceWindow` the one a stream-mode train step keeps per data shard
(``state.opt_state.window`` after ``step.init``).

Example:
  >>> import jax.numpy as jnp, optax, accumjax
  >>> state = accumjax.accumulate(optax.sgd(0.1), 2).init({"w": jnp.zeros(2)})
  >>> isinstance(state.window, accumjax.window.Window)
  True
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from accumjax._config import Config
from accumjax._moved import forward_moved
from accumjax._window import DeviceWindow, Window

__all__ = ["DeviceWindow", "Window"]


def _reduced_scatter(dims: Any, like: Any) -> Any:
    """0.4's ``close_window`` scatter markers for a sum reduced microbatch by microbatch
    (-1 a reduced shard, -2 a replicated sum); the close reads each leaf's layout plan instead."""
    leaves, treedef = jax.tree.flatten(like)
    split = [None] * len(leaves) if dims is None else treedef.flatten_up_to(dims)
    return jax.tree.unflatten(treedef, [-2 if d is None else -1 for d in split])


def _policy(*args: Any, **kwargs: Any) -> Config:
    """0.4's ``Policy(...)``, taking its arguments (positional in 0.4's order, or by name):
    the window's functions take a config holding the policy, so this returns an
    `accumjax._config.Config` with these fields (the others at their defaults),
    ``inner=optax.identity()`` (with extra-args support) and ``every_k=1`` (the window's
    functions read neither)."""
    names = (
        "scaling",
        "max_norm",
        "on_nonfinite",
        "skip_fn",
        "accumulator_dtype",
        "microbatch_transform",
    )
    given = dict(zip(names, args, strict=False))
    inner = optax.with_extra_args_support(optax.identity())
    return Config(inner=inner, every_k=1, **given, **kwargs)


# Exported by 0.4, internal now: resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(
    __name__,
    retired={
        "Policy": _policy,
        "REDUCED": -1,
        "WHOLE": -2,
        "reduced_scatter": _reduced_scatter,
    },
)
