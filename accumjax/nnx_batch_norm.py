"""Batch normalization for ``flax.nnx`` whose running statistics see the accumulated batch.

The NNX version of the linen :class:`accumjax.batch_norm.AccumBatchNorm`: the same arithmetic,
the same options (``axis`` an int or a tuple, ``force_float32_reductions``), the same
``nnx.BatchStat`` names as the linen layer's ``batch_stats`` entries, and the same two window
modes: step-driven (``accum_steps=None``: the train step closes the window with
:func:`accumjax.close_batch_norm_windows` on ``nnx.state(model, nnx.BatchStat)`` and puts
the result back with ``nnx.update``) or self-closing (an int ``accum_steps``).

References:
  - Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift", ICML 2015.
  - Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing
    sample variances", Stanford CS tech. report STAN-CS-79-773, 1979.
"""

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes
from flax.typing import Array, Axes, Dtype, Initializer, PromoteDtypeFn
from jax.nn import initializers

from accumjax._batch_norm_math import (
    BatchNormOptions,
    Running,
    StatsWindow,
    canonical_axes,
    check_config,
    empty_stats_window,
    normalize_and_accumulate,
    running_dtype,
)
from accumjax._batch_norm_windows import warn_if_open
from accumjax._checks import check_int
from accumjax._variables import variable_value

__all__ = ["AccumBatchNorm"]


def _feature_shape(num_features: Any) -> tuple[int, ...]:
    """The variables' shape for ``num_features`` (an int, or a non-empty tuple of ints)."""
    items = tuple(num_features) if isinstance(num_features, tuple | list) else (num_features,)
    if not items:
        raise ValueError("num_features must be an int or a non-empty tuple of ints, got ().")
    return tuple(check_int("num_features", n) for n in items)


class AccumBatchNorm(nnx.Module):
    """NNX BatchNorm whose running statistics are updated once per accumulation window.

    In training mode every call normalizes ``x`` with its own statistics, exactly like
    :class:`flax.nnx.BatchNorm`, and merges the per-feature count, mean and sum of squared
    deviations into the ``acc_count``, ``acc_mean`` and ``acc_m2`` batch statistics
    (``acc_step`` counts the calls). When the window closes, ``mean`` and ``var`` move
    once towards the pooled statistics of the whole window::

      mean = momentum * mean + (1 - momentum) * pooled_mean
      var = momentum * var + (1 - momentum) * pooled_var

    so after a window of ``K`` microbatches they equal those of ``nnx.BatchNorm`` applied
    once to the concatenated batch. With ``accum_steps=None`` (default) the train step
    closes the window by calling :func:`accumjax.close_batch_norm_windows` on
    ``nnx.state(model, nnx.BatchStat)`` (or its pure dict) and ``nnx.update``; the
    layer's ``momentum`` is then a float32 scalar ``nnx.BatchStat`` that the close reads.
    With an int ``accum_steps`` the layer closes the window itself on every
    ``accum_steps``-th training call, and ``momentum`` stays a plain float.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from accumjax import close_batch_norm_windows
      >>> from accumjax.nnx_batch_norm import AccumBatchNorm
      >>> bn = AccumBatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))
      >>> x = jnp.arange(12.0).reshape(6, 2)
      >>> for micro in (x[:3], x[3:]):
      ...     y = bn(micro)
      >>> bn.mean[...], int(bn.acc_step[...])
      (Array([0., 0.], dtype=float32), 2)
      >>> nnx.update(bn, close_batch_norm_windows(nnx.state(bn, nnx.BatchStat), True))
      >>> bn.mean[...]  # 0.5 * the mean of all six rows
      Array([2.5, 3. ], dtype=float32)
      >>> y = bn(x[:3])  # the pure dict works too
      >>> pure = nnx.to_pure_dict(nnx.state(bn, nnx.BatchStat))
      >>> nnx.update(bn, close_batch_norm_windows(pure, apply=False))
      >>> bn.mean[...], int(bn.acc_step[...])
      (Array([2.5, 3. ], dtype=float32), 0)

      Several feature axes, with the linen layer's variable layout:

      >>> bn = AccumBatchNorm((4, 3), axis=(1, 2), rngs=nnx.Rngs(0))
      >>> bn(jnp.ones((2, 4, 3))).shape, bn.acc_mean.shape
      ((2, 4, 3), (4, 3))

    Feature axes: ``axis`` is an int or a tuple of ints, as in the linen layer; the
    statistics reduce over all other axes. ``num_features`` is then either the feature
    shape (a tuple of ints, the sizes of the ``axis`` axes in increasing axis order: the
    variables have that shape, the linen layer's layout) or an int: the number of
    features, which for several axes is the product of their sizes (the variables are
    flat, as in :class:`flax.nnx.BatchNorm`, and are reshaped to the feature shape for
    each call). For a single axis the two are the same.

    Args:
      num_features: the number of features (an int) or the feature shape (a tuple).
      use_running_average: if True, normalize with the stored ``mean``/``var`` and
        update nothing (``model.train()``/``model.eval()`` set it).
      axis: the feature axis or axes of the input.
      momentum, epsilon, dtype, param_dtype, use_bias, use_scale, bias_init, scale_init: as
        in the linen `accumjax.AccumBatchNorm` (``epsilon`` is 1e-5 by default, as Flax's;
        pass ``epsilon=1e-3`` for a model ported from Keras or GradientAccumulator).
      axis_name: the ``pmap``/``shard_map`` axis name over which to pool each call's
        statistics.
      axis_index_groups: groups of indices within ``axis_name`` to pool separately.
      use_fast_variance: if True, compute the variance as ``E[|x|^2] - |E[x]|^2``.
      promote_dtype: as in ``nnx.BatchNorm``: called as
        ``promote_dtype((x, mean, var, scale, bias), dtype=dtype)`` on every call, it
        returns them promoted (by default all cast to ``dtype``, or to their common
        dtype when ``dtype`` is None); the statistics are computed from the promoted
        ``x`` and an evaluation normalizes with the promoted ``mean``/``var``.
      rngs: the random number generators for the parameter initializers.
      bias_metadata: metadata of the ``bias`` ``nnx.Param`` (as in ``nnx.BatchNorm``).
      scale_metadata: metadata of the ``scale`` ``nnx.Param``.
      force_float32_reductions: if True (default, what ``nnx.BatchNorm`` does),
        statistics are computed and stored in at least float32; if False, the running
        ``mean``/``var`` use ``param_dtype`` (as in the linen layer). Sums and
        accumulators are at least float32 either way.
      accum_steps: None (the train step closes the window) or the number of
        training-mode calls per window (an int >= 1; the layer closes it).

    The arguments up to ``scale_metadata`` are ``nnx.BatchNorm``'s, in its order and with
    its defaults. With ``accum_steps=1`` (and no ``axis_name``) the outputs and
    ``mean``/``var`` are ``nnx.BatchNorm``'s bit for bit eagerly (the same operations) and
    within 2 ulp under ``nnx.jit`` (two programs XLA fuses each its own way), masked or
    not, for float32, float16 and bfloat16 inputs with ``dtype`` None or the input's. A
    complex input gives ``nnx.BatchNorm``'s training outputs
    and ``var``; the running ``mean`` and ``acc_mean`` become complex on the first training
    call, as ``flax.linen.BatchNorm``'s mean does (``nnx.BatchNorm`` keeps its real part).

    References:
      Ioffe & Szegedy (2015); Chan, Golub & LeVeque (1979).
    """

    def __init__(
        self,
        num_features: int | tuple[int, ...],
        *,
        use_running_average: bool | None = False,
        axis: Axes = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = initializers.zeros,  # nnx's zeros_init(), the same function
        scale_init: Initializer = initializers.ones,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        force_float32_reductions: bool = True,
        accum_steps: int | None = None,
    ) -> None:
        """Creates the parameters and batch statistics (see the class docstring)."""
        check_config(accum_steps, momentum, epsilon)
        shape = _feature_shape(num_features)
        stats_dtype = running_dtype(force_float32_reductions, param_dtype)
        self.mean = nnx.BatchStat(jnp.zeros(shape, stats_dtype))
        self.var = nnx.BatchStat(jnp.ones(shape, stats_dtype))
        count, mean, m2, step = empty_stats_window(shape)
        self.acc_count = nnx.BatchStat(count)
        self.acc_mean = nnx.BatchStat(mean)
        self.acc_m2 = nnx.BatchStat(m2)
        self.acc_step = nnx.BatchStat(step)
        self.momentum: nnx.BatchStat | float = (
            nnx.BatchStat(jnp.asarray(momentum, jnp.float32))
            if accum_steps is None
            else float(momentum)
        )
        self.scale: nnx.Param | None = (
            nnx.Param(scale_init(rngs.params(), shape, param_dtype), **scale_metadata)
            if use_scale
            else nnx.data(None)
        )
        self.bias: nnx.Param | None = (
            nnx.Param(bias_init(rngs.params(), shape, param_dtype), **bias_metadata)
            if use_bias
            else nnx.data(None)
        )
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = axis
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.force_float32_reductions = force_float32_reductions
        self.accum_steps = accum_steps

    def __call__(
        self, x: Array, use_running_average: bool | None = None, *, mask: Array | None = None
    ) -> Array:
        """The linen layer's call (`accumjax.batch_norm.AccumBatchNorm.__call__`) on this
        module's variables.

        Args:
          x: the input to normalize.
          use_running_average: if given, overrides the attribute of the same name.
          mask: as in the linen layer: only True positions count towards the statistics.

        Returns:
          The normalized input, with the same shape as ``x``.

        Raises:
          ValueError: if the sizes of the ``axis`` axes of ``x`` do not match
            ``num_features``.
        """
        use_running_average = first_from(
            use_running_average,
            self.use_running_average,
            error_msg="Pass use_running_average to AccumBatchNorm or to its call.",
        )
        x = jnp.asarray(x)
        feature_axes = canonical_axes(x.ndim, self.axis)
        shape = tuple(x.shape[i] for i in feature_axes)
        stored = jnp.shape(self.mean[...])
        if shape != stored and stored != (math.prod(shape),):
            raise ValueError(
                f"expected {self.num_features} features on axis {self.axis}, got an input "
                f"of shape {x.shape}."
            )
        running_vars = (self.mean, self.var)
        window_vars = (self.acc_count, self.acc_mean, self.acc_m2, self.acc_step)

        def view(variable: Any) -> Array:
            """The variable's value in the input's feature shape (a no-op when equal)."""
            return variable[...].reshape(shape)

        scale = None if self.scale is None else view(self.scale)
        bias = None if self.bias is None else view(self.bias)
        # As nnx.BatchNorm: everything promoted; training updates the stored statistics.
        x, mean, var, scale, bias = self.promote_dtype(
            (x, view(self.mean), view(self.var), scale, bias), dtype=self.dtype
        )
        running = (
            Running(mean=mean, var=var)
            if use_running_average
            else Running(mean=view(self.mean), var=view(self.var))
        )
        y, new_running, new_window = normalize_and_accumulate(
            x,
            mask,
            feature_axes,
            BatchNormOptions.of(self, variable_value(self.momentum)),
            running,
            StatsWindow(
                count=view(self.acc_count),
                mean=view(self.acc_mean),
                m2=view(self.acc_m2),
                calls=self.acc_step[...],
            ),
            scale,
            bias,
            use_running_average=bool(use_running_average),
        )
        if use_running_average and self.accum_steps is None:
            warn_if_open(self.acc_step[...])
        if not use_running_average:
            assert new_window is not None
            for variable, value in zip(
                (*running_vars, *window_vars), (*new_running, *new_window), strict=True
            ):
                value = value.reshape(jnp.shape(variable[...]))
                # set_value, not [...] =, so that a complex input's mean becomes complex.
                variable.set_value(jax.lax.stop_gradient(value))
        return y

    def set_view(self, use_running_average: bool | None = None) -> None:
        """Sets ``use_running_average`` for ``nnx.view`` (as ``nnx.BatchNorm`` does)."""
        if use_running_average is not None:
            self.use_running_average = use_running_average
