"""How a window's end runs (internal): ``fn(operand)`` if a predicate holds, updated in place.

`run_once`: a loop of at most one trip on a CPU, a conditional on a CUDA GPU (whose predicate
XLA:GPU reads on the host: one wait). `select_once`, for an end that runs on nearly every step
(scan mode's update): on a CUDA GPU computed always and selected, no conditional. See the
design notes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["run_once", "select_once"]


def run_once(pred: jax.Array, fn: Callable[[Any], Any], operand: Any) -> Any:
    """``fn(operand)`` if ``pred`` else ``operand``, updating ``operand`` in place.

    On CUDA GPUs a ``lax.cond`` (XLA:GPU reads its predicate on the host once; a loop's would
    be read at every check). Elsewhere a ``lax.while_loop`` that runs at most once: XLA:CPU
    updates its carry in place, where a ``lax.cond`` copies a large operand even when ``pred``
    is False. Under differentiation the ``lax.cond`` runs everywhere, so ``jax.grad`` works
    through it.

    Args:
      pred: a boolean scalar.
      fn: a function from ``operand`` to a pytree of the same structure and types. It must
        not close over traced values that are differentiated (pass them in ``operand``).
      operand: the pytree.

    Returns:
      ``fn(operand)`` or ``operand``.

    Example:
      >>> import jax.numpy as jnp
      >>> int(run_once(jnp.array(True), lambda x: x + 1, jnp.array(1)))
      2
    """
    converted, consts = jax.closure_convert(fn, operand)  # closed-over tracers become inputs
    return _run_once(converted, pred, operand, tuple(consts))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _run_once(fn: Callable[..., Any], pred: jax.Array, operand: Any, consts: tuple) -> Any:
    by_cond, by_loop = functools.partial(_by_cond, fn), functools.partial(_by_loop, fn)
    return jax.lax.platform_dependent(pred, operand, consts, cuda=by_cond, default=by_loop)


def _by_loop(fn: Callable[..., Any], pred: jax.Array, operand: Any, consts: tuple) -> Any:
    """`run_once` as a ``lax.while_loop`` of at most one trip."""

    def body(carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        return jnp.zeros((), bool), fn(carry[1], *consts)

    return jax.lax.while_loop(lambda carry: carry[0], body, (pred, operand))[1]


def _by_cond(fn: Callable[..., Any], pred: jax.Array, operand: Any, consts: tuple) -> Any:
    """`run_once` as a ``lax.cond`` whose first branch passes ``operand`` through."""
    return jax.lax.cond(pred, lambda o: fn(o, *consts), lambda o: o, operand)


@_run_once.defjvp
def _run_once_jvp(fn: Callable[..., Any], primals: Any, tangents: Any) -> Any:
    pred, operand, consts = primals
    branch = lambda op, cs: _by_cond(fn, pred, op, cs)
    return jax.jvp(branch, (operand, consts), (tangents[1], tangents[2]))


def select_once(pred: jax.Array, fn: Callable[[Any], Any], operand: Any) -> Any:
    """`run_once` for a step whose ``pred`` nearly always holds (scan mode's update at the
    window's end): on CUDA GPUs ``fn(operand)`` is computed always and ``operand`` kept where
    ``pred`` is False (bit for bit), with no conditional and so no host wait; elsewhere
    `run_once`'s loop of at most one trip. Not differentiable.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax._control import select_once
      >>> int(select_once(jnp.array(False), lambda x: x + 1, jnp.array(1)))
      1
    """
    converted, consts = jax.closure_convert(fn, operand)

    def by_select(pred: jax.Array, operand: Any, consts: tuple) -> Any:
        new = converted(operand, *consts)
        return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, operand)

    by_loop = functools.partial(_by_loop, converted)
    return jax.lax.platform_dependent(pred, operand, tuple(consts), cuda=by_select, default=by_loop)
