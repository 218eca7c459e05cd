"""The accumulation window (internal): its state, the add and the close every entry point runs.

`Window` and `DeviceWindow` are the open window (`init_window`, `emptied_window`). `add_microbatch`
adds a microbatch's ``w_i * c_i * T(g_i)`` (its weight, clip factor and the policy's
``microbatch_transform``) as `accumjax._decision` decides and counts it (`count_microbatch`).
`close_window` reduces the window once across devices, divides it by its `denominator` and
decides whether it is usable: a `Closed`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import accumjax._scaling as scaling_lib
from accumjax._checks import INT32_MAX
from accumjax._config import Config
from accumjax._decision import (
    Microbatch,
    MicrobatchDecision,
    add_condition,
    inspect_microbatch,
    weigh,
    window_decisions,
)
from accumjax._layout import REPLICATED, LeafLayout, optimizer_dims, window_layouts
from accumjax._reduction import cross_device_reduce, sharded_norm
from accumjax._scaling import divided, nonzero_denominator

__all__ = [
    "COUNTERS",
    "Closed",
    "DeviceWindow",
    "Window",
    "add_microbatch",
    "close_window",
    "count_microbatch",
    "denominator",
    "emptied_window",
    "first_microbatch",
    "init_window",
    "local_window",
    "retyped",
    "saturating_add",
    "scaled_gradient",
    "sum_dtype",
    "sums_name",
    "sums_of",
    "window_sum",
]


class Window(NamedTuple):
    """The open window: a pytree of arrays.

    Attributes:
      grad_sum: ``sum_i w_i * c_i * g_i`` over the added microbatches (``c_i`` the clip
        factor), in the accumulator dtype, shaped and sharded like the parameters; ``None``
        in a scan-mode state, whose window opens and closes inside one call.
      weight_sum: sum of the added microbatches' weights (their count unless weighted),
        float32.
      micro_step: microbatches seen in this window, skipped ones included, int32.
      window_nonfinite: microbatches with a NaN/Inf gradient or an invalid weight, int32.
      window_skipped: microbatches not added, whatever the reason, int32.
    """

    grad_sum: Any
    weight_sum: jax.Array
    micro_step: jax.Array
    window_nonfinite: jax.Array
    window_skipped: jax.Array


class DeviceWindow(NamedTuple):
    """The open window of a stream-mode train step, kept per data shard: a pytree of arrays.

    A step on a mesh reduces a window's gradient once, when it closes, so between calls each
    data shard keeps its own partial sum. ``step.init`` of a stream-mode step builds this
    layout on every topology (one shard on one device); `accumjax.restore_checkpoint` moves it
    to another number of devices, `accumjax.accumulated_gradients` reads its total.

    Attributes:
      partial_sums: like the parameters, each leaf with a leading axis of partial sums whose
        total is the window's ``sum_i w_i * c_i * g_i``: one entry per data shard, or one
        for a parameter sharded over the data axis (FSDP: its gradient is reduce-scattered
        into the shards on every call).
      weight_sum, micro_step, window_nonfinite, window_skipped: as in `Window`, for the
        whole batch (the step reduces them, with the metrics, on every call).
    """

    partial_sums: Any
    weight_sum: jax.Array
    micro_step: jax.Array
    window_nonfinite: jax.Array
    window_skipped: jax.Array


#: A window's counters: what `Window` and `DeviceWindow` hold besides their sums.
COUNTERS = ("weight_sum", "micro_step", "window_nonfinite", "window_skipped")


class Closed(NamedTuple):
    """A closed window (after the cross-device reduction).

    Attributes:
      grad_sum: the window's sum after the reduction, in the accumulator dtype.
      denominator: what it is divided by (`scaled_gradient`), float32, > 0.
      apply: whether the window is usable (its update may be applied).
      nonfinite_count: the window's non-finite microbatches (each counted once, however many
        devices its rows are split over).
      skipped_count: the window's skipped microbatches (as ``nonfinite_count``).
      norm: the global norm of the scaled gradient (float32).
      extras: the caller's values that travelled in the window's reduction
        (`close_window`'s ``extras``, a pytree), summed over devices, float32, or None.
      accepted: with `close_window`'s ``decisions``, whether each microbatch is accepted.
    """

    grad_sum: Any
    denominator: jax.Array
    apply: jax.Array
    nonfinite_count: jax.Array
    skipped_count: jax.Array
    norm: jax.Array
    extras: Any = None
    accepted: jax.Array | None = None


def sum_dtype(dtype: Any, minimum: Any = jnp.float32) -> Any:
    """The dtype a ``dtype`` value accumulates in: at least ``minimum`` (None: ``dtype``).

    Canonical for the current JAX configuration: float64 is float32 unless
    ``jax_enable_x64`` is on. The gradient window and the BatchNorm windows both use it.

    Example:
      >>> import jax.numpy as jnp
      >>> import accumjax._window as window
      >>> window.sum_dtype(jnp.bfloat16)
      dtype('float32')
    """
    wide = dtype if minimum is None else jnp.promote_types(dtype, minimum)
    return jnp.dtype(jax.dtypes.canonicalize_dtype(wide))


def init_window(params: Any, accumulator_dtype: Any = jnp.float32) -> Window:
    """An empty window whose accumulator is created like ``params`` (same sharding).

    Args:
      params: the parameters (arrays, whose shardings the accumulator takes, or
        ``jax.ShapeDtypeStruct``s).
      accumulator_dtype: minimum precision; a leaf accumulates in
        ``promote_types(leaf dtype, accumulator_dtype)``, ``None`` keeps the leaf's dtype.

    Returns:
      A `Window` with a zero ``grad_sum`` and zero counters.

    Example:
      >>> import jax.numpy as jnp
      >>> import accumjax._window as window
      >>> w = window.init_window({"w": jnp.zeros(2, jnp.bfloat16)})
      >>> w.grad_sum["w"].dtype, int(w.micro_step)
      (dtype('float32'), 0)
    """
    grad_sum = jax.tree.map(
        lambda p: (
            jnp.zeros_like(p, dtype=sum_dtype(p.dtype, accumulator_dtype))
            if isinstance(p, jax.Array)
            else jnp.zeros(p.shape, sum_dtype(p.dtype, accumulator_dtype))
        ),
        params,
    )
    count = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: donatable
    return Window(grad_sum, jnp.zeros((), jnp.float32), count(), count(), count())


def emptied_window(window: Any) -> Any:
    """``window`` (a `Window` or `DeviceWindow`) emptied: zero sums and counters, with the
    same shapes, dtypes and shardings."""
    zeros = Window(
        grad_sum=jax.tree.map(jnp.zeros_like, sums_of(window)),
        weight_sum=jnp.zeros_like(window.weight_sum, jnp.float32),
        micro_step=jnp.zeros_like(window.micro_step, jnp.int32),
        window_nonfinite=jnp.zeros_like(window.window_nonfinite, jnp.int32),
        window_skipped=jnp.zeros_like(window.window_skipped, jnp.int32),
    )
    return retyped(zeros, type(window))


def window_sum(window: Any) -> Any:
    """The window's full-size sum, shaped like the parameters: a `Window`'s ``grad_sum``, or the
    total of a `DeviceWindow`'s partial sums (None for a scan-mode window, which has none).

    Example:
      >>> import jax.numpy as jnp
      >>> import accumjax._window as window
      >>> sums = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
      >>> w = window.retyped(window.init_window(sums), window.DeviceWindow, sums)
      >>> window.window_sum(w)["w"]
      Array([4., 6.], dtype=float32)
    """
    if isinstance(window, DeviceWindow):
        return jax.tree.map(lambda a: jnp.sum(a, axis=0), window.partial_sums)
    return window.grad_sum


def local_window(window: DeviceWindow) -> Window:
    """Inside a ``shard_map`` over the data axis: this device's part of a `DeviceWindow`
    (its partial sums, whose leading axis has one entry here) as a `Window`."""
    return retyped(window, Window, jax.tree.map(lambda a: a[0], window.partial_sums))


def sums_of(window: Any) -> Any:
    """A `Window`'s ``grad_sum`` or a `DeviceWindow`'s ``partial_sums``."""
    return window.grad_sum if isinstance(window, Window) else window.partial_sums


def sums_name(cls: type) -> str:
    """The field of a window type (`Window` or `DeviceWindow`) that holds its sums.

    Example:
      >>> sums_name(Window), sums_name(DeviceWindow)
      ('grad_sum', 'partial_sums')
    """
    return cls._fields[0]  # pyright: ignore[reportAttributeAccessIssue]


def retyped(window: Any, cls: type, sums: Any = None) -> Any:
    """``window`` (a `Window` or `DeviceWindow`) as ``cls``: its counters, by name, and
    ``sums`` (by default its own sums) as ``cls``'s sums.

    Example:
      >>> d = retyped(init_window({"w": jnp.zeros(2)}), DeviceWindow)
      >>> type(d).__name__, d.partial_sums["w"].shape, int(d.micro_step)
      ('DeviceWindow', (2,), 0)
    """
    sums = sums_of(window) if sums is None else sums
    counters = {name: getattr(window, name) for name in COUNTERS}
    return cls(**{sums_name(cls): sums}, **counters)


def saturating_add(counter: jax.Array, amount: jax.Array) -> jax.Array:
    """``counter + amount`` for non-negative int32 values, held at the int32 maximum."""
    top = INT32_MAX
    amount = jnp.asarray(amount, jnp.int32)
    return jnp.where(counter > top - amount, top, counter + amount).astype(jnp.int32)


def _count(window_count: jax.Array, flag: jax.Array) -> jax.Array:
    """``window_count`` plus one where ``flag``, saturating."""
    return saturating_add(window_count, flag.astype(jnp.int32))


def add_microbatch(
    config: Config,
    window: Window,
    grads: Any,
    weight: Any = None,
    params: Any = None,
    inspected: Microbatch | None = None,
    reduce: Callable[[Any], Any] | None = None,
    axis_name: str | None = None,
    gate: jax.Array | None = None,
    first: bool = False,
) -> tuple[Window, Microbatch]:
    """Adds one microbatch gradient to the window when it is usable.

    A policy that waits for the decision (`Config.waits`) selects between the sum with and
    without the gradient; otherwise each leaf is added as soon as it exists, and counted.

    Args:
      config: the accumulation's `accumjax._config.Config` (its window's policy).
      window: the open `Window`.
      grads: the microbatch gradient, structured like the accumulator.
      weight: the microbatch weight (``scaling="weighted"`` only).
      params: the parameters, passed to ``config.skip_fn``.
      inspected: the decision already taken by `accumjax._decision.inspect_microbatch` on
        this gradient, or None to inspect it here.
      reduce: inside ``shard_map``, maps the microbatch's scaled gradient before it is added
        (zero when not added): a per-microbatch reduce-scatter into the shards the window
        keeps; None adds the gradient as it is. Unused when the decision carries the
        ``whole`` gradient (reduced already).
      axis_name: the mapped axis the microbatch's rows are split over: the decision is the
        whole microbatch's (`inspect_microbatch`); None on one device.
      gate: whether to add the gradient, decided before it exists (a scan window's passes,
        decided at its end): it is added as it comes, without waiting for ``inspected``
        (`accumjax._decision.add_condition`).
      first: open a window with this microbatch (`first_microbatch`): ``window`` only gives
        the accumulator dtypes, and the gradient becomes the accumulator, without the zeros
        of ``add_microbatch(config, emptied_window(window), ...)`` (XLA can reuse the
        gradient's buffer); ``reduce`` is not used.

    Returns:
      ``(window, microbatch)``: the new window and what was decided about the microbatch.
    """
    if inspected is None:
        inspected = inspect_microbatch(config, grads, weight, params, axis_name=axis_name)
    m = inspected
    gate = add_condition(config, m, gate)
    source = _source(m, grads)
    if first:
        return _opened(config, window, m, source, gate), m
    part = lambda a, g: _scaled(config, m, g.astype(a.dtype))
    if reduce is None or m.whole is not None:
        add = lambda a, g: a + part(a, g) if gate is None else jnp.where(gate, a + part(a, g), a)
        grad_sum = jax.tree.map(add, window.grad_sum, source)
    else:
        # Selected after the reduction (every device reduces, whatever the decision), on the
        # shard: a selection before it would be a full-size buffer of its own.
        reduced = reduce(jax.tree.map(part, window.grad_sum, source))
        add = lambda a, r: a + r if gate is None else jnp.where(gate, a + r, a)
        grad_sum = jax.tree.map(add, window.grad_sum, reduced)
    return count_microbatch(window, grad_sum, m), m


def count_microbatch(window: Window, grad_sum: Any, m: Microbatch) -> Window:
    """``window`` holding ``grad_sum``, one microbatch further: its weight sum grown by
    ``m.weight``, its steps counted, and ``m`` counted as non-finite and as skipped (not
    ``m.added``) where it was.

    Example:
      >>> w = init_window({"w": jnp.zeros(2)})
      >>> m = Microbatch(added=jnp.array(True), nonfinite=jnp.array(False), weight=jnp.ones(()))
      >>> int(count_microbatch(w, w.grad_sum, m).micro_step)
      1
    """
    return Window(
        grad_sum=grad_sum,
        weight_sum=window.weight_sum + m.weight,
        micro_step=_count(window.micro_step, jnp.ones((), bool)),
        window_nonfinite=_count(window.window_nonfinite, m.nonfinite),
        window_skipped=_count(window.window_skipped, ~m.added),
    )


def _opened(
    config: Config, like: Window, m: Microbatch, source: Any, gate: jax.Array | None
) -> Window:
    """A window opened with one microbatch (`add_microbatch`'s ``first``)."""

    def start(a: jax.Array, g: jax.Array) -> jax.Array:
        g = _scaled(config, m, g.astype(a.dtype))
        return g if gate is None else jnp.where(gate, g, jnp.zeros_like(g))

    grad_sum = jax.tree.map(start, like.grad_sum, source)
    return count_microbatch(emptied_window(like), grad_sum, m)


#: Opens a window with its first microbatch: `add_microbatch` with ``first=True``.
first_microbatch = functools.partial(add_microbatch, first=True)


def _source(m: Microbatch, grads: Any) -> Any:
    """The gradient the window adds for a microbatch: the whole one the decision reduced, the
    transformed one, or ``grads`` as they came."""
    if m.whole is not None:
        return m.whole
    return grads if m.transformed is None else m.transformed


def _scaled(config: Config, m: Microbatch, g: jax.Array) -> jax.Array:
    """A microbatch's gradient times its factor (a weight of 0 adds exactly 0)."""
    if m.factor is None:
        return g
    if config.scaling == "weighted":
        return weigh(m.factor, g)
    return m.factor.astype(g.dtype) * g


def denominator(
    scaling: scaling_lib.Scaling, every_k: Any, weight_sum: jax.Array, devices: Any = 1
) -> jax.Array:
    """What a window's sum is divided by, float32: its weight sum (``"mean"``: the number of
    microbatches it used, each of weight 1; ``"weighted"``: their weights), 1 (``"sum"``) or
    K times the devices (``"sum_over_k"``, skips or not).

    ``weight_sum`` is the window's over all devices: on a mapped axis whose devices each counted the
    window (``devices`` of them), their sum, so ``"mean"`` divides by the microbatches used
    times the devices, as ``"sum_over_k"`` by K times the devices.

    Example:
      >>> import jax.numpy as jnp
      >>> import accumjax._window as window
      >>> float(window.denominator("mean", 4, jnp.float32(3.0)))  # 3 of 4 used
      3.0
      >>> float(window.denominator("sum_over_k", 4, jnp.float32(3.0), devices=2))
      8.0
    """
    if scaling == "sum_over_k":
        return jnp.asarray(every_k, jnp.float32) * devices
    if scaling == "sum":
        return jnp.ones((), jnp.float32)
    return jnp.asarray(weight_sum, jnp.float32)


def close_window(
    config: Config,
    window: Window,
    every_k: Any,
    axis_name: str | None = None,
    layouts: Sequence[LeafLayout] | None = None,
    *,
    extras: Any = None,
    global_counts: bool = False,
    decisions: MicrobatchDecision | None = None,
) -> Closed:
    """Reduces the window once across devices, scales it and decides whether it is usable.

    Args:
      config: the accumulation's `accumjax._config.Config` (its window's policy).
      window: the window to close.
      every_k: K of this window (``"sum_over_k"`` divides by K times the number of devices).
      axis_name: a mapped axis (``pmap``/``shard_map``): sum, weights and counts go through
        one grouped ``psum``; ``None`` for one device or a ``jit``-sharded program.
      layouts: with ``axis_name``, each leaf's `accumjax._layout.LeafLayout` (the layout
        plan's), in the order of ``jax.tree.leaves(window.grad_sum)``: its `Reduction` says
        what the close does to it (a per-window all-reduce or reduce-scatter along its
        ``optimizer`` dimension, each device keeping its shard; nothing for a leaf reduced
        every microbatch, a shard where its ``optimizer`` dimension is set). None: every
        leaf all-reduced (all-reduced every microbatch already with a policy that reads the
        gradient, whose microbatches `add_microbatch` added reduced).
      extras: with ``axis_name``, a pytree of the caller's own per-device values (a loss
        sum, say) that travels in the same ``psum`` and comes back summed, in its structure,
        float32 (`Closed.extras`).
      global_counts: with ``axis_name``, the window's weight sum and counts are whole-batch
        values already (the devices agreed about each microbatch, or the window is one
        device's part of a `DeviceWindow`): they are not reduced, and ``"sum_over_k"``
        divides by K.
      decisions: the window's microbatches were added as they came (`Config.waits` is False,
        or a first pass of a policy that waits): each one's `accumjax._decision.MicrobatchDecision`
        from this device, stacked. They travel in the reduction and decide the counts;
        `Closed.accepted` says which microbatches the devices accept.

    Returns:
      A `Closed`: ``apply`` is True when the weight sum is > 0, the scaled sum is finite
      (when the policy detects non-finite values) and no microbatch was non-finite under
      ``"skip_window"`` (or in a first pass that added every microbatch as it came).
    """
    if axis_name is not None and config.reads and layouts is None:
        # `add_microbatch` added each microbatch's whole gradient, its counts agreed on.
        replicated = (REPLICATED,) * len(jax.tree.leaves(window.grad_sum))
        layouts, global_counts = window_layouts(replicated, config.reads)
    grad_sum, weight_sum = window.grad_sum, window.weight_sum
    nonfinite, skipped = window.window_nonfinite, window.window_skipped
    devices, ok = 1, None
    if axis_name is not None:
        # The window's counts travel as its own fields (weight sum, non-finite, skipped).
        counts = None if global_counts else window._replace(grad_sum=None, micro_step=None)
        scalars = {"counts": counts, "decisions": decisions, "extras": extras}
        grad_sum, summed = cross_device_reduce(grad_sum, scalars, axis_name, layouts)
        if not global_counts:
            devices = jax.lax.axis_size(axis_name)
            # Every device decided the same about each microbatch
            # (`accumjax._decision.agreed`), so each counted the same: the sum is the devices'
            # number times the count (rounded up, so a window whose devices counted only their
            # own rows comes back the same on every device).
            counted: Window = summed["counts"]
            weight_sum = counted.weight_sum
            per_device = lambda x: jnp.ceil(x / devices).astype(jnp.int32)
            nonfinite = per_device(counted.window_nonfinite)
            skipped = per_device(counted.window_skipped)
        decisions, extras = summed["decisions"], summed["extras"]
    if decisions is not None:
        ok, rejected = window_decisions(config.scaling, decisions)
        nonfinite = skipped = rejected
    safe = nonzero_denominator(denominator(config.scaling, every_k, weight_sum, devices))
    # The scaled gradient's norm, without materializing the scaled gradient.
    norm = sharded_norm(grad_sum, axis_name, optimizer_dims(layouts)) / safe
    apply = weight_sum > 0
    if config.detects:
        apply = apply & jnp.isfinite(norm)
    if config.on_nonfinite == "skip_window" or (decisions is not None and config.detects):
        apply = apply & (nonfinite == 0)
    return Closed(grad_sum, safe, apply, nonfinite, skipped, norm, extras, ok)


def scaled_gradient(closed: Closed) -> Any:
    """The window gradient: the (reduced) sum divided by the strategy's denominator."""
    return divided(closed.grad_sum, closed.denominator)
