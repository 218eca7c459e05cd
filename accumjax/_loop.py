"""The train step's window loop (internal): the pieces scan and stream mode share.

`Setup` is what `accumjax.make_train_step` fixed; `begin` builds a call's `Context`, the one
value every function here takes. `run_microbatch` runs one microbatch (its `loss_and_grads`,
the add, `follow_decision`), `close_fields` closes a window and applies it, `finish` builds the
new state and the metrics; `stream_step` and `stream_close` are a stream-mode call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

import accumjax._window as window_lib
from accumjax._batch_norm_windows import close_model_state, warn_plain_batch_norm
from accumjax._config import Config
from accumjax._control import run_once
from accumjax._decision import (
    Microbatch,
    MicrobatchDecision,
    decide_microbatch,
    weigh,
    weight_or_one,
)
from accumjax._layout import LeafLayout
from accumjax._loss_adapter import GradFn, device_loss_scale
from accumjax._mesh import MeshLayout
from accumjax._opt_state import count_update
from accumjax._scaling import device_losses_add
from accumjax._state import config_of
from accumjax._step_checks import (
    check_accumulate,
    check_layout,
    check_step_inputs,
    microbatch_weight_of,
)
from accumjax._window_end import check_state, close_and_apply, init_state, window_closes
from accumjax.accumulation_state import AccumulationState
from accumjax.loss_scale import DynamicLossScale, update_loss_scale
from accumjax.train_state import TrainState

__all__ = [
    "Context",
    "LoopCarry",
    "Outcome",
    "Pool",
    "Setup",
    "Step",
    "begin",
    "close_fields",
    "finish",
    "follow_decision",
    "loss_and_grads",
    "loss_mean",
    "loss_parts",
    "mark_varying",
    "run_microbatch",
    "start_carry",
    "stream_close",
    "stream_step",
]

Step = Callable[..., tuple[Any, dict[str, Any]]]


class Setup(NamedTuple):
    """What `accumjax.make_train_step` fixed (static).

    Attributes:
      grad_fn: the loss adapter's gradient function (`accumjax._loss_adapter.make_grad_fn`).
      mode: ``"stream"`` or ``"scan"``.
      axis_name: the step's data axis (``make_train_step(axis_name=...)``): the ``pmap``
        axis, or with ``mesh`` the mesh axis the batch is split over; None for neither.
      weight_fn: ``weight_fn(microbatch) -> scalar``, or None.
      f16: float16 with dynamic loss scaling.
      unroll: scan mode's ``lax.scan`` unroll.
      gather_params: FSDP: gather parameters once a ``"window"`` or every ``"microbatch"``.
      loss_positional: the most positional arguments ``loss_fn`` takes
        (`positional_limit`), or None when unknown; refuses ``rng`` for a loss without a key.
      batch_axis: scan mode: each batch leaf's batch axis, or None for a leaf every
        microbatch sees full-size (`accumjax._split`).
      aux_rows: scan mode: per-microbatch aux back in the batch's row order.
      mesh: the step's own mesh (``make_train_step(mesh=...)``), or None to run where the
        arrays lie.
      reduce_scatter: scan mode with parameters split over the data axis: their gradient is
        reduce-scattered into an accumulator sharded like them every ``"microbatch"``, or
        once a ``"window"`` (a full-size accumulator on every device).
      optimizer_sharding: where a parameter replicated over the data axis keeps its
        optimizer state and accumulator (`accumjax._layout.OPTIMIZER_SHARDINGS`).
    """

    grad_fn: GradFn
    mode: str
    axis_name: str | None
    weight_fn: Callable[[Any], Any] | None
    f16: bool
    unroll: int | bool
    gather_params: str = "window"
    loss_positional: int | None = None
    batch_axis: Any = 0
    aux_rows: bool = False
    mesh: Any = None
    reduce_scatter: str = "microbatch"
    optimizer_sharding: str = "replicated"

    @property
    def pmap_axis(self) -> str | None:
        """The ``pmap`` axis the step runs under (``axis_name`` without ``mesh``), or None."""
        return self.axis_name if self.mesh is None else None

    @property
    def mesh_axis(self) -> str | None:
        """With ``mesh``, its axis the batch is split over (``axis_name``), else None."""
        return None if self.mesh is None else self.axis_name


class Context(NamedTuple):
    """One step's window: the static setup and optimizer config, the traced values that
    every microbatch needs, and what the call's layout on a mesh does to them.

    Attributes:
      setup: the `Setup`.
      config: the optimizer's `accumjax._config.Config` (K, the window's policy; the step's
        data axis is ``setup``'s or ``layout``'s, never the config's, which
        `accumjax._step_checks.check_accumulate` only compares with it).
      accumulating: whether the optimizer is an ``accumulate`` (else a plain optimizer, run as a
        window of one microbatch whose counters are not kept).
      loss_scale: the dynamic loss scale (float16), or None.
      rng: the step's PRNG key, or None.
      step_count: ``state.step``, folded into every microbatch key (the loss scale, key
        and step count: `with_call_values`).
      n_real: scan mode: how many of the K microbatches are real (an int32 scalar, maybe
        traced; the padded rest is neither computed nor counted), or None for all K.
      materialize: ``(params, microbatch index) -> params`` a microbatch computes with
        (the per-microbatch FSDP gather), or None for the parameters as they are.
      reduce: inside ``shard_map``, what each microbatch's scaled gradient goes through
        before it is added (`accumjax._window.add_microbatch`), or None.
      whole_gradient_layouts: inside ``shard_map``, for a policy that reduces each
        microbatch's whole gradient, each parameter leaf's `accumjax._layout.LeafLayout` as
        it reduces it (`accumjax._layout.reduced_per_microbatch`); None for every leaf
        all-reduced.
      split_params: ZeRO under ``jit``: ``(to_shards, to_param_layout)``, the parameters as the
        inner optimizer updates them (split like their reduced gradient) and back (one
        all-gather), inside the update's loop; None for the parameters as they are.
      layout: inside a call's ``shard_map`` on a mesh, the call's `accumjax._mesh.MeshLayout`
        (its data axis is the one the microbatches are mapped over); None outside one.
    """

    setup: Setup
    config: Config
    accumulating: bool
    loss_scale: DynamicLossScale | None = None
    rng: Any = None
    step_count: Any = None
    n_real: Any = None
    materialize: Callable[[Any, Any], Any] | None = None
    reduce: Callable[[Any], Any] | None = None
    whole_gradient_layouts: tuple[LeafLayout, ...] | None = None
    split_params: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
    layout: MeshLayout | None = None

    @property
    def axis_name(self) -> str | None:
        """The axis the step's microbatches are mapped over: inside a call's ``shard_map`` its
        layout's data axis, under ``pmap`` the step's axis (`Setup.pmap_axis`), else None. Its
        index is folded into keys, and the devices along it agree about each microbatch
        (`accumjax._decision.inspect_microbatch`)."""
        return self.setup.pmap_axis if self.layout is None else self.layout.axis

    def with_call_values(self, state: Any, rng: Any) -> Context:
        """This context with the call's traced values read from the train ``state`` (its loss
        scale under float16, its step count) and ``rng``: `begin` reads them so, and a mesh
        step's ``shard_map`` again, as one device sees them."""
        loss_scale = state.loss_scale if self.setup.f16 else None
        return self._replace(loss_scale=loss_scale, rng=rng, step_count=state.step)

    def key(self, index: Any) -> Any:
        """A key distinct for every step, device and microbatch, reproducible from ``rng``."""
        if self.rng is None:
            return None
        key = jax.random.fold_in(jax.random.fold_in(self.rng, self.step_count), index)
        if self.axis_name is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        return key

    @property
    def static_every_k(self) -> int:
        """The optimizer's int K (scan mode; `begin` refuses a schedule there)."""
        return cast(int, self.config.static_every_k)

    @property
    def adds_before_deciding(self) -> bool:
        """Whether scan mode adds each microbatch as it comes and decides about them all at the
        window's end (`accumjax._window.close_window`'s decisions): every policy that does not
        read the gradient's values, in a window of more than one microbatch (one microbatch's
        gradient is the window's sum: it is decided about as it comes)."""
        return self.setup.mode == "scan" and not self.config.reads and self.static_every_k > 1

    @property
    def sum_can_decide(self) -> bool:
        """Whether a window added as it came (`adds_before_deciding`) can leave its
        microbatches' finiteness to its sum: the default ``on_nonfinite="skip_microbatch"``
        (``"skip_window"`` keeps its check: on a GPU a window's sum deciding costs it a
        conditional a step, where it has none), without a ``weight_fn`` (a microbatch of
        weight 0 adds nothing to the sum, whatever its gradient), on one
        device or under ``jit``, with an accumulator no wider than float32. A non-finite value
        in any added gradient makes the sum's norm non-finite; only such a window reads each
        microbatch's gradient, in a pass of its own (`accumjax._scan.decide_window`)."""
        config = self.config
        wide = window_lib.sum_dtype(jnp.float32, config.accumulator_dtype) != jnp.float32
        return (
            self.adds_before_deciding
            and config.on_nonfinite == "skip_microbatch"
            and config.scaling != "weighted"
            and self.setup.weight_fn is None  # the loss metric is weighted by it
            and self.axis_name is None  # on a mapped axis each device reads its rows' gradient
            and not wide  # the gradient is read where the sum was, in the same precision
        )


class LoopCarry(NamedTuple):
    """What a step carries through its loops: while microbatches are added, the open window
    and the loss metric's running sums; through the window's close, the parts of the state
    it may change. A field the loop does not carry is None.

    Attributes:
      model_state: the model state (both).
      window: adding: the open window (`accumjax._window.Window`).
      loss_sum: adding: the added microbatches' weighted loss, summed.
      loss_weight: adding: their weight, summed.
      params: closing: the parameters.
      opt: closing: the `AccumulationState`, the window in it.
      loss_scale: closing: the dynamic loss scale (float16), else None.
    """

    model_state: Any
    window: Any = None
    loss_sum: Any = None
    loss_weight: Any = None
    params: Any = None
    opt: Any = None
    loss_scale: Any = None


class Outcome(NamedTuple):
    """What microbatches produced: one microbatch (`run_microbatch`), a window's run once over
    its microbatches (scan mode's pass, `accumjax._scan.window_loop`), or what a scan window's
    close ended with (`accumjax._scan.Close`: its closed model state, loss metric, aux means).

    Attributes:
      carry: the loop carry after them (a close: only its ``model_state``).
      loss: one microbatch's loss, or the loss metric; None for a pass.
      aux: the aux (a pass: per microbatch, stacked; rows in order with ``aux_rows``; a close:
        the aux means reduced with the window, or None), or None.
      added: one microbatch: whether it was added to the window.
      decision: added as it came (`Context.adds_before_deciding`): this device's
        `accumjax._decision.MicrobatchDecision` about it (a pass: about each microbatch,
        stacked); else None.
      nonfinite: one microbatch: whether it was found non-finite.
      losses: a pass with ``decision``: each microbatch's weighted loss and weight on this
        device, float32 ``(K, 2)`` (the window's loss is taken over the accepted ones).
    """

    carry: LoopCarry
    loss: Any
    aux: Any
    added: Any = None
    decision: MicrobatchDecision | None = None
    nonfinite: Any = None
    losses: jax.Array | None = None


# ----------------------------------------------------------------------------- set-up


def _step_config(setup: Setup, state: Any) -> tuple[Config, bool]:
    """The optimizer's config, or a one-microbatch window around a plain optimizer; an
    ``accumulate`` the step cannot run is refused (`check_accumulate`)."""
    config = config_of(state.tx)  # a TrainState: `accumjax._host` refused anything else
    check_accumulate(config, setup.mode, setup.axis_name)
    accumulating = config is not None
    if config is None:
        inner = optax.with_extra_args_support(state.tx)
        config = Config(inner=inner, every_k=1, axis_name=None)
    return config, accumulating


def begin(setup: Setup, state: Any, rng: Any) -> tuple[Context, AccumulationState]:
    """The step's `Context` and its `AccumulationState` (a fresh one for a plain optimizer).

    Every mode's step starts here, at trace time: the state and optimizer (no
    ``optax.MultiSteps``), ``rng`` (one key) and a loss that can take it are checked once.
    """
    config, accumulating = _step_config(setup, state)
    check_step_inputs(state, config, rng, setup.loss_positional, setup.f16)
    if accumulating:
        acc = check_state(config, state.opt_state)
        acc = check_layout(setup.mode, setup.pmap_axis, acc)
    else:
        acc = init_state(config, state.params, state.opt_state)
    context = Context(setup=setup, config=config, accumulating=accumulating)
    return context.with_call_values(state, rng), acc


# ----------------------------------------------------------------------------- one microbatch


def _weight(weight_fn: Callable[[Any], Any] | None, batch: Any) -> jax.Array | None:
    """The microbatch's scalar weight from ``weight_fn`` (`microbatch_weight_of`), float32,
    or None without one."""
    return None if weight_fn is None else microbatch_weight_of(weight_fn, batch)


def loss_and_grads(ctx: Context, params: Any, model_state: Any, batch: Any, index: Any) -> Any:
    """``(loss, new model state, aux, grads, weight)`` of one microbatch; at trace time, a
    warning for a plain ``BatchNorm`` whose statistics the loss moves while K > 1."""
    setup = ctx.setup
    key = ctx.key(index)
    loss, new_model_state, aux, grads = setup.grad_fn(
        params,
        model_state,
        batch,
        key,
        device_loss_scale(ctx.loss_scale, ctx.config.scaling, ctx.axis_name),
    )
    if model_state is not None and ctx.config.static_every_k != 1:
        every_k = ctx.config.static_every_k
        warn_plain_batch_norm(new_model_state, "make_train_step", every_k, before=model_state)
    return loss, new_model_state, aux, grads, _weight(setup.weight_fn, batch)


def loss_parts(ctx: Context, weight: Any, loss: Any) -> tuple[Any, Any]:
    """A microbatch's part of the loss metric, ``(weighted loss, weight)``: its loss weighed
    by ``weight`` (a weight of 0 adds nothing, even where the loss is NaN), and the weight it
    counts for in the metric's denominator, ``weight`` times its share (`_loss_share`)."""
    return weigh(weight, loss), weight * _loss_share(ctx)


def loss_mean(loss_sum: Any, loss_weight: Any) -> jax.Array:
    """The loss metric from its summed parts (`loss_parts`): their weighted mean, NaN where
    nothing weighs anything."""
    return jnp.where(loss_weight > 0, loss_sum / loss_weight, jnp.nan)


def _loss_share(ctx: Context) -> Any:
    """What a microbatch's loss counts for in the loss metric's denominator: on a mesh with
    ``"sum"`` (whose loss is each device's share of the whole) 1 over the devices' number, so
    that the metric is one device's loss; else 1."""
    if ctx.axis_name is None or not device_losses_add(ctx.config.scaling):
        return 1.0
    return 1.0 / jax.lax.axis_size(ctx.axis_name)


#: A stream call's pooling on a mesh (`accumjax._mesh_stream`): ``pool(microbatch, weight,
#: produced)`` takes this device's `accumjax._decision.Microbatch` about its rows, its weight
#: (or None) and what its rows produced, an `Outcome` by name (``loss``, ``aux`` and
#: ``carry.model_state``), and returns the whole microbatch's decision (its ``weight`` the
#: whole microbatch's) and an `Outcome` of the same fields made global (the model state
#: following the decision; ``aux`` as rows and means), all in one all-reduce.
Pool = Callable[[Microbatch, Any, Outcome], tuple[Microbatch, Outcome]]


def run_microbatch(
    ctx: Context,
    carry: LoopCarry,
    params: Any,
    batch: Any,
    index: Any,
    *,
    first: bool = False,
    gate: jax.Array | None = None,
    pool: Pool | None = None,
) -> Outcome:
    """One microbatch: gradient, add to the window, keep its model state only if added.

    In scan mode (`Context.adds_before_deciding`) it is added as it comes where ``gate`` (a
    decision taken before, True in a window's first pass) and decided about at the window's
    end from its `Outcome.decision`; otherwise decided first
    (`accumjax._decision.inspect_microbatch`; on a mesh about the whole microbatch). ``first``
    opens the window with it (`accumjax._window.first_microbatch`). With ``pool`` (a stream
    call on a mesh) this device decides about its rows and ``pool`` makes the decision, the
    loss metric, the model state and the aux the whole microbatch's; ``carry.model_state`` is
    then the state its gradient starts from.
    """
    loss, new_model_state, aux, grads, weight = loss_and_grads(
        ctx, params, carry.model_state, batch, index
    )
    config = ctx.config
    add = window_lib.first_microbatch if first else window_lib.add_microbatch
    more: dict[str, Any] = {} if first else {"reduce": ctx.reduce}
    agree = "pool" if pool is not None else "window_end" if ctx.adds_before_deciding else "now"
    m, mine = decide_microbatch(
        config,
        grads,
        weight,
        params,
        ctx.axis_name,
        ctx.whole_gradient_layouts,
        agree=agree,
        gate=gate,
    )
    if pool is not None:
        produced = Outcome(carry=LoopCarry(model_state=new_model_state), loss=loss, aux=aux)
        m, pooled = pool(m, weight, produced)
        loss, new_model_state, aux = pooled.loss, pooled.carry.model_state, pooled.aux
    window, micro = add(config, carry.window, grads, weight, params, m, gate=gate, **more)
    carry, loss = follow_decision(
        ctx, carry, window, micro.added, weight, loss, new_model_state, pooled=pool is not None
    )
    return Outcome(carry, loss, aux, micro.added, mine, micro.nonfinite)


def follow_decision(
    ctx: Context,
    carry: LoopCarry,
    window: Any,
    added: Any,
    weight: Any,
    loss: Any,
    new_state: Any,
    *,
    pooled: bool = False,
) -> tuple[LoopCarry, jax.Array]:
    """``(carry, loss)`` after one microbatch: ``window`` (the window with it), the model
    state it left (``new_state``) kept only where ``added`` (``pooled``: the whole
    microbatch's, kept), its loss (cast as the loss sum) counted with ``weight`` (None: 1)."""
    model_state = new_state if pooled else carry.model_state
    if model_state is not None and not pooled:
        model_state = optax.tree.where(added, new_state, model_state)
    w = jnp.where(added, weight_or_one(weight), 0.0)
    loss = loss.astype(carry.loss_sum.dtype)
    # Rows that weigh nothing (a device's share, on a mesh) may have a NaN mean loss.
    loss_part, weight_part = loss_parts(ctx, w, loss)
    loss_sum, loss_weight = carry.loss_sum + loss_part, carry.loss_weight + weight_part
    carry = LoopCarry(model_state, window=window, loss_sum=loss_sum, loss_weight=loss_weight)
    return carry, loss


# ----------------------------------------------------------------------------- the window's end


def close_fields(
    ctx: Context,
    fields: LoopCarry,
    closed: window_lib.Closed | None = None,
    *,
    model_state_closed: bool = False,
) -> LoopCarry:
    """Closes the window and applies it, in the global view (``ctx`` without a layout, so
    ``ctx.axis_name`` is the ``pmap`` axis or None): the window's one reduction over
    ``ctx.axis_name`` and its decision, unless ``closed`` is given (reduced and decided
    already); the update; the model state closed with the update's decision over
    ``ctx.axis_name`` (`accumjax._batch_norm_windows.close_model_state`), unless
    ``model_state_closed`` (the caller closed it with the window's decision); the loss scale.
    """
    before = fields.opt
    every_step = ctx.setup.mode == "scan"
    params, opt = close_and_apply(
        ctx.config,
        before,
        fields.params,
        ctx.axis_name,
        closed=closed,
        every_step=every_step,
        split=ctx.split_params,
    )
    model_state = fields.model_state
    if not model_state_closed:
        model_state = close_model_state(model_state, opt.updated, ctx.axis_name)
    loss_scale = fields.loss_scale
    if loss_scale is not None:
        loss_scale = update_loss_scale(loss_scale, before, opt)  # the own loop's rule
    return LoopCarry(model_state, params=params, opt=opt, loss_scale=loss_scale)


def finish(
    ctx: Context,
    state: TrainState,
    fields: LoopCarry,
    outcome: Outcome,
    *,
    skipped: jax.Array,
    nonfinite: jax.Array,
) -> tuple[TrainState, dict[str, Any]]:
    """The new train state and the step's metrics, after the window's end (if any).

    ``skipped`` and ``nonfinite``: what this call did with the microbatches it computed (the
    step's count metrics), how many it left out of the window and how many of those were
    non-finite, int32 scalars, the same on every device.
    """
    updated = fields.opt.updated
    new = state.replace(
        step=count_update(jnp.asarray(state.step), updated),
        params=fields.params,
        opt_state=fields.opt if ctx.accumulating else fields.opt.inner_tx_state,
        model_state=fields.model_state,
        loss_scale=fields.loss_scale if fields.loss_scale is not None else state.loss_scale,
    )
    # The norm of the gradient the inner optimizer saw at this call (0.0: no update here).
    grad_norm = jnp.where(updated, fields.opt.grad_norm, 0.0)
    metrics: dict[str, Any] = {
        "loss": outcome.loss,
        "updated": updated,
        "grad_norm": grad_norm,
        "skipped_microbatches": skipped,
        "nonfinite_microbatches": nonfinite,
    }
    if fields.loss_scale is not None:
        metrics["grads_finite"] = outcome.carry.window.window_nonfinite == 0
        metrics["loss_scale"] = fields.loss_scale.loss_scale
    if outcome.aux is not None:
        metrics["aux"] = outcome.aux
    return new, metrics


# ----------------------------------------------------------------------------- stream mode


def start_carry(state: TrainState, acc: AccumulationState) -> LoopCarry:
    """The loop carry a step starts from: the state's window and model state, no loss yet.

    A scan-mode state holds no accumulator; the loop's own is made here, inside the step
    (`accumjax._opt_state.opt_state_for`)."""
    zero = jnp.zeros((), jnp.float32)
    window = acc.window
    if window.grad_sum is None:
        dtype = cast(Config, config_of(state.tx)).accumulator_dtype
        window = window._replace(grad_sum=window_lib.init_window(state.params, dtype).grad_sum)
    return LoopCarry(state.model_state, window=window, loss_sum=zero, loss_weight=zero)


def stream_step(setup: Setup) -> Step:
    """``step(state, batch, rng=None)``: one microbatch per call; the window closes on the
    K-th (at once for a plain optimizer)."""

    def step(state: TrainState, batch: Any, rng: Any = None) -> tuple[TrainState, dict]:
        ctx, acc = begin(setup, state, rng)
        params = mark_varying(state.params, setup.pmap_axis)
        first = not ctx.accumulating
        carry = start_carry(state, acc)
        outcome = run_microbatch(ctx, carry, params, batch, acc.window.micro_step, first=first)
        return stream_close(ctx, state, acc, outcome)

    return step


def stream_close(
    ctx: Context,
    state: TrainState,
    acc: AccumulationState,
    outcome: Outcome,
    *,
    close: Callable[[LoopCarry], LoopCarry] | None = None,
    laid_out: Callable[[LoopCarry], LoopCarry] | None = None,
    at_once: bool | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """A stream call's end, after its one microbatch (``outcome``): the window closed when it
    is full by ``close`` (`close_fields` by default), then the new state and metrics
    (`finish`). ``acc``: the state's `AccumulationState`; ``laid_out`` (ZeRO on a mesh): the
    closed fields laid out where they lie again (GSPMD may lay the close's loop outputs out
    otherwise); ``at_once``: close without the condition (default: a plain optimizer's
    window of one microbatch, which `run_microbatch` opened with ``first``)."""
    added = outcome.added
    opt = acc._replace(window=outcome.carry.window, updated=jnp.zeros((), bool), added=added)
    fields = LoopCarry(
        outcome.carry.model_state, params=state.params, opt=opt, loss_scale=ctx.loss_scale
    )
    close = close or (lambda f: close_fields(ctx, f))
    at_once = not ctx.accumulating if at_once is None else at_once
    fields = close(fields) if at_once else run_once(window_closes(opt), close, fields)
    fields = fields if laid_out is None else laid_out(fields)
    one = lambda flag: jnp.asarray(flag).astype(jnp.int32)
    skipped, nonfinite = one(~added), one(outcome.nonfinite)
    return finish(ctx, state, fields, outcome, skipped=skipped, nonfinite=nonfinite)


# ----------------------------------------------------------------------------- device variance


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def mark_varying(tree: Any, axis_name: str | None) -> Any:
    """Marks values as device-varying so their gradients are not all-reduced implicitly.

    Example:
      >>> import jax.numpy as jnp
      >>> mark_varying({"w": jnp.ones(2)}, None)["w"]  # no axis: unchanged
      Array([1., 1.], dtype=float32)
    """
    if axis_name is None:
        return tree

    def cast(x: Any) -> Any:
        if axis_name in _varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)
