"""A jitted train-step factory with gradient accumulation.

:func:`make_train_step` is the functional form of the ``GradientAccumulateModel`` of
the TensorFlow library andreped/GradientAccumulator
(https://github.com/andreped/GradientAccumulator): it builds
``step(state, batch, rng=None) -> (state, metrics)`` for a :class:`TrainState` whose
optimizer is ``accumjax.accumulate(inner, K, ...)``, in one of two modes:

* ``"stream"``: one microbatch per call; parameters change when a window closes.
* ``"scan"``: one call takes the whole batch, splits it into K strided microbatches
  (rows ``i, i+K, ...``, so each keeps the batch's sharding), accumulates them in a
  loop and applies at most one update.

Both modes run the same window (`accumjax.window`) with the policies of the optimizer
(scaling, non-finite handling, per-microbatch clipping, ``skip_fn``), so K and every
policy are stated once, in ``accumulate``. Model state (BatchNorm statistics and any
other mutable collection) follows the window's decisions. Both support bfloat16/float16
mixed precision and data parallelism over ``pmap`` or a ``shard_map`` mesh with one
gradient all-reduce per window.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from accumjax._checks import check_callable, check_choice, check_int, check_real
from accumjax._host import TrainStep, wrap
from accumjax._loop import Setup
from accumjax._loss_adapter import make_grad_fn
from accumjax._split import check_batch_axis
from accumjax._step_checks import positional_limit
from accumjax.clipping import Mask, adaptive_clip_grad

__all__ = ["TrainStep", "make_train_step"]

_MODES = ("stream", "scan")
_PRECISIONS = {None: None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_GATHER = ("window", "microbatch")

LossFn = Callable[..., Any]


def make_train_step(
    loss_fn: LossFn,
    *,
    mode: str = "stream",
    accum_steps: int | None = None,
    has_aux: bool = False,
    use_agc: bool = False,
    clip_factor: float = 0.01,
    agc_eps: float = 1e-3,
    agc_mask: Mask = None,
    agc_axis: Any = None,
    mixed_precision: str | None = None,
    axis_name: str | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
    weight_fn: Callable[[Any], Any] | None = None,
    unroll: int | bool = 1,
    gather_params: str = "window",
    batch_axis: Any = 0,
    aux_rows: bool = False,
) -> TrainStep:
    """Builds a jitted ``step(state, batch, rng=None) -> (state, metrics)`` that accumulates.

    K and every accumulation policy come from the state's optimizer,
    ``tx=accumjax.accumulate(inner, K, scaling=..., on_nonfinite=..., max_norm=...,
    skip_fn=...)``: they mean the same in both modes. A plain optax optimizer is a window of
    one microbatch (with the default policies, and no counters kept). The step builds the
    state it takes, ``state = step.init(params, tx, model_state=...)``
    (`accumjax.TrainStep.init`): laid out for its mode, the mesh it runs on and its
    precision, so that each is stated once, here or in ``tx``. Its abstract form
    (``step.init`` of ``jax.ShapeDtypeStruct`` parameters) is an orbax restore target;
    `accumjax.restore_checkpoint` restores a checkpoint on another number of devices.

    The loss function follows the shape of ``state`` (and ``rng``):

    * ``state.model_state is None``: ``loss_fn(params, batch) -> loss``, or
      ``(loss, aux)`` with ``has_aux=True``.
    * otherwise (e.g. ``{"batch_stats": ...}``):
      ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, or
      ``(loss, (new_model_state, aux))`` with ``has_aux=True``.
    * with ``step(state, batch, rng)``, ``loss_fn`` gets one more, last argument: a PRNG key
      distinct for every microbatch, device and update (``fold_in`` of ``state.step``, the
      microbatch index and the device index), so a run is reproducible from its seed.

    ``loss`` is a scalar mean over the (micro)batch. Modes:

    * ``"stream"``: ``batch`` is one microbatch; the update is applied when the window
      closes (on the other calls params are not touched).
    * ``"scan"``: ``batch`` is the whole batch (leading axis divisible by K, per device);
      microbatch ``i`` is rows ``i, i + K, ...``, all K added in one loop.

    The mesh is where the arrays lie. Under ``jit``, put the parameters on a mesh
    (replicated, sharded over the data axis (FSDP), or over other axes) and the batch split
    over the data axis (``P("data")``): the step runs each device's rows in a ``shard_map``
    and reduces the gradient once per window, in both modes; the same program on one
    device gives the same metrics and state structure. Every value it returns is global:
    ``metrics`` are scalars, ``"aux"`` leaves with rows have every device's.

    A microbatch that is skipped (non-finite, invalid weight, ``skip_fn``) contributes neither
    its gradient nor its model state. A window that is not usable (see ``accumulate``) leaves
    params, optimizer state and model state as they were (in stream mode: BatchNorm windows
    are reset, other mutable collections keep the skipped window's changes), and
    ``state.step`` counts applied updates only. On a mesh each device decides about its own
    rows (its share of the microbatch).

    The step composes with JAX's transformations: inside ``jax.jit`` (several steps in one
    program), ``jax.vmap`` or ``lax.scan`` it runs as called step by step; the host-side
    checks (a donated array reused, a restored state's K) run only on concrete values.

    Args:
      loss_fn: the loss, see above.
      mode: ``"stream"`` or ``"scan"``; ``step.init`` builds the state for it (a scan-mode
        state holds no accumulator).
      accum_steps: deprecated: K is stated once, in ``accumulate(inner, K)``; when given it
        must equal the optimizer's K.
      has_aux: whether ``loss_fn`` also returns auxiliary outputs (``metrics["aux"]``;
        stacked over microbatches in scan mode).
      use_agc, clip_factor, agc_eps, agc_mask, agc_axis: deprecated: adaptive gradient
        clipping of the window gradient, the same as `accumjax.adaptive_clip` first in the
        inner chain, ``accumulate(optax.chain(accumjax.adaptive_clip(clip_factor, agc_eps,
        agc_mask, axis=agc_axis), inner), K)``, which to use instead.
      mixed_precision: ``None``; ``"bfloat16"`` (params and float inputs cast to bfloat16
        for the loss; master params, gradients and accumulator keep the params' dtype); or
        ``"float16"``: the same with float16 plus dynamic loss scaling (``state.loss_scale``:
        ``step.init`` makes one; a state without one is refused, as is
        ``on_nonfinite="propagate"``). An overflowed microbatch is a non-finite
        microbatch, handled by ``on_nonfinite``; the scale is adjusted once per window
        (lowered if the window saw an overflow).
      axis_name: with ``mesh``: the mesh axis the batch is split over (the data axis).
        Without ``mesh``: the step is ``jax.pmap``-ped over this axis name (``step.init``
        replicates the state over the local devices; ``rng`` is shared; metrics are per
        device, as ``pmap``'s convention is). The window's gradient sum, weights and counts
        are all-reduced once per window; step-closed BatchNorm windows are pooled across
        devices once per window, and other float model state is averaged once per window
        (integer and key leaves are left alone).
      mesh: the mesh the step runs on, with ``axis_name`` its data axis: needed only where
        the arrays do not say (a mesh with several axes of more than one device, for
        ``step.init``'s stream window). The step puts arrays that are off the mesh on it
        (the state replicated, the batch split over ``axis_name``) and keeps those on it as
        they are.
      donate: donate the input state's buffers to the output (the arrays ``step.init``
        returns are its own; do not reuse arrays of a state from elsewhere).
      weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a microbatch (e.g. its
        number of valid tokens), for ``accumulate(..., scaling="weighted")``.
      unroll: scan mode: microbatches per loop iteration, passed to ``lax.scan`` (``True``
        unrolls the whole window). On CPU, XLA runs convolutions far slower inside a loop
        body than outside, so convnets want ``unroll=True`` there.
      gather_params: scan mode with parameters sharded over the data axis (FSDP):
        ``"window"`` (default, for speed) all-gathers them once per window and keeps the
        whole copy for the window; ``"microbatch"`` (for memory) all-gathers them in every
        microbatch, so the whole copy lives only while a microbatch runs (K gathers a
        window; the gradient is still reduced once).
      batch_axis: scan mode: the batch axis that is split into microbatches, for every leaf
        (an int) or per leaf (a pytree prefix of the batch with an int or None at each
        leaf); a leaf with None is not batched and every microbatch sees it whole (as
        ``optax.microbatch``'s ``in_axes`` and ``argnums``). Default 0. On a mesh only 0 is
        supported.
      aux_rows: scan mode with ``has_aux``: give ``metrics["aux"]`` in the batch's row order
        (each aux leaf has one entry per row of its microbatch, and the K microbatches' rows
        are put back where they came from: shape ``(B, ...)``, as ``optax.microbatch``'s
        ``CONCAT``) instead of stacked per microbatch (``(K, B // K, ...)``, default).

    The step of scan mode also takes ``num_real_microbatches`` (a keyword, or the fourth
    argument): how many of the K microbatches are real, an int or an int array (traced: no
    recompile when it changes). The padded tail ones are neither computed nor counted, and
    ``"mean"`` divides by the real ones, so the update is the full-batch update over the real
    microbatches (as ``optax.microbatch(..., num_real_microbatches=...)``).

    Returns:
      The `accumjax.TrainStep`. ``metrics`` has ``"loss"`` (the window's weighted mean loss
      over the added microbatches in scan mode, NaN if none was added; the microbatch's in
      stream mode), ``"updated"`` (whether an update was applied; then ``state.step`` grows
      by one), ``"grad_norm"`` (the global norm of the window gradient the inner optimizer
      saw at this call; NaN on a call that applied no update), ``"grads_finite"`` and
      ``"loss_scale"`` with float16, and ``"aux"`` with has_aux (on a mesh: a leaf with
      rows has every device's rows, in the batch's order; a scalar per microbatch is the
      mean over the devices). A state the step did not return itself (the first call's, a
      restored checkpoint) is checked against its optimizer on the host (one made with
      another K or scaling is refused).

    Raises:
      ValueError / TypeError: naming the argument, for invalid arguments here; at trace time
      for a batch not divisible by K, an ``accum_steps`` that differs from the optimizer's K,
      scan mode with a K schedule, or a loss_fn output that does not match ``has_aux``; for
      a ``tx`` that is or contains ``optax.MultiSteps`` (use ``accumulate(inner, K)``); for
      an ``rng`` that is not one key (an int seed, a float array, a batch of keys) or is
      given to a ``loss_fn`` that takes no key; on the call, for a state holding an array
      that an earlier call donated, or a state and batch on different meshes (or on meshes
      of the same devices with other axes); at trace time for a state laid out for the other
      mode, or for another number of devices, naming the fix.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, accumjax
      >>> model = nn.Dense(1)
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> def loss_fn(params, batch):
      ...     pred = model.apply({"params": params}, batch["x"])
      ...     return jnp.mean((pred - batch["y"]) ** 2)
      >>> step = accumjax.make_train_step(loss_fn, mode="scan")
      >>> state = step.init(params, accumjax.accumulate(optax.sgd(0.1), 4))
      >>> state, metrics = step(state, {"x": x, "y": y})
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

      With model state (BatchNorm statistics, closed by the step once per window), dropout
      keys and stream mode:

      >>> model = nn.Sequential([nn.Dense(4), accumjax.AccumBatchNorm(
      ...     use_running_average=False), nn.Dense(1)])
      >>> variables = model.init(jax.random.key(0), x)
      >>> def loss_fn(params, model_state, batch, key):
      ...     x = jax.random.bernoulli(key, 0.9, batch["x"].shape) * batch["x"] / 0.9
      ...     pred, new_model_state = model.apply(
      ...         {"params": params, **model_state}, x, mutable=list(model_state))
      ...     return jnp.mean((pred - batch["y"]) ** 2), new_model_state
      >>> step = accumjax.make_train_step(loss_fn)
      >>> state = step.init(variables["params"], accumjax.accumulate(optax.adam(1e-3), 4),
      ...                   model_state={"batch_stats": variables["batch_stats"]})
      >>> for i in range(4):
      ...     batch = {"x": x[2 * i : 2 * i + 2], "y": y[:2]}
      ...     state, metrics = step(state, batch, jax.random.key(1))
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

    Reference: the ``GradientAccumulateModel`` of andreped/GradientAccumulator
    (Pedersen et al., https://github.com/andreped/GradientAccumulator).
    """
    check_callable("loss_fn", loss_fn, optional=False)
    compute_dtype = _PRECISIONS[
        check_choice("mixed_precision", mixed_precision, tuple(_PRECISIONS))
    ]
    if accum_steps is not None:
        _deprecated(
            "make_train_step(accum_steps=...)",
            "K is stated once, in tx=accumjax.accumulate(inner, K); leave accum_steps out",
        )
    data_axis = _check_mesh(mesh, axis_name)
    setup = Setup(
        grad_fn=make_grad_fn(loss_fn, has_aux, compute_dtype),
        mode=check_choice("mode", mode, _MODES),
        accum_steps=None if accum_steps is None else check_int("accum_steps", accum_steps),
        axis_name=axis_name if mesh is None else None,
        weight_fn=check_callable("weight_fn", weight_fn),
        f16=mixed_precision == "float16",
        transform=_agc(use_agc, clip_factor, agc_eps, agc_mask, agc_axis),
        unroll=_check_unroll(unroll),
        gather_params=check_choice("gather_params", gather_params, _GATHER),
        loss_positional=positional_limit(loss_fn),
        batch_axis=_check_scan_only("batch_axis", check_batch_axis(batch_axis), 0, mode),
        aux_rows=_check_scan_only("aux_rows", _check_bool("aux_rows", aux_rows), False, mode),
        mesh=mesh,
        data_axis=data_axis,
    )
    return wrap(setup, donate)


def _deprecated(what: str, instead: str) -> None:
    warnings.warn(f"{what} is deprecated: {instead}.", DeprecationWarning, stacklevel=3)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return value


def _check_scan_only(name: str, value: Any, default: Any, mode: str) -> Any:
    if mode != "scan" and value != default:
        raise ValueError(f"{name} is for mode='scan' (which splits the batch), not mode={mode!r}.")
    return value


def _check_unroll(unroll: Any) -> int | bool:
    return unroll if isinstance(unroll, bool) else check_int("unroll", unroll)


def _check_mesh(mesh: Any, axis_name: str | None) -> str | None:
    """The data axis of the step's own mesh (None without one)."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is None:
        raise ValueError("mesh needs axis_name: the mesh axis the batch is split over.")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
    return axis_name


def _agc(
    use_agc: bool, clip_factor: Any, agc_eps: Any, agc_mask: Mask, agc_axis: Any
) -> Callable[[Any, Any], Any] | None:
    if not use_agc:
        for name, value in (("agc_mask", agc_mask), ("agc_axis", agc_axis)):
            if value is not None:
                raise ValueError(f"{name} is given but use_agc is False.")
        return None
    clip_factor = check_real("clip_factor", clip_factor, low=0.0, low_open=True)
    agc_eps = check_real("agc_eps", agc_eps, low=0.0, low_open=True)
    _deprecated(
        "make_train_step(use_agc=True, clip_factor, agc_eps, agc_mask, agc_axis)",
        "put accumjax.adaptive_clip(clip_factor, agc_eps, agc_mask, axis=agc_axis) first in "
        "the inner chain: accumjax.accumulate(optax.chain(accumjax.adaptive_clip(...), "
        "inner), K), which clips the window gradient once per window the same way",
    )
    return lambda grads, params: adaptive_clip_grad(
        params, grads, clip_factor, agc_eps, agc_mask, axis=agc_axis
    )
