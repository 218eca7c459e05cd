"""The BatchNorm arithmetic both ``AccumBatchNorm`` layers run, on one layer's arrays (internal).

A call's moments (:func:`compute_moments`, all-reduced once over a device axis) and its
normalization (:func:`normalize`), both run by :func:`normalize_and_accumulate`; the merge of
a call's statistics into the window's count, mean and ``M2`` (sum of squared deviations) by
Chan, Golub & LeVeque's parallel update (:func:`chan_merge`, :func:`add_moments`); a closed
window's one move of the running averages (:func:`moving_average`, :func:`close_stats_window`); the
configuration checks, canonical axes, dtypes and statistic names (:data:`ACCUMULATOR_NAMES`).

References:
  - Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift", ICML 2015.
  - Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing
    sample variances", Stanford CS tech. report STAN-CS-79-773, 1979.

Example:
  >>> import jax.numpy as jnp
  >>> from accumjax import _batch_norm_math as bnm
  >>> x = jnp.array([[1.0], [3.0]])
  >>> running, window = bnm.Running(jnp.zeros(1), jnp.ones(1)), bnm.empty_stats_window((1,))
  >>> options = bnm.BatchNormOptions(accum_steps=1, momentum=0.5)
  >>> y, running, window = bnm.normalize_and_accumulate(
  ...     x, None, (1,), options, running, window, None, None, use_running_average=False)
  >>> [round(float(v), 4) for v in y[:, 0]], running.mean, running.var  # y: rsqrt, rounded
  ([-1.0, 1.0], Array([1.], dtype=float32), Array([1.], dtype=float32))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
from flax.linen import dtypes
from flax.typing import Array, Axes, Dtype
from jax import lax

from accumjax._checks import INT32_MAX, check_axis_bound, check_int, check_real
from accumjax._norms import abs_squared
from accumjax._window import sum_dtype

__all__ = [
    "ACCUMULATOR_NAMES",
    "MOMENTUM_NAME",
    "STEP_DRIVEN_NAMES",
    "BatchNormOptions",
    "Moments",
    "Running",
    "StatsWindow",
    "add_moments",
    "canonical_axes",
    "chan_merge",
    "check_config",
    "check_input",
    "close_stats_window",
    "complex_like",
    "compute_moments",
    "moving_average",
    "empty_stats_window",
    "normalize",
    "normalize_and_accumulate",
    "running_dtype",
    "stats_accumulator_dtype",
    "stats_dtype",
    "stats_window_of",
    "stats_window_values",
]

#: The accumulator entries that ``AccumBatchNorm`` keeps in ``batch_stats`` next to ``mean``
#: and ``var``, each with the `StatsWindow` field it holds: the open window's count, mean,
#: ``M2`` and number of calls (`stats_window_values`, `stats_window_of`).
_WINDOW_FIELDS = {"acc_count": "count", "acc_mean": "mean", "acc_m2": "m2", "acc_step": "calls"}
#: Names of the accumulator entries, in the order of `StatsWindow`'s fields.
ACCUMULATOR_NAMES: tuple[str, ...] = tuple(_WINDOW_FIELDS)
#: Name of the float32 scalar that step-driven layers (``accum_steps=None``) keep there.
MOMENTUM_NAME = "momentum"
#: Entries of one step-driven layer's statistics, as ``close_batch_norm_windows`` finds them.
STEP_DRIVEN_NAMES: tuple[str, ...] = ("mean", "var", *ACCUMULATOR_NAMES, MOMENTUM_NAME)


class Moments(NamedTuple):
    """Per-feature statistics of one (possibly cross-device) microbatch."""

    count: Array
    mean: Array
    var: Array


class Running(NamedTuple):
    """The running averages used in evaluation mode."""

    mean: Any
    var: Any


class StatsWindow(NamedTuple):
    """The open window's pooled count, mean, ``M2`` and number of calls (``calls``, kept in
    ``batch_stats`` as ``acc_step``)."""

    count: Any
    mean: Any
    m2: Any
    calls: Any


def stats_window_values(window: StatsWindow) -> dict[str, Any]:
    """``window``'s values under their names in a layer's statistics (`ACCUMULATOR_NAMES`).

    Example:
      >>> sorted(stats_window_values(StatsWindow(count=1, mean=2, m2=3, calls=4)).items())
      [('acc_count', 1), ('acc_m2', 3), ('acc_mean', 2), ('acc_step', 4)]
    """
    return {name: getattr(window, field) for name, field in _WINDOW_FIELDS.items()}


def stats_window_of(values: Mapping[str, Any]) -> StatsWindow:
    """`stats_window_values` undone: the window held in ``values`` (a layer's statistics, or
    any mapping with the `ACCUMULATOR_NAMES`), its values as they are there.

    Example:
      >>> stats_window_of({"acc_count": 1, "acc_mean": 2, "acc_m2": 3, "acc_step": 4})
      StatsWindow(count=1, mean=2, m2=3, calls=4)
    """
    return StatsWindow(**{field: values[name] for name, field in _WINDOW_FIELDS.items()})


class BatchNormOptions(NamedTuple):
    """The hyperparameters :func:`normalize_and_accumulate` reads, named as the layers' own."""

    accum_steps: int | None = None
    momentum: Any = 0.99
    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    force_float32_reductions: bool = True
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True

    @classmethod
    def of(cls, layer: Any, momentum: Any) -> BatchNormOptions:
        """``layer``'s options (linen or NNX): its attributes, ``momentum`` as it holds it."""
        return cls(**{n: momentum if n == "momentum" else getattr(layer, n) for n in cls._fields})


# ---------------------------------------------------------------------------------------------
# Checks, axes and dtypes
# ---------------------------------------------------------------------------------------------


def stats_accumulator_dtype() -> jnp.dtype:
    """The dtype of the window accumulators: float32, or float64 under ``jax_enable_x64``."""
    return sum_dtype(jnp.float32, jnp.float64)


def running_dtype(force_float32_reductions: bool, param_dtype: Dtype) -> Any:
    """The dtype of the running ``mean``/``var``: float32 if forced, else ``param_dtype``."""
    return jnp.float32 if force_float32_reductions else param_dtype


def stats_dtype(dtype: Dtype | None, x_dtype: Any, force_float32: bool) -> jnp.dtype:
    """The dtype of the normalizing statistics, as ``BatchNorm`` picks it.

    Args:
      dtype: the layer's ``dtype`` (None: that of the input).
      x_dtype: the input's dtype.
      force_float32: the layer's ``force_float32_reductions``.

    Returns:
      ``dtype`` (or ``x_dtype``), promoted to at least float32 when ``force_float32``.
    """
    chosen = jnp.dtype(dtype if dtype is not None else x_dtype)
    return jnp.promote_types(chosen, jnp.float32) if force_float32 else chosen


def complex_like(dtype: Any, other: Any) -> jnp.dtype:
    """``dtype``, promoted with ``other`` when ``other`` is complex: the dtype of a mean.

    A complex input's running and pooled means are complex (``BatchNorm``'s running mean
    turns complex on its first update); its variances, like all counts, stay real.

    Example:
      >>> complex_like(jnp.float32, jnp.complex64), complex_like(jnp.float32, jnp.float16)
      (dtype('complex64'), dtype('float32'))
    """
    complex_other = jnp.issubdtype(other, jnp.complexfloating)
    return jnp.promote_types(dtype, other) if complex_other else jnp.dtype(dtype)


def check_config(accum_steps: Any, momentum: Any, epsilon: Any = 0.0) -> None:
    """Validates a layer's ``accum_steps``, ``momentum`` and ``epsilon``.

    ``accum_steps`` must be None or an int in ``[1, 2**31 - 1]``, ``momentum`` a real number
    in ``[0, 1]`` and ``epsilon`` a finite real number ``>= 0``. A value of the wrong kind
    (a bool, a float ``accum_steps``, a string) raises ``TypeError``, one out of range
    ``ValueError`` (the rule of :mod:`accumjax._checks`).

    Example:
      >>> check_config(None, 0.9, 1e-5)
      >>> check_config(0, 0.9)
      Traceback (most recent call last):
      ...
      ValueError: accum_steps must be an int in [1, 2**31 - 1], got 0.
    """
    if accum_steps is not None:
        check_int("accum_steps", accum_steps, 1, INT32_MAX)
    check_real("momentum", momentum, low=0.0, high=1.0)
    check_real("epsilon", epsilon, low=0.0)


def canonical_axes(ndim: int, axes: Axes) -> tuple[int, ...]:
    """Sorted, deduplicated, non-negative ``axes`` (an int or ints) of a rank-``ndim`` input.

    Raises:
      ValueError: if an axis is out of range for ``ndim``.

    Example:
      >>> canonical_axes(3, (-1, 1))
      (1, 2)
    """
    items = tuple(axes) if isinstance(axes, Iterable) else (axes,)
    for axis in items:
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for an input of rank {ndim}.")
    return tuple(sorted({axis % ndim for axis in items}))


def check_input(x: Array, mask: Array | None) -> None:
    """Rejects an ``x`` that is not floating point (real or complex) and a bad ``mask``.

    Raises:
      TypeError: if ``x`` is not real or complex floating point (e.g. an integer array).
      ValueError: if ``mask`` does not broadcast to ``x.shape`` (or would enlarge it).
    """
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"x: AccumBatchNorm needs a floating-point (real or complex) input, got {x.dtype}."
        )
    if mask is None:
        return
    try:
        shape = jnp.broadcast_shapes(jnp.shape(mask), x.shape)
    except ValueError as err:
        raise ValueError(
            f"mask of shape {jnp.shape(mask)} does not broadcast to the input shape {x.shape}."
        ) from err
    if shape != x.shape:
        raise ValueError(f"mask of shape {jnp.shape(mask)} would enlarge the input {x.shape}.")


# ---------------------------------------------------------------------------------------------
# Statistics of one call, and the normalization
# ---------------------------------------------------------------------------------------------


def empty_stats_window(
    shape: tuple[int, ...], dtype: Any = None, mean_dtype: Any = None
) -> StatsWindow:
    """Zero accumulators (constants, so they are replicated under ``shard_map``).

    Args:
      shape: the feature shape.
      dtype: the accumulator dtype (default :func:`stats_accumulator_dtype`).
      mean_dtype: the mean's dtype (default ``dtype``; complex for a complex input).

    Returns:
      A :class:`StatsWindow` of zeros, with an int32 scalar ``calls``.
    """
    dtype = stats_accumulator_dtype() if dtype is None else dtype
    mean_dtype = dtype if mean_dtype is None else mean_dtype
    count, mean, m2 = (jnp.zeros(shape, d) for d in (dtype, mean_dtype, dtype))  # distinct
    return StatsWindow(count, mean, m2, jnp.zeros((), jnp.int32))


def compute_moments(
    x: Array,
    mask: Array | None,
    reduction_axes: tuple[int, ...],
    dtype: Any,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
) -> Moments:
    """Count, mean and population variance of ``x``, all-reduced over ``axis_name``.

    Sums are taken in at least float32 (and at least ``dtype``), counts in the accumulator
    dtype. One all-reduce of ``(count, sum, sum of |x|^2)`` serves the fast variance
    ``E[|x|^2] - |E[x]|^2`` (clipped at 0, as in Flax); the centred variance needs a second.
    A complex ``x`` has a complex mean and a real variance, as in Flax.

    Args:
      x: the input.
      mask: None, or a boolean array broadcastable to ``x``: only True positions count.
      reduction_axes: the axes to reduce (all but the feature axes).
      dtype: the statistics dtype (see :func:`stats_dtype`).
      axis_name: the ``pmap``/``shard_map`` axis to all-reduce over, or None.
      axis_index_groups: groups of indices within ``axis_name`` to reduce separately.
      use_fast_variance: one-pass ``E[|x|^2] - |E[x]|^2`` if True, else centre first.

    Returns:
      The per-feature :class:`Moments` (a fully masked feature has count 0, mean 0, var 0).

    Example:
      >>> import jax.numpy as jnp
      >>> compute_moments(jnp.array([[1.0], [3.0]]), None, (0,), jnp.float32)
      Moments(count=Array([2.], dtype=float32), mean=Array([2.], dtype=float32),
              var=Array([1.], dtype=float32))
    """
    x = x.astype(sum_dtype(dtype))
    feature_shape = tuple(d for i, d in enumerate(x.shape) if i not in reduction_axes)
    where = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    if where is None:
        n_local = math.prod(x.shape[i] for i in reduction_axes)
        count = jnp.full(feature_shape, n_local, stats_accumulator_dtype())
        if axis_name is None:
            return Moments(count, *_local_mean_var(x, reduction_axes, use_fast_variance))
    else:
        count = jnp.sum(where, reduction_axes, dtype=stats_accumulator_dtype())

    def all_sum(tree: Any) -> Any:
        if axis_name is None:
            return tree
        check_axis_bound(axis_name)
        return lax.psum(tree, axis_name, axis_index_groups=axis_index_groups)

    def local_sum(values: Array) -> Array:
        return jnp.sum(values, reduction_axes, where=where)

    sums = (local_sum(x), local_sum(abs_squared(x))) if use_fast_variance else (local_sum(x),)
    count, *sums = all_sum((count, *sums))
    denom = jnp.maximum(count, 1).astype(jnp.finfo(x.dtype).dtype)  # real for a complex x
    mean = sums[0] / denom
    if use_fast_variance:
        return Moments(count, mean, jnp.maximum(0.0, sums[1] / denom - abs_squared(mean)))
    centred = abs_squared(x - jnp.expand_dims(mean, reduction_axes))
    return Moments(count, mean, all_sum(local_sum(centred)) / denom)


def _local_mean_var(
    x: Array, reduction_axes: tuple[int, ...], use_fast_variance: bool
) -> tuple[Array, Array]:
    """Mean and variance of an unmasked ``x`` on one device, by Flax's ``jnp.mean`` calls:
    XLA turns their division by the constant count into a multiplication by its reciprocal
    (in ``jnp.mean``'s own ``jit`` when eager), which rounds unlike a division by an array.
    """
    mean = jnp.mean(x, reduction_axes)
    if use_fast_variance:
        var = jnp.maximum(0.0, jnp.mean(abs_squared(x), reduction_axes) - abs_squared(mean))
    else:
        var = jnp.mean(abs_squared(x - jnp.expand_dims(mean, reduction_axes)), reduction_axes)
    return mean, var


def normalize(
    x: Array,
    mean: Array,
    var: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: tuple[int, ...],
    epsilon: float,
    dtype: Dtype | None,
) -> Array:
    """Returns ``(x - mean) / sqrt(var + epsilon) * scale + bias`` (Ioffe & Szegedy 2015).

    Args:
      x: the input.
      mean, var: per-feature statistics (shaped like ``x`` without ``reduction_axes``).
      scale, bias: per-feature parameters, or None to skip them.
      reduction_axes: the reduced axes, re-inserted to broadcast the per-feature arrays.
      epsilon: added to the variance.
      dtype: the result dtype; None picks it from ``x`` and the params as Flax's
        ``BatchNorm`` does, with the same operations in the same order.

    Returns:
      The normalized input, shaped like ``x``.
    """
    y = x - jnp.expand_dims(mean, reduction_axes)
    factor = lax.rsqrt(jnp.expand_dims(var, reduction_axes) + epsilon)
    inputs = [x]
    if scale is not None:
        scale = jnp.expand_dims(scale, reduction_axes)
        factor = factor * scale
        inputs.append(scale)
    y = y * factor
    if bias is not None:
        bias = jnp.expand_dims(bias, reduction_axes)
        y = y + bias
        inputs.append(bias)
    return jnp.asarray(y, dtypes.canonicalize_dtype(*inputs, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# The window: merge, close, pool
# ---------------------------------------------------------------------------------------------


def chan_merge(
    n_a: Array, mean_a: Array, m2_a: Array, n_b: Array, mean_b: Array, m2_b: Array
) -> tuple[Array, Array, Array]:
    """Merges two (count, mean, M2) summaries (Chan, Golub & LeVeque 1979).

    ``M2`` is the sum of squared deviations ``|x - mean|**2`` from the mean. The
    ``|delta|**2`` term carries the spread between the two means (complex means too).
    Empty summaries (count 0) merge to the other one.

    Returns:
      The merged ``(count, mean, M2)``.

    Example:
      >>> import jax.numpy as jnp
      >>> one = jnp.array(1.0)  # {0} merged with {2}: mean 1, M2 = 1 + 1
      >>> [float(v) for v in chan_merge(one, jnp.array(0.0), jnp.array(0.0), one, 2 * one, 0 * one)]
      [2.0, 1.0, 2.0]
    """
    n = n_a + n_b
    w_b = n_b / jnp.maximum(n, 1)  # n_b / n, and 0 when both are empty
    delta = mean_b - mean_a
    return n, mean_a + delta * w_b, m2_a + m2_b + abs_squared(delta) * n_a * w_b


def moving_average(old: Array, new: Array, momentum: Any, update: Array) -> Array:
    """``momentum * old + (1 - momentum) * new`` where ``update``, else ``old``.

    In ``old``'s dtype, complex for a complex ``new`` (:func:`complex_like`). ``update``
    selects the factors (or ``1, 0``) and a zero for a skipped, maybe NaN, ``new``: a select
    after the blend made XLA round some results unlike ``BatchNorm``'s update.
    """
    dtype = complex_like(old.dtype, new.dtype)
    keep = jnp.where(update, momentum, 1.0)
    take = jnp.where(update, 1 - momentum, 0.0)
    new = jnp.where(update, new.astype(dtype), 0)
    return (keep * old.astype(dtype) + take * new).astype(dtype)


def add_moments(
    running: Running,
    window: StatsWindow,
    moments: Moments,
    momentum: Any,
    accum_steps: int | None,
) -> tuple[Running, StatsWindow]:
    """Merges one call's ``moments`` into the window.

    With an int ``accum_steps`` the window closes on its ``accum_steps``-th call: the
    running averages move towards the pooled (population) statistics, where the window
    holds any element, and the accumulators are reset. With ``None`` only the window
    changes; :func:`close_stats_window` (via ``close_batch_norm_windows``) closes it. The running
    mean of a complex input is complex from this call on (:func:`complex_like`).

    Returns:
      The new running averages and window.
    """
    dtype = window.count.dtype
    mean_dtype = complex_like(window.mean.dtype, moments.mean.dtype)
    running = Running(
        running.mean.astype(complex_like(running.mean.dtype, mean_dtype)), running.var
    )
    n_b, var_b = jnp.asarray(moments.count, dtype), jnp.asarray(moments.var, dtype)
    mean_b = jnp.asarray(moments.mean, mean_dtype)
    if accum_steps == 1:
        return _close_one(running, window, Moments(n_b, mean_b, var_b), momentum)
    n, mean, m2 = chan_merge(window.count, window.mean, window.m2, n_b, mean_b, var_b * n_b)
    calls = window.calls + 1
    if accum_steps is None:
        return running, StatsWindow(n, mean, m2, calls.astype(jnp.int32))
    closes = calls >= accum_steps
    update = jnp.logical_and(closes, n > 0)
    pooled_var = m2 / jnp.maximum(n, 1)
    new_running = Running(
        moving_average(running.mean, mean, momentum, update),
        moving_average(running.var, pooled_var, momentum, update),
    )
    new_window = StatsWindow(
        jnp.where(closes, jnp.zeros_like(n), n),
        jnp.where(closes, jnp.zeros_like(mean), mean),
        jnp.where(closes, jnp.zeros_like(m2), m2),
        jnp.where(closes, 0, calls).astype(jnp.int32),
    )
    return new_running, new_window


def _close_one(
    running: Running, window: StatsWindow, moments: Moments, momentum: Any
) -> tuple[Running, StatsWindow]:
    """``accum_steps=1``: the running averages move towards the call's own statistics, and
    the window, pooling nothing, stays empty. Skipping the merge, XLA sees ``BatchNorm``'s
    ``momentum * old + (1 - momentum) * mean`` and simplifies it alike (it folds
    ``1 - momentum`` into an unmasked mean's ``1 / count``): the same bits.
    """
    update = moments.count > 0
    mean, var = (
        moving_average(r, new, momentum, update)
        for r, new in zip(running, moments[1:], strict=True)
    )
    empty = empty_stats_window(window.count.shape, window.count.dtype, moments.mean.dtype)
    return Running(mean, var), empty


def close_stats_window(
    running: Running, window: StatsWindow, momentum: Array, apply: Array
) -> tuple[Running, StatsWindow]:
    """Closes a step-driven window: EMA update where ``apply`` and non-empty; reset.

    Returns:
      The running averages (moved towards the window's pooled mean and population
      variance ``M2 / count`` where ``apply`` and the window is non-empty) and an empty
      window.
    """
    update = jnp.logical_and(apply, window.count > 0)
    var = window.m2 / jnp.maximum(window.count, 1)
    new_running = Running(
        moving_average(running.mean, window.mean, momentum, update),
        moving_average(running.var, var, momentum, update),
    )
    return new_running, empty_stats_window(
        window.count.shape, window.count.dtype, window.mean.dtype
    )


# ---------------------------------------------------------------------------------------------
# One call of a layer
# ---------------------------------------------------------------------------------------------


def normalize_and_accumulate(
    x: Array,
    mask: Array | None,
    feature_axes: tuple[int, ...],
    options: BatchNormOptions,
    running: Running,
    window: StatsWindow | None,
    scale: Array | None,
    bias: Array | None,
    *,
    use_running_average: bool,
    initializing: bool = False,
) -> tuple[Array, Running, StatsWindow | None]:
    """One call of an ``AccumBatchNorm`` layer (linen or NNX), as pure arrays.

    In evaluation mode (``use_running_average``) ``x`` is normalized with ``running`` and
    nothing changes. In training mode it is normalized with its own statistics (exactly as
    Flax's ``BatchNorm``), whose count, mean and ``M2`` are merged into ``window``;
    a self-closing layer (int ``options.accum_steps``) closes the window on its last call.
    While ``initializing`` (linen's ``init``) the statistics are computed without the
    collective over ``options.axis_name`` (which may not exist yet) and nothing is merged.

    Args:
      x: the input, a real or complex floating-point array.
      mask: None, or a boolean array broadcastable to ``x``: only True positions count.
      feature_axes: canonical feature axes of ``x`` (see :func:`canonical_axes`).
      options: the layer's hyperparameters.
      running: the running ``mean`` and ``var``, shaped like the features of ``x``.
      window: the open window (may be None in evaluation mode).
      scale, bias: the per-feature parameters, or None.
      use_running_average: evaluation mode if True.
      initializing: True during linen's ``init``.

    Returns:
      ``(y, running, window)``: the normalized input and the new running averages and
      window (the given ones where nothing changes).
    """
    check_input(x, mask)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    if not options.force_float32_reductions:
        scale = None if scale is None else jnp.asarray(scale, options.param_dtype)
        bias = None if bias is None else jnp.asarray(bias, options.param_dtype)
    if use_running_average:
        mean, var = running
        if not options.force_float32_reductions:
            mean, var = (
                jnp.asarray(mean, options.param_dtype),
                jnp.asarray(var, options.param_dtype),
            )
    else:
        dtype = stats_dtype(options.dtype, x.dtype, options.force_float32_reductions)
        moments = compute_moments(
            x,
            mask,
            reduction_axes,
            dtype,
            None if initializing else options.axis_name,
            options.axis_index_groups,
            options.use_fast_variance,
        )
        mean, var = moments.mean.astype(dtype), moments.var.astype(jnp.finfo(dtype).dtype)
        if not initializing:
            if window is None:
                raise ValueError("a training-mode call needs the window accumulators.")
            running, window = add_moments(
                running, window, moments, options.momentum, options.accum_steps
            )
    y = normalize(x, mean, var, scale, bias, reduction_axes, options.epsilon, options.dtype)
    return y, running, window
