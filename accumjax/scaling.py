"""How an accumulated gradient is normalised: the scaling strategies of `accumulate`.

Every strategy accumulates ``sum_i w_i * g_i`` over the microbatches a window used (``w_i = 1``
unless ``scaling="weighted"``; a skipped microbatch adds nothing) and divides once, at the end
of the window, by a denominator:

================  ============================================  ===============================
strategy          denominator                                   use it when
================  ============================================  ===============================
``"mean"``        the microbatches used (times the data axis)   losses are means (the default)
``"sum"``         ``1``                                         losses are sums over examples
``"weighted"``    ``sum_i w_i`` of the microbatches used        per-token losses, ragged batches
``"sum_over_k"``  ``K`` (times the data axis), skips or not     0.4's ``"mean"``: a skipped
                                                                microbatch counts as a zero
                                                                gradient (a smaller step)
================  ============================================  ===============================

``"mean"`` is the mean of the microbatches the window used: without skips the sum over K
(``optax.MultiSteps``' mean), and a window that skips one microbatch of 4 applies the mean of
the other 3. ``"count"``, which did this before 0.5, is a deprecated name for it (a
``DeprecationWarning``; removed in 0.6). On a data axis each device's rows are its share of
every microbatch, and every device counts the same microbatches, so the step is the one a
single device would take.

With ``"weighted"`` and ``w_i`` the number of tokens (examples) of microbatch ``i`` whose loss
is the mean over its own tokens, ``sum_i w_i g_i / sum_i w_i`` is exactly the gradient of the
token-mean loss of the whole accumulated batch.

The accumulation window (`accumjax.window`) applies the denominator when it closes; the
weight of a microbatch is validated here. A state records its strategy as an index into
`SCALINGS` (``scaling_code``): new strategies are appended, so a checkpoint's code keeps its
meaning.
"""

from __future__ import annotations

import warnings
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = [
    "SCALINGS",
    "Scaling",
    "compatible",
    "concrete_value",
    "microbatch_weight",
    "validate_scaling",
]

Scaling = Literal["mean", "sum", "count", "weighted", "sum_over_k"]
#: The strategies by ``scaling_code`` (append only: a checkpoint stores the index).
SCALINGS: tuple[Scaling, ...] = ("mean", "sum", "count", "weighted", "sum_over_k")
_MEANS = ("mean", "count", "sum_over_k")


def validate_scaling(scaling: str) -> Scaling:
    """``scaling`` if it names a strategy (``"count"``: ``"mean"``, with a
    ``DeprecationWarning``), else ``ValueError``.

    Example:
      >>> from accumjax import scaling
      >>> scaling.validate_scaling("sum_over_k")
      'sum_over_k'
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}.")
    if scaling == "count":
        warnings.warn(
            "accumulate(scaling='count') is deprecated and will be removed in 0.6: write "
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
    windows differ only when a microbatch is skipped; 0.4's ``"mean"`` and ``"count"``
    checkpoints resume under 0.5's ``"sum_over_k"`` and ``"mean"``).

    Example:
      >>> from accumjax import scaling
      >>> scaling.compatible("count", "mean"), scaling.compatible("sum", "mean")
      (True, False)
    """
    return stored == wanted or (stored in _MEANS and wanted in _MEANS)


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
