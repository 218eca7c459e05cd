"""A jitted train-step factory with gradient accumulation.

:func:`make_train_step` is the functional form of the ``GradientAccumulateModel`` of
the TensorFlow library andreped/GradientAccumulator
(https://github.com/andreped/GradientAccumulator): it builds
``step(state, batch) -> (state, metrics)`` for a Flax-style :class:`TrainState`, in
one of two modes:

* ``"stream"``: one microbatch per call; accumulation lives in the optimizer
  (``tx=accumjax.accumulate(inner, K)``), parameters change every ``K`` calls.
* ``"scan"``: one call takes the whole batch, splits it into ``accum_steps``
  microbatches, sums their gradients in a float32 ``lax.scan`` carry and applies one
  optimizer update with the mean gradient.

Both support bfloat16/float16 mixed precision (float32 master weights and
accumulator; dynamic loss scaling for float16) and data parallelism over ``pmap``
or a ``shard_map`` mesh, with gradients all-reduced once per accumulation window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, PartitionSpec

from accumjax.accumulation import AccumulationState, has_updated
from accumjax.clipping import adaptive_clip_grad
from accumjax.loss_scale import (
    DynamicLossScale,
    adjust_loss_scale,
    all_finite,
    dynamic_loss_scale,
    scale_loss,
    unscale_grads,
)

__all__ = ["TrainState", "make_train_step"]

_MODES = ("stream", "scan")
_PRECISIONS = {None: None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

LossFn = Callable[..., Any]
Step = Callable[[Any, Any], tuple[Any, dict[str, Any]]]


class TrainState(train_state.TrainState):
    """Flax ``TrainState`` plus non-trainable model state and a loss scale.

    Attributes:
      step: number of optimizer updates applied (windows, not microbatches).
      apply_fn, params, tx, opt_state: as in ``flax.training.train_state.TrainState``.
      model_state: non-trainable collections (e.g. ``{"batch_stats": ...}``) or
        ``None``; when not ``None`` the loss function receives and returns it.
      loss_scale: a :class:`accumjax.DynamicLossScale`, used by
        ``mixed_precision="float16"`` (the step creates a default one if ``None``).
    """

    model_state: Any = None
    loss_scale: DynamicLossScale | None = struct.field(pytree_node=True, default=None)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any] | None,
        params: Any,
        tx: optax.GradientTransformation,
        model_state: Any = None,
        loss_scale: DynamicLossScale | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Creates a state with ``step == 0`` and ``opt_state = tx.init(params)``.

        Args:
          apply_fn: usually ``model.apply`` (kept for convenience; the step never calls it,
            so ``None`` is fine).
          params: the float32 master parameters.
          tx: the optimizer; ``accumjax.accumulate(inner, K)`` for stream mode.
          model_state: non-trainable collections, e.g. ``{"batch_stats": ...}``.
          loss_scale: a dynamic loss scale for float16 training.
          **kwargs: further fields of a subclass.

        Returns:
          A new :class:`TrainState`.

        Example:
          >>> import jax.numpy as jnp, optax, accumjax
          >>> state = accumjax.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
          >>> int(state.step), state.model_state is None
          (0, True)
        """
        if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
            raise TypeError(
                "loss_scale must be an accumjax.DynamicLossScale (accumjax.dynamic_loss_scale()), "
                f"got {type(loss_scale).__name__}."
            )
        state = cls(
            step=jnp.zeros((), jnp.int32),
            apply_fn=cast(Callable[..., Any], apply_fn),  # None is fine: the step never calls it
            params=params,
            tx=tx,
            opt_state=tx.init(params),
            model_state=model_state,
            loss_scale=loss_scale,
            **kwargs,
        )
        return _unalias(state)


def _unalias(tree: Any) -> Any:
    """Copies leaves that are the same array object as an earlier leaf.

    Optimizer ``init`` functions may reuse one zeros array for several fields; a donating
    step cannot donate one buffer twice.
    """
    seen: set[int] = set()

    def copy_repeat(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if id(x) in seen:
            return jnp.copy(x)
        seen.add(id(x))
        return x

    return jax.tree.map(copy_repeat, tree)


# ----------------------------------------------------------------------------- helpers


def _cast_floats(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _pvary(tree: Any, axis_name: str | None) -> Any:
    """Marks values as device-varying so their gradients are not all-reduced implicitly."""
    if axis_name is None:
        return tree

    def cast(x: Any) -> Any:
        if axis_name in getattr(jax.typeof(x), "vma", frozenset()):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


def _to_f32(tree: Any) -> Any:
    """float32 copies of the leaves (float64 kept), so one all-reduce group carries them all."""
    return jax.tree.map(
        lambda x: x if jnp.asarray(x).dtype == jnp.float64 else jnp.asarray(x, jnp.float32), tree
    )


def _mean_from_sum(summed: Any, like: Any, n: int) -> Any:
    """Cross-device mean from a psum of ``_to_f32(like)``, back in ``like``'s dtypes."""

    def mean(s: jax.Array, old: Any) -> jax.Array:
        dtype = jnp.asarray(old).dtype
        m = s / n
        return (m if jnp.issubdtype(dtype, jnp.inexact) else jnp.round(m)).astype(dtype)

    return jax.tree.map(mean, summed, like)


def _pmean_model_state(model_state: Any, axis_name: str) -> Any:
    summed = jax.lax.psum(_to_f32(model_state), axis_name)
    return _mean_from_sum(summed, model_state, jax.lax.axis_size(axis_name))


def _unpack(out: Any, has_aux: bool, with_model_state: bool) -> tuple[Any, Any, Any]:
    """Splits a loss_fn output into ``(loss, new_model_state, aux)``."""
    hint = (
        "loss_fn must return loss, or (loss, aux) with has_aux=True"
        if not with_model_state
        else "with model state loss_fn must return (loss, new_model_state), or "
        "(loss, (new_model_state, aux)) with has_aux=True"
    )
    if not with_model_state and not has_aux:
        if isinstance(out, tuple):
            raise TypeError(f"loss_fn returned a tuple; pass has_aux=True. ({hint})")
        return out, None, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"loss_fn returned {type(out).__name__}; {hint}.")
    if not with_model_state:
        return out[0], None, out[1]
    if not has_aux:
        return out[0], out[1], None
    if not (isinstance(out[1], tuple) and len(out[1]) == 2):
        raise TypeError(f"loss_fn's second output is not (new_model_state, aux); {hint}.")
    return out[0], out[1][0], out[1][1]


def _check_loss(loss: Any) -> jax.Array:
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"loss_fn must return a floating scalar loss, got {loss.dtype}{list(loss.shape)} "
            "(did you forget has_aux=True, or a .mean()?)."
        )
    return loss.astype(jnp.float32)


def _check_model_state(new: Any, old: Any, has_aux: bool) -> Any:
    if jax.tree.structure(new) != jax.tree.structure(old):
        hint = (
            ""
            if has_aux
            else " If loss_fn returns (loss, (new_model_state, aux)), pass has_aux=True."
        )
        raise TypeError(
            "loss_fn returned a new model state whose structure differs from state.model_state: "
            f"{jax.tree.structure(new)} vs {jax.tree.structure(old)}.{hint}"
        )
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.asarray(o).dtype), new, old)


def _make_grad_fn(
    loss_fn: LossFn, has_aux: bool, compute_dtype: Any
) -> Callable[..., tuple[jax.Array, Any, Any, Any]]:
    """``grad_fn(params, model_state, batch, loss_scale) -> (loss, model_state, aux, grads)``.

    Gradients are float32 (w.r.t. the float32 master params), unscaled.
    """

    def scaled_loss(params, model_state, batch, loss_scale):
        args = (_cast_floats(params, compute_dtype),)
        if model_state is not None:
            args += (model_state,)
        out = loss_fn(*args, _cast_floats(batch, compute_dtype))
        loss, new_model_state, aux = _unpack(out, has_aux, model_state is not None)
        loss = _check_loss(loss)
        if model_state is not None:
            new_model_state = _check_model_state(new_model_state, model_state, has_aux)
        scaled = loss if loss_scale is None else scale_loss(loss_scale, loss)
        return scaled, (loss, new_model_state, aux)

    def grad_fn(params, model_state, batch, loss_scale):
        grad = jax.grad(scaled_loss, has_aux=True)
        grads, (loss, new_model_state, aux) = grad(params, model_state, batch, loss_scale)
        if loss_scale is not None:
            grads = unscale_grads(loss_scale, grads)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return loss, new_model_state, aux, grads

    return grad_fn


def _is_accumulation_state(opt_state: Any) -> bool:
    return isinstance(AccumulationState, type) and isinstance(opt_state, AccumulationState)


def _weight(weight_fn: Callable[[Any], Any], batch: Any) -> jax.Array:
    w = jnp.asarray(weight_fn(batch))
    if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}.")
    return w.astype(jnp.float32)


def _split_microbatches(batch: Any, k: int) -> Any:
    shapes = [jnp.shape(x) for x in jax.tree.leaves(batch)]
    if not shapes or len({shape[:1] for shape in shapes}) != 1 or not shapes[0]:
        raise ValueError(
            f"scan mode needs every batch leaf to share one leading batch axis, got {shapes}."
        )
    size = shapes[0][0]
    if size % k:
        raise ValueError(
            f"scan mode: the (per-device) batch size {size} is not divisible by accum_steps={k}."
        )
    return jax.tree.map(lambda x: jnp.reshape(x, (k, size // k, *jnp.shape(x)[1:])), batch)


def _check_state(state: Any, f16: bool) -> DynamicLossScale | None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step expects an accumjax.TrainState, got {type(state).__name__}; create it with "
            "accumjax.TrainState.create(apply_fn=..., params=..., tx=...)."
        )
    if not f16:
        return None
    return dynamic_loss_scale() if state.loss_scale is None else state.loss_scale


def _finish(
    state: TrainState,
    new: dict[str, Any],
    finite: jax.Array | None,
    loss_scale: DynamicLossScale | None,
    updated: jax.Array,
) -> TrainState:
    """Applies ``new`` fields, or keeps the old ones bit for bit when ``finite`` is False."""
    if finite is not None and loss_scale is not None:
        old = {k: getattr(state, k) for k in new}
        new = _select(finite, new, old)
        new["loss_scale"] = adjust_loss_scale(loss_scale, finite)
    step = jnp.asarray(state.step)
    return state.replace(step=step + updated.astype(step.dtype), **new)


# ----------------------------------------------------------------------------- modes


def _stream_step(
    grad_fn: Callable[..., Any],
    accum_steps: int,
    axis_name: str | None,
    weight_fn: Callable[[Any], Any] | None,
    f16: bool,
) -> Step:
    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        loss_scale = _check_state(state, f16)
        accumulating = _is_accumulation_state(state.opt_state)
        if accum_steps > 1 and not accumulating:
            raise TypeError(
                f"mode='stream' with accum_steps={accum_steps} accumulates in the optimizer: "
                f"create the state with tx=accumjax.accumulate(inner_tx, {accum_steps}) "
                "(outermost), or use mode='scan'."
            )
        if weight_fn is not None and not accumulating:
            raise TypeError(
                "weight_fn in stream mode needs "
                "tx=accumjax.accumulate(inner, K, scaling='weighted')."
            )
        params = _pvary(state.params, axis_name)
        loss, model_state, aux, grads = grad_fn(params, state.model_state, batch, loss_scale)
        if axis_name is not None and not accumulating:
            grads = jax.lax.pmean(grads, axis_name)  # one all-reduce per (one-microbatch) window
        finite = all_finite(grads) if f16 else None
        if finite is not None and axis_name is not None and accumulating:
            overflowed = jax.lax.psum(jnp.where(finite, 0.0, 1.0), axis_name)
            finite = overflowed == 0  # every replica must skip the same microbatch
        extra = {} if weight_fn is None else {"weight": _weight(weight_fn, batch)}
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **extra)
        updated = has_updated(cast(AccumulationState, opt_state)) if accumulating else True
        updated = jnp.asarray(updated)
        if axis_name is not None and model_state is not None:
            axis = axis_name  # window end: average model state across replicas
            model_state = jax.lax.cond(
                updated, lambda m: _pmean_model_state(m, axis), lambda m: m, model_state
            )
        updated = updated if finite is None else updated & finite
        new = {
            "params": optax.apply_updates(state.params, updates),
            "opt_state": opt_state,
            "model_state": model_state,
        }
        state = _finish(state, new, finite, loss_scale, updated)
        return state, _metrics(loss, updated, aux, finite, state.loss_scale)

    return step


def _scan_step(
    grad_fn: Callable[..., Any],
    accum_steps: int,
    axis_name: str | None,
    weight_fn: Callable[[Any], Any] | None,
    f16: bool,
    agc: tuple[float, float] | None,
    unroll: int | bool,
) -> Step:
    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        loss_scale = _check_state(state, f16)
        if _is_accumulation_state(state.opt_state):
            raise TypeError(
                "mode='scan' accumulates inside the step: pass the plain inner optimizer as tx, "
                "not accumjax.accumulate(...)."
            )
        microbatches = _split_microbatches(batch, accum_steps)
        params = _pvary(state.params, axis_name)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), state.params)
        carry = (zeros, jnp.float32(0), jnp.float32(0), state.model_state)

        def body(carry, microbatch):
            acc, weight_sum, loss_sum, model_state = carry
            loss, model_state, aux, grads = grad_fn(params, model_state, microbatch, loss_scale)
            if weight_fn is None:
                acc, w = jax.tree.map(jnp.add, acc, grads), jnp.float32(1)
            else:
                w = _weight(weight_fn, microbatch)
                acc = jax.tree.map(lambda a, g: a + w * g, acc, grads)
            return (acc, weight_sum + w, loss_sum + w * loss, model_state), aux

        carry, aux = _scan(body, _pvary(carry, axis_name), microbatches, accum_steps, unroll)
        acc, weight_sum, loss_sum, model_state = carry
        if axis_name is not None:  # one all-reduce group per window, all float32
            summed = jax.lax.psum((acc, weight_sum, loss_sum, _to_f32(model_state)), axis_name)
            acc, weight_sum, loss_sum, summed_state = summed
            model_state = _mean_from_sum(summed_state, model_state, jax.lax.axis_size(axis_name))
        grads = jax.tree.map(lambda a: a / weight_sum, acc)
        finite = all_finite(grads) if f16 else None
        if agc is not None:
            grads = adaptive_clip_grad(state.params, grads, *agc)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        new = {
            "params": optax.apply_updates(state.params, updates),
            "opt_state": opt_state,
            "model_state": model_state,
        }
        updated = jnp.asarray(True) if finite is None else finite
        state = _finish(state, new, finite, loss_scale, updated)
        return state, _metrics(loss_sum / weight_sum, updated, aux, finite, state.loss_scale)

    return step


def _scan(body: Callable[..., Any], carry: Any, xs: Any, k: int, unroll: int | bool) -> Any:
    """``lax.scan``, or a plain call when there is one microbatch.

    XLA:CPU runs some ops (convolutions above all) far slower inside a loop body than outside
    it; with K == 1 there is no loop to pay for.
    """
    if k > 1:
        return jax.lax.scan(body, carry, xs, unroll=unroll)
    carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys)


def _metrics(
    loss: jax.Array,
    updated: jax.Array,
    aux: Any,
    finite: jax.Array | None,
    loss_scale: DynamicLossScale | None,
) -> dict[str, Any]:
    metrics: dict[str, Any] = {"loss": loss, "updated": updated}
    if finite is not None and loss_scale is not None:
        metrics["grads_finite"] = finite
        metrics["loss_scale"] = loss_scale.loss_scale
    if aux is not None:
        metrics["aux"] = aux
    return metrics


# ----------------------------------------------------------------------------- wrapping


def _shard_map(
    step: Step,
    mesh: Mesh,
    axis_name: str,
    mode: str,
    has_aux: bool,
    f16: bool,
) -> Step:
    """Batch sharded on ``axis_name``, state replicated.

    Stream mode keeps a device-local accumulator in the (nominally replicated) optimizer
    state between window ends, so it runs without the replication check.
    """
    local = PartitionSpec(axis_name)
    metric_specs: dict[str, Any] = {"loss": PartitionSpec(), "updated": PartitionSpec()}
    if f16:
        metric_specs.update(grads_finite=PartitionSpec(), loss_scale=PartitionSpec())
    if has_aux:
        metric_specs["aux"] = local
    if mode == "stream":
        metric_specs["loss"] = local
    stacked = ("loss", "aux") if mode == "stream" else ()

    def per_device(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        state, metrics = step(state, batch)
        for key in stacked:  # device-local values get a leading device axis
            if key in metrics:
                metrics[key] = jax.tree.map(lambda x: jnp.expand_dims(x, 0), metrics[key])
        return state, metrics

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), local),
        out_specs=(PartitionSpec(), metric_specs),
        check_vma=mode == "scan",
    )


def _validate(
    loss_fn: Any,
    accum_steps: Any,
    mode: Any,
    mixed_precision: Any,
    use_agc: bool,
    clip_factor: float,
    agc_eps: float,
    axis_name: Any,
    mesh: Any,
    weight_fn: Any,
    unroll: Any,
) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int):
        raise TypeError(f"accum_steps must be an int >= 1, got {accum_steps!r}.")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
    if mixed_precision not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision must be None, 'bfloat16' or 'float16', got {mixed_precision!r}."
        )
    if use_agc and mode == "stream":
        raise ValueError(
            "use_agc applies to scan mode; in stream mode put accumjax.adaptive_clip(...) in the "
            "inner chain: accumjax.accumulate(optax.chain(accumjax.adaptive_clip(0.01), inner), K)."
        )
    if use_agc and not (clip_factor > 0 and agc_eps > 0):
        raise ValueError(f"clip_factor and agc_eps must be > 0, got {clip_factor}, {agc_eps}.")
    if not isinstance(unroll, bool) and not (isinstance(unroll, int) and unroll >= 1):
        raise ValueError(f"unroll must be True, False or an int >= 1, got {unroll!r}.")
    if weight_fn is not None and not callable(weight_fn):
        raise TypeError(f"weight_fn must be callable or None, got {type(weight_fn).__name__}.")
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if axis_name is None:
            raise ValueError("mesh needs axis_name: the mesh axis the batch is sharded over.")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}."
            )


def make_train_step(
    loss_fn: LossFn,
    *,
    accum_steps: int = 1,
    mode: str = "stream",
    has_aux: bool = False,
    use_agc: bool = False,
    clip_factor: float = 0.01,
    agc_eps: float = 1e-3,
    mixed_precision: str | None = None,
    axis_name: str | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
    weight_fn: Callable[[Any], Any] | None = None,
    unroll: int | bool = 1,
) -> jax.stages.Wrapped:
    """Builds a jitted ``step(state, batch) -> (state, metrics)`` with gradient accumulation.

    The loss function follows the shape of ``state``:

    * ``state.model_state is None``: ``loss_fn(params, batch) -> loss``, or
      ``(loss, aux)`` with ``has_aux=True``.
    * otherwise (e.g. ``{"batch_stats": ...}``):
      ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, or
      ``(loss, (new_model_state, aux))`` with ``has_aux=True``.

    ``loss`` is a scalar mean over the (micro)batch. Modes:

    * ``"stream"``: ``batch`` is one microbatch; with ``accum_steps > 1`` the state
      must be created with ``tx=accumjax.accumulate(inner, accum_steps)``, which applies
      ``inner`` every ``accum_steps`` calls. For data parallelism pass
      ``accumulate(inner, K, axis_name=axis_name)`` so gradients are all-reduced once
      per window. For AGC put ``accumjax.adaptive_clip(...)`` in the inner chain.
    * ``"scan"``: ``batch`` is the whole batch (leading axis ``B``, divisible by
      ``accum_steps``, per device); the step scans over ``accum_steps`` microbatches,
      sums float32 gradients and applies one update of the plain optimizer ``tx`` with
      the mean gradient (``sum(w_i g_i) / sum(w_i)`` with ``weight_fn``). Model state
      is threaded through the microbatches.

    Args:
      loss_fn: the loss, see above.
      accum_steps: microbatches per optimizer update (``int >= 1``).
      mode: ``"stream"`` or ``"scan"``.
      has_aux: whether ``loss_fn`` also returns auxiliary outputs (``metrics["aux"]``;
        stacked over microbatches in scan mode).
      use_agc: scan mode only: adaptive gradient clipping
        (:func:`accumjax.adaptive_clip_grad`) of the accumulated gradient, once per window.
      clip_factor, agc_eps: AGC parameters.
      mixed_precision: ``None``; ``"bfloat16"`` (params and float inputs cast to
        bfloat16 for the loss, float32 master params, gradients and accumulator); or
        ``"float16"``: the same with float16 plus dynamic loss scaling
        (``state.loss_scale``; a default :func:`accumjax.dynamic_loss_scale` is created
        if it is ``None``). An overflowed microbatch (stream) or window (scan) leaves
        params, optimizer and model state unchanged and lowers the scale.
      axis_name: data parallelism. Without ``mesh`` the step is ``jax.pmap``-ped: the
        state carries a leading device axis (:func:`accumjax.distributed.replicate`) and
        so does the batch. Scan mode all-reduces gradients, loss, weights and model state
        (as float32) in one ``psum`` after the scan: one all-reduce per window. Stream mode
        relies on ``accumulate(..., axis_name=axis_name)`` for the gradients (without it
        replicas diverge); with ``accum_steps=1`` and a plain optimizer the step averages
        the gradients itself. Model state is averaged across devices once per window
        (BatchNorm statistics: the mean of the per-device statistics). float16 adds a
        scalar all-reduce per stream call so that every replica skips the same microbatch.
      mesh: a ``jax.sharding.Mesh``; with ``axis_name`` the step is
        ``jax.jit(jax.shard_map(...))`` with the batch sharded on ``axis_name`` and
        the state replicated. In stream mode each device's window accumulator inside
        ``opt_state`` is device-local between window ends although the state is declared
        replicated (so that mode runs without the replication check): save checkpoints
        at window boundaries, where the accumulators are empty on every device.
      donate: donate the input state's buffers to the output (do not reuse arrays that
        went into ``TrainState.create``; copy them first).
      weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a microbatch (e.g. its
        number of valid tokens); in stream mode it is passed as ``weight=`` to
        ``accumulate(..., scaling="weighted")``.
      unroll: scan mode: microbatches per loop iteration, passed to ``lax.scan`` (``True``
        unrolls the whole window: no loop, more memory). On CPU, XLA runs convolutions far
        slower inside a loop body than outside, so convnets want ``unroll=True`` there.
        MLPs do not gain from it (temp memory grows with the unroll; see the benchmarks).

    Returns:
      The jitted step. ``metrics`` has ``"loss"`` (float32: the window's mean loss in
      scan mode, the microbatch's in stream mode, one entry per device with data
      parallelism in stream mode), ``"updated"`` (whether parameters changed; then
      ``state.step``, which counts updates, grows by one), ``"grads_finite"`` and
      ``"loss_scale"`` with float16, and ``"aux"`` with has_aux. ``state.loss_scale`` is
      only used and updated with float16.

    Raises:
      ValueError / TypeError: for invalid arguments here, and at trace time for a
      batch not divisible by ``accum_steps``, a stream-mode state without
      ``accumulate``, a scan-mode state with it, or a loss_fn output that does not
      match ``has_aux``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, accumjax
      >>> model = nn.Dense(1)
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> def loss_fn(params, batch):
      ...     pred = model.apply({"params": params}, batch["x"])
      ...     return jnp.mean((pred - batch["y"]) ** 2)
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
      >>> step = accumjax.make_train_step(loss_fn, accum_steps=4, mode="scan")
      >>> state, metrics = step(state, {"x": x, "y": y})
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

      With model state (here BatchNorm statistics) and stream mode:

      >>> model = nn.Sequential([nn.Dense(4), accumjax.AccumBatchNorm(
      ...     use_running_average=False, accum_steps=4), nn.Dense(1)])
      >>> variables = model.init(jax.random.key(0), x)
      >>> params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
      >>> def loss_fn(params, model_state, batch):
      ...     pred, new_model_state = model.apply(
      ...         {"params": params, **model_state}, batch["x"], mutable=list(model_state))
      ...     return jnp.mean((pred - batch["y"]) ** 2), new_model_state
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=model.apply, params=params, model_state=model_state,
      ...     tx=accumjax.accumulate(optax.adam(1e-3), 4))
      >>> step = accumjax.make_train_step(loss_fn, accum_steps=4, mode="stream")
      >>> for i in range(4):
      ...     state, metrics = step(state, {"x": x[2 * i : 2 * i + 2], "y": y[:2]})
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

    Reference: the ``GradientAccumulateModel`` of andreped/GradientAccumulator
    (Pedersen et al., https://github.com/andreped/GradientAccumulator).
    """
    _validate(
        loss_fn,
        accum_steps,
        mode,
        mixed_precision,
        use_agc,
        clip_factor,
        agc_eps,
        axis_name,
        mesh,
        weight_fn,
        unroll,
    )
    f16 = mixed_precision == "float16"
    grad_fn = _make_grad_fn(loss_fn, has_aux, _PRECISIONS[mixed_precision])
    if mode == "stream":
        step = _stream_step(grad_fn, accum_steps, axis_name, weight_fn, f16)
    else:
        agc = (clip_factor, agc_eps) if use_agc else None
        step = _scan_step(grad_fn, accum_steps, axis_name, weight_fn, f16, agc, unroll)
    donate_argnums = (0,) if donate else ()
    if axis_name is None:
        return jax.jit(step, donate_argnums=donate_argnums)
    if mesh is None:
        return jax.pmap(step, axis_name=axis_name, donate_argnums=donate_argnums)
    sharded = _shard_map(step, mesh, axis_name, mode, has_aux, f16)
    return jax.jit(sharded, donate_argnums=donate_argnums)
