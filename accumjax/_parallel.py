"""How a train step runs (internal): ``jit``, ``pmap``, ``shard_map``, or sharded ``jit``.

`wrap` turns the window loop's step body (`accumjax._loop`) into the step
`accumjax.make_train_step` returns:

- one device, or scan mode under ``jit`` on sharded arrays (`sharded_scan_step`: the
  microbatch loop and the window's one reduction run in a ``shard_map`` built from the arrays'
  own shardings, `accumjax.sharded`; the update runs in the global view);
- stream mode under ``jit`` (`sharded_stream_step`): with a per-device window, each call's
  gradient goes into each device's own slice in a ``shard_map``, reduced once per window;
- ``axis_name`` without a mesh: ``jax.pmap`` (the state carries a leading device axis);
- ``axis_name`` with a mesh: ``jax.jit(jax.shard_map(...))``, batch split, state replicated.

Every form checks, on the host, a state it did not return itself (the first call's, or one
restored from a checkpoint) against its optimizer, refuses on every call a state holding an
array that an earlier call donated (`_checked_once`), and names the arrays of a call that fails
on arrays placed on different devices (`_devices_apart`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from accumjax import sharded
from accumjax import window as window_lib
from accumjax._loop import (
    Carry,
    Context,
    Fields,
    Outcome,
    Setup,
    Step,
    begin,
    close_fields,
    close_model_state,
    finish,
    gradient,
    stream_step,
)
from accumjax._scan import (
    real_microbatches,
    scan_finish,
    scan_step,
    window_k,
    window_loop,
    window_loss,
)
from accumjax.accumulation import check_state, config_of, window_closes
from accumjax.accumulation_state import AccumulationState
from accumjax.distributed import data_sharding
from accumjax.train_state import TrainState

__all__ = ["sharded_scan_step", "sharded_stream_step", "wrap"]


class _Local(NamedTuple):
    """One device's inputs to a sharded step's ``shard_map`` (its one argument): scan mode's
    number of real microbatches, or stream mode's per-device window."""

    params: Any
    model_state: Any
    batch: Any
    rng: Any
    step_count: Any
    loss_scale: Any
    n_real: Any = None
    window: Any = None


def sharded_scan_step(setup: Setup) -> Callable[..., tuple[TrainState, dict]]:
    """Scan mode under ``jit`` with a sharded batch: ``step(state, batch, rng, layout, n)``.

    The microbatch loop and the window's one reduction run in a ``shard_map`` built from the
    arrays' shardings (``layout``, static); the update runs in the global view, on parameters
    as they are sharded. Without a layout (nothing sharded) it is the plain scan step.
    """
    plain = scan_step(setup)

    def step(
        state: TrainState, batch: Any, rng: Any, layout: Any, n: Any = None
    ) -> tuple[TrainState, dict]:
        if layout is None:
            return plain(state, batch, rng, n)
        if setup.batch_axis != 0:
            raise NotImplementedError(
                "make_train_step(batch_axis=...) other than 0 with a batch sharded under jit: "
                "put the batch axis first, or run the step on unsharded arrays."
            )
        ctx, acc = begin(setup, state, rng)
        ctx = ctx._replace(n_real=real_microbatches(n, ctx.k))
        data, whole = PartitionSpec(layout.axis), PartitionSpec()
        specs = _Local(layout.param_specs(), whole, data, whole, whole, whole, whole)
        closed_specs = window_lib.Closed(layout.param_specs(), *(whole,) * 5)  # pyright: ignore[reportArgumentType]
        local = _Local(
            state.params, state.model_state, batch, rng, state.step, ctx.loss_scale, ctx.n_real
        )
        closed, model_state, loss, aux = jax.shard_map(
            partial(_local_window, ctx, layout),
            mesh=layout.mesh,
            in_specs=(specs,),
            out_specs=(closed_specs, whole, data, data),
            check_vma=False,
        )(local)
        window = acc.window._replace(window_nonfinite=closed.nonfinite_count)
        carry = Carry(window, model_state, jnp.zeros(()), jnp.zeros(()))
        return scan_finish(ctx, state, acc, Outcome(carry, loss, aux), closed)

    return step


def _local_window(
    ctx: Context, layout: sharded.Layout, local: _Local
) -> tuple[window_lib.Closed, Any, jax.Array, Any]:
    """One device's part of a sharded window: its rows' gradients, summed locally, then the
    window's one reduction (all-reduce, or reduce-scatter for sharded parameters)."""
    zero = jnp.zeros((), jnp.float32)
    config = ctx.config
    shapes = jax.eval_shape(partial(sharded.gather, layout=layout), local.params)
    like = window_lib.init_window(shapes, config.policy.accumulator_dtype)
    setup = ctx.setup
    params = local.params
    if setup.gather_params == "window":  # once, before the loop (more memory, one gather)
        params = sharded.gather(params, layout)
    else:  # in every microbatch, tied to its index so that XLA cannot hoist it
        gather = lambda p, i: sharded.gather(jax.lax.optimization_barrier((p, i))[0], layout)
        setup = setup._replace(materialize=gather)
    ctx = ctx._replace(
        setup=setup,
        loss_scale=local.loss_scale,
        rng=local.rng,
        step_count=local.step_count,
        axis_name=layout.axis,
        n_real=local.n_real,
    )
    carry, aux = window_loop(ctx, params, Carry(like, local.model_state, zero, zero), local.batch)
    closed = window_lib.close_window(
        config.policy, carry.window, window_k(ctx), layout.axis, layout.scatter()
    )
    model_state = close_model_state(carry.model_state, closed.apply, layout.axis)
    loss = sharded.expand(window_loss(carry))
    return closed, model_state, loss, None if aux is None else sharded.expand(aux)


# ----------------------------------------------------------------------------- stream, sharded jit


def _per_device(state: Any) -> bool:
    opt = getattr(state, "opt_state", None)
    return isinstance(opt, AccumulationState) and window_lib.is_per_device(opt.window)


def sharded_stream_step(setup: Setup) -> Callable[..., tuple[TrainState, dict]]:
    """Stream mode under ``jit``: ``step(state, batch, rng, layout)``.

    A state with a per-device window (`accumjax.sharded.per_device_window`, made from
    parameters on a mesh) adds each device's gradient of its rows to its own slice inside a
    ``shard_map``: no collective, except the reduce-scatter of a parameter sharded over the
    batch axis (gathered for the microbatch, as in any FSDP step); the window is reduced
    once, when it closes. Any other state runs the plain stream step.
    """
    plain = stream_step(setup)

    def step(state: TrainState, batch: Any, rng: Any, layout: Any) -> tuple[TrainState, dict]:
        if not _per_device(state):
            return plain(state, batch, rng)
        layout = _check_per_device(state, layout)
        ctx, acc = begin(setup, state, rng)
        whole, data = PartitionSpec(), PartitionSpec(layout.axis)
        specs = sharded.window_specs(layout)
        call = _Local(state.params, state.model_state, batch, rng, state.step, ctx.loss_scale)
        call = call._replace(window=acc.window)
        in_specs = _Local(layout.param_specs(), whole, data, whole, whole, whole, whole, specs)
        window, added, loss, aux = jax.shard_map(
            partial(_local_microbatch, ctx, layout),
            mesh=layout.mesh,
            in_specs=(in_specs,),
            out_specs=(specs, specs.weight_sum, data, data),
            check_vma=False,
        )(call)
        opt = acc._replace(window=window, updated=jnp.zeros((), bool), added=added)
        fields = Fields(state.params, opt, state.model_state, ctx.loss_scale)
        close = partial(_close_per_device, ctx, layout)
        fields = window_lib.run_once(window_closes(opt), close, fields)
        seen = window._replace(window_nonfinite=jnp.sum(window.window_nonfinite))  # metrics
        carry = Carry(seen, state.model_state, jnp.zeros(()), jnp.zeros(()))
        return finish(ctx, state, fields, Outcome(carry, loss, aux))

    return step


def _check_per_device(state: TrainState, layout: sharded.Layout | None) -> sharded.Layout:
    """The batch's layout, when a per-device window can follow it; else a clear error."""
    if layout is None:
        raise ValueError(
            "this state keeps its stream window per device (TrainState.create was given "
            "parameters on a mesh), but the batch is not split over that mesh: put each "
            "microbatch on it, e.g. jax.device_put(batch, NamedSharding(mesh, P('data')))."
        )
    if jax.tree.leaves(state.model_state):
        raise ValueError(
            "a per-device stream window needs model_state=None (its statistics would be "
            "each device's own); build the state with its model_state in TrainState.create."
        )
    for leaf, spec in zip(
        jax.tree.leaves(cast(Any, state.opt_state).window.grad_sum),
        layout.treedef.flatten_up_to(layout.param_specs()),
        strict=True,
    ):
        axes = sharded.device_axes(layout.mesh, spec)
        want = int(np.prod([layout.mesh.shape[a] for a in axes]))
        if leaf.shape[0] != want:
            raise ValueError(
                f"the state's per-device window has {leaf.shape[0]} slices, but the batch's "
                f"mesh {dict(layout.mesh.shape)} needs {want}: build the state on the mesh the "
                "batch is on."
            )
    return layout


def _squeeze(window: window_lib.Window) -> window_lib.Window:
    """One device's slice of a per-device window (its sums and counts, the shared step)."""
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    return window._replace(
        grad_sum=first(window.grad_sum),
        weight_sum=window.weight_sum[0],
        window_nonfinite=window.window_nonfinite[0],
        window_skipped=window.window_skipped[0],
    )


def _expand(window: window_lib.Window) -> window_lib.Window:
    """`_squeeze` undone: each device's values back in its slice."""
    return window._replace(
        grad_sum=sharded.expand(window.grad_sum),
        weight_sum=window.weight_sum[None],
        window_nonfinite=window.window_nonfinite[None],
        window_skipped=window.window_skipped[None],
    )


def _scatter(layout: sharded.Layout) -> Callable[[Any], Any] | None:
    """Reduce-scatters the leaves of parameters sharded over the batch axis (None: none)."""
    if all(d is None for d in layout.dims):
        return None

    def reduce(tree: Any) -> Any:
        leaves = layout.treedef.flatten_up_to(tree)
        out = [
            x
            if d is None
            else jax.lax.psum_scatter(x, layout.axis, scatter_dimension=d, tiled=True)
            for x, d in zip(leaves, layout.dims, strict=True)
        ]
        return jax.tree.unflatten(layout.treedef, out)

    return reduce


def _local_microbatch(ctx: Context, layout: sharded.Layout, call: _Local) -> tuple[Any, ...]:
    """One device's part of a stream call: its rows' gradient added to its own slice."""
    ctx = ctx._replace(
        rng=call.rng,
        step_count=call.step_count,
        loss_scale=call.loss_scale,
        axis_name=layout.axis,
    )
    params = sharded.gather(call.params, layout)
    window = _squeeze(call.window)
    loss, _, aux, grads, weight = gradient(
        ctx, params, call.model_state, call.batch, window.micro_step
    )
    window, micro = window_lib.add_microbatch(
        ctx.config.policy, window, grads, weight, params, reduce=_scatter(layout)
    )
    aux = None if aux is None else sharded.expand(aux)
    return _expand(window), micro.added[None], loss[None], aux


def _close_per_device(ctx: Context, layout: sharded.Layout, fields: Fields) -> Fields:
    """The window's end: its one reduction in a ``shard_map`` (the sums of parameters sharded
    over the batch axis were reduced microbatch by microbatch), then the update."""
    reduced = [None if d is None else window_lib.REDUCED for d in layout.dims]
    scatter = jax.tree.unflatten(layout.treedef, reduced)
    policy = ctx.config.policy

    def local(window: window_lib.Window, every_k: jax.Array) -> window_lib.Closed:
        return window_lib.close_window(policy, _squeeze(window), every_k, layout.axis, scatter)

    whole = PartitionSpec()
    closed = jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(sharded.window_specs(layout), whole),
        out_specs=window_lib.Closed(layout.param_specs(), *(whole,) * 5),  # pyright: ignore[reportArgumentType]
        check_vma=False,
    )(fields.opt.window, fields.opt.every_k)
    return close_fields(ctx, fields, closed)


def _shard_map(
    step: Step, mesh: Mesh, axis_name: str, has_aux: bool, f16: bool, scan: bool
) -> Step:
    """Batch sharded on ``axis_name``, state replicated, the key replicated.

    Stream mode keeps a device-local accumulator in the (nominally replicated) optimizer
    state between window ends, so the step runs without the replication check.
    """
    local = PartitionSpec(axis_name)
    metric_specs: dict[str, Any] = {
        "loss": local,
        "updated": PartitionSpec(),
        "grad_norm": PartitionSpec(),
    }
    if f16:
        metric_specs.update(grads_finite=local, loss_scale=PartitionSpec())
    if has_aux:
        metric_specs["aux"] = local
    per_device_keys = ("loss", "aux", "grads_finite")

    def per_device(state: Any, batch: Any, rng: Any, *n: Any) -> tuple[Any, dict[str, Any]]:
        state, metrics = step(state, batch, rng, *n)
        for key in per_device_keys:  # device-local values get a leading device axis
            if key in metrics:
                metrics[key] = jax.tree.map(lambda x: jnp.expand_dims(x, 0), metrics[key])
        return state, metrics

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), local, PartitionSpec(), *(PartitionSpec(),) * scan),
        out_specs=(PartitionSpec(), metric_specs),
        check_vma=False,
    )


def _place_on_mesh(mesh: Mesh, axis_name: str, state: Any, batch: Any) -> tuple[Any, Any]:
    """The ``shard_map`` step's inputs where its specs say: the state replicated (a state
    sharded over the mesh is refused, not silently replicated), the batch split."""
    if _per_device(state):
        raise ValueError(
            "make_train_step(mesh=..., axis_name=...) replicates the state, but this state "
            "keeps its stream window per device (TrainState.create was given parameters on a "
            "mesh). Drop mesh= and axis_name=: under jit, stream mode on this state reduces "
            "once per window and checkpoints every device's partial sums."
        )
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


def _check_alive(state: Any) -> None:
    """Refuses a state with a deleted array (donated to an earlier call's output)."""
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"state{jax.tree_util.keystr(path)} was deleted: an earlier call of this step "
                "donated it (make_train_step(..., donate=True) is the default). Use the state "
                "the step returns (state, metrics = step(state, batch)), build the step with "
                "donate=False, or copy arrays this state shares with another "
                "(jax.tree.map(jnp.copy, params))."
            )


def _where(leaf: jax.Array) -> str:
    """``mesh (data=4) of devices [0, 1, 2, 3]``, or ``devices [...]`` off a mesh."""
    sharding = leaf.sharding
    devices = f"devices {sorted(d.id for d in sharding.device_set)}"
    if isinstance(sharding, NamedSharding):
        axes = ", ".join(f"{name}={size}" for name, size in sharding.mesh.shape.items())
        return f"mesh ({axes}) of {devices}"
    return devices


def _devices_apart(state: Any, batch: Any) -> str | None:
    """Why a jitted step cannot take these arrays: two committed ones on different devices
    (e.g. params on one mesh, the batch on another), or None."""
    named = [
        (f"{root}{jax.tree_util.keystr(path)}", leaf)
        for root, tree in (("batch", batch), ("state", state))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, jax.Array) and leaf.committed and not leaf.is_deleted()
    ]
    if not named:
        return None
    first, ref = named[0]
    for name, leaf in named[1:]:
        if leaf.sharding.device_set != ref.sharding.device_set:
            return (
                f"{first} is on the {_where(ref)}, but {name} is on the {_where(leaf)}: a "
                "step's arrays must all be on one mesh. Put the state and the batch on the "
                "same mesh (jax.device_put(x, NamedSharding(mesh, spec)))."
            )
    return None


def _made_here(opt_state: Any, returned: Any) -> bool:
    """Whether ``opt_state`` is the one the step returned last (its K array, the very object),
    so it needs no check: only a state from elsewhere (a checkpoint) is read on the host."""
    every_k = getattr(opt_state, "every_k", None)
    return every_k is not None and every_k is getattr(returned, "every_k", None)


def _check_window_boundary(opt: Any) -> None:
    """Refuses a mid-window state from elsewhere on the ``mesh=`` stream path, whose window
    sums are each device's own although the state is declared replicated."""
    step = int(opt.window.micro_step)
    if step != 0:
        raise ValueError(
            "make_train_step(mode='stream', mesh=..., axis_name=...) was given a state in the "
            f"middle of a window (state.opt_state.window.micro_step == {step}) "
            "that this step did not return: on this path each device keeps its own partial "
            "window sum in an array declared replicated, so a checkpoint holds one device's and "
            "cannot resume the window. Save and restore at window boundaries "
            "(micro_step == 0), or use mode='scan', whose state holds no open window."
        )


def _check_real_microbatches(n: Any, scan: bool, config: Any) -> None:
    """``num_real_microbatches`` only in scan mode; a Python int within ``[0, K]``."""
    if n is None:
        return
    if not scan:
        raise ValueError(
            "num_real_microbatches is for make_train_step(mode='scan'), which splits a batch "
            "into K microbatches; a stream-mode call is one microbatch."
        )
    k = 1 if config is None else config.static_k
    real_microbatches(n, k)  # the Python-side checks (a traced value is clipped in the step)


def _checked_once(
    jitted: Any,
    pmapped: bool,
    sharded_jit: bool = False,
    place: Callable[[Any, Any], tuple[Any, Any]] | None = None,
    mesh_stream: bool = False,
    scan: bool = False,
) -> Any:
    """``jitted`` that checks a state it did not return itself (the first call's, or one
    restored from a checkpoint) against its optimizer on the host: another K or scaling is
    refused before anything runs, and on the ``mesh=`` stream path (``mesh_stream``) so is a
    window left open. A state the step returned last is recognized by identity, at no cost.
    Under ``jit`` (``sharded_jit``) it passes the arrays' `accumjax.sharded.Layout` (static;
    in stream mode only for a per-device window), and with ``place`` it puts the inputs
    where a ``shard_map`` step expects them.

    Every call first refuses a state holding an array an earlier call donated (`_check_alive`:
    one ``is_deleted`` per leaf); a call that fails is diagnosed, for free on success, for
    arrays on different devices (`_devices_apart`; not under ``pmap`` or ``place``)."""
    returned: list[Any] = []  # the optimizer state of the last call's output

    def args(state: Any, batch: Any, rng: Any, n: Any) -> tuple[Any, ...]:
        if place is not None:
            state, batch = place(state, batch)
        if not scan:
            if not sharded_jit:
                return state, batch, rng
            layout = sharded.layout_of(state.params, batch) if _per_device(state) else None
            return state, batch, rng, layout
        if not sharded_jit:
            return state, batch, rng, n
        return state, batch, rng, sharded.layout_of(state.params, batch), n

    def call(run: Callable[..., Any], state: Any, batch: Any, rng: Any, n: Any = None) -> Any:
        _check_real_microbatches(n, scan, config_of(getattr(state, "tx", None)))
        try:
            return run(*args(state, batch, rng, n))
        except Exception as err:
            apart = None if pmapped or place else _devices_apart(state, batch)
            if apart is None:
                raise
            raise ValueError(apart) from err

    def step(state: Any, batch: Any, rng: Any = None, num_real_microbatches: Any = None) -> Any:
        _check_alive(state)
        config = config_of(getattr(state, "tx", None))
        if config is not None and not (returned and _made_here(state.opt_state, returned[0])):
            opt = state.opt_state
            opt = check_state(config, jax.tree.map(lambda x: x[0], opt) if pmapped else opt)
            if mesh_stream:
                _check_window_boundary(opt)
        out = call(jitted, state, batch, rng, num_real_microbatches)
        returned[:] = [getattr(out[0], "opt_state", None)]
        return out

    step.lower = lambda state, batch, rng=None, num_real_microbatches=None: call(  # pyright: ignore[reportFunctionMemberAccess]
        jitted.lower, state, batch, rng, num_real_microbatches
    )
    step.__wrapped__ = jitted  # pyright: ignore[reportFunctionMemberAccess]
    return step


def wrap(setup: Setup, mesh: Mesh | None, has_aux: bool, donate: bool) -> Step:
    """The step for ``setup``: jitted, ``pmap``-ped or ``shard_map``-ped, checked once.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from accumjax import TrainState
      >>> from accumjax._loop import Setup
      >>> from accumjax._loss_adapter import make_grad_fn
      >>> grad_fn = make_grad_fn(lambda p, b: jnp.sum(p["w"] * b), False, None)
      >>> setup = Setup(grad_fn, "stream", None, None, None, False, None, 1)
      >>> step = wrap(setup, mesh=None, has_aux=False, donate=False)
      >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.5))
      >>> state, metrics = step(state, jnp.ones(2))
      >>> state.params["w"], bool(metrics["updated"])
      (Array([0.5, 0.5], dtype=float32), True)
    """
    donate_argnums = (0,) if donate else ()
    if setup.axis_name is None and setup.mode == "scan":
        jitted = jax.jit(
            sharded_scan_step(setup), static_argnums=(3,), donate_argnums=donate_argnums
        )
        return _checked_once(jitted, False, sharded_jit=True, scan=True)
    if setup.axis_name is None:
        jitted = jax.jit(
            sharded_stream_step(setup), static_argnums=(3,), donate_argnums=donate_argnums
        )
        return _checked_once(jitted, False, sharded_jit=True)
    scan = setup.mode == "scan"
    step = scan_step(setup) if scan else stream_step(setup)
    if mesh is None:
        in_axes = (0, 0, None, None) if scan else (0, 0, None)
        pmapped = jax.pmap(
            step, axis_name=setup.axis_name, in_axes=in_axes, donate_argnums=donate_argnums
        )
        return _checked_once(pmapped, True, scan=scan)
    mapped = _shard_map(step, mesh, setup.axis_name, has_aux, setup.f16, scan)
    place = partial(_place_on_mesh, mesh, setup.axis_name)
    jitted = jax.jit(mapped, donate_argnums=donate_argnums)
    return _checked_once(jitted, False, place=place, mesh_stream=not scan, scan=scan)
