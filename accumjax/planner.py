"""A microbatch planner: the smallest K whose compiled step fits a memory budget.

Gradient accumulation trades time for memory: K microbatches of ``B / K`` rows need less
memory than one batch of ``B`` rows, at the cost of K sequential passes. The right K is the
smallest one whose step fits in the device's memory. :func:`plan_microbatches` finds it
without running anything: it lowers and compiles the scan-mode step for each candidate K
(abstract ``jax.ShapeDtypeStruct`` arguments with the arrays' shardings; nothing is executed
and nothing is allocated) and reads XLA's compile-time memory analysis.

It plans the step you train (the same loss, options and state, laid out as ``step.init``
lays it out, on the arrays' mesh), and every figure is per device: the predicted footprint
is :func:`compiled_memory_bytes` of that step, ``argument + output - alias + temp +
generated_code``. ``docs/guides/planner.md`` says what the figure leaves out (the
allocator's fragmentation, other live buffers). On a mesh it can also choose the optimizer
state's layout (``optimizer_shardings=``): the one that lets the largest microbatch fit.

:func:`plan_microbatches_for` is the generic core: it takes any ``compile_for_k``
callable, so it also plans custom steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import accumjax._mesh as mesh_lib
from accumjax._checks import check_callable, check_int
from accumjax._layout import check_optimizer_sharding
from accumjax._split import split_advice
from accumjax._state import config_of
from accumjax._step_checks import requires_key
from accumjax.accumulation import accumulate, with_every_k
from accumjax.nnx_train_step import NNXTrainState, make_nnx_train_step
from accumjax.train_state import TrainState
from accumjax.train_step import make_train_step

__all__ = [
    "MicrobatchPlan",
    "compiled_memory_bytes",
    "plan_microbatches",
    "plan_microbatches_for",
    "scan_step_for_k",
]

CompileForK = Callable[[int], jax.stages.Compiled]
Tried = tuple[int, int] | tuple[int, int, str]


class MicrobatchPlan(NamedTuple):
    """The result of a plan.

    Attributes:
      accum_steps: the chosen K (the smallest candidate whose step fits).
      microbatch_size: rows per microbatch, ``batch_size // accum_steps``: the whole
        microbatch, over every device (``None`` when :func:`plan_microbatches_for` was not
        given ``batch_size``).
      predicted_bytes: :func:`compiled_memory_bytes` of the chosen step, per device.
      budget_bytes: the budget it was planned against, per device.
      tried: ``(every_k, predicted_bytes)`` for every candidate compiled, in increasing K;
        planned over ``optimizer_shardings``, ``(every_k, predicted_bytes, optimizer_sharding)``
        for every step compiled, in increasing K and each K's layouts in the order given.
      devices: how many devices the planned step runs on (1 off a mesh); each of them
        needs ``predicted_bytes``.
      optimizer_sharding: the planned step's ``make_train_step(optimizer_sharding=...)``:
        the layout chosen when planned over ``optimizer_shardings``, else the one given
        (``"replicated"`` by default); ``None`` from :func:`plan_microbatches_for`.
    """

    accum_steps: int
    microbatch_size: int | None
    predicted_bytes: int
    budget_bytes: int
    tried: tuple[Tried, ...]
    devices: int = 1
    optimizer_sharding: str | None = None


def compiled_memory_bytes(compiled: jax.stages.Compiled) -> int:
    """Device bytes a compiled computation needs, from XLA's compile-time memory analysis.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``).

    Returns:
      ``argument + output - alias + temp + generated_code`` bytes (see the module docstring),
      per device: a computation on a mesh is compiled to one program per device.

    Raises:
      ValueError: if the backend reports no memory analysis.

    Example:
      >>> import jax, jax.numpy as jnp, accumjax.planner as planner
      >>> x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
      >>> compiled = jax.jit(lambda a: a + 1).lower(x).compile()
      >>> planner.compiled_memory_bytes(compiled) >= 2 * 256 * 256 * 4  # input + output
      True
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(
            "this backend reports no compile-time memory analysis "
            "(compiled.memory_analysis() is None); the planner cannot predict memory here."
        )
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    return int(total + getattr(stats, "generated_code_size_in_bytes", 0))


def _check_budget(budget_bytes: Any, name: str) -> int:
    return check_int(name, budget_bytes, low=1, high=2**63 - 1)


def _check_candidates(candidates: Any) -> tuple[int, ...]:
    if isinstance(candidates, np.ndarray) and candidates.ndim == 1:
        candidates = list(candidates)  # numpy scalars: check_int takes integers, not floats
    if isinstance(candidates, str | bytes) or not isinstance(candidates, Sequence):
        raise TypeError(f"candidates must be a sequence of ints >= 1, got {candidates!r}.")
    if not candidates:
        raise ValueError("candidates must not be empty.")
    return tuple(sorted({check_int("candidates' K", every_k) for every_k in candidates}))


def _named(key: tuple[Any, ...]) -> str:
    """A candidate ``(every_k,)`` or ``(every_k, optimizer_sharding)`` in words."""
    return f"K={key[0]}" + (f" with optimizer_sharding={key[1]!r}" if key[1:] else "")


def _no_fit(tried: Sequence[Tried], budget_bytes: int) -> ValueError:
    best = min(tried, key=lambda t: t[1])
    smallest, fields = best[1], "(K, bytes, optimizer_sharding)" if best[2:] else "(K, bytes)"
    return ValueError(
        f"no candidate K fits the budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB): "
        f"the smallest predicted footprint is {smallest} bytes ({smallest / 2**20:.1f} MiB) at "
        f"{_named((best[0], *best[2:]))}; tried {fields} = {list(tried)}. Raise the budget, "
        "shrink the batch or the model, or add larger candidates (or rematerialisation)."
    )


def _devices(compiled: jax.stages.Compiled) -> int:
    """How many devices a compiled computation runs on (those of its inputs)."""
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=is_sharding)
    return max((len(s.device_set) for s in shardings if is_sharding(s)), default=1)


def _compile_noting(
    compile_for: Callable[..., jax.stages.Compiled], key: tuple[Any, ...]
) -> jax.stages.Compiled:
    """``compile_for(*key)``; an exception keeps its type and gains a note naming the key."""
    try:
        return compile_for(*key)
    except Exception as err:
        err.add_note(f"accumjax planner: raised while compiling the step for {_named(key)}.")
        raise


def _first_fit(
    compile_for: Callable[..., jax.stages.Compiled],
    keys: Sequence[tuple[Any, ...]],
    budget_bytes: int,
    batch_size: int | None,
) -> MicrobatchPlan:
    """The plan of the first ``(every_k,)`` or ``(every_k, optimizer_sharding)`` in ``keys`` whose
    ``compile_for(*key)`` fits ``budget_bytes``; ``ValueError`` if none does."""
    tried: list[Any] = []
    for key in keys:
        compiled = _compile_noting(compile_for, key)
        predicted = compiled_memory_bytes(compiled)
        tried.append((key[0], predicted, *key[1:]))
        if predicted <= budget_bytes:
            micro = None if batch_size is None else batch_size // key[0]
            layout = key[1] if key[1:] else None
            plan = MicrobatchPlan(key[0], micro, predicted, budget_bytes, tuple(tried))
            return plan._replace(devices=_devices(compiled), optimizer_sharding=layout)
    raise _no_fit(tried, budget_bytes)


def plan_microbatches_for(
    compile_for_k: CompileForK,
    candidates: Sequence[int],
    budget_bytes: int,
    *,
    batch_size: int | None = None,
) -> MicrobatchPlan:
    """The smallest K whose compiled computation fits ``budget_bytes``.

    Candidates are compiled in increasing K and the search stops at the first that fits,
    so a plan costs one compilation per K that does not fit, plus one. An exception raised
    by ``compile_for_k(k)`` propagates with its type and a note naming that K.

    Args:
      compile_for_k: ``k -> jax.stages.Compiled``: the step for K microbatches, compiled
        (not run; lower it with abstract ``jax.ShapeDtypeStruct`` arguments).
      candidates: the Ks to consider (ints >= 1, numpy integers too, or a 1-D integer
        array; sorted and de-duplicated here).
      budget_bytes: the memory budget in bytes.
      batch_size: the global batch size, to report ``microbatch_size``; optional.

    Returns:
      A :class:`MicrobatchPlan` for the smallest fitting K (its bytes are per device, and
      ``devices`` says on how many).

    Raises:
      ValueError / TypeError: for invalid arguments, or if no candidate fits (the message
        gives the smallest predicted footprint).

    Example:
      >>> import jax, jax.numpy as jnp, accumjax.planner as planner
      >>> def compile_for_k(k):  # sum of squares of a (1024, 256) batch in k chunks
      ...     x = jax.ShapeDtypeStruct((k, 1024 // k, 256), jnp.float32)
      ...     f = lambda x: jax.lax.map(lambda c: jnp.sum(jnp.exp(c) * c), x).sum()
      ...     return jax.jit(f).lower(x).compile()
      >>> plan = planner.plan_microbatches_for(compile_for_k, [1, 2, 4], 2**40, batch_size=1024)
      >>> plan.accum_steps, plan.microbatch_size, len(plan.tried)
      (1, 1024, 1)
    """
    if not callable(compile_for_k):
        raise TypeError(f"compile_for_k must be callable, got {type(compile_for_k).__name__}.")
    sorted_candidates = _check_candidates(candidates)
    budget_bytes = _check_budget(budget_bytes, "budget_bytes")
    if batch_size is not None:
        _check_budget(batch_size, "batch_size")
    return _first_fit(
        compile_for_k, [(every_k,) for every_k in sorted_candidates], budget_bytes, batch_size
    )


def _batch_size(batch: Any) -> int:
    sizes = {tuple(jax.numpy.shape(x)[:1]) for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or sizes == {()}:
        raise ValueError(
            "batch must be a pytree of arrays sharing one leading batch axis, got leading "
            f"shapes {sorted(sizes)}."
        )
    return sizes.pop()[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _device_budget() -> int:
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(
            f"memory_budget=None uses the device's memory limit, but JAX reports none for "
            f"{device} ({device.platform} reports no bytes_limit); pass memory_budget=<bytes>."
        )
    return int(limit)


def _abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves with the shardings of committed arrays (placed: on a
    mesh, as the step is lowered there) or given ones; uncommitted arrays (``jnp.zeros``:
    JAX may place them) have none, as a jitted call sees them. Static fields such as ``tx``
    are kept.

    Example:
      >>> import jax.numpy as jnp
      >>> _abstract({"w": jnp.zeros(2, jnp.int32)})["w"].sharding is None
      True
    """

    def with_sharding(shape: jax.ShapeDtypeStruct, x: Any) -> jax.ShapeDtypeStruct:
        placed = not isinstance(x, jax.Array) or x.committed
        sharding = getattr(x, "sharding", None) if placed else None
        weak = shape.weak_type
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding, weak_type=weak)

    return jax.tree.map(with_sharding, jax.eval_shape(lambda t: t, tree), tree)


def _check_state(state: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            "state must be an accumjax.TrainState (accumjax.TrainState.create(...)) or an "
            "accumjax.NNXTrainState (accumjax.nnx_train_state(model, tx)), got "
            f"{type(state).__name__}."
        )


def _needs_key(loss_fn: Callable[..., Any], state: Any) -> bool:
    """Whether ``loss_fn`` has a required parameter after those of a key-free call."""
    key_free = 2 if isinstance(state, NNXTrainState) or state.model_state is None else 3
    return requires_key(loss_fn, key_free)


def scan_step_for_k(
    loss_fn: Callable[..., Any], state: Any, k: int, **make_train_step_kwargs: Any
) -> tuple[Any, Any]:
    """The scan-mode train step for K microbatches, and the state it takes.

    This is the step :func:`plan_microbatches` compiles for each candidate K; use it to
    compile, measure or run the same step yourself: :func:`accumjax.make_train_step`'s, or
    :func:`accumjax.make_nnx_train_step`'s for an :class:`accumjax.NNXTrainState`. K lives
    in the optimizer: ``state.tx``
    is rebuilt for K (:func:`accumjax.with_every_k` if it is already an
    :func:`accumjax.accumulate` transformation, every other option kept; otherwise
    ``accumulate(state.tx, k)`` around it) and the state is laid out as the step's
    ``step.init`` lays it out, on the mesh the parameters lie on, from shapes only.

    Args:
      loss_fn: the loss, as for :func:`accumjax.make_train_step` (``loss_fn(params,
        [model_state,] batch[, key])``), or ``loss_fn(model, batch[, key])`` as for
        :func:`accumjax.make_nnx_train_step` when ``state`` is an ``NNXTrainState``.
      state: an :class:`accumjax.TrainState` or :class:`accumjax.NNXTrainState` (arrays or
        ``jax.ShapeDtypeStruct`` leaves).
      k: the number of microbatches per window, an int >= 1 (numpy integers too).
      **make_train_step_kwargs: further options of the step (``has_aux``,
        ``mixed_precision``, ``donate``, ...); not ``accum_steps`` (``k``) or ``mode``
        (``"scan"``).

    Returns:
      ``(step, abstract_state)``: ``step`` is ``make_train_step(loss_fn, mode="scan", ...)`` (or
      ``make_nnx_train_step``), called as ``step(abstract_state, batch[, rng])`` with the whole
      batch (it splits it into K microbatches); ``abstract_state`` is the state
      ``step.init(params, abstract_state.tx, ...)`` builds, in ``jax.ShapeDtypeStruct`` leaves
      with its shardings (a scan-mode ``opt_state``: no accumulator; with
      ``mixed_precision="float16"`` the state's loss scale, or a default one): enough to
      ``step.lower(abstract_state, batch[, rng])``, the very program of
      ``step(step.init(params, abstract_state.tx, ...), batch[, rng])``; to run the step, build
      the state with it so.

    Raises:
      TypeError: ``state`` is not a train state, ``k`` is not an integer, or
        ``accum_steps``/``mode`` is given.
      ValueError: ``k`` < 1.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> from accumjax.planner import compiled_memory_bytes, scan_step_for_k
      >>> params = {"w": jnp.zeros((8, 1))}
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
      >>> batch = {"x": jnp.ones((16, 8)), "y": jnp.ones((16, 1))}
      >>> step, state_4 = scan_step_for_k(loss_fn, state, 4)
      >>> compiled_memory_bytes(step.lower(state_4, batch).compile()) > 0
      True
      >>> new_state, metrics = step(step.init(params, state_4.tx), batch)
      >>> int(new_state.step)  # one window of 4 microbatches: one update
      1
    """
    k = check_int("k", k)
    _check_state(state)
    _refuse_set_here("scan_step_for_k sets", make_train_step_kwargs)
    build = make_nnx_train_step if isinstance(state, NNXTrainState) else make_train_step
    step = build(loss_fn, mode="scan", **make_train_step_kwargs)
    return step, _as_initialized(loss_fn, state, _tx_for(state.tx, k), make_train_step_kwargs)


def _tx_for(tx: Any, every_k: int) -> Any:
    """``tx`` for K microbatches: its K replaced, or ``accumulate(tx, every_k)`` around it."""
    return with_every_k(tx, every_k) if config_of(tx) else accumulate(tx, every_k)


def _as_initialized(loss_fn: Callable[..., Any], state: Any, tx: Any, kwargs: Any) -> Any:
    """``state`` as the scan step's ``step.init`` builds it for ``tx`` (shapes and shardings
    only; an NNX state's fields are built by the same `accumjax.TrainStep.init`)."""
    f16 = kwargs.get("mixed_precision") == "float16"
    init = make_train_step(loss_fn, mode="scan", **kwargs).init
    params = _abstract(state.params)
    built = init(
        params,
        tx,
        model_state=_abstract(state.model_state),
        loss_scale=_abstract(state.loss_scale) if f16 else None,
    )
    if all(x.sharding is None for x in jax.tree.leaves(params)):  # as step.init's outputs
        built = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), built)
    fields = ("step", "params", "opt_state", "model_state", "loss_scale")
    return state.replace(tx=tx, **{name: getattr(built, name) for name in fields})


def _data_shards(state: Any, batch: Any, kwargs: Any) -> int:
    """How many devices the step splits the batch over (1 off a mesh, and under ``pmap``,
    whose batch carries its device axis)."""
    mesh, axis = kwargs.get("mesh"), kwargs.get("axis_name")
    if axis is not None and mesh is None:
        return 1
    layout = mesh_lib.layout_of(state.params, batch, mesh=mesh, axis=axis)
    return 1 if layout is None else layout.shards


def plan_microbatches(
    loss_fn: Callable[..., Any],
    state: Any,
    batch: Any,
    *,
    memory_budget: int | None = None,
    candidates: Sequence[int] | None = None,
    rng: Any = None,
    optimizer_shardings: Sequence[str] | None = None,
    **make_train_step_kwargs: Any,
) -> MicrobatchPlan:
    """The smallest K (largest microbatch) whose scan-mode train step fits in memory.

    Compiles ``accumjax.make_train_step(loss_fn, mode="scan", ...)`` (for an
    :class:`accumjax.NNXTrainState`, ``accumjax.make_nnx_train_step``) for candidate Ks in
    increasing order, lowered as ``step.lower(state, batch, rng)`` from abstract shapes only
    (nothing runs, nothing is allocated), and returns the first whose predicted footprint
    (:func:`compiled_memory_bytes`) fits. An exception raised while compiling one K keeps
    its type and gains a note naming that K.

    Args:
      loss_fn: the loss, as for :func:`accumjax.make_train_step` (with ``model_state``,
        ``has_aux``, a key: whatever the state and options say), or ``loss_fn(model,
        batch[, key])`` as for :func:`accumjax.make_nnx_train_step` with an NNX state.
      state: an :class:`accumjax.TrainState` or :class:`accumjax.NNXTrainState` (arrays or
        ``jax.ShapeDtypeStruct`` leaves).
      batch: the global batch (arrays or ``jax.ShapeDtypeStruct`` leaves, one leading axis).
      memory_budget: bytes; ``None`` means the device's own limit
        (``memory_stats()["bytes_limit"]``) where JAX reports one (GPU, TPU; not CPU).
      candidates: the Ks to try (ints, numpy integers, a 1-D integer array); default:
        every divisor of the batch size. Each must divide the batch size.
      rng: the key you train with, ``step(state, batch, rng)``, for a loss that takes one
        (dropout): only its shape and dtype matter (``jax.random.key(0)`` or
        ``jax.ShapeDtypeStruct((), jax.random.key(0).dtype)``). Required when ``loss_fn``
        has a required key parameter; a loss with an optional key (``key=None``) is
        planned without its random masks unless ``rng`` is given.
      optimizer_shardings: plan the layout too: ``make_train_step``'s
        ``optimizer_sharding`` values to choose from (``("replicated", "zero1",
        "zero2")``), in order of preference. For each K in increasing order, the step is
        built and compiled with each of them in the order given, and the first that fits is
        the plan: the layout that lets the largest microbatch fit, the first given where
        several do at that K. ``None`` (default): the step of ``make_train_step_kwargs``
        only. Not with ``optimizer_sharding=``. The layouts differ only for parameters
        replicated over a mesh's data axis (on one device or for FSDP leaves they compile
        to the same bytes, and the first is chosen).
      **make_train_step_kwargs: further options of the step (``has_aux``,
        ``mixed_precision``, ``donate``, ``unroll``, ``optimizer_sharding``, ...); not
        ``accum_steps`` or ``mode``.

    Returns:
      A :class:`MicrobatchPlan`: ``accum_steps``, ``microbatch_size``, ``predicted_bytes``,
      ``budget_bytes``, the candidates tried and the ``optimizer_sharding`` planned (run the
      step built with it: ``make_train_step(loss_fn, mode="scan",
      optimizer_sharding=plan.optimizer_sharding)``).

    Raises:
      ValueError / TypeError: for invalid arguments (the message names the argument: e.g.
        a ``state`` that is not a train state, a key-taking loss without ``rng``), if
        ``memory_budget`` is ``None`` and the device reports no limit, or if no candidate
        fits (the message gives the smallest predicted footprint).

    Example:
      >>> import jax, jax.numpy as jnp, optax, accumjax
      >>> from accumjax.planner import plan_microbatches
      >>> params = {"w": jnp.zeros((64, 512)), "v": jnp.zeros((512, 1))}
      >>> def loss_fn(params, batch):
      ...     h = jnp.tanh(batch["x"] @ params["w"])
      ...     return jnp.mean((h @ params["v"] - batch["y"]) ** 2)
      >>> state = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
      >>> batch = {"x": jnp.ones((256, 64)), "y": jnp.ones((256, 1))}
      >>> big = plan_microbatches(loss_fn, state, batch, memory_budget=2**40)
      >>> big.accum_steps, big.microbatch_size
      (1, 256)
      >>> plan = plan_microbatches(loss_fn, state, batch, memory_budget=big.predicted_bytes - 1)
      >>> plan.accum_steps > 1, plan.predicted_bytes <= plan.budget_bytes
      (True, True)

      With dropout, plan with the key you train with (its masks take memory too):

      >>> def dropout_loss(params, batch, key):
      ...     h = jnp.tanh(batch["x"] @ params["w"])
      ...     h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)
      ...     return jnp.mean((h @ params["v"] - batch["y"]) ** 2)
      >>> keyed = plan_microbatches(dropout_loss, state, batch, memory_budget=2**40,
      ...                           rng=jax.random.key(0))
      >>> keyed.predicted_bytes > big.predicted_bytes
      True

      On a mesh, the layout that lets the largest microbatch fit (the guide shows one that
      only ZeRO fits):

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> on_mesh = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
      >>> state2 = state.replace(params=on_mesh(params, P()))
      >>> layouts = ("replicated", "zero1", "zero2")
      >>> plan = plan_microbatches(loss_fn, state2, on_mesh(batch, P("data")), candidates=[1],
      ...                          memory_budget=2**40, optimizer_shardings=layouts)
      >>> plan.optimizer_sharding, plan.tried[0][::2]  # the first fits: the first is chosen
      ('replicated', (1, 'replicated'))
    """
    check_callable("loss_fn", loss_fn, optional=False)
    _check_state(state)
    if rng is None and _needs_key(loss_fn, state):
        raise TypeError(
            "loss_fn takes a key but rng is None: plan with the key you train with, "
            "rng=jax.random.key(0) (only its shape and dtype matter), so that the planned "
            "step draws the same random masks as training."
        )
    _refuse_set_here("plan_microbatches chooses", make_train_step_kwargs)
    layouts = _check_layouts(optimizer_shardings, make_train_step_kwargs)
    batch_size = _batch_size(batch)
    abstract_batch = _abstract(batch)
    shards = _data_shards(state, abstract_batch, make_train_step_kwargs)
    advice = split_advice(batch_size, 1, shards)
    if advice is not None:
        raise ValueError(f"the batch does not split over the devices the step runs on: {advice}.")
    if candidates is None:
        candidates = _divisors(batch_size // shards)
    sorted_candidates = _check_candidates(candidates)
    bad = [
        every_k
        for every_k in sorted_candidates
        if split_advice(batch_size, every_k, shards) is not None
    ]
    if bad:
        advice = split_advice(batch_size, bad[0], shards)
        raise ValueError(f"candidates {bad} do not split the batch: for K={bad[0]}, {advice}.")
    if memory_budget is None:
        budget = _device_budget()
    else:
        budget = _check_budget(memory_budget, "memory_budget")
    abstract_rng = None if rng is None else _abstract(rng)
    steps: dict[str | None, tuple[Any, Any]] = {}

    def compile_for(every_k: int, layout: str | None = None) -> jax.stages.Compiled:
        # One step for every K (K lives in tx), and its state built once, per layout.
        if layout not in steps:
            kwargs = make_train_step_kwargs | ({} if layout is None else {_SHARDING: layout})
            steps[layout] = scan_step_for_k(loss_fn, state, sorted_candidates[0], **kwargs)
        step, laid_out = steps[layout]
        opt, tag = laid_out.opt_state, laid_out.opt_state.every_k_tag  # K is in its shape
        tag = jax.ShapeDtypeStruct((every_k,), tag.dtype, sharding=tag.sharding)
        abstract_state = laid_out.replace(
            tx=_tx_for(state.tx, every_k), opt_state=opt._replace(every_k_tag=tag)
        )
        return step.lower(abstract_state, abstract_batch, abstract_rng).compile()

    if layouts is None:
        plan = _first_fit(
            compile_for, [(every_k,) for every_k in sorted_candidates], budget, batch_size
        )
        return plan._replace(optimizer_sharding=make_train_step_kwargs.get(_SHARDING, "replicated"))
    return _first_fit(
        compile_for,
        [(every_k, lay) for every_k in sorted_candidates for lay in layouts],
        budget,
        batch_size,
    )


_SHARDING = "optimizer_sharding"


def _refuse_set_here(who: str, kwargs: Any) -> None:
    """A ``TypeError`` when ``kwargs`` (for ``make_train_step``) pass ``accum_steps`` or
    ``mode``, which the planner sets itself (``who``: the caller and its verb).

    Example:
      >>> _refuse_set_here("scan_step_for_k sets", {"donate": True})
    """
    for name in ("accum_steps", "mode"):
        if name in kwargs:
            raise TypeError(f"{who} {name}; do not pass {name}=.")


def _check_layouts(layouts: Any, kwargs: Any) -> tuple[str, ...] | None:
    """``optimizer_shardings`` validated and de-duplicated, in the order given (or None).

    Example:
      >>> _check_layouts(["zero2", "zero1", "zero2"], {})
      ('zero2', 'zero1')
    """
    if layouts is None:
        return None
    if _SHARDING in kwargs:
        raise TypeError(
            "pass optimizer_sharding= (plan that layout) or optimizer_shardings= (choose one "
            "of them), not both."
        )
    if isinstance(layouts, str | bytes) or not isinstance(layouts, Sequence):
        raise TypeError(
            "optimizer_shardings must be a sequence of optimizer_sharding values, such as "
            f"('replicated', 'zero1', 'zero2'), got {layouts!r}."
        )
    if not layouts:
        raise ValueError("optimizer_shardings must not be empty.")
    return tuple(dict.fromkeys(check_optimizer_sharding(x) for x in layouts))
