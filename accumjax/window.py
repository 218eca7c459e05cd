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

from accumjax._window import DeviceWindow, Window

__all__ = ["DeviceWindow", "Window"]
