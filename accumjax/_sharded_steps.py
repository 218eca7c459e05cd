"""The train step on a mesh under ``jit`` (internal): one gradient reduction per window.

A `accumjax.sharded.Layout` names the mesh and its data axis. Each step runs its microbatches
in a ``jax.shard_map`` manual over the data axis only (other mesh axes, a tensor-parallel one
say, stay automatic), so each device adds the gradient of its rows to a sum of its own:

- scan mode (`sharded_scan_step`): the K microbatches of one call, then the window's one
  reduction (an all-reduce, and a reduce-scatter per parameter split over the data axis),
  which also carries the loss and the per-microbatch aux means; the update runs in the
  global view;
- stream mode (`sharded_stream_step`): the state's `accumjax.window.DeviceWindow` keeps one
  partial sum per data shard between calls. Each call adds this device's gradient to its own
  (FSDP: reduce-scattered into the shard), and pools everything else the microbatch produced
  (its loss, weight and counts, BatchNorm statistics, other model state) in one small
  all-reduce; the closing call reduces the partial sums once.

Every value a step returns is global: metrics are scalars, aux leaves with rows have the rows
of every device, aux scalars are means over the devices (`_Aux`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import accumjax._window as window_lib
from accumjax import sharded
from accumjax._agreement import MicrobatchDecision, accepted, device_decision, weigh
from accumjax._batch_norm_windows import call_sums, emptied, is_step_driven, merge_pooled
from accumjax._layout import Reduction, held_sums, sums_held
from accumjax._loop import (
    Carry,
    Context,
    Counts,
    Fields,
    Outcome,
    Setup,
    begin,
    close_fields,
    close_model_state,
    finish,
    gradient,
    loss_share,
    stream_step,
)
from accumjax._scan import (
    Closing,
    accepted_loss,
    decide_window,
    real_microbatches,
    scan_finish,
    scan_step,
    window_k,
    window_loop,
)
from accumjax._window_end import window_closes
from accumjax._zero import laid_back, optimizer_side, parameter_side, split_params, zero_close
from accumjax.accumulation_state import AccumulationState
from accumjax.train_state import TrainState

__all__ = ["psum_together", "sharded_scan_step", "sharded_stream_step"]

WHOLE = PartitionSpec()


class _Local(NamedTuple):
    """One device's inputs to a sharded step's ``shard_map`` (its one argument)."""

    params: Any
    model_state: Any
    batch: Any
    rng: Any
    step_count: Any
    loss_scale: Any
    n_real: Any = None
    window: Any = None


def _local_specs(layout: sharded.Layout, **more: Any) -> _Local:
    """The ``shard_map`` specs of `_Local`: the batch split, parameters as they lie."""
    data = PartitionSpec(layout.axis)
    return _Local(layout.param_specs(), WHOLE, data, WHOLE, WHOLE, WHOLE, **more)


def _shard_map(fn: Callable[..., Any], layout: sharded.Layout, in_specs: Any, out_specs: Any):
    """``fn`` mapped over the data axis (the others stay automatic); its inputs are first
    moved to the data-axis placement ``in_specs`` says (on an ``Explicit`` axis ``shard_map``
    takes no other)."""
    mapped = jax.shard_map(
        fn,
        mesh=layout.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={layout.axis},
        check_vma=False,
    )
    return lambda *args: mapped(*_fit(args, in_specs, layout))


def _fit(args: Any, specs: Any, layout: sharded.Layout) -> Any:
    """``args`` resharded where their data-axis placement differs from ``specs`` (a pytree
    prefix), other axes kept; only an ``Explicit`` data axis needs it."""
    mesh = layout.mesh
    if mesh.axis_types[mesh.axis_names.index(layout.axis)] != jax.sharding.AxisType.Explicit:
        return args
    axis = layout.axis

    def fit(spec: PartitionSpec, x: Any) -> Any:
        now = getattr(jax.typeof(x).sharding, "spec", None)
        if now is None:
            return x
        entries = [tuple(n for n in sharded.names(e) if n != axis) for e in now]
        entries += [()] * (jnp.ndim(x) - len(entries))
        for dim, entry in enumerate(spec):
            if axis in sharded.names(entry):
                entries[dim] = (axis, *entries[dim])
        want = PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in entries))
        if want == PartitionSpec(*now) or tuple(want) == tuple(now):
            return x
        return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, want))

    return jax.tree.map(
        lambda spec, sub: jax.tree.map(partial(fit, spec), sub),
        specs,
        args,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def _local_context(ctx: Context, layout: sharded.Layout, local: _Local) -> Context:
    return ctx._replace(
        loss_scale=local.loss_scale,
        rng=local.rng,
        step_count=local.step_count,
        axis_name=layout.axis,
    )


def psum_together(parts: list[Any], axis: str) -> list[jax.Array]:
    """Sums ``parts`` (arrays of any shapes) across ``axis`` in one all-reduce: they travel
    as one flat vector of their common type (at least float32, so counts below 2**24 stay
    exact), and come back in their own (floating) types.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> summed = jax.vmap(lambda x: psum_together([x, 2 * x], "i"), axis_name="i")(
      ...     jnp.arange(3.0))
      >>> [s[0].tolist() for s in summed]
      [3.0, 6.0]
    """
    arrays = [jnp.asarray(p) for p in parts]
    dtype = jnp.result_type(jnp.float32, *arrays)
    flat = jax.lax.psum(jnp.concatenate([a.ravel().astype(dtype) for a in arrays]), axis)
    out, offset = [], 0
    for a in arrays:
        part = flat[offset : offset + a.size].reshape(a.shape)
        own = jnp.result_type(jnp.float32, a)
        part = part if jnp.issubdtype(own, jnp.complexfloating) else jnp.real(part)
        out.append(part.astype(own))
        offset += a.size
    return out


class _Aux(NamedTuple):
    """A per-device aux split for ``shard_map``'s outputs: leaves with rows (concatenated
    over the devices along their ``row_axis``) and the others (averaged over the devices)."""

    rows: list[Any]
    means: list[Any]


def _split_aux(aux: Any, row_axis: int, aux_tree: list[Any]) -> _Aux:
    """``aux`` as an `_Aux`; its structure goes into ``aux_tree`` for `_join_aux`."""
    leaves, treedef = jax.tree.flatten(aux)
    has_rows = [jnp.ndim(x) > row_axis for x in leaves]
    aux_tree[:] = [treedef, has_rows, [jnp.result_type(x) for x in leaves]]
    rows = [x for x, r in zip(leaves, has_rows, strict=True) if r]
    return _Aux(rows, [x for x, r in zip(leaves, has_rows, strict=True) if not r])


def _join_aux(split: _Aux, aux_tree: list[Any], shards: int) -> Any:
    """`_split_aux` undone, after ``shard_map``: the means divided by the number of shards."""
    treedef, has_rows, dtypes = aux_tree
    rows, means = iter(split.rows), iter(split.means)
    leaves = [
        next(rows) if r else (next(means) / shards).astype(d)
        for r, d in zip(has_rows, dtypes, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- scan mode


def sharded_scan_step(setup: Setup) -> Callable[..., tuple[TrainState, dict]]:
    """Scan mode under ``jit``: ``step(state, batch, rng, layout, n)`` (``layout`` static).

    Without a layout (one device) it is the plain scan step.
    """
    plain = scan_step(setup)

    def step(
        state: TrainState, batch: Any, rng: Any, layout: Any, n: Any = None
    ) -> tuple[TrainState, dict]:
        if layout is None:
            return plain(state, batch, rng, n)
        if setup.batch_axis != 0:
            raise NotImplementedError(
                "make_train_step(batch_axis=...) other than 0 with a batch split over a mesh: "
                "put the batch axis first, or run the step on unsharded arrays."
            )
        ctx, acc = begin(setup, state, rng)
        ctx = ctx._replace(n_real=real_microbatches(n, ctx.k))
        aux_tree: list[Any] = []
        local = _Local(
            state.params, state.model_state, batch, rng, state.step, ctx.loss_scale, ctx.n_real
        )
        closed_specs = window_lib.Closed(layout.optimizer_specs(), *(WHOLE,) * 6)  # pyright: ignore[reportArgumentType]
        row_spec = PartitionSpec(*([None] * (0 if setup.aux_rows else 1)), layout.axis)
        closed, model_state, loss, aux = _shard_map(
            partial(_local_window, ctx, layout, aux_tree),
            layout,
            in_specs=(_local_specs(layout, n_real=WHOLE),),
            out_specs=(closed_specs, WHOLE, WHOLE, _Aux(row_spec, WHOLE)),  # pyright: ignore[reportArgumentType]
        )(local)
        aux = None if not aux_tree else _join_aux(aux, aux_tree, layout.shards)
        closing = Closing(closed, model_state, loss, aux)
        if not layout.zero:
            return scan_finish(ctx, state, acc, closing)
        _, acc = optimizer_side(layout, state.params, acc)
        ctx = ctx._replace(setup=ctx.setup._replace(split_params=split_params(layout)))
        new, metrics = scan_finish(ctx, state, acc, closing)
        return parameter_side(layout, new, ctx.accumulating), metrics

    return step


def _local_window(
    ctx: Context, layout: sharded.Layout, aux_tree: list[Any], local: _Local
) -> tuple[window_lib.Closed, Any, jax.Array, _Aux]:
    """One device's part of a window: its rows' gradients summed as they come (decided at
    the window's end, with the reduction) or decided by all devices together microbatch by
    microbatch (a policy that reads the gradient), then the window's one reduction (which
    also carries the loss and the aux means)."""
    zero = jnp.zeros((), jnp.float32)
    policy = ctx.config.policy
    setup, params = ctx.setup, local.params
    if setup.gather_params == "window":  # once, before the loop (more memory, one gather)
        params = sharded.gather(params, layout)
    else:  # in every microbatch, tied to its index so that XLA cannot hoist it
        gather = lambda p, i: sharded.gather(jax.lax.optimization_barrier((p, i))[0], layout)
        setup = setup._replace(materialize=gather)
    setup, scatter, whole_counts, sum_dims = _sum_layout(setup, layout, policy)
    shapes = layout.local_sums(local.params, sum_dims)
    like = window_lib.init_window(shapes, policy.accumulator_dtype)
    ctx = _local_context(ctx, layout, local)._replace(setup=setup, n_real=local.n_real)
    start = Carry(like, local.model_state, zero, zero)
    run = window_loop(ctx, params, start, local.batch)
    first = run(None)
    rows = setup.aux_rows ^ 1
    split = _Aux([], []) if first.aux is None else _split_aux(first.aux, rows, aux_tree)
    every_k = window_k(ctx, ctx.k)

    def close(carry: Carry, decisions: Any, losses: Any) -> tuple[window_lib.Closed, Any, list]:
        extras = [carry.loss_sum, carry.loss_weight, *split.means]
        extras += [] if losses is None else [losses]
        closed = window_lib.close_window(
            policy,
            carry.window,
            every_k,
            layout.axis,
            scatter,
            extras=jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in extras]),
            whole_counts=whole_counts,
            decisions=decisions,
        )
        out = _unflatten(closed.extras, extras)
        if losses is None:
            loss = jnp.where(out[1] > 0, out[0] / out[1], jnp.nan)
        else:
            loss = accepted_loss(out[-1], cast(jax.Array, closed.accepted))
        model_state = close_model_state(carry.model_state, closed.apply, layout.axis)
        return closed._replace(extras=None), model_state, [loss, *out[2 : 2 + len(split.means)]]

    closed, model_state, extras = decide_window(ctx, first, run, close)
    return closed._replace(accepted=None), model_state, extras[0], _Aux(split.rows, extras[1:])


def _sum_layout(
    setup: Setup, layout: sharded.Layout, policy: window_lib.Policy
) -> tuple[Setup, Any, bool, tuple[int | None, ...]]:
    """Where a scan window's sum lives, from the layout plan: ``(setup, scatter,
    whole_counts, dims)``, ``scatter`` what the window's close does to each leaf
    (`accumjax._window.close_window`), ``dims`` each sum's dimension split over the data axis.

    A policy that reads the gradient reduces each microbatch's whole gradient (the leaves
    whose optimizer state is split over the data axis reduce-scattered into shards): nothing
    is left to reduce at the window's end. Otherwise a leaf reduced per microbatch is
    reduce-scattered into its sharded accumulator as it comes, a leaf reduced per window is
    a full-size sum reduce-scattered once at the end, and the others are all-reduced once.
    """
    opt_dims = layout.optimizer_dims
    if policy.reads:
        whole = [window_lib.WHOLE if d is None else window_lib.REDUCED for d in opt_dims]
        dims = jax.tree.unflatten(layout.treedef, list(opt_dims))
        scatter = jax.tree.unflatten(layout.treedef, whole)
        return setup._replace(dims=dims), scatter, True, opt_dims
    kinds = []
    for leaf in layout.leaves:
        if leaf.reduction == Reduction.REDUCE_SCATTER_MICROBATCH:
            kinds.append(window_lib.REDUCED)
        elif leaf.reduction == Reduction.REDUCE_SCATTER_WINDOW:
            kinds.append(leaf.optimizer)
        else:
            kinds.append(None)
    scatter = jax.tree.unflatten(layout.treedef, kinds)
    acc_dims = layout.accumulator_dims
    if any(d is not None for d in acc_dims):
        setup = setup._replace(reduce=_reduce(layout, whole=False))
    return setup, scatter, False, acc_dims


def _unflatten(flat: Any, like: list[Any]) -> list[jax.Array]:
    """``flat`` cut back into arrays shaped as ``like``'s."""
    out, offset = [], 0
    for x in like:
        size = int(jnp.size(x))
        out.append(flat[offset : offset + size].reshape(jnp.shape(x)))
        offset += size
    return out


# ----------------------------------------------------------------------------- stream mode


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
    window = window_lib.Window(*opt.window)
    new, metrics = plain(state.replace(opt_state=opt._replace(window=window)), batch, rng)
    new_opt = new.opt_state
    return new.replace(
        opt_state=new_opt._replace(window=window_lib.DeviceWindow(*new_opt.window))
    ), metrics


class _Pooled(NamedTuple):
    """What one stream call's ``shard_map`` returns besides the sums (global values)."""

    increments: jax.Array  # the window's weight, non-finite and skipped counts of this call
    added: jax.Array  # whether every device added its rows
    model_state: Any
    loss: jax.Array
    aux: _Aux


def _mesh_call(
    setup: Setup, layout: sharded.Layout, state: TrainState, batch: Any, rng: Any
) -> tuple[TrainState, dict]:
    """One stream call on a mesh: the gradient added in a ``shard_map``, the counts, loss
    and model state pooled, and the window closed when it is full."""
    ctx, acc = begin(setup, state, rng)
    aux_tree: list[Any] = []
    window = acc.window
    per_shard = isinstance(window, window_lib.DeviceWindow)
    sum_specs = layout.window_specs().partial_sums if per_shard else layout.accumulator_specs()
    local = _Local(
        state.params,
        state.model_state,
        batch,
        rng,
        state.step,
        ctx.loss_scale,
        window=(window[0], window.micro_step),
    )
    pooled_specs = _Pooled(WHOLE, WHOLE, WHOLE, WHOLE, _Aux(PartitionSpec(layout.axis), WHOLE))  # pyright: ignore[reportArgumentType]
    sums, pooled = _shard_map(
        partial(_local_call, ctx, layout, aux_tree, per_shard),
        layout,
        in_specs=(_local_specs(layout, n_real=WHOLE, window=(sum_specs, WHOLE)),),
        out_specs=(sum_specs, pooled_specs),
    )(local)
    inc = pooled.increments
    window = window._replace(
        **{window._fields[0]: sums},
        weight_sum=window.weight_sum + inc[0],
        micro_step=window_lib.saturating_add(window.micro_step, jnp.ones((), jnp.int32)),
        window_nonfinite=window_lib.saturating_add(window.window_nonfinite, inc[1]),
        window_skipped=window_lib.saturating_add(window.window_skipped, inc[2]),
    )
    opt = acc._replace(window=window, updated=jnp.zeros((), bool), added=pooled.added)
    fields = Fields(state.params, opt, pooled.model_state, ctx.loss_scale)
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
    aux = None if not aux_tree else _join_aux(pooled.aux, aux_tree, layout.shards)
    carry = Carry(window, fields.model_state, jnp.zeros(()), jnp.zeros(()))
    counts = Counts(inc[2].astype(jnp.int32), inc[1].astype(jnp.int32))
    return finish(ctx, state, fields, Outcome(carry, pooled.loss, aux), counts)


def _local_call(
    ctx: Context, layout: sharded.Layout, aux_tree: list[Any], per_shard: bool, local: _Local
) -> tuple[Any, _Pooled]:
    """One device's part of a stream call: its rows' gradient added to its own partial sum
    (``per_shard``), or reduced and added to the window's one sum; the rest pooled over the
    devices in one all-reduce."""
    ctx = _local_context(ctx, layout, local)
    params = sharded.gather(local.params, layout)
    sums, micro_step = local.window  # per shard: a leading axis of one, which grads broadcast to
    zero = jnp.zeros((), jnp.int32)
    window = window_lib.Window(sums, jnp.zeros((), jnp.float32), micro_step, zero, zero)
    start = None if local.model_state is None else emptied(local.model_state)
    loss, new_state, aux, grads, weight = gradient(
        ctx, params, start, local.batch, window.micro_step
    )
    policy = ctx.config.policy
    # The decision is the whole microbatch's. A policy that reads the gradient sees the whole
    # gradient (one gradient-sized all-reduce); otherwise each device's decision about its rows
    # travels in the call's one small all-reduce below, and the gradient is added after it.
    reads = policy.reads
    axis = layout.axis if reads else None
    m = window_lib.inspect_microbatch(
        policy, grads, weight, params, axis_name=axis, keep_whole=False
    )
    weighs = jnp.ones((), jnp.float32) if weight is None else weight
    mine = device_decision(policy.scaling, ~m.added, weighs)
    m = _share(policy, m, layout)
    split = _split_aux(aux, 0, aux_tree) if aux is not None else _Aux([], [])
    floats = [] if new_state is None else _floats(new_state)[1]
    bn = jnp.zeros(1) if new_state is None else call_sums(new_state)
    parts = jnp.stack([m.weight, *mine])
    # A device whose rows weigh nothing may have a NaN mean loss: it adds nothing.
    weighted_loss = weigh(weighs, loss.astype(jnp.result_type(jnp.float32, loss)))
    losses = jnp.stack([weighted_loss, weighs * loss_share(ctx)])
    loss_parts, parts, bn, *rest = psum_together(
        [losses, parts, bn, *floats, *split.means],
        layout.axis,
    )
    added = accepted(policy.scaling, MicrobatchDecision(*parts[1:]))
    nonfinite = m.nonfinite if reads else ~added  # without skip_fn, only non-finite is refused
    m = m._replace(added=added, nonfinite=nonfinite, weight=jnp.where(added, m.weight, 0.0))
    reduce = _reduce(layout, whole=not per_shard)
    window, _ = window_lib.add_microbatch(
        policy, window, grads, weight, params, inspected=m, reduce=reduce
    )
    inc = jnp.stack([jnp.where(added, parts[0], 0.0), nonfinite, ~added]).astype(jnp.float32)
    model_state = None
    if new_state is not None:
        bn = jnp.where(added, bn, jnp.zeros_like(bn))
        means = [total / layout.shards for total in rest[: len(floats)]]
        model_state = _pooled_model_state(local.model_state, new_state, bn, means, added)
    loss = loss_parts[0] / loss_parts[1]
    pooled = _Pooled(inc, added, model_state, loss, _Aux(split.rows, rest[len(floats) :]))
    return window.grad_sum, pooled


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


def _reduce(layout: sharded.Layout, whole: bool) -> Callable[[Any], Any] | None:
    """What a device's gradient goes through before it is added: reduce-scattered into the
    shards of parameters split over the data axis, and all-reduced for the others when the
    window keeps one ``whole`` sum (None: nothing to do)."""
    dims = layout.accumulator_dims
    if not whole and all(d is None for d in dims):
        return None

    def reduce(tree: Any) -> Any:
        leaves = layout.treedef.flatten_up_to(tree)
        summed = [i for i, d in enumerate(dims) if d is None and whole]
        for i, x in zip(
            summed, jax.lax.psum([leaves[i] for i in summed], layout.axis), strict=True
        ):
            leaves[i] = x  # one all-reduce for all of them
        for i, d in enumerate(dims):
            if d is not None:
                leaves[i] = jax.lax.psum_scatter(
                    leaves[i], layout.axis, scatter_dimension=d, tiled=True
                )
        return jax.tree.unflatten(layout.treedef, leaves)

    return reduce


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


def _close_device_window(ctx: Context, layout: sharded.Layout, fields: Fields) -> Fields:
    """The window's end: its one reduction in a ``shard_map`` (the sums of parameters split
    over the data axis are reduced already), then the update in the global view."""
    kinds = [
        window_lib.REDUCED if leaf.accumulator is not None else leaf.optimizer
        for leaf in layout.leaves
    ]
    scatter = jax.tree.unflatten(layout.treedef, kinds)
    policy = ctx.config.policy

    def local(window: window_lib.DeviceWindow, every_k: jax.Array) -> window_lib.Closed:
        part = window_lib.local_window(window)
        return window_lib.close_window(
            policy, part, every_k, layout.axis, scatter, whole_counts=True
        )

    closed = _shard_map(
        local,
        layout,
        in_specs=(layout.window_specs(), WHOLE),
        out_specs=window_lib.Closed(layout.optimizer_specs(), *(WHOLE,) * 6),  # pyright: ignore[reportArgumentType]
    )(fields.opt.window, fields.opt.every_k)
    fields = close_fields(ctx, fields, closed)
    model_state = close_model_state(fields.model_state, fields.opt.updated, None)
    return fields._replace(model_state=model_state)
