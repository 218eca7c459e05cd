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

Both modes run the window of ``accumulate`` with its policies (scaling, non-finite handling,
per-microbatch clipping, ``skip_fn``), so K and every policy are stated once, in
``accumulate``. Model state (BatchNorm statistics and any other mutable collection) follows
the window's decisions. Both support bfloat16/float16 mixed precision and data parallelism
over ``pmap`` or a mesh, with each gradient reduced where the layout plan says (once a window,
or every microbatch for FSDP's reduce-scatter and a policy that reads the whole gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from accumjax._checks import (
    check_callable,
    check_choice,
    check_int,
    check_mesh_axis,
    raise_on_unknown_kwargs,
)
from accumjax._host import TrainStep, wrap
from accumjax._layout import check_optimizer_sharding
from accumjax._loop import Setup
from accumjax._loss_adapter import make_grad_fn
from accumjax._opt_state import MODES
from accumjax._split import check_batch_axis
from accumjax._step_checks import positional_limit

__all__ = ["TrainStep", "make_train_step"]


_PRECISIONS = {None: None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
#: When an FSDP collective runs (``gather_params``, ``reduce_scatter``): once a window, or once
#: a microbatch.
_FSDP_TIMINGS = ("window", "microbatch")

LossFn = Callable[..., Any]

#: Where GradientAccumulator's adaptive gradient clipping (0.3's ``use_agc=True``) went.
AGC_REPLACEMENT = (
    "per microbatch, as GradientAccumulator clips each microbatch's gradient before adding "
    "it: accumulate(inner, K, microbatch_transform=accumjax.adaptive_clip(clip_factor, eps, "
    "mask, axis=axis)); on the window's gradient: accumjax.adaptive_clip first in the inner "
    "chain, accumulate(optax.chain(accumjax.adaptive_clip(clip_factor, eps, mask, "
    "axis=axis), inner), K)"
)
#: What the removed arguments' messages start with: when they went, and where to read why.
_GONE_SINCE = "removed in accumjax 0.4 (docs/guides/migrating.md)"
_AGC_PART = (
    f"{_GONE_SINCE} with use_agc: it is accumjax.adaptive_clip's {{arg}}, and adaptive "
    "clipping is the optimizer's, {where}."
)

#: The arguments accumjax 0.4 removed from the step, and what to write instead.
_REMOVED = {
    "accum_steps": f"{_GONE_SINCE}: K is stated once, in the optimizer: "
    "step.init(params, accumjax.accumulate(inner, K)).",
    "use_agc": f"{_GONE_SINCE}: adaptive gradient clipping is the optimizer's, "
    f"{AGC_REPLACEMENT}. With use_agc=False leave it out.",
    **{
        name: _AGC_PART.format(arg=arg, where=AGC_REPLACEMENT)
        for name, arg in (
            ("clip_factor", "clip_factor"),
            ("agc_eps", "eps"),
            ("agc_mask", "mask"),
            ("agc_axis", "axis"),
        )
    },
}


def make_train_step(
    loss_fn: LossFn,
    *,
    mode: str = "stream",
    has_aux: bool = False,
    mixed_precision: str | None = None,
    axis_name: str | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
    weight_fn: Callable[[Any], Any] | None = None,
    unroll: int | bool = 1,
    gather_params: str = "window",
    reduce_scatter: str = "microbatch",
    optimizer_sharding: str = "replicated",
    batch_axis: Any = 0,
    aux_rows: bool = False,
    **removed: Any,
) -> TrainStep:
    """Builds a jitted ``step(state, batch, rng=None) -> (state, metrics)`` that accumulates.

    K and every accumulation policy come from the state's optimizer,
    ``accumjax.accumulate(inner, K, ...)`` (a plain optax optimizer is a window of one
    microbatch); the step builds that state, ``step.init(params, tx, model_state=...)``
    (`accumjax.TrainStep.init`), laid out for its mode, mesh and precision. On arrays on a
    mesh the same step runs each device's rows and reduces the gradient once per window.
    Guides: :doc:`/guides/modes` (the modes, the loss function's forms, the metrics, keys),
    :doc:`/guides/data_parallel`, :doc:`/guides/mixed_precision`; :doc:`/limits`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, a scalar mean over the (micro)batch; with
        model state, ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``;
        ``has_aux=True`` adds an aux output; ``step(state, batch, rng)`` adds a last
        argument, a key per microbatch, device and update.
      mode: ``"stream"`` (one microbatch per call; an update on every K-th call) or
        ``"scan"`` (the whole batch per call, K strided microbatches inside).
      has_aux: ``loss_fn`` also returns auxiliary outputs (``metrics["aux"]``; stacked over
        microbatches in scan mode).
      mixed_precision: ``None``, ``"bfloat16"`` (the loss sees the parameters in bfloat16 and
        the batch as given, so float masks and weights are not rounded: give float model
        inputs in bfloat16 to compute in it; master params, gradients and accumulator keep
        their dtype) or ``"float16"`` (the same, with a dynamic loss scale that ``step.init``
        makes and the step adjusts once per window).
      axis_name: with ``mesh``, the mesh's data axis; without, the step is ``jax.pmap``-ped
        over this axis name (replicated state, per-device metrics).
      mesh: the mesh the step runs on, needed only where the arrays do not say (a mesh with
        several axes of more than one device); arrays off it are put on it.
      donate: donate the input state's buffers to the output.
      weight_fn: ``weight_fn(microbatch) -> scalar`` weight (e.g. its number of tokens), for
        ``accumulate(..., scaling="weighted")``.
      unroll: scan mode: microbatches per loop iteration (``True``: the whole window), as in
        ``lax.scan``; convnets on CPU want ``True``.
      gather_params: scan mode with FSDP parameters: ``"window"`` (default) gathers them once
        per window, ``"microbatch"`` in every microbatch, for less memory.
      reduce_scatter: scan mode with parameters split over the data axis (FSDP):
        ``"microbatch"`` (default) reduce-scatters each microbatch's gradient into an
        accumulator sharded like the parameters (a 1/N-size accumulator per device, K
        reduce-scatters a window); ``"window"`` keeps a full-size sum on every device and
        reduces it once, when the window closes (one reduction, three full-size gradients
        of memory per device). Replicated parameters are reduced once per window either way.
      optimizer_sharding: under ``jit`` on a mesh, where parameters replicated over the data
        axis keep their optimizer state: ``"replicated"`` (default: every device the full
        state, one all-reduce of the window's gradient), ``"zero1"`` (ZeRO-1: the state
        split over the data axis; each device's full-size window sum is reduce-scattered
        once, the optimizer runs on the shards and the new parameters are all-gathered once)
        or ``"zero2"`` (ZeRO-2: also each microbatch's gradient reduce-scattered into a
        1/N-size accumulator, K reduce-scatters a window). ``step.init`` lays the state out;
        a state the user split over the data axis himself runs as ``"zero1"`` with his
        layout. A leaf with no dimension that divides by the devices stays replicated.
        ``pmap`` keeps its replicated layout (a ZeRO choice with ``axis_name`` and no ``mesh``
        is refused). See :doc:`/guides/data_parallel`.
      batch_axis: scan mode: the batch axis split into microbatches, an int or a pytree prefix
        of the batch (``None`` at a leaf leaves it unsplit, full-size); only 0 on a mesh.
      aux_rows: scan mode with ``has_aux``: aux in the batch's row order, shape ``(B, ...)``,
        instead of stacked per microbatch, ``(K, B // K, ...)``.
      **removed: none taken: the arguments accumjax 0.4 removed (``accum_steps``,
        ``use_agc``, ``clip_factor``, ``agc_eps``, ``agc_mask``, ``agc_axis``) raise a
        ``TypeError`` naming what to write instead.

    Returns:
      The `accumjax.TrainStep`: ``step(state, batch, rng=None)`` (scan mode also takes
      ``num_real_microbatches``, the real microbatches of a padded batch) returns the new
      state and ``metrics`` (on a mesh every metric is global, a scalar; under ``pmap`` one
      per device):

      * ``"loss"``: scan mode, the window's weighted mean loss over the microbatches it
        added (NaN if none); stream mode, this call's microbatch's loss.
      * ``"updated"``: this call closed a window and applied its update (``state.step``
        counts those). False on a stream call that does not close its window, and on a
        call whose window was not usable: nothing added, a non-finite sum, or
        ``on_nonfinite="skip_window"`` after a non-finite microbatch (`accumjax.stats`'
        ``skipped_windows``).
      * ``"skipped_microbatches"``: int32, how many of the microbatches this call computed
        were left out of the window (non-finite, an invalid weight, ``skip_fn``): scan mode,
        of its K (or ``num_real_microbatches``); stream mode, its one, 0 or 1. Summed over
        the calls it is `accumjax.stats`' ``skipped_microbatches``.
      * ``"nonfinite_microbatches"``: int32, how many of those had a NaN/Inf gradient or an
        invalid weight (0 under ``on_nonfinite="propagate"``, which does not look); summed,
        `accumjax.stats`' ``num_nonfinite``. Both counts are whole microbatches, the same on
        one device and on N.
      * ``"grad_norm"``: the global norm of the window gradient the inner optimizer saw at
        this call; 0.0 on a call that applied no update (never NaN for that reason).
      * ``"grads_finite"`` (float16): no microbatch of this call's window so far had a
        non-finite gradient (an overflow) or an invalid weight. Scan mode: none of the K.
        Stream mode: False from the call whose microbatch overflowed through the call that
        closes that window; the next window starts afresh.
      * ``"loss_scale"`` (float16): the dynamic loss scale after this call. It changes only
        where a window closes: lowered after a window with an overflow, raised after
        ``period`` windows without.
      * ``"aux"`` (``has_aux``): the loss function's aux; in scan mode stacked per
        microbatch, ``(K, ...)``, or in the batch's row order with ``aux_rows``.

    Raises:
      ValueError, TypeError: naming the argument: here for invalid arguments; at the call
        or at trace time for a state that is not a `accumjax.TrainState`, is laid out for the
        other mode or another number of devices, holds a donated array, or whose optimizer
        is ``optax.MultiSteps`` or has another K or scaling than it was made with; a batch
        not divisible by K; an ``rng`` that is not one key; a ``loss_fn`` output that does
        not match ``has_aux``; a state and batch on different meshes.

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
      >>> state, metrics = step(state, {"x": x, "y": y})  # 4 microbatches of 2 rows
      >>> int(state.step), bool(metrics["updated"]), round(float(metrics["loss"]), 2)
      (1, True, 8.35)
    """
    raise_on_unknown_kwargs("make_train_step", removed, _REMOVED)
    check_callable("loss_fn", loss_fn, optional=False)
    compute_dtype = _PRECISIONS[
        check_choice("mixed_precision", mixed_precision, tuple(_PRECISIONS))
    ]
    _check_mesh(mesh, axis_name)
    setup = Setup(
        grad_fn=make_grad_fn(loss_fn, has_aux, compute_dtype),
        mode=check_choice("mode", mode, MODES),
        axis_name=axis_name,
        weight_fn=check_callable("weight_fn", weight_fn),
        f16=mixed_precision == "float16",
        unroll=_check_unroll(unroll),
        gather_params=check_choice("gather_params", gather_params, _FSDP_TIMINGS),
        reduce_scatter=_check_scan_only(
            "reduce_scatter",
            check_choice("reduce_scatter", reduce_scatter, _FSDP_TIMINGS),
            _FSDP_TIMINGS[1],
            mode,
        ),
        optimizer_sharding=_check_zero_on_a_mesh(optimizer_sharding, axis_name, mesh),
        loss_positional=positional_limit(loss_fn),
        batch_axis=_check_scan_only("batch_axis", check_batch_axis(batch_axis), 0, mode),
        aux_rows=_check_scan_only("aux_rows", _check_bool("aux_rows", aux_rows), False, mode),
        mesh=mesh,
    )
    return wrap(setup, donate)


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


def _check_zero_on_a_mesh(optimizer_sharding: Any, axis_name: Any, mesh: Any) -> str:
    """``optimizer_sharding`` validated; a ZeRO layout is refused for ``pmap`` (``axis_name``
    without ``mesh``), whose state is replicated per device."""
    choice = check_optimizer_sharding(optimizer_sharding)
    if choice != "replicated" and axis_name is not None and mesh is None:
        raise ValueError(
            f"optimizer_sharding={choice!r} splits the optimizer state over a mesh's data axis "
            f"under jit; make_train_step(axis_name={axis_name!r}) without mesh= runs under "
            "jax.pmap, which keeps a full replica per device. Put the arrays on a mesh "
            "(parameters replicated, the batch split over its data axis) and leave axis_name "
            f"out, or pass mesh=...; or keep optimizer_sharding='replicated' under pmap."
        )
    return choice


def _check_mesh(mesh: Any, axis_name: str | None) -> None:
    """Refuses a step's own ``mesh`` that is not a mesh, or has no axis ``axis_name``."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is None:
        raise ValueError("mesh needs axis_name: the mesh axis the batch is split over.")
    check_mesh_axis(axis_name, mesh)
