"""The train step object (internal): `TrainStep` and `wrap`, which builds it.

A `TrainStep` holds its compiled step (under ``jit``, on one device or a mesh, or under
``pmap``), builds the state it takes (`TrainStep.init`: laid out for its mode, mesh and
precision) and, where a call's values are concrete, checks them on the host: a state it did
not return itself, arrays an earlier call donated, arrays on different devices.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import accumjax._mesh as mesh_lib
import accumjax._window as window_lib
from accumjax._checks import check_alive
from accumjax._loop import Setup, stream_step
from accumjax._mesh_stream import sharded_stream_step
from accumjax._opt_state import opt_state_for, unalias
from accumjax._scan import real_microbatches, scan_step
from accumjax._sharded_steps import sharded_scan_step
from accumjax._split import split_advice, strided_microbatches
from accumjax._state import config_of
from accumjax._step_checks import (
    check_accumulate,
    check_init_inputs,
    init_call,
    microbatch_weight_of,
)
from accumjax._window_end import check_state
from accumjax._zero import as_placed, placed_zero
from accumjax.distributed import replicate
from accumjax.loss_scale import DynamicLossScale, dynamic_loss_scale
from accumjax.train_state import TrainState

__all__ = ["TrainStep", "wrap"]


def _traced(tree: Any) -> bool:
    """Whether any leaf is traced or abstract (the step runs inside a transformation, or is
    lowered from shapes): host-side checks need concrete values."""
    return any(isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _is_abstract(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _check_is_state(state: Any, f16: bool) -> None:
    """Refuses what is not a `accumjax.TrainState` before anything reads its fields, naming
    the state this step takes (`accumjax.TrainState.create` builds a stream-mode state
    without a loss scale: not what every step takes)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step expects an accumjax.TrainState, got {type(state).__name__}: build the state "
            f"with this step, state = {init_call(f16)}; it is laid out for the step's mode, "
            "mesh and precision."
        )


def _placement(leaf: jax.Array) -> str:
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
                f"{first} is on the {_placement(ref)}, but {name} is on the {_placement(leaf)}: "
                f"{mesh_lib.ONE_MESH}. Put the state and the batch on the same mesh "
                "(jax.device_put(x, NamedSharding(mesh, spec)))."
            )
    return None


def _made_here(opt_state: Any, returned: Any) -> bool:
    """Whether ``opt_state`` is the step's last (its very K array): no host-side check."""
    every_k = getattr(opt_state, "every_k", None)
    return every_k is not None and every_k is getattr(returned, "every_k", None)


def _static_every_k(config: Any) -> int | None:
    """K of ``config``: 1 for None (a plain optimizer), None for a schedule."""
    return 1 if config is None else config.static_every_k


def _check_real_microbatches(n: Any, scan: bool, config: Any) -> None:
    """``num_real_microbatches`` only in scan mode; a Python int within ``[0, K]``."""
    if n is None:
        return
    if not scan:
        raise ValueError(
            "num_real_microbatches is for make_train_step(mode='scan'), which splits a batch "
            "into K microbatches; a stream-mode call is one microbatch."
        )
    # A schedule in scan mode was refused first (`check_accumulate`): K is an int.
    real_microbatches(n, cast(int, _static_every_k(config)))


def _microbatch_weights(
    weight_fn: Callable[[Any], Any], every_k: int, batch_axis: Any, batch: Any
) -> jax.Array:
    """Each of the ``every_k`` strided microbatches' ``weight_fn``, float32 ``(every_k,)``."""
    rows = strided_microbatches(batch, every_k, batch_axis)
    weigh = lambda i: microbatch_weight_of(weight_fn, rows(i))
    return jax.lax.map(weigh, jnp.arange(every_k))


def _real_rows_left_out(weights: np.ndarray, n: int, every_k: int) -> str | None:
    """Why a batch with ``n`` real microbatches of ``every_k`` does not fit the strided rule (a
    microbatch after the first ``n`` weighs more than 0: real rows the step leaves out), or
    None."""
    heavy = [int(i) for i in np.flatnonzero(weights[n:] > 0) + n]
    if not heavy:
        return None
    return (
        f"num_real_microbatches={n}, but microbatches {heavy} of the K={every_k} (after the first "
        f"{n}) weigh more than 0 (weight_fn): their rows are real and the step would leave "
        f"them out. Microbatch i holds the rows i, i + K, i + 2K, ... (strided), so a short "
        f"batch holds its real rows in the first {n} of every {every_k} rows and padding in "
        f"the other {every_k - n}: interleave them (docs/guides/modes.md, 'A short batch'), not "
        "padding appended at the end."
    )


def _on_mesh(tree: Any, mesh: Any, spec: PartitionSpec, name: str) -> Any:
    """``tree`` (named ``name`` in errors) with its leaves that are not on ``mesh`` put there
    (``spec``); leaves on the mesh, sharded or not, are left as they are (nothing is
    replicated behind the user's back). A leaf JAX cannot place so is named, with what
    accumjax tried."""
    sharding = NamedSharding(mesh, spec)

    def put(path: Any, x: Any) -> Any:
        if isinstance(x, jax.core.Tracer):
            return x
        now = mesh_lib.sharding_of(x)
        if isinstance(now, NamedSharding) and now.mesh == mesh:
            return x
        if isinstance(now, NamedSharding) and len(now.device_set) > 1:
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} lies on the {_placement(x)}, but the step "
                f"runs on the mesh {dict(mesh.shape)} of devices "
                f"{sorted(d.id for d in mesh.devices.flat)}; the two differ in "
                f"{mesh_lib.mesh_difference(now.mesh, mesh)}: {mesh_lib.ONE_MESH} (moving a "
                "sharded array would replicate it behind your back). Put the state and the batch "
                "on the same mesh."
            )
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        try:
            return jax.device_put(x, sharding)
        except ValueError as err:
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} (shape {jnp.shape(x)}) is not on the "
                f"step's mesh {dict(mesh.shape)}, so accumjax puts it there as {spec}, and JAX "
                f"refuses: {err}"
            ) from err

    return jax.tree_util.tree_map_with_path(put, tree)


def _warn_if_replicated(params: Any, mesh: Mesh) -> None:
    """Warns when parameters that are not on ``mesh`` (of several devices), the mesh the batch
    lies on, are about to be put there replicated (`_on_mesh`): a full copy on every device,
    not FSDP, without a word. (A step made with ``mesh=`` was asked to put what is off its
    mesh on it, and says nothing.)"""
    if mesh.size <= 1:
        return

    def placed_here(x: Any) -> bool:  # or refused by `_on_mesh`: on a mesh of several devices
        now = mesh_lib.sharding_of(x)
        return isinstance(now, NamedSharding) and (now.mesh == mesh or len(now.device_set) > 1)

    off = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if not isinstance(x, jax.core.Tracer) and not placed_here(x)
    ]
    if not off:
        return
    more = f" (and {len(off) - 1} more)" if len(off) > 1 else ""
    warnings.warn(
        f"params{off[0]}{more} are not on the mesh {dict(mesh.shape)} the step runs on, so "
        "accumjax puts them there replicated: a full copy of each on every device. To shard "
        "them over the data axis (FSDP), place them first, e.g. "
        "jax.device_put(params['w'], NamedSharding(mesh, P('data', None))) for a kernel "
        "(see the data-parallel guide); to replicate them without this warning, "
        "jax.device_put(params, NamedSharding(mesh, P())).",
        UserWarning,
        stacklevel=4,
    )


def _check_rows(batch: Any, layout: mesh_lib.MeshLayout, every_k: int | None) -> None:
    """Refuses a batch whose rows do not split over the devices of the data axis (and, in
    scan mode, into ``every_k`` microbatches on each device), stating the global rule with the
    numbers; for a batch off the mesh, that accumjax puts it there."""
    n = layout.shards
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        advice = split_advice(shape[0], every_k or 1, n) if shape else None
        if advice is None:
            continue
        name = f"batch{jax.tree_util.keystr(path)}"
        now = mesh_lib.sharding_of(leaf)
        if isinstance(now, NamedSharding) and now.mesh == layout.mesh:
            where = f"{name}, split over the mesh axis {layout.axis!r}"
        else:
            where = (
                f"{name} is not on the mesh, so accumjax puts it there, split over the mesh "
                f"axis {layout.axis!r} of {dict(layout.mesh.shape)}"
            )
        raise ValueError(f"{where}: {advice}.")


class TrainStep:
    """The step `accumjax.make_train_step` returns.

    ``step(state, batch, rng=None)`` (scan mode: ``num_real_microbatches=None`` too) runs
    one call; ``step.init(params, tx, ...)`` builds the state it takes; ``step.lower(...)``
    lowers it (e.g. for `accumjax.collectives.count_collectives`); ``step.layout(state)`` is
    its layout plan.
    """

    def __init__(self, setup: Setup, jitted: Any, *, pmapped: bool) -> None:
        self._setup = setup
        self._jitted = jitted
        self._pmapped = pmapped
        self._scan = setup.mode == "scan"
        self._returned: list[Any] = []  # the optimizer state of the last call's output
        self._builders: dict[Any, Any] = {}  # (id(tx), where) -> (tx, init's build function)
        self._weighers: dict[int, Any] = {}  # K -> the jitted `_microbatch_weights`
        self._plans: dict[Any, Any] = {}  # (id(tx), layout, choice) -> (tx, the layout plan)
        self.__wrapped__ = jitted

    # ------------------------------------------------------------------------- calls

    def _args(self, state: Any, batch: Any, rng: Any, n: Any) -> tuple[Any, ...]:
        """The compiled program's arguments: the inputs on the step's mesh, and the static
        layout of the call (``jit`` forms)."""
        setup = self._setup
        if self._pmapped:
            return (state, batch, rng, n) if self._scan else (state, batch, rng)
        if setup.mesh is not None:  # asked for: the step's mesh takes what is off it
            state = _on_mesh(state, setup.mesh, PartitionSpec(), "state")
        mesh_lib.check_one_mesh(state.params, batch)
        layout = self.layout(state, batch)
        if layout is not None:
            config = config_of(state.tx)
            scan = self._scan and setup.batch_axis == 0  # else refused in the step
            every_k = _static_every_k(config) if scan else None
            _check_rows(batch, layout, every_k)
        if layout is not None and isinstance(layout.mesh, Mesh):  # what is off the mesh, on it
            _warn_if_replicated(state.params, layout.mesh)
            state = _on_mesh(state, layout.mesh, PartitionSpec(), "state")
            rng = _on_mesh(rng, layout.mesh, PartitionSpec(), "rng")
            batch = _on_mesh(batch, layout.mesh, PartitionSpec(layout.axis), "batch")
        return (state, batch, rng, layout, n) if self._scan else (state, batch, rng, layout)

    def layout(self, state: Any, batch: Any = None) -> mesh_lib.MeshLayout | None:
        """The layout plan the step runs ``state`` (and ``batch``) with: per parameter leaf,
        where it, its window accumulator and its optimizer state lie along the data axis
        (`accumjax.sharded.MeshLayout`; ``accumjax.stats(state, step.layout(state))`` sizes a
        scan-mode window by it), or None off a mesh and under ``pmap``."""
        if self._pmapped:
            return None
        s = self._setup
        layout = mesh_lib.layout_of(
            state.params, batch, mesh=s.mesh, axis=s.mesh_axis, reduce_scatter=s.reduce_scatter
        )
        return None if layout is None else self._optimizer_plan(layout, state)

    def _optimizer_plan(self, layout: mesh_lib.MeshLayout, state: Any) -> mesh_lib.MeshLayout:
        """``layout`` with its optimizer plan: ZeRO where ``optimizer_sharding`` says so (scan
        mode, a stream state with a per-shard window), else where the optimizer state lies
        split over the data axis beside replicated parameters (`accumjax._zero.placed_zero`:
        a state the user placed, a plain optimizer's that ``step.init`` split)."""
        choice = self._setup.optimizer_sharding
        opt = getattr(state, "opt_state", None)
        inner = getattr(opt, "inner_tx_state", opt)
        per_shard = isinstance(getattr(opt, "window", None), window_lib.DeviceWindow)
        by_choice = choice != "replicated" and (self._scan or per_shard)
        placed = None if by_choice else placed_zero(inner, state.params, layout)
        if placed:
            choice = "zero1"
        if not (by_choice or placed):
            return layout
        mine = tuple(getattr(mesh_lib.sharding_of(x), "spec", None) for x in jax.tree.leaves(inner))
        key = (id(state.tx), layout, choice, mine if placed else None)
        found = self._plans.get(key)
        if found is None or found[0] is not state.tx:
            plan = self._new_plan(state, layout, choice, placed, mine)
            found = self._plans[key] = (state.tx, plan)
        return found[1]

    def _new_plan(
        self,
        state: Any,
        layout: mesh_lib.MeshLayout,
        choice: str,
        placed: dict[Any, int | None] | None,
        mine: tuple[Any, ...],
    ) -> mesh_lib.MeshLayout:
        """The ZeRO plan of ``layout`` for ``choice``: where the user ``placed`` the state
        (its leaves' specs ``mine``), or where ``step.init`` lays it out."""
        plan = mesh_lib.layout_of(
            state.params,
            None,
            mesh=layout.mesh,
            axis=layout.axis,
            optimizer_sharding=choice,
            reduce_scatter=self._setup.reduce_scatter,
        )
        assert plan is not None  # the same mesh and axis as ``layout``'s
        if placed:  # the user's layout: the dimension the state lies split on
            return plan._replace(leaves=as_placed(plan, state.params, placed), opt_specs=mine)
        config = config_of(state.tx)
        init = state.tx.init if config is None else config.inner.init
        return plan._replace(opt_specs=mesh_lib.optimizer_state_specs(init, state.params, plan))

    def _check_call(self, state: Any, n: Any) -> Any:
        """A call's first checks, before anything reads the state's arrays: a
        `accumjax.TrainState`, an ``accumulate`` this step can run (`check_accumulate`), then
        ``num_real_microbatches`` (``n``). Returns the optimizer's config (None: a plain one)."""
        _check_is_state(state, self._setup.f16)
        config = config_of(state.tx)
        check_accumulate(config, self._setup.mode, self._setup.axis_name)
        _check_real_microbatches(n, self._scan, config)
        return config

    def _run(self, run: Callable[..., Any], state: Any, batch: Any, rng: Any, n: Any) -> Any:
        traced = _traced((state, batch, rng))
        try:
            return run(*self._args(state, batch, rng, n))
        except Exception as err:
            apart = None if self._pmapped or traced else _devices_apart(state, batch)
            if apart is None:
                raise
            raise ValueError(apart) from err

    def __call__(
        self, state: Any, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        config = self._check_call(state, num_real_microbatches)
        if _traced((state, batch, rng, num_real_microbatches)):
            return self._run(self._jitted, state, batch, rng, num_real_microbatches)
        check_alive(state, "state")
        returned = self._returned
        if config is not None and not (returned and _made_here(state.opt_state, returned[0])):
            opt = state.opt_state
            check_state(config, jax.tree.map(lambda x: x[0], opt) if self._pmapped else opt)
        self._check_padding(batch, num_real_microbatches, config)
        out = self._run(self._jitted, state, batch, rng, num_real_microbatches)
        returned[:] = [getattr(out[0], "opt_state", None)]
        return out

    def _check_padding(self, batch: Any, n: Any, config: Any) -> None:
        """Refuses a short batch whose real rows are not where the strided rule puts them,
        where the step can tell: ``n`` real microbatches of K given, and a ``weight_fn``
        that weighs a microbatch after them more than 0 (one small program, run here)."""
        setup, every_k = self._setup, _static_every_k(config)
        scan_only = self._scan and not self._pmapped
        if not scan_only or n is None or setup.weight_fn is None or every_k is None:
            return
        n = int(n)
        if not 0 <= n < every_k:  # all real, or out of range (refused by the call)
            return
        if every_k not in self._weighers:
            weights = partial(_microbatch_weights, setup.weight_fn, every_k, setup.batch_axis)
            self._weighers[every_k] = jax.jit(weights)
        weigh = self._weighers[every_k]
        why = _real_rows_left_out(np.asarray(weigh(batch)), n, every_k)
        if why is not None:
            raise ValueError(why)

    def lower(
        self, state: Any, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> Any:
        """``jax.jit(...).lower`` of the step for these inputs (arrays or shapes)."""
        self._check_call(state, num_real_microbatches)
        return self._run(self._jitted.lower, state, batch, rng, num_real_microbatches)

    # ------------------------------------------------------------------------- the state

    def init(
        self,
        params: Any,
        tx: Any,
        *,
        model_state: Any = None,
        loss_scale: DynamicLossScale | None = None,
        apply_fn: Callable[..., Any] | None = None,
    ) -> TrainState:
        """The state this step takes, laid out for its mode, its mesh and its precision.

        - scan mode: no accumulator (the window opens and closes inside one call);
        - stream mode: a `accumjax.window.DeviceWindow`, one partial sum per data shard of
          the mesh the parameters lie on (or the step's ``mesh=``; one shard on one device),
          so the gradient is reduced once per window and a checkpoint holds every shard's;
        - ``mixed_precision="float16"``: a dynamic loss scale (``loss_scale``, or
          `accumjax.dynamic_loss_scale` with its defaults);
        - ``pmap`` (``axis_name`` without ``mesh``): replicated over the local devices.

        Args:
          params: the parameters: arrays (placed as they are to be trained: replicated or
            sharded on a mesh), or ``jax.ShapeDtypeStruct`` leaves with shardings, for a state of
            shapes only (an orbax restore target; nothing is allocated).
          tx: the optimizer, ``accumjax.accumulate(inner, K)`` (a plain optax optimizer is
            a window of one microbatch): K and the policies are stated there.
          model_state: non-trainable collections (``{"batch_stats": ...}``) or None.
          loss_scale: a `accumjax.DynamicLossScale` (float16 makes one if None).
          apply_fn: kept in the state (``state.apply_fn``); the step never calls it.

        Returns:
          An `accumjax.TrainState` (of ``jax.ShapeDtypeStruct`` leaves for abstract ``params``).
          Its arrays are new: the step may donate them, and ``params`` stay usable.
        """
        setup = self._setup
        check_init_inputs(params, tx, loss_scale, setup.f16, setup.mode, setup.axis_name)
        if setup.f16 and loss_scale is None:
            loss_scale = dynamic_loss_scale()
        if setup.mesh is not None:
            params = _on_mesh(params, setup.mesh, PartitionSpec(), "params")
            model_state = _on_mesh(model_state, setup.mesh, PartitionSpec(), "model_state")
        if self._pmapped:  # each device's copy holds its own window: tx.init's layout
            where = (None, None, None)
            state = _build(setup.mode, tx, where, None, params, model_state, loss_scale)
            state = state.replace(opt_state=opt_state_for(tx, params, setup.mode))
            return replicate(state).replace(apply_fn=apply_fn)
        plan = self._init_plan(params)
        specs = self._zero_specs(tx, params, plan) or _opt_specs(tx, params)
        build, jitted = self._builder(tx, self._window_where(plan), specs)
        args = (params, model_state, loss_scale)
        if _is_abstract(params):
            shapes = jax.eval_shape(build, *args)
            shardings = jitted.lower(*args).compile().output_shardings
            state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
            )
        elif _traced(args):
            state = build(*args)
        else:
            state = _as_returned(unalias(jitted(*args)), specs)
        return state.replace(apply_fn=apply_fn)

    def _builder(self, tx: Any, where: tuple[Any, str | None, Any], specs: Any) -> tuple[Any, Any]:
        """`_build` for ``tx``, ``where`` and ``specs``, and its jitted form: one pair per
        ``tx`` and layout, so that a second ``init`` compiles nothing."""
        key = (id(tx), where, specs)
        found = self._builders.get(key)
        if found is None or found[0] is not tx:
            build = partial(_build, self._setup.mode, tx, where, specs)
            found = self._builders[key] = (tx, build, jax.jit(build))
        return found[1], found[2]

    def _init_plan(self, params: Any) -> mesh_lib.MeshLayout | None:
        """The layout plan ``init`` lays the state out by, where it lays out one by a plan (a
        stream window's partial sums, a ZeRO optimizer state): on the step's mesh and data
        axis, or the parameters' mesh and its data axis, read here, before tracing (None:
        one device, or nothing laid out by a plan)."""
        setup = self._setup
        if self._scan and setup.optimizer_sharding == "replicated":
            return None
        mesh = setup.mesh if setup.mesh is not None else mesh_lib.mesh_of(params)
        axis = None if mesh is None else mesh_lib.data_axis(mesh, setup.mesh_axis)
        if mesh is None or axis is None:
            return None
        return mesh_lib.layout_of(
            params,
            None,
            mesh=mesh,
            axis=axis,
            optimizer_sharding=setup.optimizer_sharding,
            reduce_scatter=setup.reduce_scatter,
        )

    def _window_where(self, plan: mesh_lib.MeshLayout | None) -> tuple[Any, str | None, Any]:
        """Where a stream window's partial sums are laid out: the plan's mesh, data axis and
        accumulator dimensions (None, None, None: one device, or scan mode's no window)."""
        if plan is None or self._scan:
            return None, None, None
        return plan.mesh, plan.axis, plan.accumulator_dims

    def _zero_specs(
        self, tx: Any, params: Any, plan: mesh_lib.MeshLayout | None
    ) -> OptSpecs | None:
        """With ``optimizer_sharding`` ZeRO on a concrete mesh: the mesh and each optimizer
        state leaf's partition spec of the layout plan (None otherwise)."""
        if self._setup.optimizer_sharding == "replicated" or plan is None:
            return None
        init = partial(opt_state_for, tx, mode="scan")
        specs = mesh_lib.optimizer_state_specs(init, params, plan)
        return None if specs is None else (cast(Mesh, plan.mesh), specs)


OptSpecs = tuple[Mesh, tuple[PartitionSpec | None, ...]]


def _opt_specs(tx: Any, params: Any) -> OptSpecs | None:
    """On an ``Auto`` mesh: the mesh and each optimizer state leaf's partition spec, as
    sharding in types derives it from the parameters' (traced on an ``Explicit`` copy of the
    mesh): Adam's moments sharded like their parameters, as the step returns them. None
    elsewhere: an ``Explicit`` mesh's types carry the layout into ``tx.init`` themselves, and
    a ``jit`` would leave an ``Auto`` one's parameter-shaped zeros replicated.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> _opt_specs(optax.adam(0.1), {"w": jnp.zeros(8)}) is None  # no mesh
      True
    """
    mesh = mesh_lib.mesh_of(params)
    if not isinstance(mesh, Mesh) or any(t != AxisType.Auto for t in mesh.axis_types):
        return None
    specs = [
        getattr(mesh_lib.sharding_of(x), "spec", PartitionSpec()) for x in jax.tree.leaves(params)
    ]
    return mesh, mesh_lib.state_specs(partial(opt_state_for, tx, mode="scan"), mesh, params, specs)


def _as_returned(state: Any, specs: OptSpecs | None) -> Any:
    """On an ``Auto`` mesh of one device, every array of ``state`` replicated, as the step
    returns them (``P()`` and ``P("data")`` are one layout there, but not one ``jit`` cache
    entry): the first call then compiles the step once."""
    if specs is None or specs[0].size != 1:
        return state
    one = NamedSharding(specs[0], PartitionSpec())
    return jax.tree.map(lambda x: jax.device_put(x, one) if isinstance(x, jax.Array) else x, state)


def _laid_out(opt_state: Any, specs: OptSpecs | None) -> Any:
    """``opt_state`` constrained to ``specs`` (`_opt_specs`), or as it is for None."""
    if specs is None:
        return opt_state
    mesh, leaf_specs = specs
    return mesh_lib.lay_out(opt_state, mesh, leaf_specs)


def _build(
    mode: str,
    tx: Any,
    where: tuple[Any, str | None, Any],
    specs: OptSpecs | None,
    params: Any,
    model_state: Any,
    loss_scale: Any,
) -> TrainState:
    """A train state with ``step == 0`` for ``mode`` (traceable); ``where`` lays out a
    stream window (`TrainStep._window_where`), ``specs`` the optimizer state (ZeRO's split
    over the data axis, `TrainStep._zero_specs`; on an ``Auto`` mesh, `_opt_specs`)."""
    config = config_of(tx)
    opt_state = _laid_out(opt_state_for(tx, params, "scan"), specs)  # no accumulator
    if mode == "stream" and config is not None:
        window = mesh_lib.device_window(params, config.accumulator_dtype, *where)
        opt_state = opt_state._replace(window=window)
    without_weak_types = lambda tree: jax.tree.map(
        lambda x: jnp.asarray(x, jnp.result_type(x)), tree
    )
    return TrainState(  # strongly typed, as the step returns them: one program per step
        step=jnp.zeros((), jnp.int32),
        apply_fn=None,  # pyright: ignore[reportArgumentType]
        params=without_weak_types(params),
        tx=tx,
        opt_state=opt_state,
        model_state=without_weak_types(model_state),
        loss_scale=loss_scale,
    )


def wrap(setup: Setup, donate: bool) -> TrainStep:
    """The `TrainStep` for ``setup``: jitted (one device or a mesh) or ``pmap``-ped.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from accumjax import _loop, _loss_adapter
      >>> grad_fn = _loss_adapter.make_grad_fn(lambda p, b: jnp.sum(p["w"] * b), False, None)
      >>> options = dict(mode="stream", axis_name=None, weight_fn=None, f16=False, unroll=1)
      >>> step = wrap(_loop.Setup(grad_fn=grad_fn, **options), donate=False)
      >>> state = step.init({"w": jnp.ones(2)}, optax.sgd(0.5))
      >>> state, metrics = step(state, jnp.ones(2))
      >>> state.params["w"], bool(metrics["updated"])
      (Array([0.5, 0.5], dtype=float32), True)
    """
    donate_argnums = (0,) if donate else ()
    scan = setup.mode == "scan"
    if setup.pmap_axis is None:
        body = sharded_scan_step(setup) if scan else sharded_stream_step(setup)
        jitted = jax.jit(body, static_argnums=(3,), donate_argnums=donate_argnums)
        return TrainStep(setup, jitted, pmapped=False)
    step = scan_step(setup) if scan else stream_step(setup)
    in_axes = (0, 0, None, None) if scan else (0, 0, None)
    pmapped = jax.pmap(
        step, axis_name=setup.pmap_axis, in_axes=in_axes, donate_argnums=donate_argnums
    )
    return TrainStep(setup, pmapped, pmapped=True)
