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

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from accumjax import sharded
from accumjax import window as window_lib
from accumjax.accumulation import (
    AccumulationState,
    Config,
    check_int,
    check_positive_real,
    check_state,
    config_of,
    end_window,
    init_state,
    window_closes,
)
from accumjax.batch_norm import _is_step_driven, close_batch_norm_windows
from accumjax.clipping import Mask, adaptive_clip_grad
from accumjax.distributed import data_sharding
from accumjax.loss_scale import (
    DynamicLossScale,
    adjust_loss_scale,
    dynamic_loss_scale,
    scale_loss,
    unscale_grads,
)

__all__ = ["TrainState", "make_train_step"]

_MODES = ("stream", "scan")
_PRECISIONS = {None: None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

LossFn = Callable[..., Any]
Step = Callable[..., tuple[Any, dict[str, Any]]]


class TrainState(train_state.TrainState):
    """Flax ``TrainState`` plus non-trainable model state and a loss scale.

    Attributes:
      step: number of optimizer updates applied (windows, not microbatches), whichever
        way the state is advanced (``make_train_step`` or ``apply_gradients``).
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
          params: the master parameters (float32, or float64 with x64).
          tx: the optimizer: ``accumjax.accumulate(inner, K)`` (a plain optax optimizer is
            a window of one microbatch).
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

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """One optimizer call, as flax's; ``step`` grows only when an update was applied.

        Args:
          grads: one microbatch's gradients.
          **kwargs: other fields to replace.

        Returns:
          The new state.

        Example:
          >>> import jax.numpy as jnp, optax, accumjax
          >>> state = accumjax.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)},
          ...     tx=accumjax.accumulate(optax.sgd(0.1), 2))
          >>> state = state.apply_gradients(grads={"w": jnp.ones(2)})
          >>> int(state.step)
          0
        """
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        applied = opt_state.updated if isinstance(opt_state, AccumulationState) else True
        step = jnp.asarray(self.step)
        return self.replace(
            step=optax.safe_increment(step) if applied is True else _count_if(step, applied),
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


def _count_if(counter: jax.Array, flag: Any) -> jax.Array:
    return jnp.where(flag, optax.safe_increment(counter), counter)


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


# ----------------------------------------------------------------------------- the loss


class _Setup(NamedTuple):
    """What a step needs besides the state (static)."""

    grad_fn: Callable[..., Any]
    mode: str
    accum_steps: int | None
    axis_name: str | None
    weight_fn: Callable[[Any], Any] | None
    f16: bool
    transform: Callable[[Any, Any], Any] | None
    unroll: int | bool
    gather_params: str = "window"
    materialize: Callable[[Any, Any], Any] | None = None  # (params, microbatch index) -> params


def _cast_floats(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


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
    return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))


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


def _make_grad_fn(loss_fn: LossFn, has_aux: bool, compute_dtype: Any) -> Callable[..., Any]:
    """``grad_fn(params, model_state, batch, key, loss_scale) -> (loss, model_state, aux, grads)``.

    Gradients are unscaled and in the parameters' own dtypes (float64 stays float64, complex
    stays complex); ``key`` (or None) is passed to ``loss_fn`` as its last argument.
    """

    def scaled_loss(params, model_state, batch, key, loss_scale):
        args = (_cast_floats(params, compute_dtype),)
        if model_state is not None:
            args += (model_state,)
        args += (_cast_floats(batch, compute_dtype),)
        out = loss_fn(*args) if key is None else loss_fn(*args, key)
        loss, new_model_state, aux = _unpack(out, has_aux, model_state is not None)
        loss = _check_loss(loss)
        if model_state is not None:
            new_model_state = _check_model_state(new_model_state, model_state, has_aux)
        scaled = loss if loss_scale is None else scale_loss(loss_scale, loss)
        return scaled, (loss, new_model_state, aux)

    def grad_fn(params, model_state, batch, key, loss_scale):
        grad = jax.grad(scaled_loss, has_aux=True)
        grads, (loss, new_model_state, aux) = grad(params, model_state, batch, key, loss_scale)
        if loss_scale is not None:
            grads = unscale_grads(loss_scale, grads)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        return loss, new_model_state, aux, grads

    return grad_fn


# ----------------------------------------------------------------------------- the window


def _accumulation(setup: _Setup, state: Any) -> tuple[Config, AccumulationState, bool]:
    """``(config, accumulation state, owned)``: from an ``accumulate`` tx, or a one-microbatch
    window around a plain optimizer (``owned`` False: its counters are not kept)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step expects an accumjax.TrainState, got {type(state).__name__}; create it with "
            "accumjax.TrainState.create(apply_fn=..., params=..., tx=...)."
        )
    config = config_of(state.tx)
    if config is None:
        config = Config(optax.with_extra_args_support(state.tx), 1, window_lib.Policy(), None)
        owned = False
    else:
        owned = True
    if config.axis_name not in (None, setup.axis_name):
        raise ValueError(
            f"accumulate(axis_name={config.axis_name!r}) differs from make_train_step's "
            f"axis_name={setup.axis_name!r}; give the axis to make_train_step only."
        )
    config = config._replace(axis_name=setup.axis_name)
    k = config.static_k
    if setup.accum_steps is not None and k != setup.accum_steps:
        raise ValueError(
            f"make_train_step(accum_steps={setup.accum_steps}) but the optimizer's K is {k}: "
            "state K once, in tx=accumjax.accumulate(inner, K) (accum_steps may be omitted)."
        )
    if setup.mode == "scan" and k is None:
        raise TypeError("mode='scan' needs an int K in accumjax.accumulate, not a schedule.")
    if owned:
        acc = check_state(config, state.opt_state)
    else:
        acc = init_state(config, state.params, state.opt_state)
    return config, acc, owned


def _key(rng: Any, step: Any, index: Any, axis_name: str | None) -> Any:
    """A key distinct for every step, device and microbatch, reproducible from ``rng``."""
    if rng is None:
        return None
    key = jax.random.fold_in(jax.random.fold_in(rng, step), index)
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return key


class _Micro(NamedTuple):
    """The running per-window values of the loop carry."""

    window: window_lib.Window
    model_state: Any
    loss_sum: jax.Array
    loss_weight: jax.Array


def _microbatch(
    setup: _Setup,
    config: Config,
    params: Any,
    carry: _Micro,
    batch: Any,
    key: Any,
    loss_scale: Any,
    first: bool,
    inspected: window_lib.Microbatch | None = None,
) -> tuple[_Micro, jax.Array, Any]:
    """One microbatch: gradient, add to the window, keep its model state only if added.

    ``inspected``: the policy's decision about this microbatch, taken earlier (`_decisions`),
    or None to take it here.
    """
    loss, new_model_state, aux, grads = setup.grad_fn(
        params, carry.model_state, batch, key, loss_scale
    )
    weight = _weight(setup.weight_fn, batch)
    add = window_lib.first_microbatch if first else window_lib.add_microbatch
    window, micro = add(config.policy, carry.window, grads, weight, params, inspected)
    model_state = carry.model_state
    if model_state is not None:
        model_state = _select(micro.added, new_model_state, model_state)
    w = jnp.where(micro.added, 1.0 if weight is None else weight, 0.0)
    loss = loss.astype(carry.loss_sum.dtype)
    loss_sum = carry.loss_sum + jnp.where(micro.added, w * loss, 0.0)
    return _Micro(window, model_state, loss_sum, carry.loss_weight + w), loss, aux


def _weight(weight_fn: Callable[[Any], Any] | None, batch: Any) -> jax.Array | None:
    """The microbatch's scalar weight from ``weight_fn``, float32, or None without one."""
    if weight_fn is None:
        return None
    w = jnp.asarray(weight_fn(batch))
    if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}.")
    return w.astype(jnp.float32)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


class _Fields(NamedTuple):
    """The parts of the state a window close may change (a loop carry)."""

    params: Any
    opt: AccumulationState
    model_state: Any
    loss_scale: Any


def _close(
    setup: _Setup, config: Config, fields: _Fields, closed: window_lib.Closed | None = None
) -> _Fields:
    """Closes the window: one reduction, the decision, the update, model state, loss scale.

    With ``closed`` (reduced and decided inside a ``shard_map``, where the model state was
    closed too) only the update and the loss scale are left.
    """
    before = fields.opt
    params, opt = end_window(
        config,
        before,
        fields.params,
        fields.params,
        fields.params,
        {},
        setup.transform,
        True,
        closed,
    )
    apply = opt.updated
    model_state = fields.model_state
    if closed is None:
        model_state = _close_model_state(model_state, apply, setup.axis_name)
    loss_scale = fields.loss_scale
    if loss_scale is not None:
        loss_scale = adjust_loss_scale(loss_scale, opt.nonfinite_count == before.nonfinite_count)
    return _Fields(params, opt, model_state, loss_scale)


def _close_model_state(model_state: Any, apply: jax.Array, axis_name: str | None) -> Any:
    """BatchNorm windows closed with the window's decision; other float leaves averaged
    across devices once (integer and PRNG-key leaves never are)."""
    if model_state is None:
        return None
    model_state = close_batch_norm_windows(model_state, apply, axis_name)
    if axis_name is None:
        return model_state

    def averaged(leaf: Any) -> bool:
        dtype = jnp.result_type(leaf)
        return jnp.issubdtype(dtype, jnp.inexact) and not jax.dtypes.issubdtype(
            dtype, jax.dtypes.prng_key
        )

    leaves, treedef = jax.tree.flatten(model_state, is_leaf=_is_step_driven)
    picked = [i for i, x in enumerate(leaves) if not _is_step_driven(x) and averaged(x)]
    if picked:
        means = jax.lax.pmean([leaves[i] for i in picked], axis_name)
        for i, mean in zip(picked, means, strict=True):
            leaves[i] = mean
    return jax.tree.unflatten(treedef, leaves)


def _loss_scale(setup: _Setup, state: TrainState) -> DynamicLossScale | None:
    if not setup.f16:
        return None
    return dynamic_loss_scale() if state.loss_scale is None else state.loss_scale


def _finish(
    state: TrainState, fields: _Fields, owned: bool, micro: _Micro, aux: Any, loss: Any
) -> tuple[TrainState, dict[str, Any]]:
    updated = fields.opt.updated
    new = state.replace(
        step=_count_if(jnp.asarray(state.step), updated),
        params=fields.params,
        opt_state=fields.opt if owned else fields.opt.inner_tx_state,
        model_state=fields.model_state,
        loss_scale=fields.loss_scale if fields.loss_scale is not None else state.loss_scale,
    )
    metrics: dict[str, Any] = {"loss": loss, "updated": updated}
    if fields.loss_scale is not None:
        metrics["grads_finite"] = micro.window.window_nonfinite == 0
        metrics["loss_scale"] = fields.loss_scale.loss_scale
    if aux is not None:
        metrics["aux"] = aux
    return new, metrics


# ----------------------------------------------------------------------------- modes


def _start(setup: _Setup, state: TrainState, acc: AccumulationState) -> _Micro:
    zero = jnp.zeros((), jnp.float32)
    return _Micro(acc.window, state.model_state, zero, zero)


def _stream_step(setup: _Setup) -> Step:
    def step(state: TrainState, batch: Any, rng: Any = None) -> tuple[TrainState, dict]:
        config, acc, owned = _accumulation(setup, state)
        loss_scale = _loss_scale(setup, state)
        params = _pvary(state.params, setup.axis_name)
        key = _key(rng, state.step, acc.window.micro_step, setup.axis_name)
        micro, loss, aux = _microbatch(
            setup, config, params, _start(setup, state, acc), batch, key, loss_scale, not owned
        )
        opt = acc._replace(window=micro.window, updated=jnp.zeros((), bool))
        fields = _Fields(state.params, opt, micro.model_state, loss_scale)
        close = lambda f: _close(setup, config, f)
        fields = window_lib.run_once(window_closes(opt), close, fields) if owned else close(fields)
        return _finish(state, fields, owned, micro, aux, loss)

    return step


def _strided(batch: Any, k: int) -> Any:
    """``(B, ...) -> (B // k, k, ...)``: microbatch ``i`` is rows ``i, i + k, ...``.

    The leading axis keeps the batch's sharding, so every microbatch is split across the
    data-parallel devices exactly as the batch is.
    """
    shapes = [jnp.shape(x) for x in jax.tree.leaves(batch)]
    if not shapes or len({shape[:1] for shape in shapes}) != 1 or not shapes[0]:
        raise ValueError(
            f"scan mode needs every batch leaf to share one leading batch axis, got {shapes}."
        )
    size = shapes[0][0]
    if size % k:
        raise ValueError(
            f"scan mode: the (per-device) batch size {size} is not divisible by K={k}."
        )
    return jax.tree.map(lambda x: jnp.reshape(x, (size // k, k, *jnp.shape(x)[1:])), batch)


def _window_loop(
    setup: _Setup,
    config: Config,
    params: Any,
    start: _Micro,
    batch: Any,
    key: Callable[[Any], Any],
    loss_scale: Any,
) -> tuple[_Micro, Any]:
    """The window over the K strided microbatches of ``batch``: ``(carry, stacked aux)``.

    Scan mode holds the whole window's data, so when the policy only looks for non-finite
    values it need not inspect every microbatch: the gradients are added as they come (each
    leaf's add follows its gradient, with no norm pass and no wait for the other leaves),
    and only a window whose sum is not finite (a NaN/Inf or overflowed microbatch: any of
    them makes the sum non-finite) is computed again. The re-run takes the per-microbatch
    decisions in a first loop (`_decisions`) and adds with them in a second, so it holds no
    more memory than the blind loop. The result is the same as inspecting every microbatch
    (short of microbatches whose float32 norms overflow while their values cancel in the sum).
    """
    policy = config.policy
    take = _microbatches(setup, params, batch, cast(int, config.static_k))
    inspects = policy.skip_fn is not None or policy.max_norm is not None
    # At K=1 a re-run would compute the whole batch again; the one check costs a norm pass.
    if not policy.detects or inspects or config.static_k == 1:
        return _microbatch_loop(setup, config, take, start, key, loss_scale)
    blind = config._replace(policy=policy._replace(on_nonfinite="propagate"))
    found = _microbatch_loop(setup, blind, take, start, key, loss_scale)
    finite = jnp.isfinite(window_lib.global_norm(found[0].window.grad_sum))

    def inspect_each(_: Any) -> tuple[_Micro, Any]:
        decided = _decisions(setup, config, take, start, key, loss_scale)
        return _microbatch_loop(setup, config, take, start, key, loss_scale, decided)

    return window_lib.run_once(~finite, inspect_each, found)


def _microbatches(
    setup: _Setup, params: Any, batch: Any, k: int
) -> Callable[[jax.Array], tuple[Any, Any]]:
    """``i -> (params, rows)`` of microbatch ``i`` (the parameters as its gradient sees them)."""
    rows = _strided(batch, k)
    whole = setup.materialize or (lambda p, i: p)

    def take(i: jax.Array) -> tuple[Any, Any]:
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, False), rows)
        return whole(params, i), mb

    return take


def _decisions(
    setup: _Setup,
    config: Config,
    take: Callable[[jax.Array], tuple[Any, Any]],
    start: _Micro,
    key: Callable[[Any], Any],
    loss_scale: Any,
) -> window_lib.Microbatch:
    """The policy's decision about each of the K microbatches (stacked), nothing added.

    Each gradient only feeds reductions, so one leaf of it is alive at a time; the model state
    follows the decisions as in `_microbatch`.
    """

    def body(model_state: Any, i: jax.Array) -> tuple[Any, window_lib.Microbatch]:
        p, mb = take(i)
        _, new_model_state, _, grads = setup.grad_fn(p, model_state, mb, key(i), loss_scale)
        weight = _weight(setup.weight_fn, mb)
        decided = window_lib.inspect_microbatch(config.policy, grads, weight, p)
        if model_state is not None:
            model_state = _select(decided.added, new_model_state, model_state)
        return model_state, decided

    steps = jnp.arange(cast(int, config.static_k))
    return jax.lax.scan(body, start.model_state, steps, unroll=setup.unroll)[1]


def _microbatch_loop(
    setup: _Setup,
    config: Config,
    take: Callable[[jax.Array], tuple[Any, Any]],
    start: _Micro,
    key: Callable[[Any], Any],
    loss_scale: Any,
    decided: window_lib.Microbatch | None = None,
) -> tuple[_Micro, Any]:
    """One microbatch opens the window when K is 1 (no loop, no zeros); otherwise a
    ``lax.scan`` adds all K to a zero accumulator (with the ``decided`` decisions, if given:
    K > 1 only, `_window_loop` never re-runs a one-microbatch window).

    Every microbatch runs in the same loop body: computed outside the loop, the first one's
    activations are not shared with the loop's, and at K=2 (where XLA inlines a one-trip
    loop) both microbatches' activations are alive at once.
    """
    k = cast(int, config.static_k)
    if k == 1:
        p, mb = take(jnp.zeros((), jnp.int32))
        micro, _, aux = _microbatch(setup, config, p, start, mb, key(0), loss_scale, True)
        return micro, None if aux is None else jax.tree.map(lambda a: a[None], aux)

    def body(carry: _Micro, xs: tuple[jax.Array, Any]) -> tuple[_Micro, Any]:
        i, inspected = xs
        p, mb = take(i)
        carry, _, aux = _microbatch(
            setup, config, p, carry, mb, key(i), loss_scale, False, inspected
        )
        return carry, aux

    start = _pvary(start._replace(window=window_lib.empty_like(start.window)), setup.axis_name)
    return jax.lax.scan(body, start, (jnp.arange(k), decided), unroll=setup.unroll)


def _scan_finish(
    setup: _Setup,
    config: Config,
    state: TrainState,
    acc: AccumulationState,
    owned: bool,
    micro: _Micro,
    aux: Any,
    loss: Any,
    loss_scale: Any,
    closed: window_lib.Closed | None = None,
) -> tuple[TrainState, dict]:
    """Closes a scan-mode window (unless ``closed`` already) and builds the new state."""
    opt = acc._replace(window=micro.window, updated=jnp.zeros((), bool))
    fields = _Fields(state.params, opt, micro.model_state, loss_scale)
    fields = _close(setup, config, fields, closed)
    # The state's own (stream) window is handed back untouched: its buffer is donated to
    # the output instead of a fresh zero accumulator being allocated every step.
    fields = fields._replace(opt=fields.opt._replace(window=acc.window))
    if state.model_state is not None:  # a skipped window leaves all model state as it was
        kept = _select(fields.opt.updated, fields.model_state, state.model_state)
        fields = fields._replace(model_state=kept)
    return _finish(state, fields, owned, micro, aux, loss)


def _window_loss(micro: _Micro) -> jax.Array:
    return jnp.where(micro.loss_weight > 0, micro.loss_sum / micro.loss_weight, jnp.nan)


def _scan_step(setup: _Setup) -> Step:
    def step(state: TrainState, batch: Any, rng: Any = None) -> tuple[TrainState, dict]:
        config, acc, owned = _accumulation(setup, state)
        loss_scale = _loss_scale(setup, state)
        params = _pvary(state.params, setup.axis_name)
        key = lambda i: _key(rng, state.step, i, setup.axis_name)
        start = _start(setup, state, acc)
        micro, aux = _window_loop(setup, config, params, start, batch, key, loss_scale)
        loss = _window_loss(micro)
        return _scan_finish(setup, config, state, acc, owned, micro, aux, loss, loss_scale)

    return step


def _sharded_scan_step(setup: _Setup) -> Callable[..., tuple[TrainState, dict]]:
    """Scan mode under ``jit`` with a sharded batch: the microbatch loop and the window's one
    reduction run in a ``shard_map`` built from the arrays' shardings (`accumjax.sharded`);
    the update runs in the global view, on parameters as they are sharded."""
    plain = _scan_step(setup)

    def step(state: TrainState, batch: Any, rng: Any, layout: Any) -> tuple[TrainState, dict]:
        if layout is None:
            return plain(state, batch, rng)
        config, acc, owned = _accumulation(setup, state)
        loss_scale = _loss_scale(setup, state)
        specs = layout.param_specs()
        local_step = partial(_local_window, setup, config, layout)
        data, whole = PartitionSpec(layout.axis), PartitionSpec()
        closed_specs = window_lib.Closed(specs, *(whole,) * 5)  # pyright: ignore[reportArgumentType]
        closed, model_state, loss, aux = jax.shard_map(
            local_step,
            mesh=layout.mesh,
            in_specs=(specs, whole, data, whole, whole, whole),
            out_specs=(closed_specs, whole, data, data),
            check_vma=False,
        )(state.params, state.model_state, batch, rng, state.step, loss_scale)
        window = acc.window._replace(window_nonfinite=closed.nonfinite_count)
        micro = _Micro(window, model_state, jnp.zeros(()), jnp.zeros(()))
        return _scan_finish(setup, config, state, acc, owned, micro, aux, loss, loss_scale, closed)

    return step


def _local_window(
    setup: _Setup,
    config: Config,
    layout: Any,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: Any,
    step_count: Any,
    loss_scale: Any,
) -> tuple[window_lib.Closed, Any, jax.Array, Any]:
    """One device's part of a sharded window: its rows' gradients, summed locally, then the
    window's one reduction (all-reduce, or reduce-scatter for sharded parameters)."""
    zero = jnp.zeros((), jnp.float32)
    shapes = jax.eval_shape(partial(sharded.gather, layout=layout), params)
    like = window_lib.init_window(shapes, config.policy.accumulator_dtype)
    if setup.gather_params == "window":  # once, before the loop (more memory, one gather)
        params = sharded.gather(params, layout)
    else:  # in every microbatch, tied to its index so that XLA cannot hoist it
        gather = lambda p, i: sharded.gather(jax.lax.optimization_barrier((p, i))[0], layout)
        setup = setup._replace(materialize=gather)
    key = lambda i: _key(rng, step_count, i, layout.axis)
    start = _Micro(like, model_state, zero, zero)
    micro, aux = _window_loop(setup, config, params, start, batch, key, loss_scale)
    closed = window_lib.close_window(
        config.policy, micro.window, config.static_k, layout.axis, layout.scatter()
    )
    model_state = _close_model_state(micro.model_state, closed.apply, layout.axis)
    loss = sharded.expand(_window_loss(micro))
    return closed, model_state, loss, None if aux is None else sharded.expand(aux)


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def _pvary(tree: Any, axis_name: str | None) -> Any:
    """Marks values as device-varying so their gradients are not all-reduced implicitly."""
    if axis_name is None:
        return tree

    def cast(x: Any) -> Any:
        if axis_name in _varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


# ----------------------------------------------------------------------------- wrapping


def _shard_map(step: Step, mesh: Mesh, axis_name: str, has_aux: bool, f16: bool) -> Step:
    """Batch sharded on ``axis_name``, state replicated, the key replicated.

    Stream mode keeps a device-local accumulator in the (nominally replicated) optimizer
    state between window ends, so the step runs without the replication check.
    """
    local = PartitionSpec(axis_name)
    metric_specs: dict[str, Any] = {"loss": local, "updated": PartitionSpec()}
    if f16:
        metric_specs.update(grads_finite=local, loss_scale=PartitionSpec())
    if has_aux:
        metric_specs["aux"] = local
    per_device_keys = ("loss", "aux", "grads_finite")

    def per_device(state: Any, batch: Any, rng: Any) -> tuple[Any, dict[str, Any]]:
        state, metrics = step(state, batch, rng)
        for key in per_device_keys:  # device-local values get a leading device axis
            if key in metrics:
                metrics[key] = jax.tree.map(lambda x: jnp.expand_dims(x, 0), metrics[key])
        return state, metrics

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), local, PartitionSpec()),
        out_specs=(PartitionSpec(), metric_specs),
        check_vma=False,
    )


def _validate(
    loss_fn: Any,
    accum_steps: Any,
    mode: Any,
    mixed_precision: Any,
    axis_name: Any,
    mesh: Any,
    weight_fn: Any,
    unroll: Any,
    gather_params: Any,
) -> int | None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
    if mixed_precision not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision must be None, 'bfloat16' or 'float16', got {mixed_precision!r}."
        )
    if not isinstance(unroll, bool) and not (isinstance(unroll, int) and unroll >= 1):
        raise ValueError(f"unroll must be True, False or an int >= 1, got {unroll!r}.")
    if gather_params not in ("window", "microbatch"):
        raise ValueError(f"gather_params must be 'window' or 'microbatch', got {gather_params!r}.")
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
    return None if accum_steps is None else check_int("accum_steps", accum_steps)


def _agc(
    use_agc: bool, clip_factor: Any, agc_eps: Any, agc_mask: Mask
) -> Callable[[Any, Any], Any] | None:
    if not use_agc:
        if agc_mask is not None:
            raise ValueError("agc_mask is given but use_agc is False.")
        return None
    clip_factor = check_positive_real("clip_factor", clip_factor)
    agc_eps = check_positive_real("agc_eps", agc_eps)
    return lambda grads, params: adaptive_clip_grad(params, grads, clip_factor, agc_eps, agc_mask)


def _place_on_mesh(mesh: Mesh, axis_name: str, state: Any, batch: Any) -> tuple[Any, Any]:
    """The ``shard_map`` step's inputs where its specs say: the state replicated (a state
    sharded over the mesh is refused, not silently replicated), the batch split."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        spec = getattr(getattr(leaf, "sharding", None), "spec", ())
        if any(entry is not None for entry in spec):
            raise ValueError(
                f"state{jax.tree_util.keystr(path)} is sharded ({spec}), but "
                "make_train_step(mesh=..., axis_name=...) replicates the state. For sharded "
                "parameters use make_train_step(mode='scan') without mesh/axis_name under jit: "
                "it keeps every array as it is sharded."
            )
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.device_put(state, replicated), jax.device_put(batch, data_sharding(mesh, axis_name))


def _checked_once(
    jitted: Any,
    pmapped: bool,
    sharded_scan: bool = False,
    place: Callable[[Any, Any], tuple[Any, Any]] | None = None,
) -> Any:
    """``jitted`` that, on its first call, checks the (concrete) state against its optimizer
    (a checkpoint resumed under another K or scaling is refused before anything runs); for
    scan mode under ``jit`` it passes the arrays' `accumjax.sharded.Layout` (static), and
    with ``place`` it puts the inputs where a ``shard_map`` step expects them."""
    checked: list[bool] = []

    def args(state: Any, batch: Any, rng: Any) -> tuple[Any, ...]:
        if place is not None:
            state, batch = place(state, batch)
        if not sharded_scan:
            return state, batch, rng
        return state, batch, rng, sharded.layout_of(state.params, batch)

    def step(state: Any, batch: Any, rng: Any = None) -> Any:
        if not checked:
            config = config_of(getattr(state, "tx", None))
            if config is not None:
                opt = state.opt_state
                check_state(config, jax.tree.map(lambda x: x[0], opt) if pmapped else opt)
            checked.append(True)
        return jitted(*args(state, batch, rng))

    step.lower = lambda state, batch, rng=None: jitted.lower(*args(state, batch, rng))  # pyright: ignore[reportFunctionMemberAccess]
    step.__wrapped__ = jitted  # pyright: ignore[reportFunctionMemberAccess]
    return step


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
    mixed_precision: str | None = None,
    axis_name: str | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
    weight_fn: Callable[[Any], Any] | None = None,
    unroll: int | bool = 1,
    gather_params: str = "window",
) -> Step:
    """Builds a jitted ``step(state, batch, rng=None) -> (state, metrics)`` that accumulates.

    K and every accumulation policy come from the state's optimizer,
    ``tx=accumjax.accumulate(inner, K, scaling=..., on_nonfinite=..., max_norm=...,
    skip_fn=...)``: they mean the same in both modes. A plain optax optimizer is a window of
    one microbatch (with the default policies, and no counters kept).

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
      microbatch ``i`` is rows ``i, i + K, ...``, all K added in one ``lax.scan`` (under
      ``jit`` with sharded arrays, inside a ``shard_map`` that reduces once per window).

    A microbatch that is skipped (non-finite, invalid weight, ``skip_fn``) contributes neither
    its gradient nor its model state. A window that is not usable (see ``accumulate``) leaves
    params, optimizer state and model state as they were (in stream mode: BatchNorm windows
    are reset, other mutable collections keep the skipped window's changes), and
    ``state.step`` counts applied updates only.

    Args:
      loss_fn: the loss, see above.
      mode: ``"stream"`` or ``"scan"``.
      accum_steps: optional; when given it must equal the optimizer's K (K is stated once).
      has_aux: whether ``loss_fn`` also returns auxiliary outputs (``metrics["aux"]``;
        stacked over microbatches in scan mode).
      use_agc: adaptive gradient clipping (:func:`accumjax.adaptive_clip_grad`) of the window
        gradient, once per window, in both modes (the same as putting
        ``accumjax.adaptive_clip`` first in the inner chain).
      clip_factor, agc_eps: AGC parameters (finite numbers > 0).
      agc_mask: which parameters AGC clips (see :func:`accumjax.adaptive_clip_grad`).
      mixed_precision: ``None``; ``"bfloat16"`` (params and float inputs cast to bfloat16
        for the loss; master params, gradients and accumulator keep the params' dtype); or
        ``"float16"``: the same with float16 plus dynamic loss scaling (``state.loss_scale``;
        a default :func:`accumjax.dynamic_loss_scale` is created if it is ``None``). An
        overflowed microbatch is a non-finite microbatch, handled by ``on_nonfinite``; the
        scale is adjusted once per window (lowered if the window saw an overflow).
      axis_name: data parallelism. Without ``mesh`` the step is ``jax.pmap``-ped (the state
        carries a leading device axis, :func:`accumjax.replicate`; ``rng`` is shared). The
        window's gradient sum, weights and counts are all-reduced once per window; step-closed
        BatchNorm windows are pooled across devices once per window, and other float model
        state is averaged once per window (integer and key leaves are left alone).
      mesh: a ``jax.sharding.Mesh``; with ``axis_name`` the step is
        ``jax.jit(jax.shard_map(...))`` with the batch sharded on ``axis_name`` and the state
        replicated. In stream mode each device's window accumulator is device-local between
        window ends although the state is declared replicated: save checkpoints at window
        boundaries, where the accumulators are empty on every device.
      donate: donate the input state's buffers to the output (do not reuse arrays that
        went into ``TrainState.create``; copy them first).
      weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a microbatch (e.g. its
        number of valid tokens), for ``accumulate(..., scaling="weighted")``.
      unroll: scan mode: microbatches per loop iteration, passed to ``lax.scan`` (``True``
        unrolls the whole window). On CPU, XLA runs convolutions far slower inside a loop
        body than outside, so convnets want ``unroll=True`` there.
      gather_params: scan mode under ``jit`` with parameters sharded over the batch axis
        (FSDP): ``"window"`` (default, for speed) all-gathers them once per window and keeps
        the whole copy for the window; ``"microbatch"`` (for memory) all-gathers them in
        every microbatch, so the whole copy lives only while a microbatch runs (K gathers a
        window; the gradient is still reduced once).

    Returns:
      The step. ``metrics`` has ``"loss"`` (the window's weighted mean loss over the added
      microbatches in scan mode, NaN if none was added; the microbatch's in stream mode; one
      entry per device with data parallelism), ``"updated"`` (whether an update was applied;
      then ``state.step`` grows by one), ``"grads_finite"`` and ``"loss_scale"`` with
      float16, and ``"aux"`` with has_aux. The first call checks the state against its
      optimizer (a checkpoint made with another K or scaling is refused).

    Raises:
      ValueError / TypeError: naming the argument, for invalid arguments here; at trace time
      for a batch not divisible by K, an ``accum_steps`` that differs from the optimizer's K,
      scan mode with a K schedule, or a loss_fn output that does not match ``has_aux``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, accumjax
      >>> model = nn.Dense(1)
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> def loss_fn(params, batch):
      ...     pred = model.apply({"params": params}, batch["x"])
      ...     return jnp.mean((pred - batch["y"]) ** 2)
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=model.apply, params=params, tx=accumjax.accumulate(optax.sgd(0.1), 4))
      >>> step = accumjax.make_train_step(loss_fn, mode="scan")
      >>> state, metrics = step(state, {"x": x, "y": y})
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

      With model state (BatchNorm statistics, closed by the step once per window), dropout
      keys and stream mode:

      >>> model = nn.Sequential([nn.Dense(4), accumjax.AccumBatchNorm(
      ...     use_running_average=False), nn.Dense(1)])
      >>> variables = model.init(jax.random.key(0), x)
      >>> params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
      >>> def loss_fn(params, model_state, batch, key):
      ...     x = jax.random.bernoulli(key, 0.9, batch["x"].shape) * batch["x"] / 0.9
      ...     pred, new_model_state = model.apply(
      ...         {"params": params, **model_state}, x, mutable=list(model_state))
      ...     return jnp.mean((pred - batch["y"]) ** 2), new_model_state
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=model.apply, params=params, model_state=model_state,
      ...     tx=accumjax.accumulate(optax.adam(1e-3), 4))
      >>> step = accumjax.make_train_step(loss_fn)
      >>> for i in range(4):
      ...     batch = {"x": x[2 * i : 2 * i + 2], "y": y[:2]}
      ...     state, metrics = step(state, batch, jax.random.key(1))
      >>> int(state.step), bool(metrics["updated"])
      (1, True)

    Reference: the ``GradientAccumulateModel`` of andreped/GradientAccumulator
    (Pedersen et al., https://github.com/andreped/GradientAccumulator).
    """
    k = _validate(
        loss_fn,
        accum_steps,
        mode,
        mixed_precision,
        axis_name,
        mesh,
        weight_fn,
        unroll,
        gather_params,
    )
    setup = _Setup(
        grad_fn=_make_grad_fn(loss_fn, has_aux, _PRECISIONS[mixed_precision]),
        mode=mode,
        accum_steps=k,
        axis_name=axis_name,
        weight_fn=weight_fn,
        f16=mixed_precision == "float16",
        transform=_agc(use_agc, clip_factor, agc_eps, agc_mask),
        unroll=unroll,
        gather_params=gather_params,
    )
    donate_argnums = (0,) if donate else ()
    if axis_name is None and mode == "scan":
        jitted = jax.jit(
            _sharded_scan_step(setup), static_argnums=(3,), donate_argnums=donate_argnums
        )
        return _checked_once(jitted, False, sharded_scan=True)
    step = _stream_step(setup) if mode == "stream" else _scan_step(setup)
    if axis_name is None:
        return _checked_once(jax.jit(step, donate_argnums=donate_argnums), False)
    if mesh is None:
        pmapped = jax.pmap(
            step, axis_name=axis_name, in_axes=(0, 0, None), donate_argnums=donate_argnums
        )
        return _checked_once(pmapped, True)
    mapped = _shard_map(step, mesh, axis_name, has_aux, setup.f16)
    place = partial(_place_on_mesh, mesh, axis_name)
    return _checked_once(jax.jit(mapped, donate_argnums=donate_argnums), False, place=place)
