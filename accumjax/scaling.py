"""How an accumulated gradient is normalised: the scaling strategies of `accumulate`.

Every strategy accumulates ``sum_i w_i * g_i`` (``w_i = 1`` unless ``scaling="weighted"``)
and divides once, at the end of the window, by a denominator:

=============  =========================================  ==================================
strategy       denominator                                use it when
=============  =========================================  ==================================
``"mean"``     ``K`` (times the data-parallel axis size)  losses are means; as optax.MultiSteps
``"sum"``      ``1``                                      losses are sums over examples
``"count"``    microbatches actually added                some microbatches may be skipped
``"weighted"`` ``sum_i w_i`` of the added microbatches    per-token losses, ragged batches
=============  =========================================  ==================================

With ``"weighted"`` and ``w_i`` the number of tokens (examples) of microbatch ``i`` whose loss
is the mean over its own tokens, ``sum_i w_i g_i / sum_i w_i`` is exactly the gradient of the
token-mean loss of the whole accumulated batch.

The accumulation window (`accumjax.window`) applies the denominator when it closes; the
weight of a microbatch is validated here.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["SCALINGS", "Scaling", "concrete_value", "microbatch_weight", "validate_scaling"]

Scaling = Literal["mean", "sum", "count", "weighted"]
SCALINGS: tuple[Scaling, ...] = ("mean", "sum", "count", "weighted")


def validate_scaling(scaling: str) -> Scaling:
    """Returns ``scaling`` if it names a strategy, else raises ``ValueError``."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}.")
    return scaling  # type: ignore[return-value]


def concrete_value(x: jax.typing.ArrayLike) -> float | None:
    """``float(x)`` when ``x`` is known at trace time, else ``None`` (it is a tracer)."""
    try:
        return float(x)  # type: ignore[arg-type]
    except (jax.errors.ConcretizationTypeError, TypeError):
        return None


def microbatch_weight(
    scaling: Scaling, weight: jax.typing.ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
    """Validates a microbatch's ``weight`` and returns it as float32 with a validity flag.

    Concrete weights are checked now (``ValueError`` when negative or not finite); traced weights
    cannot be, so their validity comes back as a boolean array and an invalid one is handled
    like a non-finite microbatch.

    Args:
      scaling: the strategy; only ``"weighted"`` takes (and requires) a weight.
      weight: the microbatch's weight (a scalar), or ``None``.

    Returns:
      ``(weight, valid)``: float32 scalars; ``(1.0, True)`` for the unweighted strategies.
    """
    if scaling != "weighted":
        if weight is not None:
            raise ValueError(
                "a microbatch weight (make_train_step(..., weight_fn=...), or "
                "tx.update(..., weight=w) in a loop of your own) is only taken with "
                f"scaling='weighted'; this accumulate uses {scaling!r}. Use "
                "accumjax.accumulate(inner, K, scaling='weighted'), or leave the weight out."
            )
        return jnp.ones((), jnp.float32), jnp.ones((), jnp.bool_)
    if weight is None:
        raise ValueError(
            "scaling='weighted' needs every microbatch's weight (e.g. its number of tokens): "
            "with the train step, make_train_step(..., weight_fn=fn), fn(microbatch) -> its "
            "weight; in a loop of your own, tx.update(..., weight=w) on every call."
        )
    w = jnp.asarray(weight)
    if w.shape != ():
        raise ValueError(f"weight must be a scalar, got shape {w.shape}.")
    if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)):
        raise TypeError(f"weight must be a real number, got dtype {w.dtype}.")
    w = w.astype(jnp.float32)
    value = concrete_value(w)
    if value is not None and not (value >= 0.0 and value != float("inf")):
        raise ValueError(f"weight must be finite and >= 0, got {value}.")
    return w, jnp.isfinite(w) & (w >= 0)
