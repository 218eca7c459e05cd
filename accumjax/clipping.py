"""Adaptive gradient clipping (AGC) and the unit-wise norms it is built on.

AGC (Brock et al. 2021) rescales each *unit* of a gradient so that its L2 norm is at most
``clip_factor * max(||param unit||, eps)``. A unit is the slice of a parameter that feeds one
output: a column of a ``(in, out)`` Dense kernel, one output channel of a ``HWIO`` conv kernel
(or of a ``DHWIO`` Conv3D kernel), or an entire bias/scale vector. See :func:`unitwise_norm` for
the exact convention.

Two public entry points do the same arithmetic:

- :func:`adaptive_clip_grad` is a plain function ``(params, grads) -> grads``.
- :func:`adaptive_clip` is an ``optax`` transformation; it needs ``params`` in ``update``.

Both take ``axis=`` (the axes a unit spans, as in optax) for layouts the rank-based default
does not know, and a clip factor that may be an array (a schedule's value, maybe traced).
``docs/guides/clipping.md`` shows where each kind of clipping goes in gradient accumulation
and how these functions differ from optax's and GradientAccumulator's.

References:
  Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
  <https://arxiv.org/abs/2102.06171>`_, 2021
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from accumjax._checks import check_real
from accumjax._norms import squared_norm

__all__ = [
    "adaptive_clip",
    "adaptive_clip_grad",
    "compute_norm",
    "squared_norm",
    "unitwise_norm",
]

# A pytree of bools (or a prefix of params), or a callable params -> such a pytree, or None.
Mask = Any
# A clip factor or eps: a Python number, or a floating point array of shape () (a value from
# `optax.inject_hyperparams` or a schedule, maybe traced).
Hyperparam = float | jax.Array | np.ndarray
# The axes a unit spans, with optax's meaning: None (by rank), an int or a tuple of ints.
Axis = int | Sequence[int] | None

_MAX_RANK = 5


def _check_hyperparam(name: str, value: Any, *, low_open: bool) -> Hyperparam:
    """A Python number as a float, finite and > 0 (``>= 0`` unless ``low_open``); a floating
    point array of shape () as it is: it may be traced, so its value is not checked."""
    is_array = isinstance(value, jax.Array | np.ndarray)
    if is_array and value.shape == () and jnp.issubdtype(value.dtype, jnp.floating):
        return value
    if is_array or isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = (
            f"an array of dtype {value.dtype} and shape {value.shape}" if is_array else repr(value)
        )
        raise TypeError(
            f"{name} must be a real number or a floating point array of shape (), got {got}."
        )
    return check_real(name, value, low=0.0, low_open=low_open)


def _clip_factor_arg(clip_factor: Any, clipping: Any) -> tuple[str, Any]:
    """The clip factor and the name it was given under (``clipping`` is optax's); 0.01 if
    neither is given."""
    if clip_factor is not None and clipping is not None:
        raise TypeError(
            "adaptive_clip takes either `clip_factor` or `clipping` (optax's name for the same "
            "factor), not both."
        )
    if clipping is not None:
        return "clipping", clipping
    return "clip_factor", 0.01 if clip_factor is None else clip_factor


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _check_axis(axis: Any) -> int | tuple[int, ...] | None:
    """``axis`` as ``None``, an int or a tuple of ints (a list is welcome), or ``TypeError``."""
    if axis is None or _is_int(axis):
        return None if axis is None else int(axis)
    if isinstance(axis, tuple | list) and all(_is_int(a) for a in axis):
        return tuple(int(a) for a in axis)
    hint = ""
    if isinstance(axis, jax.Array | np.ndarray):
        hint = (
            " It picks the reduced axes, so it must be static: `optax.inject_hyperparams` makes "
            'an int an array; pass static_args="axis" to it, or a tuple such as (0,).'
        )
    raise TypeError(f"axis must be None, an int or a tuple of ints, got {axis!r}.{hint}")


def _given_axes(axis: int | tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """``axis`` as sorted non-negative axes of an array of ``shape``, or ``ValueError``."""
    axes = (axis,) if isinstance(axis, int) else axis
    ndim = len(shape)
    if not all(-ndim <= a < ndim for a in axes):
        raise ValueError(f"axis {axis!r} is out of range for shape {shape}.")
    unique = {a % ndim for a in axes}
    if len(unique) < len(axes):
        raise ValueError(f"axis {axis!r} names an axis twice.")
    return tuple(sorted(unique))


def compute_norm(
    x: jax.typing.ArrayLike,
    axis: int | tuple[int, ...] | None = None,
    keepdims: bool = False,
) -> jax.Array:
    """Computes the L2 norm of ``x`` over ``axis``, accumulating in at least float32.

    Args:
      x: A floating point (or complex) array.
      axis: Axis or axes to reduce; ``None`` reduces all of them.
      keepdims: Whether to keep the reduced axes with size 1 (as ``jnp.sum`` does).

    Returns:
      ``sqrt(squared_norm(x, axis, keepdims))`` (see :func:`squared_norm`). Its dtype is
      ``float32`` for ``float16``, ``bfloat16`` (and other sub-32-bit) inputs, and the real
      dtype of ``x`` otherwise (``float32``, ``float64``; ``complex64 -> float32``). Its shape
      is that of ``jnp.sum``.

    Raises:
      TypeError: if ``x`` is not floating point or complex.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax import compute_norm
      >>> compute_norm(jnp.array([[3.0, 0.0], [4.0, 1.0]], jnp.bfloat16), axis=0)
      Array([5., 1.], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
      <https://arxiv.org/abs/2102.06171>`_, 2021
    """
    return jnp.sqrt(squared_norm(x, axis=axis, keepdims=keepdims))


def _unit_axes(
    shape: tuple[int, ...], axis: int | tuple[int, ...] | None = None
) -> tuple[int, ...] | None:
    """Axes reduced by :func:`unitwise_norm` for an array of ``shape``; ``None`` means all."""
    if axis is not None:
        return _given_axes(axis, shape)
    if len(shape) > _MAX_RANK:
        raise ValueError(
            f"`unitwise_norm` supports arrays of rank 0 to {_MAX_RANK} by default, got shape "
            f"{shape}. Pass `axis=`, or exclude such leaves from clipping with `mask`."
        )
    if sum(d != 1 for d in shape) <= 1:  # Scalars and vectors, also shaped (1, n) etc.
        return None
    if len(shape) <= 3:  # Dense (in, out) and 3-D kernels (in, heads, head_dim): per axis 0.
        return (0,)
    if len(shape) == 4:  # HWIO conv kernels: per output channel.
        return (0, 1, 2)
    return (0, 1, 2, 3)  # DHWIO Conv3D kernels: per output channel.


def unitwise_norm(x: jax.typing.ArrayLike, axis: Axis = None) -> jax.Array:
    """Computes the L2 norm of each output unit of a parameter (or gradient) array.

    With ``axis`` given, a unit spans exactly those axes, for an array of any rank (as
    ``optax.transforms.unitwise_norm(x, axis=axis)``; e.g. ``axis=-1`` for PyTorch-style
    ``(out, in)`` kernels). With ``axis=None`` the reduced axes depend only on the shape of ``x``:

    - at most one dimension larger than 1 (scalars, biases, shapes like ``(1, n)``): one unit,
      the entire array (``optax`` uses the same squeeze rule);
    - rank 2, Dense kernel ``(in, out)``: per output unit, reduce axis 0;
    - rank 3, e.g. a multi-head kernel ``(in, heads, head_dim)``: reduce axis 0;
    - rank 4, conv kernel ``HWIO``: per output channel, reduce axes ``(0, 1, 2)``;
    - rank 5, Conv3D kernel ``DHWIO``: per output channel, reduce axes ``(0, 1, 2, 3)``.

    This is ``optax.adaptive_grad_clip``'s default norm (its code reduces axis 0 for rank 3,
    though its docstring says ``(0, 1, 2)``) and the TensorFlow ``andreped/GradientAccumulator``
    library's units (which keep the axis dims for ranks 2-5 and return a bare scalar for ranks
    0-1; here the dims are always kept, so the result broadcasts).

    Args:
      x: A floating point array: of rank 0 to 5 when ``axis`` is ``None``, any rank otherwise.
      axis: The axes a unit spans: an int or a tuple of ints (negative ones count from the end;
        ``()`` makes each element a unit), or ``None`` for the rank-based default above.

    Returns:
      The norms with ``keepdims=True``: shape ``x.shape`` with every reduced axis set to 1 (so
      it broadcasts against ``x``; ``()`` for a scalar; optax broadcasts them to ``x.shape``).
      Dtype as in :func:`compute_norm`: ``float32`` for ``float16``/``bfloat16`` inputs, the real
      dtype of ``x`` otherwise.

    Raises:
      ValueError: if ``axis`` is ``None`` and ``x`` has rank above 5, or if ``axis`` is out of
        range for ``x`` or names an axis twice.
      TypeError: if ``x`` is not floating point or complex, or ``axis`` is not ``None``, an int
        or a tuple of ints.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax import unitwise_norm
      >>> kernel = jnp.array([[3.0, 0.0], [4.0, 2.0]])  # Dense (in=2, out=2)
      >>> unitwise_norm(kernel)
      Array([[5., 2.]], dtype=float32)
      >>> unitwise_norm(kernel.T, axis=-1)  # the same units in a PyTorch (out, in) layout
      Array([[5.],
             [2.]], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
      <https://arxiv.org/abs/2102.06171>`_, 2021
    """
    x = jnp.asarray(x)
    return compute_norm(x, axis=_unit_axes(x.shape, _check_axis(axis)), keepdims=True)


def _leaf_axes(shape: tuple[int, ...], axis: int | tuple[int, ...] | None, where: str) -> Any:
    """The axes AGC reduces for one leaf (``None``: all), or ``ValueError`` naming the leaf."""
    if axis is None and len(shape) > _MAX_RANK:
        raise ValueError(
            f"Without `axis=`, AGC supports leaves of rank 0 to {_MAX_RANK}; leaf {where} has "
            f"shape {shape}. Pass `axis=`, or exclude it with `mask`."
        )
    try:
        return _unit_axes(shape, axis)
    except ValueError as err:
        raise ValueError(f"AGC cannot clip leaf {where}: {err} Exclude it with `mask`.") from None


def _clip_leaf(
    param: jax.Array,
    grad: jax.Array,
    clip_factor: Hyperparam,
    eps: Hyperparam,
    axes: tuple[int, ...] | None,
) -> jax.Array:
    """AGC of one gradient leaf over ``axes`` (``None``: all), returned in ``grad``'s dtype."""
    p_norm = compute_norm(param, axis=axes, keepdims=True)
    g_norm = compute_norm(grad, axis=axes, keepdims=True)
    dtype = jnp.promote_types(p_norm.dtype, g_norm.dtype)
    p_norm, g_norm = p_norm.astype(dtype), g_norm.astype(dtype)
    # Hyperparameters in the norms' dtype: a Python float rounds as it would in `c * norm`,
    # and an injected bfloat16 or float64 value cannot change the compute dtype.
    max_norm = jnp.asarray(clip_factor, dtype) * jnp.maximum(p_norm, jnp.asarray(eps, dtype))
    # The floor only guards 0 / 0: when clipping is selected, g_norm >= max_norm > 0 unless
    # clip_factor * eps underflows.
    scale = max_norm / jnp.maximum(g_norm, jnp.finfo(dtype).tiny)
    clipped = (grad * scale).astype(grad.dtype)
    return jnp.where(g_norm < max_norm, grad, clipped)


def _mask_leaves(mask: Mask, params: Any) -> list[bool]:
    """Resolves ``mask`` (pytree, prefix pytree or callable) to one bool per params leaf."""
    if mask is None:
        return [True] * len(jax.tree.leaves(params))
    mask_tree = mask(params) if callable(mask) else mask
    try:
        full = jax.tree.broadcast(mask_tree, params)
    except ValueError as err:
        raise ValueError(
            "`mask` must be a pytree of bools with the structure of params (or a prefix of it), "
            f"got mask structure {jax.tree.structure(mask_tree)} for params structure "
            f"{jax.tree.structure(params)}."
        ) from err
    return _check_mask_leaves(jax.tree.leaves(full))


def _check_mask_leaves(leaves: list[Any]) -> list[bool]:
    """Checks that mask leaves are static bools (jit needs to know which leaves to clip)."""
    bad = [m for m in leaves if not isinstance(m, bool | np.bool_)]
    if bad:
        raise TypeError(
            f"`mask` leaves must be Python bools (static, not arrays), got {type(bad[0])}."
        )
    return [bool(m) for m in leaves]


def adaptive_clip_grad(
    params: Any,
    grads: Any,
    clip_factor: Hyperparam = 0.01,
    eps: Hyperparam = 1e-3,
    mask: Mask = None,
    *,
    axis: Axis = None,
) -> Any:
    """Clips each unit of ``grads`` to ``clip_factor`` times the norm of its parameter unit.

    For every leaf and every unit (see :func:`unitwise_norm`), with
    ``max_norm = clip_factor * max(unitwise_norm(param), eps)``, a gradient unit with
    ``unitwise_norm(grad) >= max_norm`` is scaled by ``max_norm / unitwise_norm(grad)``; other
    units are returned as they are. Comparisons and scales use the norms' dtype (at least
    float32; ``clip_factor`` and ``eps`` are cast to it); each output leaf has the dtype of its
    gradient leaf. A unit with an ``inf`` or ``NaN`` entry comes out with ``NaN`` entries (it
    is not silently repaired).

    Args:
      params: Pytree of parameters (floating point arrays; of rank 0 to 5 unless ``axis`` is
        given).
      grads: Pytree of gradients with exactly the structure and leaf shapes of ``params``.
      clip_factor: Maximum ratio of gradient to parameter unit norm: a Python number > 0, or a
        floating point array of shape () (a schedule's value, maybe traced: not checked).
      eps: Lower bound on the parameter unit norm, so zero-initialised parameters (biases) can
        still move: a Python number >= 0, or a floating point array of shape ().
      mask: ``None`` (clip every leaf), a pytree of Python bools with the structure of
        ``params`` or a prefix of it, or a callable ``params -> such a pytree`` (as in
        ``optax.masked``). ``True`` means clip; ``False`` leaves are returned unchanged and
        are not checked for dtype or rank (use it for the final classifier layer, as the NFNets
        paper does, or for integer leaves and leaves of rank above 5).
      axis: The axes a unit spans in every clipped leaf (``optax.adaptive_grad_clip``'s
        ``axis``: an int or a tuple of ints, any rank), or ``None`` for the rank-based units of
        :func:`unitwise_norm`.

    Returns:
      A pytree like ``grads`` with the clipped gradients.

    Raises:
      ValueError: on mismatched pytree structures or leaf shapes, a clipped leaf of rank above
        5 without ``axis`` or one ``axis`` does not fit (the message names the leaf), or
        hyperparameters out of range.
      TypeError: on integer (or other non-floating) leaves that are to be clipped, or
        hyperparameters or ``axis`` of the wrong kind.

    Example:
      >>> import jax.numpy as jnp
      >>> from accumjax import adaptive_clip_grad
      >>> params = {"w": jnp.array([[3.0, 0.0], [4.0, 10.0]]), "b": jnp.zeros(2)}
      >>> grads = {"w": jnp.array([[0.0, 0.0], [2.0, 0.05]]), "b": jnp.ones(2)}
      >>> clipped = adaptive_clip_grad(params, grads, clip_factor=0.1)
      >>> clipped["w"]  # Column 0 had norm 2 > 0.1 * 5 and is scaled to 0.5 (exactly).
      Array([[0.  , 0.  ],
             [0.5 , 0.05]], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
      <https://arxiv.org/abs/2102.06171>`_, 2021
    """
    clip_factor = _check_hyperparam("clip_factor", clip_factor, low_open=True)
    eps = _check_hyperparam("eps", eps, low_open=False)
    axis = _check_axis(axis)
    p_paths, p_def = jax.tree_util.tree_flatten_with_path(params)
    g_leaves, g_def = jax.tree.flatten(grads)
    if p_def != g_def:
        raise ValueError(
            f"`grads` must have the pytree structure of `params`; got grads {g_def} "
            f"and params {p_def}."
        )
    out = []
    for (path, param), grad, clip in zip(
        p_paths, g_leaves, _mask_leaves(mask, params), strict=True
    ):
        if not clip:
            out.append(grad)
            continue
        where = jax.tree_util.keystr(path) or "<root>"
        for name, leaf in (("grads", grad), ("params", param)):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                raise TypeError(
                    f"AGC needs floating point {name}; leaf {where} has dtype "
                    f"{jnp.result_type(leaf)}. Exclude it with `mask`."
                )
        param, grad = jnp.asarray(param), jnp.asarray(grad)
        if grad.shape != param.shape:
            raise ValueError(
                f"Leaf {where}: grads shape {grad.shape} != params shape {param.shape}."
            )
        axes = _leaf_axes(param.shape, axis, where)
        out.append(_clip_leaf(param, grad, clip_factor, eps, axes))
    return jax.tree.unflatten(g_def, out)


def _check_mask_arg(mask: Mask) -> None:
    """Fails at construction, not in ``update``, on mask leaves that are not Python bools; an
    int or a tuple of ints is most likely optax's positional ``axis``, and the error says so."""
    if _is_int(mask) or (isinstance(mask, tuple) and mask and all(_is_int(a) for a in mask)):
        raise TypeError(
            f"mask must be None, a pytree of Python bools or a callable, got {mask!r}. optax's "
            f"third argument is `axis`; here it is keyword-only: pass it by name: axis={mask!r}."
        )
    if mask is not None and not callable(mask):
        _check_mask_leaves(jax.tree.leaves(mask))


def adaptive_clip(
    clip_factor: Hyperparam | None = None,
    eps: Hyperparam = 1e-3,
    mask: Mask = None,
    *,
    clipping: Hyperparam | None = None,
    axis: Axis = None,
) -> optax.GradientTransformationExtraArgs:
    """Adaptive gradient clipping as an ``optax`` transformation.

    Applies :func:`adaptive_clip_grad` to the updates; ``params`` must be passed to ``update``.
    Placed in the inner optimizer of gradient accumulation it clips the accumulated gradient
    (see the module docstring for per-microbatch clipping).

    A drop-in for ``optax.adaptive_grad_clip(clipping, eps, axis)``: a call such as
    ``optax.adaptive_grad_clip(clipping=0.01, eps=1e-3, axis=...)`` works with the function
    name swapped (``axis`` is keyword-only here; the third positional argument is ``mask``).
    ``clip_factor`` is the canonical name of the factor (as in :func:`adaptive_clip_grad` and
    ``make_train_step``); ``clipping`` is optax's name for it. Give at most one.

    The factor and ``eps`` may be floating point arrays of shape (), so
    ``optax.inject_hyperparams(accumjax.adaptive_clip)(clipping=schedule)`` schedules the
    factor (the state's ``hyperparams`` holds it under the name it was given). There, give an
    int ``axis`` in ``static_args`` (``inject_hyperparams`` would make it an array) or as a
    tuple, and a callable ``mask`` in ``static_args`` (it would be taken for a schedule).

    Args:
      clip_factor: Maximum ratio of gradient to parameter unit norm: a Python number > 0 or a
        floating point array of shape () (not checked: it may be traced). ``0.01`` when
        neither it nor ``clipping`` is given.
      eps: Lower bound on the parameter unit norm: a Python number >= 0 or a floating point
        array of shape ().
      mask: ``None``, a pytree of Python bools (``True`` = clip) matching params or a prefix of
        them, or a callable ``params -> mask``; excluded leaves pass through unchanged.
      clipping: ``optax.adaptive_grad_clip``'s name for ``clip_factor``, the same meaning.
      axis: The axes a unit spans, as ``optax.adaptive_grad_clip``'s ``axis`` (an int or a
        tuple of ints, leaves of any rank); ``None`` for the rank-based units of
        :func:`unitwise_norm`.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with an empty state.

    Raises:
      ValueError: from ``update`` if ``params`` is not given or ``axis`` does not fit a leaf,
        and at construction on hyperparameters out of range.
      TypeError: at construction if both ``clip_factor`` and ``clipping`` are given, or a
        hyperparameter, ``mask`` or ``axis`` is of the wrong kind.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import accumjax
      >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> tx = optax.chain(accumjax.adaptive_clip(0.01), optax.sgd(1.0))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.full((3, 2), 10.0), "b": jnp.zeros(2)}
      >>> updates, state = tx.update(grads, state, params)
      >>> ratio = jnp.linalg.norm(updates["w"][:, 0]) / jnp.linalg.norm(params["w"][:, 0])
      >>> round(float(ratio), 6)  # The update is -1.0 * (grads clipped to 0.01 * |param unit|).
      0.01
      >>> schedule = optax.linear_schedule(0.1, 0.01, transition_steps=100)
      >>> agc = optax.inject_hyperparams(accumjax.adaptive_clip)(clipping=schedule, eps=1e-3)
      >>> _, agc_state = agc.update(grads, agc.init(params), params)
      >>> round(float(agc_state.hyperparams["clipping"]), 6)  # the factor at step 0
      0.1

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
      <https://arxiv.org/abs/2102.06171>`_, 2021
    """
    name, factor = _clip_factor_arg(clip_factor, clipping)
    factor = _check_hyperparam(name, factor, low_open=True)
    eps = _check_hyperparam("eps", eps, low_open=False)
    axis = _check_axis(axis)
    _check_mask_arg(mask)

    def init_fn(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        del extra_args
        if params is None:
            raise ValueError(
                "`adaptive_clip` needs the current parameters: call "
                "`update(updates, state, params)`."
            )
        return adaptive_clip_grad(params, updates, factor, eps, mask, axis=axis), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
