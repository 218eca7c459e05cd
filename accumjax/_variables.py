"""Flax NNX variables as plain arrays (internal).

Functions on accumjax states and statistics accept them as the user holds them: plain
pytrees, or wrapped in ``nnx.Variable``s (an ``nnx.Optimizer``'s ``opt_state``, an
``nnx.State`` of batch statistics). It does not import flax: a value can be an
``nnx.Variable`` only once ``flax.nnx`` is imported, so that is when it checks the type.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

__all__ = ["is_variable", "unwrap_variables", "variable_value"]


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Variable`` (a leaf that holds one value)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def variable_value(x: Any) -> Any:
    """The value held by ``x`` if it is an ``nnx.Variable``, else ``x`` itself.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> variable_value(nnx.BatchStat(jnp.ones(2)))
      Array([1., 1.], dtype=float32)
    """
    return x.get_value() if is_variable(x) else x


def unwrap_variables(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable`` replaced by the value it holds.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> unwrap_variables({"a": nnx.Param(jnp.zeros(1)), "b": 1})
      {'a': Array([0.], dtype=float32), 'b': 1}
    """
    return jax.tree.map(variable_value, tree, is_leaf=is_variable)
