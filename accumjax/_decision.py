"""A microbatch's decision (internal): whether it is added, skipped or non-finite, and how
the devices that hold its rows agree about it.

`inspect_microbatch` is this device's decision, a `Microbatch`; `decide_microbatch` takes it as
the devices agree about it (at once, in a stream call's pool, or at the window's end). Each
device gives its `MicrobatchDecision` on its rows (`device_decision`, `rows_decision`), the
decisions are summed over the devices and `accepted` reads the sum (`agreed`); a policy that
reads the gradient's values reads the `whole_gradient`. Each caller's reading of a decision
(a stream call's pool, a scan pass's gate, a window's sum) is here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

import accumjax._scaling as scaling_lib
from accumjax._config import Config, transformed_gradient
from accumjax._layout import REPLICATED, LeafLayout, optimizer_dims, reduced_per_microbatch
from accumjax._norms import global_norm
from accumjax._reduction import gathered, own_shard, reduce_leaves, sharded_norm
from accumjax._scaling import Scaling, share_divisor

__all__ = [
    "Microbatch",
    "MicrobatchDecision",
    "accepted",
    "add_condition",
    "agreed",
    "decide_microbatch",
    "device_decision",
    "gated_decision",
    "inspect_microbatch",
    "pooled_decision",
    "rows_decision",
    "sum_decision",
    "weigh",
    "weight_or_one",
    "whole_gradient",
    "window_decisions",
]


class Microbatch(NamedTuple):
    """What the policy decided about one microbatch (`inspect_microbatch`).

    Attributes:
      added: whether its gradient goes into the window; model state follows this.
      nonfinite: whether its gradient (or weight) was not finite.
      weight: what it adds to the window's weight sum (0 when not added), float32.
      factor: what its gradient is multiplied by (weight times clip factor), or None for 1.
      whole: the whole microbatch's gradient, reduced while deciding (a policy that reads it,
        on a mesh; transformed by its ``microbatch_transform``), added instead of this
        device's own and never reduced again; or None.
      transformed: without ``whole``, the policy's ``microbatch_transform`` of the gradient
        it read (on a mesh the whole microbatch's, full-size), added instead of ``grads``
        (through ``add_microbatch``'s ``reduce``); or None.
    """

    added: jax.Array
    nonfinite: jax.Array
    weight: jax.Array
    factor: jax.Array | None = None
    whole: Any = None
    transformed: Any = None


class MicrobatchDecision(NamedTuple):
    """Devices' decisions about a microbatch (or, stacked, about each of a window's), summed
    over the devices that hold its rows: float32 arrays.

    Attributes:
      rejected: how many devices rejected rows that weigh something (a non-finite gradient,
        an invalid weight).
      rejected_weightless: how many devices rejected rows that weigh nothing
        (``"weighted"``: a mean over no rows may be NaN, and such rows add nothing).
      weight: the rows' weight (``"weighted"``; 1 a device otherwise).
    """

    rejected: jax.Array
    rejected_weightless: jax.Array
    weight: jax.Array


def inspect_microbatch(
    config: Config,
    grads: Any,
    weight: Any = None,
    params: Any = None,
    axis_name: str | None = None,
    layouts: Sequence[LeafLayout] | None = None,
    keep_whole: bool = True,
) -> Microbatch:
    """The policy's decision about one microbatch gradient, without adding it.

    `accumjax._window.add_microbatch` inspects and adds in one go. On a mesh (``axis_name``)
    a microbatch is one thing: every device takes the decision one device holding all its
    rows would take (`agreed`: a NaN in any device's rows leaves the whole microbatch out).

    Args:
      config: the accumulation's `accumjax._config.Config` (its window's policy).
      grads: the microbatch gradient (on a mesh, of this device's rows).
      weight: the microbatch weight (``scaling="weighted"`` only; on a mesh, this device's).
      params: the parameters, passed to ``config.skip_fn``.
      axis_name: the mapped axis the microbatch's rows are split over, or None (one device).
      layouts: with ``axis_name``, for a policy that reads the gradient: None (every leaf of
        the whole gradient all-reduced), or each leaf's `accumjax._layout.LeafLayout` as the
        policy reduces it (`accumjax._layout.reduced_per_microbatch`), in the order of
        ``jax.tree.leaves(grads)``: a leaf it reduce-scatters comes back as this device's
        shard along its ``optimizer`` dimension.
      keep_whole: with ``axis_name``, a policy that reads the gradient hands the whole
        gradient it reduced to the window (`Microbatch.whole`); False keeps this device's
        own gradient and weight (a window whose partial sums are reduced at its end).

    Returns:
      A `Microbatch`. Its ``weight`` and ``factor`` are this device's, or the whole
      microbatch's when it carries the ``whole`` gradient.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import accumjax._decision as decision
      >>> from accumjax._config import Config
      >>> config = Config(inner=optax.with_extra_args_support(optax.sgd(0.1)), every_k=2)
      >>> m = decision.inspect_microbatch(config, {"w": jnp.array([1.0, jnp.nan])})
      >>> bool(m.added), bool(m.nonfinite), float(m.weight)
      (False, True, 0.0)
    """
    w, w_ok = scaling_lib.microbatch_weight(config.scaling, weight)
    whole = None
    if axis_name is None:
        seen, norm, finite = grads, None, w_ok
        if config.detects or config.max_norm is not None:
            norm = global_norm(grads)
            finite = _finite_norm(config, finite, norm)
    else:
        seen, norm, finite, total, whole = agreed(config, grads, w, w_ok, axis_name, layouts)
        if keep_whole and whole is not None:
            w = total
        else:
            whole = None
    added = finite
    if config.skip_fn is not None:
        added = added & ~jnp.asarray(config.skip_fn(seen, params), bool)
    transformed = None
    if config.microbatch_transform is not None:
        transformed = transformed_gradient(config.microbatch_transform, seen, params)
        if whole is not None:  # in the whole gradient's layout: this device's shards
            whole, transformed = own_shard(transformed, axis_name, optimizer_dims(layouts)), None
    factor = w if config.scaling == "weighted" else None
    if config.max_norm is not None and norm is not None:
        tiny = jnp.finfo(jnp.float32).tiny
        clip = jnp.minimum(1.0, config.max_norm / jnp.maximum(norm, tiny))
        factor = clip if factor is None else factor * clip
    weight_added = jnp.where(added, w, 0.0)
    return Microbatch(jnp.asarray(added), ~finite, weight_added, factor, whole, transformed)


def decide_microbatch(
    config: Config,
    grads: Any,
    weight: Any,
    params: Any,
    axis_name: str | None = None,
    layouts: Sequence[LeafLayout] | None = None,
    *,
    agree: Literal["now", "pool", "window_end"] = "now",
    gate: Any = None,
) -> tuple[Microbatch, MicrobatchDecision | None]:
    """This device's decision about one microbatch, taken as the devices that hold its rows
    agree about it (``agree``).

    Args:
      config, grads, weight, params, axis_name, layouts: as `inspect_microbatch` takes them.
      agree: ``"now"``: every device decides about the whole microbatch at once
        (`inspect_microbatch` over ``axis_name``). ``"pool"``: a stream call's pool agrees
        afterwards (`pooled_decision`): this device decides about its rows, and a policy that
        reads the gradient reads the whole one now, keeping this device's own gradient and
        weight. ``"window_end"``: a scan window that adds as it comes agrees at its end:
        this device decides about its rows (`gated_decision`).
      gate: with ``"window_end"``, whether it is added, decided by an earlier pass.

    Returns:
      ``(m, mine)``: the `Microbatch`, and with ``"window_end"`` this device's
      `MicrobatchDecision` that travels to the window's end (else None).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from accumjax._config import Config
      >>> config = Config(inner=optax.with_extra_args_support(optax.sgd(0.1)), every_k=2)
      >>> grads = {"w": jnp.array([1.0, jnp.nan])}
      >>> m, mine = decide_microbatch(config, grads, None, None, agree="window_end", gate=True)
      >>> bool(m.added), float(mine.rejected)
      (False, 1.0)
    """
    if agree == "window_end":
        m = inspect_microbatch(config, grads, weight, params)
        return gated_decision(config, m, weight, jnp.asarray(gate))
    if agree == "pool":  # only a policy that reads the gradient reads the whole one now
        axis = axis_name if config.reads else None
        m = inspect_microbatch(config, grads, weight, params, axis, layouts, keep_whole=False)
        return m, None
    return inspect_microbatch(config, grads, weight, params, axis_name, layouts), None


def agreed(
    config: Config,
    grads: Any,
    weight: jax.Array,
    valid: jax.Array,
    axis_name: str,
    layouts: Sequence[LeafLayout] | None = None,
) -> tuple[Any, jax.Array | None, jax.Array, jax.Array, Any]:
    """Inside a map over ``axis_name``: what one device holding all of a microbatch's rows
    would see, the same on every device: ``(gradient the policy reads, its norm, whether the
    microbatch is finite, the weight to add, the whole gradient or None)``.

    The devices' decisions meet in one all-reduce; for a policy that reads the gradient it is
    the reduction of the whole gradient (`whole_gradient`), which the window
    then adds and never reduces again. ``"propagate"`` without weights needs none.
    """
    weighted, reads = config.scaling == "weighted", config.reads
    if not (config.detects or weighted or reads):
        return grads, None, valid, weight, None
    own = valid
    if config.detects and (weighted or not reads):  # else the whole gradient's norm decides
        own = own & jnp.isfinite(global_norm(grads))
    mine = device_decision(config.scaling, ~own, weight)
    if not reads:
        return grads, None, accepted(config.scaling, jax.lax.psum(mine, axis_name)), weight, None
    whole, summed = whole_gradient(config.scaling, grads, weight, axis_name, mine, layouts)
    dims = optimizer_dims(layouts)
    norm = sharded_norm(whole, axis_name, dims)
    reader = config.skip_fn is not None or config.microbatch_transform is not None
    seen = gathered(whole, axis_name, dims) if reader else whole
    finite = _finite_norm(config, accepted(config.scaling, summed), norm)
    return seen, norm, finite, summed.weight if weighted else weight, whole


def _finite_norm(config: Config, finite: jax.Array, norm: jax.Array) -> jax.Array:
    """``finite``, and with a policy that detects non-finite values, the gradient's ``norm``
    finite too."""
    return finite & jnp.isfinite(norm) if config.detects else finite


def device_decision(scaling: Scaling, rejected: jax.Array, weight: jax.Array) -> MicrobatchDecision:
    """One device's `MicrobatchDecision` about its rows of a microbatch: whether it
    ``rejected`` them, and their ``weight``."""
    rejected_weightless = weight == 0 if scaling == "weighted" else jnp.zeros((), bool)
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
    return MicrobatchDecision(
        f32(rejected & ~rejected_weightless), f32(rejected & rejected_weightless), f32(weight)
    )


def rows_decision(scaling: Scaling, m: Microbatch, weight: jax.Array | None) -> MicrobatchDecision:
    """This device's `MicrobatchDecision` about its rows of a microbatch from its `Microbatch`
    ``m``: it rejected them where ``m`` did not add them (non-finite, an invalid weight, or a
    ``skip_fn`` skip), weighing ``weight`` (None: 1).

    Example:
      >>> import jax.numpy as jnp
      >>> skipped = Microbatch(jnp.bool_(False), jnp.bool_(False), jnp.float32(0.0))
      >>> mine = rows_decision("mean", skipped, None)
      >>> float(mine.rejected), float(mine.weight)
      (1.0, 1.0)
    """
    return device_decision(scaling, ~m.added, weight_or_one(weight))


def weight_or_one(weight: jax.Array | None) -> jax.Array:
    """A microbatch's (or a device's rows') ``weight``, float32, and 1 where it has none (an
    unweighted scaling, or no ``weight_fn``).

    Example:
      >>> float(weight_or_one(None)), float(weight_or_one(jnp.float32(3.0)))
      (1.0, 3.0)
    """
    return jnp.ones((), jnp.float32) if weight is None else weight


def accepted(scaling: Scaling, summed: MicrobatchDecision) -> jax.Array:
    """Whether the devices' summed decisions accept a microbatch (elementwise for stacked
    ones): no device rejected rows that weigh something, and rows that weigh nothing decide
    only when the whole microbatch weighs nothing, as on one device.

    Example (two devices, the second's rows weigh nothing and gave a NaN; then that device
    alone, the whole microbatch weighing nothing):
      >>> import jax, jax.numpy as jnp
      >>> from accumjax._decision import accepted, device_decision
      >>> kept = device_decision("weighted", jnp.bool_(False), jnp.float32(3.0))
      >>> weightless = device_decision("weighted", jnp.bool_(True), jnp.float32(0.0))
      >>> both = jax.tree.map(jnp.add, kept, weightless)
      >>> bool(accepted("weighted", both)), bool(accepted("weighted", weightless))
      (True, False)
    """
    if scaling != "weighted":
        return summed.rejected == 0
    return (summed.rejected == 0) & ((summed.weight > 0) | (summed.rejected_weightless == 0))


def whole_gradient(
    scaling: Scaling,
    grads: Any,
    weight: jax.Array,
    axis_name: str,
    own: MicrobatchDecision,
    layouts: Sequence[LeafLayout] | None = None,
) -> tuple[Any, MicrobatchDecision]:
    """Inside a map over ``axis_name``: the whole microbatch's gradient from each device's
    gradient of its rows, as one device would compute it: their mean (``"mean"``,
    ``"sum_over_k"``), sum (``"sum"``) or weighted mean (``"weighted"``; a device of weight 0 adds
    nothing), the summed parts divided by `accumjax._scaling.share_divisor` (or the summed
    weight). Each share is summed in its own dtype widened to at least float32 (float16
    shares that are each finite stay finite), with the decisions in the same reduction.

    Args:
      scaling: the window's scaling.
      grads: this device's gradient of its rows.
      weight: this device's weight (float32).
      axis_name: the mapped axis.
      own: this device's `MicrobatchDecision`.
      layouts: each leaf's `accumjax._layout.LeafLayout`, in the order of
        ``jax.tree.leaves(grads)``, its `accumjax._layout.Reduction` one that runs on every
        microbatch (`accumjax._layout.reduced_per_microbatch`): a leaf reduce-scattered comes
        back as this device's shard of its whole gradient. None: every leaf all-reduced.

    Returns:
      ``(whole, summed decision)``.
    """
    weighted = scaling == "weighted"
    wide = lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))
    part = jax.tree.map(lambda g: weigh(weight, wide(g)) if weighted else wide(g), grads)
    leaves, treedef = jax.tree.flatten(part)
    every_leaf = [reduced_per_microbatch(REPLICATED)] * len(leaves)
    plan = every_leaf if layouts is None else layouts
    leaves, summed_decision = reduce_leaves(leaves, axis_name, plan, own, per_microbatch=True)
    divisor = share_divisor(scaling, jax.lax.axis_size(axis_name))
    by = summed_decision.weight if divisor is None else jnp.float32(divisor)
    by = scaling_lib.nonzero_denominator(by)
    whole = scaling_lib.divided(jax.tree.unflatten(treedef, leaves), by)
    return whole, summed_decision


def weigh(factor: jax.Array, g: jax.Array) -> jax.Array:
    """``factor * g``, and exactly 0 where ``factor`` is 0 (``g`` may be NaN there: a device
    whose rows weigh nothing computes a mean over no rows)."""
    return jnp.where(factor > 0, factor.astype(g.dtype) * g, jnp.zeros((), g.dtype))


def pooled_decision(
    config: Config, m: Microbatch, weight_sum: jax.Array, summed: MicrobatchDecision
) -> Microbatch:
    """The whole microbatch's decision from a stream call's pool on a mesh: ``m`` (this
    device's decision about its rows), with the devices' ``summed`` decisions and their
    ``weight_sum``, both from the pool's all-reduce.

    It is added where the devices accept it (`accepted`), then weighing ``weight_sum``.
    It is non-finite where ``m`` says so for a policy that reads the gradient (which decided
    about the whole microbatch already); otherwise where it is not accepted.
    """
    added = accepted(config.scaling, summed)
    nonfinite = m.nonfinite if config.reads else ~added
    return m._replace(added=added, nonfinite=nonfinite, weight=jnp.where(added, weight_sum, 0.0))


def gated_decision(
    config: Config, m: Microbatch, weight: jax.Array | None, gate: jax.Array
) -> tuple[Microbatch, MicrobatchDecision]:
    """A microbatch of a scan window that adds as it comes and decides at its end:
    ``(m added only where gate, this device's MicrobatchDecision about it)``.

    Args:
      config: the accumulation's `accumjax._config.Config`.
      m: this device's `inspect_microbatch` of it.
      weight: its weight, or None (1).
      gate: whether it is added, decided by an earlier pass (True in a window's first pass).

    Returns:
      ``(m, mine)``: ``m`` neither added nor weighing anything where ``gate`` is False, and
      the decision that travels to the window's end (`window_decisions`, `rows_decision`:
      such a window's policy reads no gradient, no ``skip_fn``: ``m`` left out exactly the
      rows it found non-finite).
    """
    mine = rows_decision(config.scaling, m, weight)
    return m._replace(added=m.added & gate, weight=jnp.where(gate, m.weight, 0.0)), mine


def sum_decision(
    config: Config, norm: jax.Array, gate: jax.Array, reading: jax.Array
) -> tuple[Microbatch, jax.Array, MicrobatchDecision]:
    """A microbatch of a window its sum decides (`accumjax._loop.Context.sum_can_decide`):
    unweighted, added where ``gate`` without its gradient read, or, ``reading``, read alone.

    Args:
      config: the accumulation's `accumjax._config.Config`.
      norm: the global norm of what was written: the window's sum with it added, or
        (``reading``) its own gradient.
      gate: whether it is added.
      reading: whether its own gradient was read (a pass that adds nothing).

    Returns:
      ``(counted, kept, mine)``: the `Microbatch` the window counts (weight 1 where added),
      whether its model state and loss count (added, or read and finite), and this device's
      `MicrobatchDecision` about it.
    """
    # Reading: the gradient's own norm, as `inspect_microbatch` reads it. Adding: the sum so
    # far, no larger than 2**62, tells that each gradient in it, a difference of two such
    # sums, had a finite norm (at most 2**63: its squares sum below float32's 2**128). Only a
    # window with a larger sum reads its gradients.
    nonfinite = jnp.where(reading, ~jnp.isfinite(norm), ~(norm <= 2.0**62))
    kept = gate | (reading & ~nonfinite)
    counted = Microbatch(added=gate, nonfinite=nonfinite, weight=jnp.where(gate, 1.0, 0.0))
    mine = device_decision(config.scaling, nonfinite, jnp.ones((), jnp.float32))
    return counted, kept, mine


def add_condition(config: Config, m: Microbatch, gate: jax.Array | None) -> jax.Array | None:
    """Where a window adds a microbatch's gradient: ``gate`` when one was decided before the
    gradient existed; else, for a policy that waits for the decision (`Config.waits`), where
    ``m`` added it; else None (added as it comes, everywhere)."""
    if gate is None and config.waits:
        return m.added
    return gate


def window_decisions(scaling: Scaling, summed: MicrobatchDecision) -> tuple[jax.Array, jax.Array]:
    """A window's stacked decisions, summed over the devices: ``(whether the devices accept
    each microbatch, how many they refuse: int32)``."""
    ok = accepted(scaling, summed)
    return ok, jnp.sum(~ok).astype(jnp.int32)
