"""The scaling strategies' rules (internal): a strategy's name checked
(`validate_scaling`), which stored strategies a state may resume under (`compatible`), a
microbatch's weight validated (`microbatch_weight`), whether devices' losses add up
(`device_losses_add`), what one device's gradient counts for in a microbatch's
(`share_divisor`), and a sum divided by its denominator (`nonzero_denominator`, `divided`: a
window's and a microbatch's whole gradient). `accumjax.scaling` describes them.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp

from accumjax._moved import REMOVED_IN

__all__ = [
    "SCALINGS",
    "Scaling",
    "compatible",
    "concrete_value",
    "device_losses_add",
    "divided",
    "microbatch_weight",
    "nonzero_denominator",
    "share_divisor",
    "validate_scaling",
]

Scaling = Literal["mean", "sum", "count", "weighted", "sum_over_k"]
#: The strategies by ``scaling_code`` (append only: a checkpoint stores the index).
SCALINGS: tuple[Scaling, ...] = ("mean", "sum", "count", "weighted", "sum_over_k")
_MEANS = ("mean", "count", "sum_over_k")


def device_losses_add(scaling: str) -> bool:
    """Whether, on a mapped axis, a microbatch's loss is the sum of its devices' losses
    (``"sum"``: each device's loss is its share of the microbatch's) rather than their mean
    (each device's loss a mean over its own rows). A device's whole-microbatch gradient, loss
    metric and loss scale follow from it.

    Example:
      >>> device_losses_add("sum"), device_losses_add("mean")
      (True, False)
    """
    return scaling == "sum"


def share_divisor(scaling: str, devices: int) -> int | None:
    """On a mapped axis of ``devices``, what one device's part of a microbatch (the gradient
    of its rows, and in a window its count) is divided by to be its share of the whole
    microbatch's: ``devices`` where the window averages microbatches (``"mean"``,
    ``"sum_over_k"``: each device's loss is a mean over its rows, the microbatch's gradient
    the devices' mean), 1 where the devices' losses add (``"sum"``, `device_losses_add`:
    each device's loss is its share already), None for ``"weighted"`` (a device's part is
    weighed by its weight, and the sum divided by the devices' summed weight).

    Example:
      >>> share_divisor("mean", 8), share_divisor("sum", 8), share_divisor("weighted", 8)
      (8, 1, None)
    """
    if scaling == "weighted":
        return None
    return 1 if device_losses_add(scaling) else devices


def validate_scaling(scaling: str) -> Scaling:
    """``scaling`` if it names a strategy (``"count"``: ``"mean"``, with a
    ``DeprecationWarning``), else ``ValueError``.

    Example:
      >>> import accumjax._scaling as scaling
      >>> scaling.validate_scaling("sum_over_k")
      'sum_over_k'
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}.")
    if scaling == "count":
        warnings.warn(
            f"accumulate(scaling='count') is deprecated and will be removed in {REMOVED_IN}: write "
            "scaling='mean', which since 0.5 divides by the microbatches a window used, as "
            "'count' did.",
            DeprecationWarning,
            stacklevel=4,
        )
        return "mean"
    return scaling  # type: ignore[return-value]


def compatible(stored: str, wanted: str) -> bool:
    """Whether a state made with scaling ``stored`` resumes under ``wanted``: the same
    strategy, or two of ``"mean"``, ``"count"`` and ``"sum_over_k"`` (one state, whose
    windows differ only when a microbatch is skipped).

    Example:
      >>> import accumjax._scaling as scaling
      >>> scaling.compatible("count", "mean"), scaling.compatible("sum", "mean")
      (True, False)
    """
    return stored == wanted or (stored in _MEANS and wanted in _MEANS)


def nonzero_denominator(denom: jax.Array) -> jax.Array:
    """``denom`` where it is > 0, else 1 (a sum without weight, zero, stays zero).

    Example:
      >>> float(nonzero_denominator(jnp.float32(0.0))), float(nonzero_denominator(jnp.float32(4.0)))
      (1.0, 4.0)
    """
    return jnp.where(denom > 0, denom, 1.0)


def divided(sums: Any, denom: jax.Array) -> Any:
    """Each leaf of ``sums`` divided by ``denom`` (a `nonzero_denominator`), in its own dtype."""
    return jax.tree.map(lambda a: a / denom.astype(a.dtype), sums)


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
