"""The train step's window loop (internal): stream and scan mode on one device or one shard.

`begin` reads K and the policies from the state's optimizer and bundles everything a window
needs into one `Context` (as optax's microbatching ``Accumulator`` bundles init, update and
finalize); every function below takes that one value. One microbatch (`microbatch`) computes
its gradient with the loss adapter, adds it to the window (`accumjax.window`) and keeps its
model state only when it was added. `close_fields` closes a window: one reduction, the
decision, the update (`accumjax.accumulation.close_and_apply`), BatchNorm windows and the loss
scale. `stream_step` runs one microbatch per call; `scan_step` runs the K strided
microbatches of a batch in a ``lax.scan`` (`window_loop`). The parallel wrappers
(`accumjax._parallel`) run these bodies under ``jit``, ``pmap`` and ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from accumjax import window as window_lib
from accumjax._batch_norm_windows import is_step_driven
from accumjax._loss_adapter import GradFn
from accumjax._step_checks import check_step_inputs
from accumjax.accumulation import (
    Config,
    check_state,
    close_and_apply,
    config_of,
    init_state,
    window_closes,
)
from accumjax.accumulation_state import AccumulationState
from accumjax.batch_norm import close_batch_norm_windows
from accumjax.loss_scale import DynamicLossScale, adjust_loss_scale
from accumjax.train_state import TrainState, count_update

__all__ = [
    "Carry",
    "Context",
    "Outcome",
    "Setup",
    "Step",
    "begin",
    "close_model_state",
    "pvary",
    "scan_finish",
    "scan_step",
    "stream_step",
    "window_loop",
    "window_loss",
]

Step = Callable[..., tuple[Any, dict[str, Any]]]
Take = Callable[[jax.Array], tuple[Any, Any]]  # microbatch index -> (params, rows)


class Setup(NamedTuple):
    """What `accumjax.make_train_step` fixed (static).

    Attributes:
      grad_fn: the loss adapter's gradient function (`accumjax._loss_adapter.make_grad_fn`).
      mode: ``"stream"`` or ``"scan"``.
      accum_steps: the K given to ``make_train_step``, checked against the optimizer's.
      axis_name: the mapped data-parallel axis, or None.
      weight_fn: ``weight_fn(microbatch) -> scalar``, or None.
      f16: float16 with dynamic loss scaling.
      transform: ``transform(grads, params)`` before the inner optimizer (AGC), or None.
      unroll: scan mode's ``lax.scan`` unroll.
      gather_params: FSDP: gather parameters once a ``"window"`` or every ``"microbatch"``.
      materialize: ``(params, microbatch index) -> params`` a microbatch computes with
        (the per-microbatch FSDP gather), or None for the parameters as they are.
      loss_positional: the most positional arguments ``loss_fn`` takes
        (`positional_limit`), or None when unknown; refuses ``rng`` for a loss without a key.
    """

    grad_fn: GradFn
    mode: str
    accum_steps: int | None
    axis_name: str | None
    weight_fn: Callable[[Any], Any] | None
    f16: bool
    transform: Callable[[Any, Any], Any] | None
    unroll: int | bool
    gather_params: str = "window"
    materialize: Callable[[Any, Any], Any] | None = None
    loss_positional: int | None = None


class Context(NamedTuple):
    """One step's window: the static setup and optimizer config, and the traced values that
    every microbatch needs.

    Attributes:
      setup: the `Setup`.
      config: the optimizer's `accumjax.accumulation.Config` (K, policy, axis).
      owned: whether the optimizer is an ``accumulate`` (else a plain optimizer, run as a
        window of one microbatch whose counters are not kept).
      loss_scale: the dynamic loss scale (float16), or None.
      rng: the step's PRNG key, or None.
      step_count: ``state.step``, folded into every microbatch key.
      axis_name: the axis whose index is folded into keys (the mapped or sharded batch axis).
    """

    setup: Setup
    config: Config
    owned: bool
    loss_scale: DynamicLossScale | None
    rng: Any
    step_count: Any
    axis_name: str | None

    def key(self, index: Any) -> Any:
        """A key distinct for every step, device and microbatch, reproducible from ``rng``."""
        if self.rng is None:
            return None
        key = jax.random.fold_in(jax.random.fold_in(self.rng, self.step_count), index)
        if self.axis_name is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        return key

    @property
    def k(self) -> int:
        """The optimizer's int K (scan mode; `begin` refuses a schedule there)."""
        return cast(int, self.config.static_k)


class Carry(NamedTuple):
    """The running per-window values of the loop carry."""

    window: window_lib.Window
    model_state: Any
    loss_sum: jax.Array
    loss_weight: jax.Array


class Outcome(NamedTuple):
    """What a window's microbatches produced: the carry, the loss metric and the aux; for one
    microbatch, also whether it was added to the window."""

    carry: Carry
    loss: Any
    aux: Any
    added: Any = None


class Fields(NamedTuple):
    """The parts of the state a window close may change (a loop carry)."""

    params: Any
    opt: AccumulationState
    model_state: Any
    loss_scale: Any


# ----------------------------------------------------------------------------- set-up


def _config(setup: Setup, state: Any) -> tuple[Config, bool]:
    """The optimizer's config, or a one-microbatch window around a plain optimizer."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step expects an accumjax.TrainState, got {type(state).__name__}; create it with "
            "accumjax.TrainState.create(apply_fn=..., params=..., tx=...)."
        )
    config = config_of(state.tx)
    owned = config is not None
    if config is None:
        config = Config(optax.with_extra_args_support(state.tx), 1, window_lib.Policy(), None)
    if config.axis_name not in (None, setup.axis_name):
        raise ValueError(
            f"accumulate(axis_name={config.axis_name!r}) differs from make_train_step's "
            f"axis_name={setup.axis_name!r}; give the axis to make_train_step only."
        )
    k = config.static_k
    if setup.accum_steps is not None and k != setup.accum_steps:
        raise ValueError(
            f"make_train_step(accum_steps={setup.accum_steps}) but the optimizer's K is {k}: "
            "state K once, in tx=accumjax.accumulate(inner, K) (accum_steps may be omitted)."
        )
    if setup.mode == "scan" and k is None:
        raise TypeError("mode='scan' needs an int K in accumjax.accumulate, not a schedule.")
    return config._replace(axis_name=setup.axis_name), owned


def begin(setup: Setup, state: Any, rng: Any) -> tuple[Context, AccumulationState]:
    """The step's `Context` and its `AccumulationState` (a fresh one for a plain optimizer).

    Every mode's step starts here, at trace time: the state and optimizer (no
    ``optax.MultiSteps``), ``rng`` (one key) and a loss that can take it are checked once.
    """
    config, owned = _config(setup, state)
    check_step_inputs(state, config.policy, rng, setup.loss_positional, setup.f16)
    if owned:
        acc = check_state(config, state.opt_state)
    else:
        acc = init_state(config, state.params, state.opt_state)
    loss_scale = state.loss_scale if setup.f16 else None
    context = Context(setup, config, owned, loss_scale, rng, state.step, setup.axis_name)
    return context, acc


# ----------------------------------------------------------------------------- one microbatch


def _weight(weight_fn: Callable[[Any], Any] | None, batch: Any) -> jax.Array | None:
    """The microbatch's scalar weight from ``weight_fn``, float32, or None without one."""
    if weight_fn is None:
        return None
    w = jnp.asarray(weight_fn(batch))
    if w.shape != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {w.shape}.")
    return w.astype(jnp.float32)


def _gradient(ctx: Context, params: Any, model_state: Any, batch: Any, index: Any) -> Any:
    """``(loss, new model state, aux, grads, weight)`` of one microbatch."""
    setup = ctx.setup
    key = ctx.key(index)
    loss, new_model_state, aux, grads = setup.grad_fn(
        params, model_state, batch, key, ctx.loss_scale
    )
    return loss, new_model_state, aux, grads, _weight(setup.weight_fn, batch)


def microbatch(
    ctx: Context,
    carry: Carry,
    params: Any,
    batch: Any,
    index: Any,
    *,
    first: bool = False,
    inspected: window_lib.Microbatch | None = None,
) -> Outcome:
    """One microbatch: gradient, add to the window, keep its model state only if added.

    ``first`` opens the window with it (`accumjax.window.first_microbatch`); ``inspected``
    is the policy's decision about it, taken earlier (`_decisions`), or None to take it here.
    """
    loss, new_model_state, aux, grads, weight = _gradient(
        ctx, params, carry.model_state, batch, index
    )
    add = window_lib.first_microbatch if first else window_lib.add_microbatch
    window, micro = add(ctx.config.policy, carry.window, grads, weight, params, inspected)
    model_state = carry.model_state
    if model_state is not None:
        model_state = optax.tree.where(micro.added, new_model_state, model_state)
    w = jnp.where(micro.added, 1.0 if weight is None else weight, 0.0)
    loss = loss.astype(carry.loss_sum.dtype)
    loss_sum = carry.loss_sum + jnp.where(micro.added, w * loss, 0.0)
    carry = Carry(window, model_state, loss_sum, carry.loss_weight + w)
    return Outcome(carry, loss, aux, micro.added)


# ----------------------------------------------------------------------------- the window's end


def close_fields(ctx: Context, fields: Fields, closed: window_lib.Closed | None = None) -> Fields:
    """Closes the window: one reduction, the decision, the update, model state, loss scale.

    With ``closed`` (reduced and decided inside a ``shard_map``, where the model state was
    closed too) only the update and the loss scale are left.
    """
    before = fields.opt
    params, opt = close_and_apply(
        ctx.config, before, fields.params, transform=ctx.setup.transform, closed=closed
    )
    model_state = fields.model_state
    if closed is None:
        model_state = close_model_state(model_state, opt.updated, ctx.setup.axis_name)
    loss_scale = fields.loss_scale
    if loss_scale is not None:
        loss_scale = adjust_loss_scale(loss_scale, opt.nonfinite_count == before.nonfinite_count)
    return Fields(params, opt, model_state, loss_scale)


def close_model_state(model_state: Any, apply: jax.Array, axis_name: str | None) -> Any:
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

    leaves, treedef = jax.tree.flatten(model_state, is_leaf=is_step_driven)
    picked = [i for i, x in enumerate(leaves) if not is_step_driven(x) and averaged(x)]
    if picked:
        means = jax.lax.pmean([leaves[i] for i in picked], axis_name)
        for i, mean in zip(picked, means, strict=True):
            leaves[i] = mean
    return jax.tree.unflatten(treedef, leaves)


def _finish(
    ctx: Context, state: TrainState, fields: Fields, outcome: Outcome
) -> tuple[TrainState, dict[str, Any]]:
    updated = fields.opt.updated
    new = state.replace(
        step=count_update(jnp.asarray(state.step), updated),
        params=fields.params,
        opt_state=fields.opt if ctx.owned else fields.opt.inner_tx_state,
        model_state=fields.model_state,
        loss_scale=fields.loss_scale if fields.loss_scale is not None else state.loss_scale,
    )
    # The norm of the gradient the inner optimizer saw at this call (NaN: no update here).
    grad_norm = jnp.where(updated, fields.opt.grad_norm, jnp.nan)
    metrics: dict[str, Any] = {"loss": outcome.loss, "updated": updated, "grad_norm": grad_norm}
    if fields.loss_scale is not None:
        metrics["grads_finite"] = outcome.carry.window.window_nonfinite == 0
        metrics["loss_scale"] = fields.loss_scale.loss_scale
    if outcome.aux is not None:
        metrics["aux"] = outcome.aux
    return new, metrics


# ----------------------------------------------------------------------------- stream mode


def _start(state: TrainState, acc: AccumulationState) -> Carry:
    zero = jnp.zeros((), jnp.float32)
    return Carry(acc.window, state.model_state, zero, zero)


def stream_step(setup: Setup) -> Step:
    """``step(state, batch, rng=None)``: one microbatch per call; the window closes on the
    K-th (at once for a plain optimizer)."""

    def step(state: TrainState, batch: Any, rng: Any = None) -> tuple[TrainState, dict]:
        ctx, acc = begin(setup, state, rng)
        params = pvary(state.params, setup.axis_name)
        outcome = microbatch(
            ctx, _start(state, acc), params, batch, acc.window.micro_step, first=not ctx.owned
        )
        opt = acc._replace(
            window=outcome.carry.window, updated=jnp.zeros((), bool), added=outcome.added
        )
        fields = Fields(state.params, opt, outcome.carry.model_state, ctx.loss_scale)
        close = lambda f: close_fields(ctx, f)
        if ctx.owned:
            fields = window_lib.run_once(window_closes(opt), close, fields)
        else:
            fields = close(fields)
        return _finish(ctx, state, fields, outcome)

    return step


# ----------------------------------------------------------------------------- scan mode


def _strided(batch: Any, k: int) -> Any:
    """``(B, ...) -> (B // k, k, ...)``: microbatch ``i`` is rows ``i, i + k, ...``.

    The leading axis keeps the batch's sharding, so every microbatch is split across the
    data-parallel devices exactly as the batch is. ``optax.microbatching.reshape_batch_axis``
    picks the same rows, but through a Fortran-order reshape, which transposes every leaf
    whole: on a (256, 32, 32, 3) batch at K=8 XLA then holds a 6.0 MiB copy where this
    reshape (a bitcast) needs 0.38 MiB of temp memory.
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


def _microbatches(ctx: Context, params: Any, batch: Any) -> Take:
    """``i -> (params, rows)`` of microbatch ``i`` (the parameters as its gradient sees them)."""
    rows = _strided(batch, ctx.k)
    whole = ctx.setup.materialize or (lambda p, i: p)

    def take(i: jax.Array) -> tuple[Any, Any]:
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, False), rows)
        return whole(params, i), mb

    return take


def window_loop(ctx: Context, params: Any, start: Carry, batch: Any) -> tuple[Carry, Any]:
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
    policy = ctx.config.policy
    take = _microbatches(ctx, params, batch)
    inspects = policy.skip_fn is not None or policy.max_norm is not None
    # At K=1 a re-run would compute the whole batch again; the one check costs a norm pass.
    if not policy.detects or inspects or ctx.k == 1:
        return _microbatch_loop(ctx, take, start)
    blind_policy = policy._replace(on_nonfinite="propagate")
    blind = ctx._replace(config=ctx.config._replace(policy=blind_policy))
    found = _microbatch_loop(blind, take, start)
    finite = jnp.isfinite(window_lib.global_norm(found[0].window.grad_sum))

    def inspect_each(_: Any) -> tuple[Carry, Any]:
        return _microbatch_loop(ctx, take, start, _decisions(ctx, take, start))

    return window_lib.run_once(~finite, inspect_each, found)


def _decisions(ctx: Context, take: Take, start: Carry) -> window_lib.Microbatch:
    """The policy's decision about each of the K microbatches (stacked), nothing added.

    Each gradient only feeds reductions, so one leaf of it is alive at a time; the model state
    follows the decisions as in `microbatch`.
    """

    def body(model_state: Any, i: jax.Array) -> tuple[Any, window_lib.Microbatch]:
        p, mb = take(i)
        _, new_model_state, _, grads, weight = _gradient(ctx, p, model_state, mb, i)
        decided = window_lib.inspect_microbatch(ctx.config.policy, grads, weight, p)
        if model_state is not None:
            model_state = optax.tree.where(decided.added, new_model_state, model_state)
        return model_state, decided

    steps = jnp.arange(ctx.k)
    return jax.lax.scan(body, start.model_state, steps, unroll=ctx.setup.unroll)[1]


def _microbatch_loop(
    ctx: Context, take: Take, start: Carry, decided: window_lib.Microbatch | None = None
) -> tuple[Carry, Any]:
    """One microbatch opens the window when K is 1 (no loop, no zeros); otherwise a
    ``lax.scan`` adds all K to a zero accumulator (with the ``decided`` decisions, if given:
    K > 1 only, `window_loop` never re-runs a one-microbatch window).

    Every microbatch runs in the same loop body: computed outside the loop, the first one's
    activations are not shared with the loop's, and at K=2 (where XLA inlines a one-trip
    loop) both microbatches' activations are alive at once.
    """
    if ctx.k == 1:
        p, mb = take(jnp.zeros((), jnp.int32))
        outcome = microbatch(ctx, start, p, mb, 0, first=True)
        aux = outcome.aux
        return outcome.carry, None if aux is None else jax.tree.map(lambda a: a[None], aux)

    def body(carry: Carry, xs: tuple[jax.Array, Any]) -> tuple[Carry, Any]:
        i, inspected = xs
        p, mb = take(i)
        outcome = microbatch(ctx, carry, p, mb, i, inspected=inspected)
        return outcome.carry, outcome.aux

    start = pvary(start._replace(window=window_lib.empty_like(start.window)), ctx.setup.axis_name)
    return jax.lax.scan(body, start, (jnp.arange(ctx.k), decided), unroll=ctx.setup.unroll)


def window_loss(carry: Carry) -> jax.Array:
    """The window's weighted mean loss over its added microbatches (NaN if none was)."""
    return jnp.where(carry.loss_weight > 0, carry.loss_sum / carry.loss_weight, jnp.nan)


def scan_finish(
    ctx: Context,
    state: TrainState,
    acc: AccumulationState,
    outcome: Outcome,
    closed: window_lib.Closed | None = None,
) -> tuple[TrainState, dict]:
    """Closes a scan-mode window (unless ``closed`` already) and builds the new state."""
    carry = outcome.carry
    opt = acc._replace(window=carry.window, updated=jnp.zeros((), bool))
    fields = close_fields(ctx, Fields(state.params, opt, carry.model_state, ctx.loss_scale), closed)
    # The state's own (stream) window is handed back untouched: its buffer is donated to
    # the output instead of a fresh zero accumulator being allocated every step.
    updated = fields.opt.updated
    fields = fields._replace(opt=fields.opt._replace(window=acc.window, added=updated))
    if state.model_state is not None:  # a skipped window leaves all model state as it was
        kept = optax.tree.where(fields.opt.updated, fields.model_state, state.model_state)
        fields = fields._replace(model_state=kept)
    return _finish(ctx, state, fields, outcome)


def scan_step(setup: Setup) -> Step:
    """``step(state, batch, rng=None)``: the whole batch per call, K strided microbatches."""

    def step(state: TrainState, batch: Any, rng: Any = None) -> tuple[TrainState, dict]:
        ctx, acc = begin(setup, state, rng)
        params = pvary(state.params, setup.axis_name)
        carry, aux = window_loop(ctx, params, _start(state, acc), batch)
        return scan_finish(ctx, state, acc, Outcome(carry, window_loss(carry), aux))

    return step


# ----------------------------------------------------------------------------- device variance


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def pvary(tree: Any, axis_name: str | None) -> Any:
    """Marks values as device-varying so their gradients are not all-reduced implicitly.

    Example:
      >>> import jax.numpy as jnp
      >>> pvary({"w": jnp.ones(2)}, None)["w"]  # no axis: unchanged
      Array([1., 1.], dtype=float32)
    """
    if axis_name is None:
        return tree

    def cast(x: Any) -> Any:
        if axis_name in _varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)
