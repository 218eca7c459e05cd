"""The train step on a mesh under ``jit`` (internal): a ``shard_map`` over the data axis.

Each device adds the gradient of its rows to a sum of its own, in a ``shard_map`` manual over
the data axis only (`data_shard_map`; other mesh axes stay automatic). Scan mode
(`sharded_scan_step`) runs the K microbatches, then the window's one reduction, which also
carries the loss and the aux means, and updates in the global view. The ``shard_map``'s specs
(`step_specs`), a gradient reduced before it is added (`reduce_gradient`) and the aux split
(`split_aux`) serve a stream call on a mesh too. Every value a step returns is global.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import accumjax._mesh as mesh_lib
import accumjax._window as window_lib
from accumjax._layout import reduced_into_one_sum, window_layouts
from accumjax._loop import Context, LoopCarry, Outcome, Setup, begin
from accumjax._mesh import REPLICATED_SPEC
from accumjax._reduction import reduce_leaves
from accumjax._scan import (
    close_pass,
    decide_window,
    real_microbatches,
    scan_finish,
    scan_step,
    window_every_k,
    window_loop,
)
from accumjax._zero import optimizer_side, parameter_side, split_params
from accumjax.train_state import TrainState

__all__ = [
    "data_shard_map",
    "join_aux",
    "local_context",
    "reduce_gradient",
    "sharded_scan_step",
    "split_aux",
    "step_specs",
]


def step_specs(layout: mesh_lib.MeshLayout, state: Any, more: Any) -> tuple[Any, ...]:
    """The ``shard_map`` specs of a step's inputs ``(state, batch, rng, more)``, whose part on
    one device is the mapped function's one argument: the train ``state``'s parameters as
    they lie and every other field of it replicated (one spec per field, so a subclass's fields
    match too), the batch split over the data axis, the key replicated, and ``more``'s specs
    (what the mode adds: scan mode's real microbatches, stream mode's open window)."""
    specs = jax.tree.map(lambda _: REPLICATED_SPEC, state, is_leaf=lambda x: x is not state)
    return (
        specs.replace(params=layout.param_specs()),
        PartitionSpec(layout.axis),
        REPLICATED_SPEC,
        more,
    )


def data_shard_map(
    fn: Callable[..., Any], layout: mesh_lib.MeshLayout, in_specs: Any, out_specs: Any
):
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


def _fit(args: Any, specs: Any, layout: mesh_lib.MeshLayout) -> Any:
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
        dim = next((d for d, entry in enumerate(spec) if axis in mesh_lib.names(entry)), None)
        want = mesh_lib.moved_axis(now, axis, dim, jnp.ndim(x))
        if want == PartitionSpec(*now) or tuple(want) == tuple(now):
            return x
        return jax.sharding.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, want))

    return jax.tree.map(
        lambda spec, sub: jax.tree.map(partial(fit, spec), sub),
        specs,
        args,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def local_context(ctx: Context, layout: mesh_lib.MeshLayout, state: Any, rng: Any) -> Context:
    """``ctx`` inside the ``shard_map``: the call's traced values read again from the train
    ``state`` and key as one device sees them (`accumjax._loop.Context.with_call_values`), and the
    call's ``layout``, whose data axis the devices decide along."""
    return ctx._replace(layout=layout).with_call_values(state, rng)


def split_aux(
    aux: Any, row_axis: int, aux_structure: dict[str, Any]
) -> tuple[list[Any], list[Any]]:
    """A per-device ``aux`` split for ``shard_map``'s outputs: ``(rows, means)``, the leaves
    with rows (concatenated over the devices along their ``row_axis``) and the others
    (averaged over the devices); its structure goes into ``aux_structure`` (by name: its
    ``treedef``, which leaves have rows, their dtypes) for `join_aux`, which runs outside the
    ``shard_map`` the split ran in. The ``shard_map`` spec of a split is a pair too, one spec
    for each list.

    Example:
      >>> import jax.numpy as jnp
      >>> structure = {}
      >>> rows, means = split_aux({"loss": jnp.float32(3), "y": jnp.ones((2, 5))}, 0, structure)
      >>> [x.shape for x in rows], [x.shape for x in means]
      ([(2, 5)], [()])
      >>> join_aux((rows, means), structure, shards=2)["loss"]
      Array(1.5, dtype=float32)
    """
    leaves, treedef = jax.tree.flatten(aux)
    has_rows = [jnp.ndim(x) > row_axis for x in leaves]
    dtypes = [jnp.result_type(x) for x in leaves]
    aux_structure.update(treedef=treedef, has_rows=has_rows, dtypes=dtypes)
    rows = [x for x, r in zip(leaves, has_rows, strict=True) if r]
    return rows, [x for x, r in zip(leaves, has_rows, strict=True) if not r]


def _aux_row_axis(setup: Setup) -> int:
    """Where a scan window's aux leaves hold their rows: axis 0 in the batch's row order
    (``aux_rows``), else axis 1 of the per-microbatch stack."""
    return 0 if setup.aux_rows else 1


def join_aux(split: tuple[Any, Any], aux_structure: dict[str, Any], shards: int) -> Any:
    """`split_aux` undone, after ``shard_map``: the means divided by the number of shards."""
    rows, means = iter(split[0]), iter(split[1])
    leaves = [
        next(rows) if r else (next(means) / shards).astype(d)
        for r, d in zip(aux_structure["has_rows"], aux_structure["dtypes"], strict=True)
    ]
    return jax.tree.unflatten(aux_structure["treedef"], leaves)


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
        ctx = ctx._replace(n_real=real_microbatches(n, ctx.static_every_k))
        aux_structure: dict[str, Any] = {}
        local_state = state.replace(opt_state=None)
        closed_specs = mesh_lib.field_specs(window_lib.Closed, layout.optimizer_specs())
        row_spec = PartitionSpec(*([None] * _aux_row_axis(setup)), layout.axis)
        ended_specs = Outcome(
            carry=LoopCarry(model_state=REPLICATED_SPEC),
            loss=REPLICATED_SPEC,
            aux=(row_spec, REPLICATED_SPEC),  # `split_aux`'s rows and means
        )
        closed, ended = data_shard_map(
            partial(_window_on_device, ctx, layout, aux_structure),
            layout,
            in_specs=(step_specs(layout, local_state, REPLICATED_SPEC),),
            out_specs=(closed_specs, ended_specs),
        )((local_state, batch, rng, ctx.n_real))
        aux = None if not aux_structure else join_aux(ended.aux, aux_structure, layout.shards)
        if layout.zero_sharded:
            _, acc = optimizer_side(layout, state.params, acc)
            ctx = ctx._replace(split_params=split_params(layout))
        model_state = ended.carry.model_state
        new, metrics = scan_finish(
            ctx, state, acc, closed, model_state=model_state, loss=ended.loss, aux=aux
        )
        if layout.zero_sharded:
            new = parameter_side(layout, new, ctx.accumulating)
        return new, metrics

    return step


def _window_on_device(
    ctx: Context,
    layout: mesh_lib.MeshLayout,
    aux_structure: dict[str, Any],
    inputs: tuple[Any, ...],
) -> tuple[window_lib.Closed, Outcome]:
    """One device's part of a window, from its ``(state, batch, rng, n_real)`` (`step_specs`):
    its rows' gradients summed as they come (decided at the window's end, with the
    reduction) or decided by all devices together microbatch by microbatch (a policy that
    reads the gradient), then the window's one reduction (which also carries the loss and
    the aux means). Returns what the window's close returns (`accumjax._scan.Close`): the
    closed window and, by name, an `accumjax._loop.Outcome` of its closed model state, loss
    metric and aux, `split_aux`'s ``(rows, means)``."""
    state, batch, rng, n_real = inputs
    zero = jnp.zeros((), jnp.float32)
    config = ctx.config
    params = state.params
    ctx = local_context(ctx, layout, state, rng)._replace(n_real=n_real)
    if ctx.setup.gather_params == "window":  # once, before the loop (more memory, one gather)
        params = mesh_lib.gather_params(params, layout)
    else:  # in every microbatch, tied to its index so that XLA cannot hoist it
        gather = lambda p, i: mesh_lib.gather_params(
            jax.lax.optimization_barrier((p, i))[0], layout
        )
        ctx = ctx._replace(materialize=gather)
    ctx, sum_dims = _sum_layout(ctx, layout)
    shapes = layout.local_sums(state.params, sum_dims)
    like = window_lib.init_window(shapes, config.accumulator_dtype)
    start = LoopCarry(window=like, model_state=state.model_state, loss_sum=zero, loss_weight=zero)
    run = window_loop(ctx, params, start, batch)
    first = run(None)
    rows = _aux_row_axis(ctx.setup)
    aux_rows, aux_means = [], []
    if first.aux is not None:
        aux_rows, aux_means = split_aux(first.aux, rows, aux_structure)
    every_k = window_every_k(ctx, ctx.static_every_k)
    close = partial(close_pass, ctx, every_k, aux_means=aux_means)
    closed, ended = decide_window(ctx, first, run, close)
    return closed._replace(accepted=None), ended._replace(aux=(aux_rows, ended.aux))


def _sum_layout(
    ctx: Context, layout: mesh_lib.MeshLayout
) -> tuple[Context, tuple[int | None, ...]]:
    """Where a scan window's sum lives, from the layout plan: ``(ctx, dims)``, ``ctx`` with
    the per-microbatch reduction it runs and ``dims`` each sum's dimension split over the data
    axis (the rows `accumjax._layout.window_layouts` gives, which the close reads too).

    A policy that reads the gradient reduces each microbatch's whole gradient (the leaves
    whose optimizer state is split over the data axis reduce-scattered into shards;
    `accumjax._layout.window_layouts`): nothing is left to reduce at the window's end.
    Otherwise a leaf reduced per microbatch is reduce-scattered into its sharded accumulator
    as it comes, a leaf reduced per window is a full-size sum reduce-scattered once at the
    end, and the others are all-reduced once.
    """
    reads = ctx.config.reads
    layouts, _ = window_layouts(layout.leaves, reads)
    sum_dims = tuple(leaf.accumulator for leaf in layouts)
    if reads:
        ctx = ctx._replace(whole_gradient_layouts=layouts)
    else:
        ctx = ctx._replace(reduce=reduce_gradient(layout, replicated=False))
    return ctx, sum_dims


def reduce_gradient(layout: mesh_lib.MeshLayout, replicated: bool) -> Callable[[Any], Any] | None:
    """What a device's gradient goes through before it is added: each leaf reduced as its
    `LeafLayout` says on every microbatch (reduce-scattered into the shards of a split
    accumulator), and when the window keeps one ``replicated`` sum every other leaf
    all-reduced (`accumjax._layout.reduced_into_one_sum`) (None: nothing to do)."""
    layouts = layout.leaves
    if replicated:
        layouts = tuple(reduced_into_one_sum(leaf) for leaf in layouts)
    elif not any(leaf.reduction.per_microbatch for leaf in layouts):
        return None

    def reduce(tree: Any) -> Any:
        leaves = layout.treedef.flatten_up_to(tree)
        leaves, _ = reduce_leaves(leaves, layout.axis, layouts, per_microbatch=True)
        return jax.tree.unflatten(layout.treedef, leaves)

    return reduce
