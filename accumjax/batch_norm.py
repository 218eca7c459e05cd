"""Batch normalization whose running statistics see the whole accumulated batch.

With gradient accumulation a logical batch of ``K * B`` examples is processed as ``K``
microbatches of ``B``. A plain :class:`flax.linen.BatchNorm` then updates its running
mean and variance ``K`` times per optimizer step from small, noisy microbatches.
:class:`AccumBatchNorm` normalizes each microbatch exactly as ``BatchNorm`` does, but
pools the per-microbatch count, mean and sum of squared deviations (``M2``) with the
parallel merge of Chan, Golub & LeVeque (1979), and updates the running statistics once
per window with the statistics of the whole accumulated batch.

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
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.core import FrozenDict
from flax.linen import dtypes
from flax.typing import Array, Axes, Dtype, Initializer
from jax import lax
from jax.nn import initializers

__all__ = ["ACCUMULATOR_NAMES", "AccumBatchNorm", "convert_batch_norm_variables"]

#: Names of the accumulator entries that :class:`AccumBatchNorm` keeps in ``batch_stats``
#: next to ``mean`` and ``var``.
ACCUMULATOR_NAMES: tuple[str, ...] = ("acc_count", "acc_mean", "acc_m2", "acc_step")


class _Moments(NamedTuple):
    """Per-feature statistics of one (possibly cross-device) microbatch."""

    count: Array
    mean: Array
    var: Array


class _Accumulators(NamedTuple):
    """The ``batch_stats`` variables holding the open window's pooled statistics."""

    count: Any
    mean: Any
    m2: Any
    step: Any


def _accumulator_dtype() -> jnp.dtype:
    """Float32, or float64 when ``jax_enable_x64`` is on."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


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


class AccumBatchNorm(nn.Module):
    """BatchNorm whose running statistics are updated once per accumulation window.

    In training mode every call normalizes its input with that input's own statistics,
    exactly like :class:`flax.linen.BatchNorm`, so the forward pass and the gradients are
    unchanged. The statistics are also merged into accumulators in ``batch_stats``; on
    every ``accum_steps``-th call the running averages are updated once with the pooled
    (population) mean and variance of all elements seen in the window, and the
    accumulators are reset::

      mean = momentum * mean + (1 - momentum) * pooled_mean
      var = momentum * var + (1 - momentum) * pooled_var

    After a window of ``K`` microbatches, ``mean`` and ``var`` equal those of a
    ``BatchNorm`` applied once to the concatenated batch. With ``accum_steps=1`` the
    outputs and the ``mean``/``var``/``scale``/``bias`` variables match ``BatchNorm``.

    The ``batch_stats`` collection holds, per layer, ``mean`` and ``var`` (as in
    ``BatchNorm``) plus ``acc_count``, ``acc_mean`` and ``acc_m2`` (per-feature count,
    mean and sum of squared deviations of the open window, float32, or float64 with
    ``jax_enable_x64``) and ``acc_step`` (int32 scalar: calls made in the open window).
    The window decision uses ``jnp.where``, so the layer works under ``jit``, ``scan``,
    ``pmap`` and ``shard_map``; thread ``batch_stats`` through the loop carry.

    Calls, not optimizer steps, advance the window: every training-mode call is one
    microbatch contribution. A model that calls the same instance ``c`` times per forward
    pass (a shared layer) pools all ``c`` inputs and must set
    ``accum_steps = K * c`` to close the window once per ``K`` microbatches.

    With ``axis_name``, counts and sums are all-reduced once per call, so the statistics
    are those of the global microbatch, weighted by each device's unmasked count.
    ``BatchNorm`` instead averages per-device means, which differs only when devices see
    different numbers of unmasked elements. A microbatch whose elements are all masked
    contributes nothing (and its output stays finite); a window with no unmasked element
    leaves the running statistics unchanged. During ``init`` nothing is updated.

    Example::

      >>> import jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm
      >>> bn = AccumBatchNorm(accum_steps=2, momentum=0.9)
      >>> x = jnp.arange(12.0).reshape(6, 2)
      >>> variables = bn.init(jax.random.key(0), x, use_running_average=False)
      >>> sorted(variables["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'var']
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
      accum_steps: number of training-mode calls per window (an int >= 1).
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

    accum_steps: int = 1
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
        steps = self.accum_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"accum_steps must be an int >= 1, got {steps!r}.")
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"momentum must lie in [0, 1], got {self.momentum!r}.")
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

        ra_mean, ra_var = self._running_stats(feature_shape)
        if use_running_average:
            if self.is_initializing():
                self._accumulators(feature_shape)  # declared so the layout is complete
            mean, var = ra_mean.value, ra_var.value
            if not self.force_float32_reductions:
                mean, var = jnp.asarray(mean, self.param_dtype), jnp.asarray(var, self.param_dtype)
        else:
            accumulators = self._accumulators(feature_shape)
            moments = self._moments(x, mask, reduction_axes, feature_shape)
            stats_dtype = self._stats_dtype(x)
            mean, var = moments.mean.astype(stats_dtype), moments.var.astype(stats_dtype)
            if not self.is_initializing():
                self._accumulate(ra_mean, ra_var, accumulators, moments)
        return self._normalize(x, mean, var, feature_axes, reduction_axes)

    def _stats_dtype(self, x: Array) -> jnp.dtype:
        """The dtype of the normalizing statistics, as ``BatchNorm`` picks it."""
        dtype = jnp.dtype(self.dtype if self.dtype is not None else x.dtype)
        return jnp.promote_types(dtype, jnp.float32) if self.force_float32_reductions else dtype

    def _running_stats(self, feature_shape: tuple[int, ...]) -> tuple[Any, Any]:
        """Declares the running ``mean`` (zeros) and ``var`` (ones), as ``BatchNorm``."""
        dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        mean = self.variable("batch_stats", "mean", jnp.zeros, feature_shape, dtype)
        var = self.variable("batch_stats", "var", jnp.ones, feature_shape, dtype)
        return mean, var

    def _accumulators(self, feature_shape: tuple[int, ...]) -> _Accumulators:
        """Declares the zero-initialized accumulators of the open window."""
        dtype = _accumulator_dtype()
        names = ACCUMULATOR_NAMES[:3]
        count, mean, m2 = (
            self.variable("batch_stats", name, jnp.zeros, feature_shape, dtype) for name in names
        )
        step = self.variable("batch_stats", "acc_step", jnp.zeros, (), jnp.int32)
        return _Accumulators(count, mean, m2, step)

    def _moments(
        self,
        x: Array,
        mask: Array | None,
        reduction_axes: tuple[int, ...],
        feature_shape: tuple[int, ...],
    ) -> _Moments:
        """Count, mean and population variance of ``x``, all-reduced over ``axis_name``.

        Sums are taken in at least float32 and counts in the accumulator dtype. One
        all-reduce of ``(count, sum, sum of squares)`` serves the fast variance; the
        centred variance needs a second one.
        """
        x = x.astype(jnp.promote_types(self._stats_dtype(x), jnp.float32))
        where = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
        if where is None:
            n_local = math.prod(x.shape[i] for i in reduction_axes)
            count = jnp.full(feature_shape, n_local, _accumulator_dtype())
        else:
            count = jnp.sum(where, reduction_axes, dtype=_accumulator_dtype())
        # During init the named axis may not exist, as in BatchNorm.
        axis_name = None if self.is_initializing() else self.axis_name

        def all_sum(tree: Any) -> Any:
            if axis_name is None:
                return tree
            return lax.psum(tree, axis_name, axis_index_groups=self.axis_index_groups)

        def local_sum(values: Array) -> Array:
            return jnp.sum(values, reduction_axes, where=where)

        if self.use_fast_variance:
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

    def _accumulate(self, ra_mean: Any, ra_var: Any, acc: _Accumulators, moments: _Moments) -> None:
        """Merges ``moments`` into the window; on its last call, updates the running stats."""
        dtype = acc.count.value.dtype
        n_b, mean_b, var_b = (jnp.asarray(v, dtype) for v in moments)
        n_a = acc.count.value
        n, mean, m2 = _chan_merge(n_a, acc.mean.value, acc.m2.value, n_b, mean_b, var_b * n_b)
        # A window holding one contribution pools to its own variance; taking it directly
        # avoids the (var * n) / n round trip, so accum_steps=1 matches BatchNorm bit for bit.
        pooled_var = jnp.where(n_a == 0, var_b, m2 / jnp.maximum(n, 1))
        step = acc.step.value + 1
        closes = step >= self.accum_steps
        update = jnp.logical_and(closes, n > 0)
        for running, pooled in ((ra_mean, mean), (ra_var, pooled_var)):
            old = running.value
            new = self.momentum * old + (1 - self.momentum) * pooled.astype(old.dtype)
            running.value = jnp.where(update, new, old)
        acc.count.value = jnp.where(closes, jnp.zeros_like(n), n)
        acc.mean.value = jnp.where(closes, jnp.zeros_like(mean), mean)
        acc.m2.value = jnp.where(closes, jnp.zeros_like(m2), m2)
        acc.step.value = jnp.where(closes, 0, step).astype(jnp.int32)

    def _normalize(
        self,
        x: Array,
        mean: Array,
        var: Array,
        feature_axes: tuple[int, ...],
        reduction_axes: tuple[int, ...],
    ) -> Array:
        """Applies ``(x - mean) / sqrt(var + eps) * scale + bias`` with broadcast stats."""
        param_shape = tuple(x.shape[i] for i in feature_axes)
        broadcast_shape = tuple(x.shape[i] if i in feature_axes else 1 for i in range(x.ndim))
        y = x - jnp.expand_dims(mean, reduction_axes)
        factor = lax.rsqrt(jnp.expand_dims(var, reduction_axes) + self.epsilon)
        inputs = [x]
        if self.use_scale:
            scale = self._param("scale", self.scale_init, param_shape, broadcast_shape)
            factor = factor * scale
            inputs.append(scale)
        y = y * factor
        if self.use_bias:
            bias = self._param("bias", self.bias_init, param_shape, broadcast_shape)
            y = y + bias
            inputs.append(bias)
        return jnp.asarray(y, dtypes.canonicalize_dtype(*inputs, dtype=self.dtype))

    def _param(
        self,
        name: str,
        init: Initializer,
        shape: tuple[int, ...],
        broadcast_shape: tuple[int, ...],
    ) -> Array:
        """Declares a per-feature parameter and reshapes it to broadcast against ``x``."""
        value = self.param(name, init, shape, self.param_dtype).reshape(broadcast_shape)
        if not self.force_float32_reductions:
            value = jnp.asarray(value, self.param_dtype)
        return value


def _is_batch_norm_stats(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is one layer's ``batch_stats`` (array leaves ``mean`` and ``var``)."""
    return all(key in node and not isinstance(node[key], Mapping) for key in ("mean", "var"))


def _with_accumulators(node: Mapping[str, Any], path: str) -> tuple[dict[str, Any], int]:
    """Copies a ``batch_stats`` subtree, adding missing accumulators; counts the layers."""
    if _is_batch_norm_stats(node):
        mean, var = jnp.asarray(node["mean"]), jnp.asarray(node["var"])
        if mean.shape != var.shape:
            raise ValueError(f"{path}: mean {mean.shape} and var {var.shape} shapes differ.")
        fresh = {name: jnp.zeros(mean.shape, _accumulator_dtype()) for name in ACCUMULATOR_NAMES}
        fresh["acc_step"] = jnp.zeros((), jnp.int32)
        return {**fresh, **node}, 1
    out: dict[str, Any] = {}
    layers = 0
    for key, value in node.items():
        if isinstance(value, Mapping):
            value, found = _with_accumulators(value, f"{path}/{key}")
            layers += found
        out[key] = value
    return out, layers


def convert_batch_norm_variables(variables: Mapping[str, Any]) -> Mapping[str, Any]:
    """Adds zeroed :class:`AccumBatchNorm` accumulators to a ``BatchNorm`` model's variables.

    Every ``batch_stats`` subtree that holds ``mean`` and ``var`` arrays (one
    :class:`flax.linen.BatchNorm` layer) gets ``acc_count``, ``acc_mean`` and ``acc_m2``
    (zeros shaped like ``mean``, float32 or float64 with ``jax_enable_x64``) and an int32
    ``acc_step`` of 0. ``scale``, ``bias``, ``mean``, ``var`` and every other collection
    are kept as they are, so the same model with ``AccumBatchNorm`` layers under the same
    names (e.g. ``nn.BatchNorm(name="bn")`` -> ``AccumBatchNorm(name="bn")``) restores
    them. Entries already present are kept, so converting twice is harmless. The input is
    not modified.

    Args:
      variables: the variables of a model built with ``nn.BatchNorm`` (a dict or a
        ``FrozenDict`` with a ``batch_stats`` collection).

    Returns:
      A new variables mapping of the same kind (``FrozenDict`` in, ``FrozenDict`` out).

    Raises:
      ValueError: if there is no ``batch_stats`` collection, it holds no layer with
        ``mean`` and ``var``, or a layer's ``mean`` and ``var`` shapes differ.

    Example::

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm, convert_batch_norm_variables
      >>> x = jnp.ones((4, 3))
      >>> old = nn.BatchNorm(use_running_average=True).init(jax.random.key(0), x)
      >>> new = convert_batch_norm_variables(old)
      >>> sorted(new["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'var']
      >>> y = AccumBatchNorm(accum_steps=4, use_running_average=True).apply(new, x)
    """
    if not isinstance(variables, Mapping) or "batch_stats" not in variables:
        raise ValueError("variables must be a mapping with a 'batch_stats' collection.")
    batch_stats = variables["batch_stats"]
    if not isinstance(batch_stats, Mapping):
        raise ValueError("variables['batch_stats'] must be a mapping.")
    converted, layers = _with_accumulators(batch_stats, "batch_stats")
    if layers == 0:
        raise ValueError("variables['batch_stats'] holds no BatchNorm layer ('mean' and 'var').")
    plain = dict(variables)
    plain["batch_stats"] = converted
    return FrozenDict(plain) if isinstance(variables, FrozenDict) else plain
