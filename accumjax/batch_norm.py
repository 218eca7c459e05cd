"""Batch normalization whose running statistics see the whole accumulated batch.

With gradient accumulation a logical batch of ``K * B`` examples is processed as ``K``
microbatches of ``B``. A plain :class:`flax.linen.BatchNorm` then updates its running
mean and variance ``K`` times per optimizer step from small, noisy microbatches.
:class:`AccumBatchNorm` normalizes each microbatch exactly as ``BatchNorm`` does, but
pools the per-microbatch count, mean and sum of squared deviations (``M2``) with the
parallel merge of Chan, Golub & LeVeque (1979), and updates the running statistics once
per window with the statistics of the whole accumulated batch.

Two ways to close a window:

- **Step-driven** (``accum_steps=None``, the default): the layer only pools; the train
  step calls :func:`close_batch_norm_windows` once per optimizer step, which updates
  ``mean``/``var`` from the pooled statistics (optionally pooled across devices with one
  all-reduce) and resets the accumulators. ``K`` is stated once, in the optimizer.
- **Self-closing** (``accum_steps=K``): the layer counts its calls and updates the
  running statistics itself on every ``K``-th one (standalone use, without a train step).

The arithmetic (moments, merge, normalization, window updates) lives in module-level
functions shared with the NNX layer in :mod:`accumjax.nnx_batch_norm`.

References:
  - Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift", ICML 2015.
  - Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing
    sample variances", Stanford CS tech. report STAN-CS-79-773, 1979.
  - The TensorFlow gradient-accumulator library (andreped/GradientAccumulator)
    ``AccumBatchNormalization`` averages the per-microbatch variances, which misses the
    spread of the microbatch means around the pooled mean; the merge here keeps it.
"""

import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.core import FrozenDict
from flax.linen import dtypes
from flax.typing import Array, Axes, Dtype, Initializer
from jax import lax
from jax.nn import initializers

__all__ = [
    "ACCUMULATOR_NAMES",
    "AccumBatchNorm",
    "close_batch_norm_windows",
    "convert_batch_norm_variables",
]

#: Names of the accumulator entries that :class:`AccumBatchNorm` keeps in ``batch_stats``
#: next to ``mean`` and ``var``.
ACCUMULATOR_NAMES: tuple[str, ...] = ("acc_count", "acc_mean", "acc_m2", "acc_step")

# The float32 scalar that step-driven layers (accum_steps=None) keep in batch_stats.
_MOMENTUM = "momentum"
# Entries of one step-driven layer's batch_stats, as close_batch_norm_windows finds them.
_STEP_DRIVEN_NAMES = ("mean", "var", *ACCUMULATOR_NAMES, _MOMENTUM)
# Flax's automatic names: "<class name>_<index within the parent>".
_AUTO_NAME = re.compile(r"(Accum)?BatchNorm_(\d+)")

_Tree = TypeVar("_Tree")


class _Moments(NamedTuple):
    """Per-feature statistics of one (possibly cross-device) microbatch."""

    count: Array
    mean: Array
    var: Array


class _Running(NamedTuple):
    """The running averages used in evaluation mode."""

    mean: Any
    var: Any


class _Window(NamedTuple):
    """The open window's pooled count, mean, M2 and number of calls."""

    count: Any
    mean: Any
    m2: Any
    step: Any


# ---------------------------------------------------------------------------------------------
# Arithmetic shared by the linen and NNX layers
# ---------------------------------------------------------------------------------------------


def _accumulator_dtype() -> jnp.dtype:
    """Float32, or float64 when ``jax_enable_x64`` is on."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def _check_config(accum_steps: int | None, momentum: float, epsilon: float = 0.0) -> None:
    """Rejects an ``accum_steps`` that is neither None nor an int in [1, 2**31), a momentum
    outside [0, 1] and an epsilon that is negative or not finite (bools and strings too)."""
    steps = accum_steps
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps < 2**31
    ):
        raise ValueError(f"accum_steps must be None or an int in [1, 2**31), got {steps!r}.")
    for name, value in (("momentum", momentum), ("epsilon", epsilon)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {value!r}.")
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must lie in [0, 1], got {momentum!r}.")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}.")


def _canonical_axes(ndim: int, axes: Axes) -> tuple[int, ...]:
    """Returns sorted, deduplicated, non-negative axes, checking they fit ``ndim``."""
    items = tuple(axes) if isinstance(axes, Iterable) else (axes,)
    for axis in items:
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for an input of rank {ndim}.")
    return tuple(sorted({axis % ndim for axis in items}))


def _check_input(x: Array, mask: Array | None) -> None:
    """Rejects complex inputs and masks that do not broadcast to ``x``."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"AccumBatchNorm needs a real floating-point input, got {x.dtype}.")
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


def _stats_dtype(dtype: Dtype | None, x_dtype: Any, force_float32: bool) -> jnp.dtype:
    """The dtype of the normalizing statistics, as ``BatchNorm`` picks it."""
    chosen = jnp.dtype(dtype if dtype is not None else x_dtype)
    return jnp.promote_types(chosen, jnp.float32) if force_float32 else chosen


def _empty_window(shape: tuple[int, ...], dtype: Any = None) -> _Window:
    """Zero accumulators (constants, so they are replicated under ``shard_map``)."""
    dtype = _accumulator_dtype() if dtype is None else dtype
    count, mean, m2 = (jnp.zeros(shape, dtype) for _ in range(3))  # distinct buffers
    return _Window(count, mean, m2, jnp.zeros((), jnp.int32))


def _compute_moments(
    x: Array,
    mask: Array | None,
    reduction_axes: tuple[int, ...],
    dtype: Any,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
) -> _Moments:
    """Count, mean and population variance of ``x``, all-reduced over ``axis_name``.

    Sums are taken in at least float32 (and at least ``dtype``), counts in the accumulator
    dtype. One all-reduce of ``(count, sum, sum of squares)`` serves the fast variance
    ``E[x^2] - E[x]^2`` (clipped at 0, as in Flax); the centred variance needs a second.
    """
    x = x.astype(jnp.promote_types(dtype, jnp.float32))
    feature_shape = tuple(d for i, d in enumerate(x.shape) if i not in reduction_axes)
    where = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    if where is None:
        n_local = math.prod(x.shape[i] for i in reduction_axes)
        count = jnp.full(feature_shape, n_local, _accumulator_dtype())
    else:
        count = jnp.sum(where, reduction_axes, dtype=_accumulator_dtype())

    def all_sum(tree: Any) -> Any:
        if axis_name is None:
            return tree
        return lax.psum(tree, axis_name, axis_index_groups=axis_index_groups)

    def local_sum(values: Array) -> Array:
        return jnp.sum(values, reduction_axes, where=where)

    if use_fast_variance:
        count, s1, s2 = all_sum((count, local_sum(x), local_sum(lax.square(x))))
        denom = jnp.maximum(count, 1).astype(x.dtype)
        mean = s1 / denom
        var = jnp.maximum(0.0, s2 / denom - lax.square(mean))
    else:
        count, s1 = all_sum((count, local_sum(x)))
        denom = jnp.maximum(count, 1).astype(x.dtype)
        mean = s1 / denom
        centred = lax.square(x - jnp.expand_dims(mean, reduction_axes))
        var = all_sum(local_sum(centred)) / denom
    return _Moments(count, mean, var)


def _normalize(
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

    ``mean``, ``var``, ``scale`` and ``bias`` are per-feature arrays (``None`` skips the
    scale or bias); the result dtype is picked from ``x``, the params and ``dtype`` as in
    Flax's ``BatchNorm``, with the same operations in the same order.
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


def _chan_merge(
    n_a: Array, mean_a: Array, m2_a: Array, n_b: Array, mean_b: Array, m2_b: Array
) -> tuple[Array, Array, Array]:
    """Merges two (count, mean, M2) summaries (Chan, Golub & LeVeque 1979).

    ``M2`` is the sum of squared deviations from the mean. The ``delta**2`` term carries
    the spread between the two means. Empty summaries (count 0) merge to the other one.
    """
    n = n_a + n_b
    w_b = n_b / jnp.maximum(n, 1)  # n_b / n, and 0 when both are empty
    delta = mean_b - mean_a
    return n, mean_a + delta * w_b, m2_a + m2_b + lax.square(delta) * n_a * w_b


def _ema(old: Array, new: Array, momentum: Any, update: Array) -> Array:
    """``momentum * old + (1 - momentum) * new`` where ``update``, else ``old``."""
    blended = momentum * old + (1 - momentum) * new.astype(old.dtype)
    return jnp.where(update, blended.astype(old.dtype), old)


def _accumulate(
    running: _Running,
    window: _Window,
    moments: _Moments,
    momentum: float,
    accum_steps: int | None,
) -> tuple[_Running, _Window]:
    """Merges one call's ``moments`` into the window.

    With an int ``accum_steps`` the window closes on its ``accum_steps``-th call: the
    running averages move towards the pooled (population) statistics, where the window
    holds any element, and the accumulators are reset. With ``None`` only the window
    changes; :func:`close_batch_norm_windows` closes it.
    """
    dtype = window.count.dtype
    n_b, mean_b, var_b = (jnp.asarray(v, dtype) for v in moments)
    n, mean, m2 = _chan_merge(window.count, window.mean, window.m2, n_b, mean_b, var_b * n_b)
    step = window.step + 1
    if accum_steps is None:
        return running, _Window(n, mean, m2, step.astype(jnp.int32))
    # A window holding one contribution pools to its own variance; taking it directly
    # avoids the (var * n) / n round trip, so accum_steps=1 matches BatchNorm bit for bit.
    pooled_var = jnp.where(window.count == 0, var_b, m2 / jnp.maximum(n, 1))
    closes = step >= accum_steps
    update = jnp.logical_and(closes, n > 0)
    new_running = _Running(
        _ema(running.mean, mean, momentum, update), _ema(running.var, pooled_var, momentum, update)
    )
    new_window = _Window(
        jnp.where(closes, jnp.zeros_like(n), n),
        jnp.where(closes, jnp.zeros_like(mean), mean),
        jnp.where(closes, jnp.zeros_like(m2), m2),
        jnp.where(closes, 0, step).astype(jnp.int32),
    )
    return new_running, new_window


def _close(
    running: _Running, window: _Window, momentum: Array, apply: Array
) -> tuple[_Running, _Window]:
    """Closes a step-driven window: EMA update where ``apply`` and non-empty; reset."""
    update = jnp.logical_and(apply, window.count > 0)
    var = window.m2 / jnp.maximum(window.count, 1)
    new_running = _Running(
        _ema(running.mean, window.mean, momentum, update), _ema(running.var, var, momentum, update)
    )
    return new_running, _empty_window(window.count.shape, window.count.dtype)


def _pool_windows(shifts: list[Array], windows: list[_Window], axis_name: str) -> list[_Window]:
    """Pools every layer's window across ``axis_name`` with a single ``psum``.

    Each window is summarized by shifted sums ``(n, n * (mean - s), M2 + n * (mean - s)^2)``
    with a shift ``s`` equal on every device (the running mean), so they add exactly; all
    layers' sums travel in one flat array, i.e. one all-reduce.
    """
    parts: list[Array] = []
    for shift, window in zip(shifts, windows, strict=True):
        delta = window.mean - shift.astype(window.mean.dtype)
        parts += [window.count, window.count * delta, window.m2 + window.count * lax.square(delta)]
    dtype = jnp.result_type(*parts)
    flat = lax.psum(jnp.concatenate([p.astype(dtype).ravel() for p in parts]), axis_name)
    sums, offset = [], 0
    for part in parts:
        sums.append(flat[offset : offset + part.size].reshape(part.shape).astype(part.dtype))
        offset += part.size
    pooled = []
    for i, (shift, window) in enumerate(zip(shifts, windows, strict=True)):
        count, s1, s2 = sums[3 * i : 3 * i + 3]
        offset_mean = s1 / jnp.maximum(count, 1)
        mean = shift.astype(offset_mean.dtype) + offset_mean
        pooled.append(_Window(count, mean, jnp.maximum(s2 - s1 * offset_mean, 0), window.step))
    return pooled


# ---------------------------------------------------------------------------------------------
# The linen layer
# ---------------------------------------------------------------------------------------------


class AccumBatchNorm(nn.Module):
    """BatchNorm whose running statistics are updated once per accumulation window.

    In training mode every call normalizes its input with that input's own statistics,
    exactly like :class:`flax.linen.BatchNorm`, so the forward pass and the gradients are
    unchanged. The statistics are also merged into accumulators in ``batch_stats``; when
    the window closes the running averages are updated once with the pooled (population)
    mean and variance of all elements seen in the window, and the accumulators are
    reset::

      mean = momentum * mean + (1 - momentum) * pooled_mean
      var = momentum * var + (1 - momentum) * pooled_var

    After a window of ``K`` microbatches, ``mean`` and ``var`` equal those of a
    ``BatchNorm`` applied once to the concatenated batch.

    Who closes the window:

    - ``accum_steps=None`` (default, step-driven): the train step, by calling
      :func:`close_batch_norm_windows` on the ``batch_stats`` once per optimizer step.
      The layer never touches ``mean``/``var``; it also keeps its ``momentum`` in
      ``batch_stats`` (a float32 scalar, rewritten from the attribute on every training
      call) so that the close is a pure function of the statistics. A layer called ``c``
      times per forward pass simply pools all ``c * K`` inputs.
    - ``accum_steps=K`` (self-closing): the layer, on every ``K``-th training-mode call.
      Calls, not optimizer steps, advance the window, so a layer called ``c`` times per
      forward pass needs ``accum_steps = K * c``. With ``accum_steps=1`` the outputs and
      the ``mean``/``var``/``scale``/``bias`` variables match ``BatchNorm``.

    The ``batch_stats`` collection holds, per layer, ``mean`` and ``var`` (as in
    ``BatchNorm``) plus ``acc_count``, ``acc_mean`` and ``acc_m2`` (per-feature count,
    mean and sum of squared deviations of the open window, float32, or float64 with
    ``jax_enable_x64``), ``acc_step`` (int32 scalar: training calls in the open window)
    and, step-driven only, ``momentum``. Window decisions use ``jnp.where``, so the layer
    works under ``jit``, ``scan``, ``pmap`` and ``shard_map``; thread ``batch_stats``
    through the loop carry.

    With ``axis_name``, counts and sums are all-reduced once per call, so the statistics
    are those of the global microbatch, weighted by each device's unmasked count.
    ``BatchNorm`` instead averages per-device means, which differs only when devices see
    different numbers of unmasked elements. Without ``axis_name`` each device normalizes
    with its own statistics and, step-driven, ``close_batch_norm_windows(..., axis_name)``
    pools the windows across devices once per step. A microbatch whose elements are all
    masked contributes nothing (and its output stays finite); a window with no unmasked
    element leaves the running statistics unchanged. During ``init`` nothing is updated.

    Example::

      >>> import jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm, close_batch_norm_windows
      >>> x = jnp.arange(12.0).reshape(6, 2)
      >>> bn = AccumBatchNorm(momentum=0.5)  # step-driven
      >>> variables = bn.init(jax.random.key(0), x, use_running_average=False)
      >>> sorted(variables["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'momentum', 'var']
      >>> stats = variables["batch_stats"]
      >>> for micro in (x[:3], x[3:]):
      ...     _, upd = bn.apply(
      ...         {**variables, "batch_stats": stats}, micro,
      ...         use_running_average=False, mutable=["batch_stats"])
      ...     stats = upd["batch_stats"]
      >>> stats["mean"], stats["acc_step"]  # pooled, not applied yet
      (Array([0., 0.], dtype=float32), Array(2, dtype=int32))
      >>> stats = close_batch_norm_windows(stats, apply=True)
      >>> stats["mean"]  # 0.5 * the mean of all six rows
      Array([2.5, 3. ], dtype=float32)

      Self-closing, for use without a train step:

      >>> bn = AccumBatchNorm(accum_steps=2, momentum=0.9)
      >>> variables = bn.init(jax.random.key(0), x, use_running_average=False)
      >>> stats = variables["batch_stats"]
      >>> for micro in (x[:3], x[3:]):
      ...     _, upd = bn.apply(
      ...         {**variables, "batch_stats": stats}, micro,
      ...         use_running_average=False, mutable=["batch_stats"])
      ...     stats = upd["batch_stats"]
      >>> stats["mean"]  # 0.1 * the mean of all six rows
      Array([0.5, 0.6], dtype=float32)

    References:
      Ioffe & Szegedy (2015) for batch normalization; Chan, Golub & LeVeque (1979) for
      the merge; andreped/GradientAccumulator's ``AccumBatchNormalization`` for the
      averaged-variance behaviour this replaces (see the module docstring).

    Attributes:
      accum_steps: ``None`` (the train step closes the window with
        :func:`close_batch_norm_windows`) or the number of training-mode calls per
        window (an int >= 1; the layer closes it).
      use_running_average: if True, normalize with the stored ``mean``/``var`` and
        update nothing.
      axis: the feature axis or axes; the statistics reduce over all other axes.
      momentum: decay rate of the running averages, in ``[0, 1]``.
      epsilon: small float added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: inferred from input and params).
      param_dtype: the dtype of ``scale`` and ``bias`` (default: float32).
      use_bias: if True, add the learned ``bias``.
      use_scale: if True, multiply by the learned ``scale``.
      bias_init: initializer for ``bias`` (default zeros).
      scale_init: initializer for ``scale`` (default ones).
      axis_name: the ``pmap``/``shard_map`` axis name over which to pool statistics.
      axis_index_groups: groups of indices within ``axis_name`` to pool separately.
      use_fast_variance: if True, compute the variance as ``E[x^2] - E[x]^2`` in one
        pass; otherwise centre first (one more all-reduce with ``axis_name``).
      force_float32_reductions: if True, statistics are computed and stored in at least
        float32; if False, the running ``mean``/``var`` use ``param_dtype``. Sums and
        accumulators are at least float32 either way.
    """

    accum_steps: int | None = None
    use_running_average: bool | None = None
    axis: int | tuple[int, ...] = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = initializers.zeros
    scale_init: Initializer = initializers.ones
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    def __post_init__(self) -> None:
        """Validates the hyperparameters before the module is used."""
        _check_config(self.accum_steps, self.momentum, self.epsilon)
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        x: Array,
        use_running_average: bool | None = None,
        *,
        mask: Array | None = None,
    ) -> Array:
        """Normalizes ``x`` and, in training mode, accumulates its statistics.

        Args:
          x: the input to normalize.
          use_running_average: if True, use the stored statistics and update nothing.
            Give it here or as the attribute, not both (as in ``BatchNorm``).
          mask: optional boolean array broadcastable to ``x``; only True positions count
            towards the statistics.

        Returns:
          The normalized input, with the same shape as ``x``.
        """
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        x = jnp.asarray(x)
        _check_input(x, mask)
        feature_axes = _canonical_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = tuple(x.shape[i] for i in feature_axes)

        running = self._running_stats(feature_shape)
        if use_running_average:
            if self.is_initializing():
                self._window_stats(feature_shape)  # declared so the layout is complete
            mean, var = running.mean.value, running.var.value
            if not self.force_float32_reductions:
                mean, var = jnp.asarray(mean, self.param_dtype), jnp.asarray(var, self.param_dtype)
        else:
            window, momentum = self._window_stats(feature_shape)
            stats_dtype = _stats_dtype(self.dtype, x.dtype, self.force_float32_reductions)
            moments = _compute_moments(
                x,
                mask,
                reduction_axes,
                stats_dtype,
                # During init the named axis may not exist, as in BatchNorm.
                None if self.is_initializing() else self.axis_name,
                self.axis_index_groups,
                self.use_fast_variance,
            )
            mean, var = moments.mean.astype(stats_dtype), moments.var.astype(stats_dtype)
            if not self.is_initializing():
                self._update(running, window, moments)
                if momentum is not None:
                    momentum.value = jnp.asarray(self.momentum, jnp.float32)
        scale = self._param("scale", self.scale_init, feature_shape) if self.use_scale else None
        bias = self._param("bias", self.bias_init, feature_shape) if self.use_bias else None
        return _normalize(x, mean, var, scale, bias, reduction_axes, self.epsilon, self.dtype)

    def _running_stats(self, feature_shape: tuple[int, ...]) -> _Running:
        """Declares the running ``mean`` (zeros) and ``var`` (ones), as ``BatchNorm``."""
        dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        mean = self.variable("batch_stats", "mean", jnp.zeros, feature_shape, dtype)
        var = self.variable("batch_stats", "var", jnp.ones, feature_shape, dtype)
        return _Running(mean, var)

    def _window_stats(self, feature_shape: tuple[int, ...]) -> tuple[_Window, Any]:
        """Declares the zero accumulators and, step-driven, the ``momentum`` scalar."""
        dtype = _accumulator_dtype()
        count, mean, m2 = (
            self.variable("batch_stats", name, jnp.zeros, feature_shape, dtype)
            for name in ACCUMULATOR_NAMES[:3]
        )
        step = self.variable("batch_stats", "acc_step", jnp.zeros, (), jnp.int32)
        momentum = None
        if self.accum_steps is None:
            momentum = self.variable(
                "batch_stats", _MOMENTUM, lambda: jnp.asarray(self.momentum, jnp.float32)
            )
        return _Window(count, mean, m2, step), momentum

    def _update(self, running: _Running, window: _Window, moments: _Moments) -> None:
        """Writes the result of :func:`_accumulate` back to the variables."""
        new_running, new_window = _accumulate(
            _Running(*(v.value for v in running)),
            _Window(*(v.value for v in window)),
            moments,
            self.momentum,
            self.accum_steps,
        )
        for variable, value in zip((*running, *window), (*new_running, *new_window), strict=True):
            variable.value = value

    def _param(self, name: str, init: Initializer, shape: tuple[int, ...]) -> Array:
        """Declares a per-feature parameter (cast to ``param_dtype`` if not float32-forced)."""
        value = self.param(name, init, shape, self.param_dtype)
        if not self.force_float32_reductions:
            value = jnp.asarray(value, self.param_dtype)
        return value


# ---------------------------------------------------------------------------------------------
# Closing step-driven windows
# ---------------------------------------------------------------------------------------------


def _unwrap(value: Any) -> Array:
    """The array held by a leaf (an array, or an ``nnx.Variable`` in an ``nnx.State``)."""
    return jnp.asarray(value.get_value() if isinstance(value, nnx.Variable) else value)


def _is_step_driven(node: Any) -> bool:
    """Whether ``node`` is one step-driven layer's statistics (all of its seven leaves)."""
    return isinstance(node, Mapping) and all(
        key in node and not isinstance(node[key], Mapping) for key in _STEP_DRIVEN_NAMES
    )


def _replace_leaves(node: Mapping[str, Any], values: Mapping[str, Array]) -> Any:
    """A copy of ``node`` (same mapping type, ``nnx.Variable`` leaves kept) with ``values``."""
    new = {
        key: node[key].replace(value) if isinstance(node[key], nnx.Variable) else value
        for key, value in values.items()
    }
    mapping_type: Any = type(node)  # dict, FrozenDict or nnx.State
    return mapping_type({**node, **new})


def close_batch_norm_windows(stats_tree: _Tree, apply: Any, axis_name: str | None = None) -> _Tree:
    """Closes the windows of every step-driven ``AccumBatchNorm`` layer in ``stats_tree``.

    A step-driven layer (``accum_steps=None``, linen or NNX) is recognized by its
    statistics: a mapping holding ``mean``, ``var``, ``acc_count``, ``acc_mean``,
    ``acc_m2``, ``acc_step`` and ``momentum``. For each one:

    1. with ``axis_name``, the windows are pooled across devices: every layer's count and
       shifted sums ``n * (mean - s)`` and ``M2 + n * (mean - s)**2`` (``s`` the running
       mean, equal on every device) travel in one ``psum``, which gives the global count,
       mean and ``M2`` exactly up to rounding (Chan, Golub & LeVeque 1979);
    2. where ``apply`` is True and the pooled count is positive,
       ``mean = momentum * mean + (1 - momentum) * pooled_mean`` and likewise ``var``
       with the pooled population variance ``M2 / count`` (Ioffe & Szegedy 2015);
    3. ``acc_*`` are reset to zero, whether or not ``apply`` is True.

    The stored ``momentum`` is float32, so ``1 - momentum`` may differ from the Python
    float arithmetic of ``BatchNorm`` by float32 rounding (about 1e-7 relative).

    Everything else, including self-closing layers (no ``momentum`` leaf), is returned
    unchanged. Call it once per optimizer step, after the last microbatch, with
    ``apply`` telling whether the optimizer applied its update. Pooling layers that
    already all-reduce per call (``axis_name`` set on the layer) is harmless: their
    windows are equal on every device and pool to the same statistics.

    Args:
      stats_tree: a pytree of nested mappings holding the statistics: the
        ``batch_stats`` collection, a ``{"batch_stats": ...}`` model state (dicts or
        ``FrozenDict``), ``nnx.state(model, nnx.BatchStat)`` or its pure dict.
      apply: a bool scalar (may be traced) saying whether to update ``mean``/``var``.
      axis_name: the ``pmap``/``shard_map`` axis to pool the windows over, or None.

    Returns:
      A tree of the same structure and types with the updated statistics.

    Raises:
      ValueError: if ``apply`` is not a scalar.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm, close_batch_norm_windows
      >>> bn = AccumBatchNorm(momentum=0.5)
      >>> variables = bn.init(jax.random.key(0), jnp.ones((2, 1)), use_running_average=False)
      >>> _, state = bn.apply(variables, jnp.array([[1.0], [3.0]]),
      ...                     use_running_average=False, mutable=["batch_stats"])
      >>> skipped = close_batch_norm_windows(state, apply=False)
      >>> skipped["batch_stats"]["mean"], skipped["batch_stats"]["acc_count"]
      (Array([0.], dtype=float32), Array([0.], dtype=float32))
      >>> closed = jax.jit(close_batch_norm_windows)(state, jnp.array(True))
      >>> closed["batch_stats"]["mean"], closed["batch_stats"]["var"]
      (Array([1.], dtype=float32), Array([1.], dtype=float32))

    References:
      Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing
      sample variances", 1979; Ioffe & Szegedy, "Batch Normalization", ICML 2015.
    """
    apply = jnp.asarray(apply)
    if apply.shape != ():
        raise ValueError(f"apply must be a bool scalar, got shape {apply.shape}.")
    nodes, treedef = jax.tree.flatten(stats_tree, is_leaf=_is_step_driven)
    where = [i for i, node in enumerate(nodes) if _is_step_driven(node)]
    running = [_Running(*(_unwrap(nodes[i][k]) for k in ("mean", "var"))) for i in where]
    windows = [_Window(*(_unwrap(nodes[i][k]) for k in ACCUMULATOR_NAMES)) for i in where]
    if axis_name is not None and where:
        windows = _pool_windows([r.mean for r in running], windows, axis_name)
    for i, old, window in zip(where, running, windows, strict=True):
        new_running, new_window = _close(old, window, _unwrap(nodes[i][_MOMENTUM]), apply)
        names = ("mean", "var", *ACCUMULATOR_NAMES)
        values = dict(zip(names, (*new_running, *new_window), strict=True))
        nodes[i] = _replace_leaves(nodes[i], values)
    return jax.tree.unflatten(treedef, nodes)


# ---------------------------------------------------------------------------------------------
# Converting BatchNorm variables
# ---------------------------------------------------------------------------------------------


def _is_batch_norm_stats(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is one layer's ``batch_stats`` (array leaves ``mean`` and ``var``)."""
    return all(key in node and not isinstance(node[key], Mapping) for key in ("mean", "var"))


def _where(path: tuple[Any, ...]) -> str:
    """A readable ``batch_stats/...`` path."""
    return "/".join(["batch_stats", *map(str, path)])


def _layer_paths(node: Mapping[str, Any], path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of all BatchNorm layers (``mean`` and ``var`` leaves) in a ``batch_stats``."""
    if _is_batch_norm_stats(node):
        return [path]
    found = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += _layer_paths(value, (*path, key))
    return found


def _auto_named(layers: list[tuple[Any, ...]], parent: tuple[Any, ...]) -> list[str]:
    """Keys of the automatically named (Accum)BatchNorm layers directly under ``parent``."""
    keys = [p[-1] for p in layers if p and p[:-1] == parent]
    return [k for k in keys if isinstance(k, str) and _AUTO_NAME.fullmatch(k)]


def _index(key: str) -> int:
    """The index in an automatic name ``BatchNorm_<i>``."""
    return int(key.rsplit("_", 1)[1])


def _default_renames(layers: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, str]]:
    """``BatchNorm_<i>`` -> ``AccumBatchNorm_<i>`` in every parent (a full swap)."""
    renames: dict[tuple[Any, ...], dict[str, str]] = {}
    for parent in dict.fromkeys(p[:-1] for p in layers if p):
        keys = _auto_named(layers, parent)
        if any(k.startswith("Accum") for k in keys) and any(k.startswith("Batch") for k in keys):
            raise ValueError(
                f"{_where(parent)} holds both BatchNorm_* and AccumBatchNorm_* layers {keys}; "
                "pass target= (the new model's init variables) to map them."
            )
        renames[parent] = {k: f"Accum{k}" for k in keys if k.startswith("Batch")}
    return renames


def _target_renames(
    layers: list[tuple[Any, ...]], target_layers: list[tuple[Any, ...]]
) -> dict[tuple[Any, ...], dict[str, str]]:
    """Maps auto-named layers to the target's, parent by parent, in creation order."""
    renames: dict[tuple[Any, ...], dict[str, str]] = {}
    for parent in dict.fromkeys(p[:-1] for p in layers + target_layers if p):
        source, wanted = _auto_named(layers, parent), _auto_named(target_layers, parent)
        if sorted(source) == sorted(wanted):
            continue
        if len(source) != len(wanted) or any(k.startswith("Accum") for k in source):
            raise ValueError(
                f"{_where(parent)}: cannot match the unnamed norm layers of variables "
                f"{sorted(source)} with those of target {wanted}: the models differ."
            )
        for family in ("BatchNorm_", "AccumBatchNorm_"):
            indices = [_index(k) for k in wanted if k.startswith(family)]
            if indices != list(range(len(indices))):
                raise ValueError(
                    f"{_where(parent)}: target's {family}* keys {wanted} are not in creation "
                    "order; pass the dict returned by an eager model.init, unsorted."
                )
        renames[parent] = dict(zip(sorted(source, key=_index), wanted, strict=True))
    return renames


def _renamed(
    node: Any, renames: Mapping[tuple[Any, ...], Mapping[str, str]], path: tuple[Any, ...] = ()
) -> Any:
    """A plain-dict copy of ``node`` with keys renamed per parent path."""
    if not isinstance(node, Mapping):
        return node
    names = renames.get(path, {})
    return {
        names.get(key, key): _renamed(value, renames, (*path, key)) for key, value in node.items()
    }


def _with_accumulators(
    node: Mapping[str, Any], momentum: float | None, path: tuple[Any, ...] = ()
) -> dict[str, Any]:
    """Copies a ``batch_stats`` subtree, adding missing accumulators (and ``momentum``)."""
    if _is_batch_norm_stats(node):
        mean, var = jnp.asarray(node["mean"]), jnp.asarray(node["var"])
        if mean.shape != var.shape:
            raise ValueError(
                f"{_where(path)}: mean {mean.shape} and var {var.shape} shapes differ."
            )
        fresh: dict[str, Any] = dict(zip(ACCUMULATOR_NAMES, _empty_window(mean.shape), strict=True))
        if momentum is not None:
            fresh[_MOMENTUM] = jnp.asarray(momentum, jnp.float32)
        return {**fresh, **node}
    return {
        key: _with_accumulators(value, momentum, (*path, key))
        if isinstance(value, Mapping)
        else value
        for key, value in node.items()
    }


def _overlay(source: Any, target: Any, path: str, fill: tuple[str, ...]) -> dict[str, Any]:
    """``target``'s structure with ``source``'s leaves; only ``fill`` names may be missing."""
    extra = [key for key in source if key not in target]
    if extra:
        raise ValueError(f"{path}/{extra[0]} is in variables but not in target.")
    out = {}
    for key, want in target.items():
        where = f"{path}/{key}"
        have = source.get(key)
        if key not in source:
            if key not in fill:
                raise ValueError(f"{where} is in target but not in variables.")
            out[key] = want
        elif isinstance(want, Mapping) != isinstance(have, Mapping):
            raise ValueError(f"{where} is a layer in one tree and a leaf in the other.")
        elif isinstance(want, Mapping):
            out[key] = _overlay(have, want, where, fill)
        elif jnp.shape(have) != jnp.shape(want):
            raise ValueError(
                f"{where}: shape {jnp.shape(have)} in variables, {jnp.shape(want)} in target."
            )
        else:
            out[key] = have
    return out


def _batch_stats(variables: Any, name: str) -> Mapping[str, Any]:
    """The ``batch_stats`` collection of ``variables``, checked."""
    if not isinstance(variables, Mapping) or "batch_stats" not in variables:
        raise ValueError(f"{name} must be a mapping with a 'batch_stats' collection.")
    batch_stats = variables["batch_stats"]
    if not isinstance(batch_stats, Mapping):
        raise ValueError(f"{name}['batch_stats'] must be a mapping.")
    return batch_stats


def convert_batch_norm_variables(
    variables: Mapping[str, Any],
    *,
    momentum: float | None = 0.99,
    target: Mapping[str, Any] | None = None,
) -> Mapping[str, Any]:
    """Converts a ``BatchNorm`` model's variables for the same model with ``AccumBatchNorm``.

    Every ``batch_stats`` subtree that holds ``mean`` and ``var`` arrays (one
    :class:`flax.linen.BatchNorm` layer) gets zeroed accumulators ``acc_count``,
    ``acc_mean`` and ``acc_m2`` (shaped like ``mean``, float32 or float64 with
    ``jax_enable_x64``) and an int32 ``acc_step``; ``scale``, ``bias``, ``mean``, ``var``
    and every other collection keep their values. Layer names:

    - explicit names are kept (``nn.BatchNorm(name="bn")`` -> ``AccumBatchNorm(name="bn")``);
    - automatic names ``BatchNorm_<i>`` become ``AccumBatchNorm_<i>`` in both ``params``
      and ``batch_stats``. Flax numbers unnamed submodules per class within each parent, so
      this is exact when every ``BatchNorm`` of the model is swapped.
    - When only some are swapped, pass ``target``: the new model's variables from an
      eager ``model.init`` (its key order is the creation order; ``jax.jit(model.init)``
      sorts keys). Within each parent the unnamed layers are matched in creation order,
      the result gets ``target``'s ``params`` and ``batch_stats`` structure (missing
      accumulators and ``momentum`` come from ``target``), and any mismatch (layer
      counts, names, shapes) raises a ``ValueError``.

    Without ``target``, ``momentum`` decides the layout: a float adds the float32 scalar
    ``momentum`` that step-driven layers (``accum_steps=None``, the default) keep in
    ``batch_stats``; ``None`` adds none, for self-closing layers (an int ``accum_steps``).
    A step-driven layer rewrites the scalar from its own ``momentum`` attribute on every
    training call, so its value only matters for a window closed before any call (an
    empty window, which changes nothing). With ``target``, ``momentum`` is not used.
    Entries already present are kept, so converting twice is harmless. The input is not
    modified.

    Args:
      variables: the variables of a model built with ``nn.BatchNorm`` (a dict or a
        ``FrozenDict`` with a ``batch_stats`` collection).
      momentum: the ``momentum`` scalar to add to each layer, or None for none.
      target: optional variables of the new model, to map a partial swap exactly.

    Returns:
      A new variables mapping of the same kind (``FrozenDict`` in, ``FrozenDict`` out).

    Raises:
      ValueError: if there is no ``batch_stats`` collection, it holds no layer with
        ``mean`` and ``var``, a layer's ``mean`` and ``var`` shapes differ, automatic
        names are ambiguous without ``target``, or ``variables`` cannot be matched with
        ``target``.

    Example::

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm, convert_batch_norm_variables
      >>> x = jnp.ones((4, 3))
      >>> old = nn.BatchNorm(use_running_average=True).init(jax.random.key(0), x)
      >>> new = convert_batch_norm_variables(old)
      >>> sorted(new["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'momentum', 'var']
      >>> y = AccumBatchNorm(use_running_average=True).apply(new, x)
      >>> sorted(convert_batch_norm_variables(old, momentum=None)["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'var']
    """
    batch_stats = _batch_stats(variables, "variables")
    layers = _layer_paths(batch_stats)
    if not layers:
        raise ValueError("variables['batch_stats'] holds no BatchNorm layer ('mean' and 'var').")
    if momentum is not None:
        _check_config(None, momentum)
    if target is None:
        renames = _default_renames(layers)
    else:
        renames = _target_renames(layers, _layer_paths(_batch_stats(target, "target")))
    converted = {
        key: _renamed(value, renames) if key in ("params", "batch_stats") else value
        for key, value in variables.items()
    }
    if target is None:
        converted["batch_stats"] = _with_accumulators(converted["batch_stats"], momentum)
    else:
        fills = {"params": (), "batch_stats": (*ACCUMULATOR_NAMES, _MOMENTUM)}
        for name, fill in fills.items():
            converted[name] = _overlay(converted.get(name, {}), target.get(name, {}), name, fill)
    return FrozenDict(converted) if isinstance(variables, FrozenDict) else converted
