"""Dynamic loss scaling for float16 training.

float16 has a narrow exponent range: small gradients flush to zero. Multiplying the
loss by a large scale before differentiation shifts the backward pass into the
representable range; the gradients are divided by the same scale (in float32)
before the optimizer sees them. The scale is adjusted dynamically: halved when a
step overflows (that step is skipped) and doubled after ``period`` consecutive
finite steps.

The state is a :class:`DynamicLossScale` ``NamedTuple`` of arrays, so it lives in a
train state, under ``jit`` and in checkpoints; all operations are free functions. With
gradient accumulation a "step" is a window: `update_loss_scale` adjusts the scale once per
window from `accumjax.accumulate`'s state, as `accumjax.make_train_step` does.

Reference: Micikevicius et al. 2018, "Mixed Precision Training",
https://arxiv.org/abs/1710.03740 (section 3.2, loss scaling).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accumjax._checks import check_int, check_real
from accumjax._state import accumulation_state_in, closed_its_window
from accumjax.accumulation_state import AccumulationState

__all__ = [
    "DynamicLossScale",
    "adjust_loss_scale",
    "all_finite",
    "dynamic_loss_scale",
    "scale_loss",
    "unscale_grads",
    "update_loss_scale",
]


class DynamicLossScale(NamedTuple):
    """State of a dynamic loss scale (a pytree of scalar arrays).

    Attributes:
      loss_scale: current scale, float32.
      counter: consecutive finite steps since the last change of scale, int32.
      period: finite steps after which the scale grows, int32.
      factor: growth / back-off factor (> 1), float32.
      min_loss_scale: the scale never goes below this, float32.
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: jax.Array
    factor: jax.Array
    min_loss_scale: jax.Array


def dynamic_loss_scale(
    initial: float = 2.0**15,
    period: int = 2000,
    factor: float = 2.0,
    min_loss_scale: float = 1.0,
) -> DynamicLossScale:
    """Creates a dynamic loss scale.

    Args:
      initial: starting scale; must satisfy ``initial >= min_loss_scale``.
      period: number of consecutive finite steps after which the scale is
        multiplied by ``factor`` (an ``int >= 1``).
      factor: growth and back-off factor, ``> 1``.
      min_loss_scale: lower bound of the scale, ``> 0``.

    Returns:
      A :class:`DynamicLossScale` with ``counter == 0``.

    Raises:
      ValueError / TypeError: on invalid arguments.

    Example:
      >>> import accumjax
      >>> ls = accumjax.dynamic_loss_scale(initial=2.0**15, period=2000)
      >>> float(ls.loss_scale)
      32768.0

    Reference: Micikevicius et al. 2018, "Mixed Precision Training".
    """
    top = float(jnp.finfo(jnp.float32).max)
    min_loss_scale = check_real("min_loss_scale", min_loss_scale, low=0.0, low_open=True, high=top)
    initial = check_real("initial", initial, low=min_loss_scale, high=top)
    factor = check_real("factor", factor, low=1.0, low_open=True, high=top)
    period = check_int("period", period)
    return DynamicLossScale(
        loss_scale=jnp.asarray(initial, jnp.float32),
        counter=jnp.zeros((), jnp.int32),
        period=jnp.asarray(period, jnp.int32),
        factor=jnp.asarray(factor, jnp.float32),
        min_loss_scale=jnp.asarray(min_loss_scale, jnp.float32),
    )


def scale_loss(ls: DynamicLossScale, loss: jax.Array) -> jax.Array:
    """Multiplies ``loss`` by the current scale (in the loss's dtype).

    Args:
      ls: the loss scale.
      loss: a floating-point loss (usually a float32 scalar).

    Returns:
      ``loss * ls.loss_scale``, same dtype as ``loss``.

    Example:
      >>> import jax.numpy as jnp, accumjax
      >>> float(accumjax.scale_loss(accumjax.dynamic_loss_scale(8.0), jnp.float32(0.5)))
      4.0
    """
    loss = jnp.asarray(loss)
    return loss * ls.loss_scale.astype(loss.dtype)


def unscale_grads(ls: DynamicLossScale, grads: Any) -> Any:
    """Divides every floating leaf of ``grads`` by the scale, in float32 or wider.

    Args:
      ls: the loss scale used for :func:`scale_loss`.
      grads: a pytree of gradients of the scaled loss (any float dtype).

    Returns:
      The unscaled gradients in ``promote_types(dtype, float32)`` (float64 and complex stay
      so); non-float leaves are returned as is.

    Example:
      >>> import jax.numpy as jnp, accumjax
      >>> g = accumjax.unscale_grads(accumjax.dynamic_loss_scale(4.0), jnp.ones(2, jnp.float16))
      >>> g.dtype, g.tolist()
      (dtype('float32'), [0.25, 0.25])
    """

    def unscale(g: jax.Array) -> jax.Array:
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return g
        g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
        return g / ls.loss_scale.astype(g.dtype)

    return jax.tree.map(unscale, grads)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite.

    Args:
      tree: a pytree of arrays.

    Returns:
      A boolean scalar array (``True`` for a tree without floating leaves).

    Example:
      >>> import jax.numpy as jnp, accumjax
      >>> bool(accumjax.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(leaves))


def adjust_loss_scale(ls: DynamicLossScale, grads_finite: jax.Array | bool) -> DynamicLossScale:
    """Updates the scale after a step.

    If the gradients overflowed, the scale is divided by ``factor`` (but not below
    ``min_loss_scale``) and the counter restarts. Otherwise the counter counts the
    finite step; on the ``period``-th consecutive finite step the scale is multiplied
    by ``factor`` (unless that would overflow float32) and the counter restarts.

    Args:
      ls: the current loss scale.
      grads_finite: boolean scalar, e.g. ``all_finite(grads)``.

    Returns:
      The new :class:`DynamicLossScale`.

    Example:
      >>> import accumjax
      >>> ls = accumjax.dynamic_loss_scale(initial=8.0, period=2)
      >>> ls = accumjax.adjust_loss_scale(ls, False)
      >>> float(ls.loss_scale), int(ls.counter)
      (4.0, 0)

    Reference: Micikevicius et al. 2018, "Mixed Precision Training".
    """
    finite = jnp.asarray(grads_finite, bool)
    counter = ls.counter + 1
    grown = ls.loss_scale * ls.factor
    grow = finite & (counter >= ls.period) & jnp.isfinite(grown)
    lowered = jnp.maximum(ls.loss_scale / ls.factor, ls.min_loss_scale)
    scale = jnp.where(finite, jnp.where(grow, grown, ls.loss_scale), lowered)
    counter = jnp.where(finite & ~grow, counter, 0).astype(jnp.int32)
    return ls._replace(loss_scale=scale, counter=counter)


def update_loss_scale(ls: DynamicLossScale, opt_state: Any, new_opt_state: Any) -> DynamicLossScale:
    """Adjusts the scale once per window, from `accumjax.accumulate`'s state before and after
    one ``tx.update`` call (the rule of ``make_train_step(mixed_precision="float16")``).

    A call that leaves the window open returns ``ls`` unchanged. At the call that closes the
    window (``new_opt_state``'s window is empty again), `adjust_loss_scale` runs once: the
    window counts as finite when ``nonfinite_count``, which takes in the window's non-finite
    microbatches when it closes, did not rise. An overflow anywhere in the window divides the
    scale by ``factor`` (halves it by default); a finite window counts towards growth. Call it
    after every ``tx.update``, with the optimizer state before and after that call.

    Args:
      ls: the current loss scale.
      opt_state: the `accumjax.AccumulationState` given to ``tx.update``.
      new_opt_state: the state that call returned.

    Returns:
      The new :class:`DynamicLossScale` (under ``jit`` too: the choice is a select).

    Raises:
      TypeError: naming the argument that is not an `accumjax.AccumulationState`.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = accumjax.accumulate(optax.sgd(0.1), 2)  # K = 2
      >>> params = {"w": jnp.zeros(2)}
      >>> opt_state, ls = tx.init(params), accumjax.dynamic_loss_scale(2.0**15, period=2)
      >>> scales = []
      >>> for g in [jnp.inf, 1.0, 1.0, 1.0, 1.0, 1.0]:  # an overflow in the first window
      ...     _, new_opt_state = tx.update({"w": jnp.full(2, g)}, opt_state, params)
      ...     ls = accumjax.update_loss_scale(ls, opt_state, new_opt_state)
      ...     opt_state = new_opt_state
      ...     scales.append(float(ls.loss_scale))
      >>> scales  # halved when the window closes; doubled after period=2 finite windows
      [32768.0, 16384.0, 16384.0, 16384.0, 16384.0, 32768.0]
    """
    before = _accumulation_state("opt_state", opt_state)
    after = _accumulation_state("new_opt_state", new_opt_state)
    closed = closed_its_window(after)
    adjusted = adjust_loss_scale(ls, after.nonfinite_count == before.nonfinite_count)
    return jax.tree.map(lambda new, old: jnp.where(closed, new, old), adjusted, ls)


def _accumulation_state(name: str, state: Any) -> AccumulationState:
    """``state`` as an `AccumulationState`, or a TypeError naming the argument."""
    try:
        return accumulation_state_in(state)
    except TypeError:
        raise TypeError(
            f"update_loss_scale(ls, opt_state, new_opt_state): {name} is a "
            f"{type(state).__name__}, not the state of accumjax.accumulate; pass the state given "
            "to tx.update and the one it returned, for tx = accumjax.accumulate(inner, K)."
        ) from None
