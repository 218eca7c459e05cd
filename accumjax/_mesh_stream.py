"""A stream-mode call on a mesh under ``jit`` (internal): one microbatch in a ``shard_map``.

`sharded_stream_step` runs the loop's microbatch on every device's rows with a pool: one small
all-reduce makes the decision, the loss metric, the model state and the aux means the whole
microbatch's. The state's `accumjax.window.DeviceWindow` keeps one partial sum per data shard
between calls; the call that closes the window reduces them once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import accumjax._mesh as mesh_lib
import accumjax._window as window_lib
from accumjax._batch_norm_windows import (
    emptied_stats_windows,
    model_state_sums,
    pooled_model_state,
)
from accumjax._config import Config
from accumjax._decision import Microbatch, pooled_decision, rows_decision, weight_or_one
from accumjax._layout import partial_sum_count, partial_sums_shape
from accumjax._loop import (
    Context,
    LoopCarry,
    Outcome,
    Setup,
    begin,
    close_fields,
    loss_mean,
    loss_parts,
    run_microbatch,
    stream_close,
    stream_step,
)
from accumjax._mesh import REPLICATED_SPEC
from accumjax._reduction import psum_together
from accumjax._scaling import device_losses_add, share_divisor
from accumjax._sharded_steps import (
    data_shard_map,
    join_aux,
    local_context,
    reduce_gradient,
    split_aux,
    step_specs,
)
from accumjax._zero import optimizer_side, restore_layout, zero_close
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = ["sharded_stream_step"]


def _has_device_window(state: Any) -> bool:
    opt = getattr(state, "opt_state", None)
    return isinstance(opt, AccumulationState) and isinstance(opt.window, window_lib.DeviceWindow)


def sharded_stream_step(setup: Setup) -> Callable[..., tuple[TrainState, dict]]:
    """Stream mode under ``jit``: ``step(state, batch, rng, layout)`` (``layout`` static).

    On a mesh every call runs in a ``shard_map``. A state made by ``step.init`` (a
    `accumjax.window.DeviceWindow`) adds each device's gradient to its own partial sum and
    reduces the sums once, when the window closes; a parameter-shaped window
    (``TrainState.create``, ``tx.init``) takes the gradient reduced on every call. On one
    device it is the plain stream step (a `DeviceWindow`'s one partial sum is the window).
    """
    plain = stream_step(setup)

    def step(state: TrainState, batch: Any, rng: Any, layout: Any) -> tuple[TrainState, dict]:
        per_shard = _has_device_window(state)
        if per_shard:
            _check_shards(state.opt_state.window, layout)  # pyright: ignore[reportAttributeAccessIssue]
        if layout is None:
            return _one_shard(plain, state, batch, rng) if per_shard else plain(state, batch, rng)
        return _mesh_call(setup, layout, state, batch, rng)

    return step


def _check_shards(window: window_lib.DeviceWindow, layout: mesh_lib.MeshLayout | None) -> None:
    """Refuses a `DeviceWindow` laid out for another number of data shards than the call's.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax._window import DeviceWindow, init_window, retyped
      >>> two_shards = retyped(init_window({"w": jnp.zeros((2, 3))}), DeviceWindow)
      >>> try:
      ...     _check_shards(two_shards, None)
      ... except ValueError as e:
      ...     print(str(e).split(":")[0])
      the state's stream window keeps 2 partial sums per parameter, but this call runs on one device
    """
    want = 1 if layout is None else layout.shards
    dims = (None,) * len(jax.tree.leaves(window.partial_sums))
    dims = dims if layout is None else layout.accumulator_dims
    for leaf, dim in zip(jax.tree.leaves(window.partial_sums), dims, strict=True):
        held = partial_sums_shape(leaf.shape)[0]
        if held != partial_sum_count(dim, want):  # the sums the plan lays out for this leaf
            where = "one device" if layout is None else f"{want} data shards ({layout.axis!r})"
            raise ValueError(
                f"the state's stream window keeps {held} partial sums per parameter, "
                f"but this call runs on {where}: build the state with step.init on the mesh "
                "the step runs on, or move a checkpoint there with "
                "accumjax.restore_checkpoint(path, step.init(...))."
            )


def _one_shard(plain: Callable[..., Any], state: TrainState, batch: Any, rng: Any) -> Any:
    """A `DeviceWindow` of one shard on one device: its partial sums are the window (each
    gradient broadcasts into its leading axis of one: no copy of the sums per call)."""
    opt: AccumulationState = state.opt_state  # pyright: ignore[reportAssignmentType]
    window = window_lib.retyped(opt.window, window_lib.Window)
    new, metrics = plain(state.replace(opt_state=opt._replace(window=window)), batch, rng)
    new_opt = new.opt_state
    window = window_lib.retyped(new_opt.window, window_lib.DeviceWindow)
    return new.replace(opt_state=new_opt._replace(window=window)), metrics


def _mesh_call(
    setup: Setup, layout: mesh_lib.MeshLayout, state: TrainState, batch: Any, rng: Any
) -> tuple[TrainState, dict]:
    """One stream call on a mesh: the microbatch added in a ``shard_map`` (its decision, loss
    and model state pooled), and the window closed when it is full."""
    ctx, acc = begin(setup, state, rng)
    aux_structure: dict[str, Any] = {}
    per_shard = isinstance(acc.window, window_lib.DeviceWindow)
    if per_shard:
        window_specs = layout.window_specs()
    else:
        window_specs = mesh_lib.field_specs(window_lib.Window, layout.accumulator_specs())
    local_state = state.replace(opt_state=None)
    aux_specs = (PartitionSpec(layout.axis), REPLICATED_SPEC)  # `split_aux`'s rows and means
    outcome_specs = Outcome(
        carry=LoopCarry(model_state=REPLICATED_SPEC),
        loss=REPLICATED_SPEC,
        aux=aux_specs,
        added=REPLICATED_SPEC,
        nonfinite=REPLICATED_SPEC,
    )
    window, outcome = data_shard_map(
        partial(_local_call, ctx, layout, aux_structure, per_shard),
        layout,
        in_specs=(step_specs(layout, local_state, window_specs),),
        out_specs=(window_specs, outcome_specs),
    )((local_state, batch, rng, acc.window))
    if per_shard:
        close = partial(_close_device_window, ctx, layout)
    else:  # the sum is reduced already: the window closes in the global view
        close = lambda f: close_fields(ctx, f)
    laid_out = None
    if layout.zero_sharded:  # the close's loop carries the optimizer state as planned
        close = partial(zero_close, layout, ctx.accumulating, close)
        acc = optimizer_side(layout, state.params, acc)[1]
        laid_out = partial(restore_layout, layout)
    aux = None if not aux_structure else join_aux(outcome.aux, aux_structure, layout.shards)
    carry = outcome.carry._replace(window=window)
    outcome = outcome._replace(carry=carry, aux=aux)
    # The window came through `add_microbatch`: even a plain optimizer's closes when full.
    return stream_close(ctx, state, acc, outcome, close=close, laid_out=laid_out, at_once=False)


def _local_call(
    ctx: Context,
    layout: mesh_lib.MeshLayout,
    aux_structure: dict[str, Any],
    per_shard: bool,
    inputs: tuple[Any, ...],
) -> tuple[Any, Outcome]:
    """One device's part of a stream call, from its ``(state, batch, rng, window)``
    (`accumjax._sharded_steps.step_specs`): the loop's microbatch, its gradient added to this
    device's partial sum (``per_shard``: a leading axis of one, which the gradient broadcasts
    to) or reduced and added to the window's one sum, the rest pooled (`_pool`). Returns the
    window (of the type it came in, its counters advanced by
    `accumjax._window.add_microbatch`) and, by name, the microbatch's `accumjax._loop.Outcome`:
    the global model state (its ``carry``'s only field), loss and aux (`split_aux`'s ``(rows,
    means)``), whether it was ``added`` and whether it was ``nonfinite``."""
    state, batch, rng, open_window = inputs
    ctx = local_context(ctx, layout, state, rng)
    reduce = reduce_gradient(layout, replicated=not per_shard)
    ctx = ctx._replace(reduce=reduce)
    params = mesh_lib.gather_params(state.params, layout)
    window = window_lib.retyped(open_window, window_lib.Window)
    start = None if state.model_state is None else emptied_stats_windows(state.model_state)
    zero = jnp.zeros((), jnp.float32)
    carry = LoopCarry(window=window, model_state=start, loss_sum=zero, loss_weight=zero)
    pool = partial(_pool, ctx, layout, aux_structure, state.model_state)
    out = run_microbatch(ctx, carry, params, batch, window.micro_step, pool=pool)
    window = window_lib.retyped(out.carry.window, type(open_window))
    carry = LoopCarry(model_state=out.carry.model_state)
    outcome = Outcome(
        carry=carry, loss=out.loss, aux=out.aux, added=out.added, nonfinite=out.nonfinite
    )
    return window, outcome


def _pool(
    ctx: Context,
    layout: mesh_lib.MeshLayout,
    aux_structure: dict[str, Any],
    before: Any,
    m: Microbatch,
    weight: jax.Array | None,
    produced: Outcome,
) -> tuple[Microbatch, Outcome]:
    """The `accumjax._loop.Pool` of a stream call on a mesh: this device's decision ``m``
    about its rows as its share (`_share`), summed with the loss, the model state's sums
    (`accumjax._batch_norm_windows.model_state_sums`: BatchNorm statistics, other floating
    leaves) and aux means in one all-reduce; ``before``: the model state the call started
    from (`accumjax._batch_norm_windows.pooled_model_state` makes it global). A policy that
    reads the gradient decided about the whole microbatch already (its one gradient-sized
    all-reduce); otherwise, without a ``skip_fn``, a microbatch is refused only for being
    non-finite."""
    loss, new_state, aux = produced.loss, produced.carry.model_state, produced.aux
    config = ctx.config
    weighs = weight_or_one(weight)
    mine = rows_decision(config.scaling, m, weight)
    m = _share(config, m, layout)
    aux_rows, aux_means = split_aux(aux, 0, aux_structure) if aux is not None else ([], [])
    sums = model_state_sums(new_state)
    # A device whose rows weigh nothing may have a NaN mean loss: it adds nothing.
    loss_sum, loss_weight = loss_parts(ctx, weighs, loss.astype(jnp.result_type(jnp.float32, loss)))
    parts = {
        "loss_sum": loss_sum,
        "loss_weight": loss_weight.astype(loss_sum.dtype),
        "weight": m.weight,
        "decision": mine,
        "sums": sums,
        "aux_means": aux_means,
    }
    pooled = psum_together(parts, layout.axis)
    m = pooled_decision(config, m, pooled["weight"], pooled["decision"])
    model_state = pooled_model_state(before, new_state, pooled["sums"], m.added, layout.shards)
    loss = loss_mean(pooled["loss_sum"], pooled["loss_weight"])
    aux = (aux_rows, pooled["aux_means"])
    return m, Outcome(carry=LoopCarry(model_state=model_state), loss=loss, aux=aux)


def _share(config: Config, m: Microbatch, layout: mesh_lib.MeshLayout) -> Microbatch:
    """A device's decision about its rows, as its share of the whole microbatch
    (`accumjax._scaling.share_divisor`, the rule `accumjax._decision.whole_gradient` divides
    by): for losses that are means (``"mean"``, ``"sum_over_k"``), its gradient and weight
    count 1/shards of the microbatch's, so that a `accumjax.window.DeviceWindow` holds what
    one device's window would (its sum and counts do not depend on the number of devices);
    under ``"sum"`` its gradient is its share already; under ``"weighted"`` its factor is its
    own weight. A transformed gradient is the whole microbatch's on every device: under
    ``"sum"`` each device adds 1/shards of it too."""
    divisor = share_divisor(config.scaling, layout.shards)
    if divisor is None:  # "weighted"
        return m
    if device_losses_add(config.scaling):
        if m.transformed is None:
            return m
        return m._replace(factor=jnp.asarray(1.0 / layout.shards, jnp.float32))
    share = 1.0 / divisor
    factor = share if m.factor is None else m.factor * share
    return m._replace(weight=m.weight * share, factor=jnp.asarray(factor, jnp.float32))


def _close_device_window(ctx: Context, layout: mesh_lib.MeshLayout, fields: LoopCarry) -> LoopCarry:
    """The window's end: its one reduction in a ``shard_map`` (the sums of parameters split
    over the data axis are reduced already), then the update and the model state's close in
    the global view (`accumjax._loop.close_fields`)."""
    config = ctx.config

    def local(window: window_lib.DeviceWindow, every_k: jax.Array) -> window_lib.Closed:
        part = window_lib.local_window(window)
        return window_lib.close_window(
            config, part, every_k, layout.axis, layout.leaves, global_counts=True
        )

    closed = data_shard_map(
        local,
        layout,
        in_specs=(layout.window_specs(), REPLICATED_SPEC),
        out_specs=mesh_lib.field_specs(window_lib.Closed, layout.optimizer_specs()),
    )(fields.opt.window, fields.opt.every_k)
    return close_fields(ctx, fields, closed)
