"""Batch normalization for ``flax.nnx`` whose running statistics see the accumulated batch.

The NNX twin of the linen :class:`accumjax.batch_norm.AccumBatchNorm`: same arithmetic
(the module-level functions of :mod:`accumjax.batch_norm`), same ``nnx.BatchStat``
names as the linen layer's ``batch_stats`` entries, and the same two window modes:
step-driven (``accum_steps=None``: the train step closes the window with
:func:`accumjax.close_batch_norm_windows` on ``nnx.state(model, nnx.BatchStat)`` and
puts the result back with ``nnx.update``) or self-closing (an int ``accum_steps``).

References:
  - Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift", ICML 2015.
  - Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing
    sample variances", Stanford CS tech. report STAN-CS-79-773, 1979.
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.typing import Array, Dtype, Initializer
from jax.nn import initializers

from accumjax.batch_norm import (
    _accumulate,
    _canonical_axes,
    _check_config,
    _check_input,
    _compute_moments,
    _empty_window,
    _Moments,
    _normalize,
    _Running,
    _stats_dtype,
    _Window,
)

__all__ = ["AccumBatchNorm"]


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

    Args:
      num_features: the number of input features.
      use_running_average: if True, normalize with the stored ``mean``/``var`` and
        update nothing (``model.train()``/``model.eval()`` set it).
      axis: the feature axis of the input.
      momentum: decay rate of the running averages, in ``[0, 1]``.
      epsilon: small float added to the variance to avoid dividing by zero.
      dtype: the dtype of the result (default: inferred from input and params).
      param_dtype: the dtype of ``scale`` and ``bias`` (default: float32).
      use_bias: if True, add the learned ``bias``.
      use_scale: if True, multiply by the learned ``scale``.
      bias_init: initializer for ``bias`` (default zeros).
      scale_init: initializer for ``scale`` (default ones).
      axis_name: the ``pmap``/``shard_map`` axis name over which to pool each call's
        statistics.
      axis_index_groups: groups of indices within ``axis_name`` to pool separately.
      use_fast_variance: if True, compute the variance as ``E[x^2] - E[x]^2``.
      accum_steps: None (the train step closes the window) or the number of
        training-mode calls per window (an int >= 1; the layer closes it).
      rngs: the random number generators for the parameter initializers.

    References:
      Ioffe & Szegedy (2015); Chan, Golub & LeVeque (1979).
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = False,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = initializers.zeros,
        scale_init: Initializer = initializers.ones,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        accum_steps: int | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        """Creates the parameters and batch statistics (see the class docstring)."""
        _check_config(accum_steps, momentum, epsilon)
        shape = (num_features,)
        self.mean = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.var = nnx.BatchStat(jnp.ones(shape, jnp.float32))
        count, mean, m2, step = _empty_window(shape)
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
            nnx.Param(scale_init(rngs.params(), shape, param_dtype))
            if use_scale
            else nnx.data(None)
        )
        self.bias: nnx.Param | None = (
            nnx.Param(bias_init(rngs.params(), shape, param_dtype)) if use_bias else nnx.data(None)
        )
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = axis
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.accum_steps = accum_steps

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
          use_running_average: if given, overrides the attribute of the same name.
          mask: optional boolean array broadcastable to ``x``; only True positions count
            towards the statistics.

        Returns:
          The normalized input, with the same shape as ``x``.
        """
        use_running_average = first_from(
            use_running_average,
            self.use_running_average,
            error_msg="Pass use_running_average to AccumBatchNorm or to its call.",
        )
        x = jnp.asarray(x)
        _check_input(x, mask)
        feature_axes = _canonical_axes(x.ndim, self.axis)
        if x.shape[feature_axes[0]] != self.num_features:
            raise ValueError(
                f"expected {self.num_features} features on axis {self.axis}, got {x.shape}."
            )
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        if use_running_average:
            mean, var = self.mean[...], self.var[...]
        else:
            dtype = _stats_dtype(self.dtype, x.dtype, True)
            moments = _compute_moments(
                x,
                mask,
                reduction_axes,
                dtype,
                self.axis_name,
                self.axis_index_groups,
                self.use_fast_variance,
            )
            mean, var = moments.mean.astype(dtype), moments.var.astype(dtype)
            self._update(moments)
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        return _normalize(x, mean, var, scale, bias, reduction_axes, self.epsilon, self.dtype)

    def _update(self, moments: _Moments) -> None:
        """Merges ``moments`` into the window (and closes it when self-closing)."""
        variables = (self.mean, self.var, self.acc_count, self.acc_mean, self.acc_m2, self.acc_step)
        momentum = self.momentum
        new_running, new_window = _accumulate(
            _Running(self.mean[...], self.var[...]),
            _Window(*(v[...] for v in variables[2:])),
            moments,
            momentum if isinstance(momentum, int | float) else momentum[...],
            self.accum_steps,
        )
        for variable, value in zip(variables, (*new_running, *new_window), strict=True):
            variable[...] = jax.lax.stop_gradient(value)

    def set_view(self, use_running_average: bool | None = None) -> None:
        """Sets ``use_running_average`` for ``nnx.view`` (as ``nnx.BatchNorm`` does)."""
        if use_running_average is not None:
            self.use_running_average = use_running_average
