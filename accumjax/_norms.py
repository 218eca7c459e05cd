"""Sums of squares (internal): ``|x|**2`` elementwise, a leaf's sum of squares and a
pytree's global L2 norm, accumulated in at least float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["abs_squared", "global_norm", "squared_norm"]


def abs_squared(x: jax.Array) -> jax.Array:
    """``|x|**2`` elementwise, real: ``re**2 + im**2`` for a complex ``x`` (as Flax computes it).

    Example:
      >>> import jax.numpy as jnp
      >>> abs_squared(jnp.array([3 + 4j], jnp.complex64))
      Array([25.], dtype=float32)
    """
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def _compute_dtype(dtype: Any) -> np.dtype:
    """Real dtype in which norms of ``dtype`` arrays are accumulated (at least float32)."""
    real = jnp.finfo(dtype).dtype  # complex64 -> float32, bfloat16 -> bfloat16, ...
    return jnp.promote_types(real, jnp.float32)


def squared_norm(
    x: jax.typing.ArrayLike,
    axis: int | tuple[int, ...] | None = None,
    keepdims: bool = False,
) -> jax.Array:
    """Computes the sum of squares ``sum(|x|**2)`` over ``axis``, in at least float32.

    The one norm implementation of the package: :func:`accumjax.clipping.compute_norm` (and
    through it :func:`accumjax.clipping.unitwise_norm` and AGC) is its square root.

    Args:
      x: A floating point (or complex) array.
      axis: Axis or axes to reduce; ``None`` reduces all of them.
      keepdims: Whether to keep the reduced axes with size 1 (as ``jnp.sum`` does).

    Returns:
      ``sum(x * x)`` for real ``x`` and ``sum(re(x)**2 + im(x)**2)`` for complex ``x``, with
      ``x`` first cast to at least float32 (complex64 for complex ``x``). Its dtype is
      ``float32`` for ``float16``, ``bfloat16`` (and other sub-32-bit) inputs, and the real
      dtype of ``x`` otherwise (``float32``, ``float64``; ``complex64 -> float32``). Its
      shape is that of ``jnp.sum``.

    Raises:
      TypeError: if ``x`` is not floating point or complex.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax.clipping import squared_norm
      >>> squared_norm(jnp.array([3.0, 4.0], jnp.float16))
      Array(25., dtype=float32)
      >>> squared_norm(jnp.array([[3.0, 0.0], [4.0, 1.0]]), axis=0, keepdims=True)
      Array([[25.,  1.]], dtype=float32)
      >>> squared_norm(jnp.array([3 + 4j], jnp.complex64))
      Array(25., dtype=float32)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(f"a norm needs a floating point array, got dtype {x.dtype}.")
    x = x.astype(jnp.promote_types(x.dtype, _compute_dtype(x.dtype)))
    return jnp.sum(abs_squared(x), axis=axis, keepdims=keepdims)


def global_norm(tree: Any) -> jax.Array:
    r"""Global L2 norm of a pytree: the leaves' `squared_norm`\s (float32 or wider whatever
    the leaf dtype), summed, float32.

    Example:
      >>> import jax.numpy as jnp
      >>> global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0], jnp.bfloat16)})
      Array(5., dtype=float32)
    """
    squares = [squared_norm(x) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32))).astype(jnp.float32)
