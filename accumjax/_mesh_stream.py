"""A stream-mode call on a mesh under ``jit`` (internal): one microbatch in a ``shard_map``.

Each call is `accumjax._loop.microbatch` on every device with a `accumjax._loop.Pool`: the
device decides about its rows, and one small all-reduce makes the decision, the loss metric,
BatchNorm statistics, other model state and aux means the whole microbatch's. The window's
counters advance in `accumjax._window.add_microbatch` as on one device. The state's
`accumjax.window.DeviceWindow` keeps one partial sum per data shard between calls (FSDP:
reduce-scattered into the shard); the closing call reduces the partial sums once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import accumjax._window as window_lib
from accumjax import sharded
from accumjax._agreement import MicrobatchDecision, accepted, device_decision, weigh
from accumjax._batch_norm_windows import call_sums, emptied, is_step_driven, merge_pooled
from accumjax._layout import held_sums, sums_held
from accumjax._loop import (
    Carry,
    Context,
    Outcome,
    Setup,
    begin,
    close_fields,
    close_model_state,
    finish,
    loss_share,
    microbatch,
    stream_step,
)
from accumjax._sharded_steps import (
    WHOLE,
    data_shard_map,
    field_specs,
    join_aux,
    local_context,
    psum_together,
    reduce_gradient,
    split_aux,
    step_specs,
)
from accumjax._window_end import window_closes
from accumjax._zero import laid_back, optimizer_side, zero_close
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


def _check_shards(window: window_lib.DeviceWindow, layout: sharded.Layout | None) -> None:
    """Refuses a `DeviceWindow` laid out for another number of data shards than the call's."""
    want = 1 if layout is None else layout.shards
    dims = (None,) * len(jax.tree.leaves(window.partial_sums))
    dims = dims if layout is None else layout.accumulator_dims
    for leaf, dim in zip(jax.tree.leaves(window.partial_sums), dims, strict=True):
        held = held_sums(leaf.shape)[0]
        if held != sums_held(dim, want):  # the sums the plan lays out for this leaf
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
    window = _retyped(opt.window, window_lib.Window)
    new, metrics = plain(state.replace(opt_state=opt._replace(window=window)), batch, rng)
    new_opt = new.opt_state
    window = _retyped(new_opt.window, window_lib.DeviceWindow)
    return new.replace(opt_state=new_opt._replace(window=window)), metrics


def _retyped(window: Any, cls: type) -> Any:
    """``window`` (a `accumjax._window.Window` or `accumjax._window.DeviceWindow`) as ``cls``:
    the same sum (its first field) and counters, by name.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax._window import DeviceWindow, init_window
      >>> d = _retyped(init_window({"w": jnp.zeros(2)}), DeviceWindow)
      >>> type(d).__name__, d.partial_sums["w"].shape, int(d.micro_step)
      ('DeviceWindow', (2,), 0)
    """
    counters = {name: getattr(window, name) for name in window._fields[1:]}
    return cls(**{cls._fields[0]: window[0]}, **counters)  # pyright: ignore[reportAttributeAccessIssue]


def _mesh_call(
    setup: Setup, layout: sharded.Layout, state: TrainState, batch: Any, rng: Any
) -> tuple[TrainState, dict]:
    """One stream call on a mesh: the microbatch added in a ``shard_map`` (its decision, loss
    and model state pooled), and the window closed when it is full."""
    ctx, acc = begin(setup, state, rng)
    aux_tree: list[Any] = []
    per_shard = isinstance(acc.window, window_lib.DeviceWindow)
    if per_shard:
        window_specs = layout.window_specs()
    else:
        window_specs = field_specs(window_lib.Window, layout.accumulator_specs())
    local_state = state.replace(opt_state=None)
    aux_specs = (PartitionSpec(layout.axis), WHOLE)  # `split_aux`'s rows and means
    window, model_state, loss, aux, added, nonfinite = data_shard_map(
        partial(_local_call, ctx, layout, aux_tree, per_shard),
        layout,
        in_specs=(step_specs(layout, local_state, window_specs),),
        out_specs=(window_specs, WHOLE, WHOLE, aux_specs, WHOLE, WHOLE),
    )((local_state, batch, rng, acc.window))
    opt = acc._replace(window=window, updated=jnp.zeros((), bool), added=added)
    fields = Carry(params=state.params, opt=opt, model_state=model_state, loss_scale=ctx.loss_scale)
    if per_shard:
        close = partial(_close_device_window, ctx, layout)
    else:  # the sum is reduced already: the window closes in the global view
        close = lambda f: close_fields(ctx, f)
    if layout.zero:
        close = partial(zero_close, layout, ctx.accumulating, close)
        fields = fields._replace(opt=optimizer_side(layout, fields.params, fields.opt)[1])
    fields = window_lib.run_once(window_closes(opt), close, fields)
    if layout.zero:  # GSPMD may lay the loop's outputs out otherwise (an Auto mesh)
        fields = laid_back(layout, fields)
    aux = None if not aux_tree else join_aux(aux, aux_tree, layout.shards)
    zero = jnp.zeros(())
    carry = Carry(window=window, model_state=fields.model_state, loss_sum=zero, loss_weight=zero)
    one = lambda flag: flag.astype(jnp.int32)
    outcome = Outcome(carry=carry, loss=loss, aux=aux)
    return finish(ctx, state, fields, outcome, skipped=one(~added), nonfinite=one(nonfinite))


def _local_call(
    ctx: Context,
    layout: sharded.Layout,
    aux_tree: list[Any],
    per_shard: bool,
    inputs: tuple[Any, ...],
) -> tuple[Any, Any, jax.Array, tuple[Any, Any], jax.Array, jax.Array]:
    """One device's part of a stream call, from its ``(state, batch, rng, window)``
    (`accumjax._sharded_steps.step_specs`): the loop's microbatch, its gradient added to this
    device's partial sum (``per_shard``: a leading axis of one, which the gradient broadcasts
    to) or reduced and added to the window's one sum, the rest pooled (`_pool`). Returns the
    window (of the type it came in, its counters advanced by
    `accumjax._window.add_microbatch`), and the global model state, loss, aux, whether the
    microbatch was added and whether it was non-finite."""
    state, batch, rng, open_window = inputs
    ctx = local_context(ctx, layout, state, rng)
    reduce = reduce_gradient(layout, whole=not per_shard)
    ctx = ctx._replace(reduce=reduce)
    params = sharded.gather(state.params, layout)
    window = _retyped(open_window, window_lib.Window)
    start = None if state.model_state is None else emptied(state.model_state)
    zero = jnp.zeros((), jnp.float32)
    carry = Carry(window=window, model_state=start, loss_sum=zero, loss_weight=zero)
    pool = partial(_pool, ctx, layout, aux_tree, state.model_state)
    out = microbatch(ctx, carry, params, batch, window.micro_step, pool=pool)
    window = _retyped(out.carry.window, type(open_window))
    return window, out.carry.model_state, out.loss, out.aux, out.added, out.nonfinite


def _pool(
    ctx: Context,
    layout: sharded.Layout,
    aux_tree: list[Any],
    before: Any,
    m: window_lib.Microbatch,
    weight: jax.Array | None,
    produced: tuple[Any, Any, Any],
) -> tuple[window_lib.Microbatch, tuple[jax.Array, Any, tuple[Any, Any]]]:
    """The `accumjax._loop.Pool` of a stream call on a mesh: this device's decision ``m``
    about its rows as its share (`_share`), summed with the loss, BatchNorm statistics, other
    floating model state and aux means in one all-reduce; ``before``: the model state the
    call started from. A policy that reads the gradient decided about the whole microbatch
    already (its one gradient-sized all-reduce); otherwise, without a ``skip_fn``, a
    microbatch is refused only for being non-finite."""
    loss, new_state, aux = produced
    policy = ctx.config.policy
    weighs = jnp.ones((), jnp.float32) if weight is None else weight
    mine = device_decision(policy.scaling, ~m.added, weighs)
    m = _share(policy, m, layout)
    aux_rows, aux_means = split_aux(aux, 0, aux_tree) if aux is not None else ([], [])
    floats = [] if new_state is None else _floats(new_state)[1]
    bn = jnp.zeros(1) if new_state is None else call_sums(new_state)
    parts = jnp.stack([m.weight, *mine])
    # A device whose rows weigh nothing may have a NaN mean loss: it adds nothing.
    weighted_loss = weigh(weighs, loss.astype(jnp.result_type(jnp.float32, loss)))
    losses = jnp.stack([weighted_loss, weighs * loss_share(ctx)])
    loss_parts, parts, bn, *rest = psum_together(
        [losses, parts, bn, *floats, *aux_means],
        layout.axis,
    )
    decision = MicrobatchDecision(rejected=parts[1], rejected_weightless=parts[2], weight=parts[3])
    added = accepted(policy.scaling, decision)
    nonfinite = m.nonfinite if policy.reads else ~added
    m = m._replace(added=added, nonfinite=nonfinite, weight=jnp.where(added, parts[0], 0.0))
    model_state = None
    if new_state is not None:
        bn = jnp.where(added, bn, jnp.zeros_like(bn))
        means = [total / layout.shards for total in rest[: len(floats)]]
        model_state = _pooled_model_state(before, new_state, bn, means, added)
    pooled_aux = (aux_rows, rest[len(floats) :])
    return m, (loss_parts[0] / loss_parts[1], model_state, pooled_aux)


def _share(
    policy: window_lib.Policy, m: window_lib.Microbatch, layout: sharded.Layout
) -> window_lib.Microbatch:
    """A device's decision about its rows, as its share of the whole microbatch: for losses
    that are means (``"mean"``, ``"sum_over_k"``), its gradient and weight count 1/shards of
    the microbatch's, so that a `accumjax.window.DeviceWindow` holds what one device's window
    would (its sum and counts do not depend on the number of devices). A transformed
    gradient is the whole microbatch's on every device: under ``"sum"`` each device adds
    1/shards of it too (``"weighted"``: its own weight's share, as its factor says)."""
    share = 1.0 / layout.shards
    if policy.scaling not in ("mean", "sum_over_k"):
        if m.transformed is None or policy.scaling != "sum":
            return m
        return m._replace(factor=jnp.asarray(share, jnp.float32))
    factor = share if m.factor is None else m.factor * share
    return m._replace(weight=m.weight * share, factor=jnp.asarray(factor, jnp.float32))


def _floats(tree: Any) -> tuple[list[int], list[Any]]:
    """The floating leaves of a model state beside its step-driven BatchNorm layers (each
    layer one node), by position among ``jax.tree.flatten(tree, is_leaf=is_step_driven)``."""
    leaves = jax.tree.flatten(tree, is_leaf=is_step_driven)[0]
    where = [
        i
        for i, x in enumerate(leaves)
        if not is_step_driven(x)
        and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        and not jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
    ]
    return where, [leaves[i] for i in where]


def _pooled_model_state(
    before: Any, called: Any, bn: jax.Array, means: list[Any], added: jax.Array
) -> Any:
    """The global model state after a stream call on a mesh, ``called`` this device's model
    state after the call: each step-driven BatchNorm window merged with the call's
    statistics pooled over the devices (``bn``: zeros when the microbatch was not added);
    every other leaf changed only when the microbatch was ``added`` (as on one device):
    floating leaves to their mean over the devices, others (counts, keys: the same on every
    device) to this device's."""
    merged, treedef = jax.tree.flatten(merge_pooled(before, bn), is_leaf=is_step_driven)
    ours = jax.tree.flatten(called, is_leaf=is_step_driven)[0]
    where, _ = _floats(called)
    for i, mean in zip(where, means, strict=True):
        ours[i] = mean.astype(jnp.result_type(ours[i]))
    out = [
        m if is_step_driven(m) else jnp.where(added, o, m)
        for m, o in zip(merged, ours, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _close_device_window(ctx: Context, layout: sharded.Layout, fields: Carry) -> Carry:
    """The window's end: its one reduction in a ``shard_map`` (the sums of parameters split
    over the data axis are reduced already), then the update in the global view."""
    policy = ctx.config.policy

    def local(window: window_lib.DeviceWindow, every_k: jax.Array) -> window_lib.Closed:
        part = window_lib.local_window(window)
        return window_lib.close_window(
            policy, part, every_k, layout.axis, layout.leaves, whole_counts=True
        )

    closed = data_shard_map(
        local,
        layout,
        in_specs=(layout.window_specs(), WHOLE),
        out_specs=field_specs(window_lib.Closed, layout.optimizer_specs()),
    )(fields.opt.window, fields.opt.every_k)
    fields = close_fields(ctx, fields, closed)
    model_state = close_model_state(fields.model_state, fields.opt.updated, None)
    return fields._replace(model_state=model_state)
