"""Batch normalization whose running statistics see the whole accumulated batch.

:class:`AccumBatchNorm` normalizes each microbatch as :class:`flax.linen.BatchNorm` does,
pools the microbatches' count, mean and ``M2`` (Chan, Golub & LeVeque's parallel merge) and
moves the running statistics once per window. A step-driven layer (``accum_steps=None``) is
closed by the train step or :func:`close_batch_norm_windows`; a self-closing one
(``accum_steps=K``) closes on its ``K``-th call. This module also holds
:func:`sync_batch_norm`. The BatchNorm guide (``docs/guides/batch_norm.md``) has the details.
"""

from typing import Any, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.typing import Array, Dtype, Initializer
from jax.nn import initializers

from accumjax._batch_norm_math import (
    ACCUMULATOR_NAMES,
    MOMENTUM_NAME,
    BatchNormOptions,
    Running,
    StatsWindow,
    canonical_axes,
    check_config,
    complex_like,
    normalize_and_accumulate,
    running_dtype,
    stats_accumulator_dtype,
    stats_dtype,
)
from accumjax._batch_norm_windows import (
    array_of,
    check_no_self_closing,
    close_step_driven_windows,
    is_step_driven,
    warn_if_open,
    warn_plain_batch_norm,
)
from accumjax._moved import forward_moved
from accumjax._state import accumulation_state_in, closed_its_window
from accumjax._variables import is_variable, unwrap_variables

__all__ = [
    "ACCUMULATOR_NAMES",
    "AccumBatchNorm",
    "close_batch_norm_windows",
    "sync_batch_norm",
]

# `convert_batch_norm_variables` is exported by `accumjax.batch_norm_convert`: resolved here with a
# DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)

_Tree = TypeVar("_Tree")


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
      forward pass needs ``accum_steps = K * c``.

    ``batch_stats`` holds ``mean`` and ``var`` (as in ``BatchNorm``) plus the open window's
    accumulators (``acc_count``, ``acc_mean``, ``acc_m2``, ``acc_step``) and, step-driven,
    ``momentum``. StatsWindow decisions use ``jnp.where``, so the layer works under ``jit``,
    ``scan``, ``pmap`` and ``shard_map``. Complex inputs, masks, ``axis_name`` pooling and
    ``accum_steps=1`` against ``BatchNorm``: :doc:`/guides/batch_norm`.

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
      epsilon: small float added to the variance to avoid dividing by zero; 1e-5 by
        default, as Flax's ``BatchNorm``. Keras' ``BatchNormalization`` and
        GradientAccumulator's ``AccumBatchNormalization`` default to 1e-3: pass
        ``epsilon=1e-3`` to normalize as a model ported from them did.
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
        check_config(self.accum_steps, self.momentum, self.epsilon)
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
        feature_axes = canonical_axes(x.ndim, self.axis)
        feature_shape = tuple(x.shape[i] for i in feature_axes)

        # A complex input's means are complex from the start (BatchNorm's turns complex on
        # its first update), so the statistics keep their dtypes through loops.
        statistics = stats_dtype(self.dtype, x.dtype, self.force_float32_reductions)
        running = self._running_stats(feature_shape, statistics)
        window, momentum = None, None
        if not use_running_average or self.is_initializing():
            # Declared during an eval-mode init too, so that the layout is complete.
            window, momentum = self._window_stats(feature_shape, statistics)
        elif self.accum_steps is None and self.has_variable("batch_stats", "acc_step"):
            warn_if_open(self.get_variable("batch_stats", "acc_step"))
        param_dtype = self.param_dtype
        scale = (
            self.param("scale", self.scale_init, feature_shape, param_dtype)
            if self.use_scale
            else None
        )
        bias = (
            self.param("bias", self.bias_init, feature_shape, param_dtype)
            if self.use_bias
            else None
        )
        y, new_running, new_window = normalize_and_accumulate(
            x,
            mask,
            feature_axes,
            BatchNormOptions.of(self, self.momentum),
            Running(mean=running.mean.value, var=running.var.value),
            None if window is None else _values(window),
            scale,
            bias,
            use_running_average=bool(use_running_average),
            # During init nothing is updated and the named axis may not exist (as BatchNorm).
            initializing=self.is_initializing(),
        )
        if not use_running_average and not self.is_initializing():
            assert window is not None and new_window is not None
            for variable, value in zip(
                (*running, *window), (*new_running, *new_window), strict=True
            ):
                variable.value = value
            if momentum is not None:
                momentum.value = jnp.asarray(self.momentum, jnp.float32)
        return y

    def _running_stats(self, feature_shape: tuple[int, ...], statistics: Any) -> Running:
        """Declares the running ``mean`` (zeros, complex for complex ``statistics``) and
        ``var`` (ones), as ``BatchNorm``."""
        dtype = running_dtype(self.force_float32_reductions, self.param_dtype)
        mean_dtype = complex_like(dtype, statistics)
        mean = self.variable("batch_stats", "mean", jnp.zeros, feature_shape, mean_dtype)
        var = self.variable("batch_stats", "var", jnp.ones, feature_shape, dtype)
        return Running(mean=mean, var=var)

    def _window_stats(
        self, feature_shape: tuple[int, ...], statistics: Any
    ) -> tuple[StatsWindow, Any]:
        """Declares the zero accumulators and, step-driven, the ``momentum`` scalar."""
        dtype = stats_accumulator_dtype()
        dtypes = (dtype, complex_like(dtype, statistics), dtype)
        count, mean, m2 = (
            self.variable("batch_stats", name, jnp.zeros, feature_shape, d)
            for name, d in zip(ACCUMULATOR_NAMES[:3], dtypes, strict=True)
        )
        calls = self.variable("batch_stats", "acc_step", jnp.zeros, (), jnp.int32)
        momentum = None
        if self.accum_steps is None:
            momentum = self.variable(
                "batch_stats", MOMENTUM_NAME, lambda: jnp.asarray(self.momentum, jnp.float32)
            )
        return StatsWindow(count=count, mean=mean, m2=m2, calls=calls), momentum


def _values(window: StatsWindow) -> StatsWindow:
    """The arrays held by a window of linen ``Variable``s."""
    w = window
    return StatsWindow(count=w.count.value, mean=w.mean.value, m2=w.m2.value, calls=w.calls.value)


# ---------------------------------------------------------------------------------------------
# Closing step-driven windows
# ---------------------------------------------------------------------------------------------


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
    unchanged; a plain ``BatchNorm``'s statistics (``mean`` and ``var`` alone) get a warning
    naming ``AccumBatchNorm``. Call it once per optimizer step, after the last microbatch, with
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
    if isinstance(apply, str | bytes) or not jnp.issubdtype(jnp.result_type(apply), jnp.bool_):
        raise TypeError(
            f"apply must be a bool scalar (True, False or a bool array), got {apply!r}."
        )
    apply = jnp.asarray(apply)
    if apply.shape != ():
        raise ValueError(f"apply must be a bool scalar, got shape {apply.shape}.")
    warn_plain_batch_norm(stats_tree, "close_batch_norm_windows")
    return close_step_driven_windows(stats_tree, apply, axis_name)


def sync_batch_norm(new_stats: _Tree, old_stats: _Tree, opt_state: Any) -> _Tree:
    """BatchNorm statistics kept in step with ``accumulate``, for a loop you write yourself.

    `accumjax.make_train_step` does this itself. In your own loop (an optax chain with
    `accumjax.accumulate`, or ``nnx.Optimizer(model, accumulate(...))``), call it after each
    optimizer ``update``, with the statistics the forward pass returned and those it started
    from. It follows the optimizer's decisions:

    1. a microbatch the optimizer left out (non-finite, an invalid weight, ``skip_fn``) leaves
       the statistics as they were (``old_stats``), so its (maybe NaN) statistics never reach
       a window;
    2. when the call closed the optimizer's window, every step-driven layer's window is
       closed (`close_batch_norm_windows`), applied only if the optimizer applied its update.

    Args:
      new_stats: the statistics after this microbatch's forward pass: the ``batch_stats``
        collection a linen ``apply(..., mutable=["batch_stats"])`` returned, or
        ``nnx.state(model, nnx.BatchStat)`` after the call.
      old_stats: the statistics before it, of the same structure; for NNX a copy taken
        before the forward pass, ``nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))``
        (``nnx.state`` itself is a live view of the model's variables, refused here).
      opt_state: the optimizer state after this microbatch's ``update``: an
        `accumjax.AccumulationState`, or a state holding exactly one (an ``nnx.Optimizer``'s
        ``opt_state``, an optax combinator's state such as ``optax.chain``'s).

    Returns:
      The statistics to keep, as ``new_stats`` (for NNX its pure dict, for ``nnx.update``).

    Raises:
      ValueError: if ``old_stats`` is a live view of the same variables as ``new_stats``, or
        ``opt_state`` holds several accumulate states or one inside ``optax.apply_if_finite``
        or ``optax.MultiSteps`` (see `accumjax.has_updated`), or if ``old_stats`` has counted
        more training calls than ``new_stats`` (the two swapped; under ``jit`` when the
        program runs). Statistics of a plain ``BatchNorm`` (not an ``AccumBatchNorm``) get a
        warning: they move once per microbatch.

    Example:
      The loop of plain Flax and optax, with one line changed (the last):

      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, accumjax
      >>> bn = accumjax.AccumBatchNorm(use_running_average=False, momentum=0.5)
      >>> model = nn.Sequential([nn.Dense(3), bn])
      >>> x = jax.random.normal(jax.random.key(0), (8, 2))
      >>> variables = model.init(jax.random.key(1), x)
      >>> params, batch_stats = variables["params"], variables["batch_stats"]
      >>> tx = accumjax.accumulate(optax.sgd(0.1), every_k=2)
      >>> opt_state = tx.init(params)
      >>> def loss_fn(params, batch_stats, xb):
      ...     y, new = model.apply({"params": params, "batch_stats": batch_stats}, xb,
      ...                          mutable=["batch_stats"])
      ...     return jnp.mean(y**2), new["batch_stats"]
      >>> @jax.jit
      ... def train_step(params, batch_stats, opt_state, xb):
      ...     grads, new_stats = jax.grad(loss_fn, has_aux=True)(params, batch_stats, xb)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      ...     batch_stats = accumjax.sync_batch_norm(new_stats, batch_stats, opt_state)
      ...     return params, batch_stats, opt_state
      >>> for xb in (x[:4], x[4:]):
      ...     params, batch_stats, opt_state = train_step(params, batch_stats, opt_state, xb)
      >>> int(batch_stats["layers_1"]["acc_step"])  # the window closed after 2 microbatches
      0

      With ``nnx.Optimizer`` (two lines beyond plain Flax NNX: ``before`` and the last):

      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.linear = nnx.Linear(2, 3, rngs=rngs)
      ...         self.norm = accumjax.NNXAccumBatchNorm(3, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.norm(self.linear(x))
      >>> net = Net(nnx.Rngs(0))
      >>> opt = nnx.Optimizer(net, accumjax.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
      >>> @nnx.jit
      ... def nnx_step(net, opt, xb):
      ...     before = nnx.to_pure_dict(nnx.state(net, nnx.BatchStat))
      ...     opt.update(net, nnx.grad(lambda m: jnp.mean(m(xb) ** 2))(net))
      ...     after = nnx.state(net, nnx.BatchStat)
      ...     nnx.update(net, accumjax.sync_batch_norm(after, before, opt.opt_state))
      >>> for xb in (x[:4], x[4:]):
      ...     nnx_step(net, opt, xb)
      >>> int(net.norm.acc_step[...])
      0
    """
    state = accumulation_state_in(opt_state)
    check_no_self_closing(new_stats, "sync_batch_norm")
    _check_not_live(new_stats, old_stats)
    new_stats, old_stats = _pure(new_stats), _pure(old_stats)
    _check_order(new_stats, old_stats)
    every_k = None if isinstance(state.every_k, jax.core.Tracer) else int(state.every_k)
    if every_k != 1:  # K=1: a plain BatchNorm is what trains
        warn_plain_batch_norm(new_stats, "sync_batch_norm", every_k, before=old_stats)
    kept = optax.tree.where(state.added, new_stats, old_stats)
    closed = close_step_driven_windows(kept, jnp.asarray(state.updated), None)
    return optax.tree.where(closed_its_window(state), closed, kept)


_SWAPPED = (
    "sync_batch_norm(new_stats, old_stats, opt_state) was given its statistics the other way "
    "round: old_stats has counted more training calls (acc_step) than new_stats, so the "
    "statistics would never move. Pass the statistics after the forward pass first and those "
    "before it second: sync_batch_norm(new_stats, old_stats, opt_state)."
)


def _raise_swapped() -> None:
    raise ValueError(_SWAPPED)


def _check_order(new_stats: Any, old_stats: Any) -> None:
    """Refuses swapped statistics: a forward pass only adds calls to a step-driven window, so
    ``old_stats`` never holds more (``acc_step``) than ``new_stats``. Checked now for concrete
    values, when the program runs (under ``jit``) for traced ones."""
    new, structure = jax.tree.flatten(new_stats, is_leaf=is_step_driven)
    old, old_structure = jax.tree.flatten(old_stats, is_leaf=is_step_driven)
    if structure != old_structure:
        return  # refused by what reads them together
    steps = [
        array_of(o["acc_step"]) > array_of(n["acc_step"])
        for n, o in zip(new, old, strict=True)
        if is_step_driven(n)
    ]
    if not steps:
        return
    swapped = jnp.any(jnp.stack(steps))
    if not isinstance(swapped, jax.core.Tracer):
        if bool(swapped):
            _raise_swapped()
        return
    jax.lax.cond(swapped, lambda: jax.debug.callback(_raise_swapped), lambda: None)


def _pure(stats: Any) -> Any:
    """Statistics as plain arrays: an ``nnx.State`` as its pure dict, others unwrapped."""
    return nnx.to_pure_dict(stats) if isinstance(stats, nnx.State) else unwrap_variables(stats)


def _check_not_live(new_stats: Any, old_stats: Any) -> None:
    """Refuses ``old_stats`` holding the very variables of ``new_stats`` (``nnx.state`` is a
    live view: its values change with the model's, so nothing could be rolled back)."""
    is_var = lambda x: is_variable(x)
    new = {id(v) for v in jax.tree.leaves(new_stats, is_leaf=is_var) if is_variable(v)}
    if any(id(v) in new for v in jax.tree.leaves(old_stats, is_leaf=is_var) if is_variable(v)):
        raise ValueError(
            "sync_batch_norm: old_stats holds the model's own variables (nnx.state is a live "
            "view, which the forward pass changed too). Take a copy before the forward pass: "
            "old_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))."
        )
