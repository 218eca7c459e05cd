"""Argument checks shared by every public entry point (internal).

One family, one rule for the error type: a value of the wrong *kind* (a bool where a number
is wanted, a string, a float where an int is wanted) raises ``TypeError``; a value of the
right kind outside its range raises ``ValueError``. Every message names the argument.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.core

__all__ = [
    "INT32_MAX",
    "check_alive",
    "check_axis_bound",
    "check_callable",
    "check_choice",
    "check_int",
    "check_mesh_axis",
    "check_real",
    "is_transformation",
    "raise_on_unknown_kwargs",
]

INT32_MAX = 2**31 - 1


def check_int(name: str, value: Any, low: int = 1, high: int = INT32_MAX) -> int:
    """``value`` as a Python int in ``[low, high]`` (numpy integers welcome, bools not).

    Example:
      >>> check_int("every_k", 4)
      4
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}.")
    value = int(value)
    if not low <= value <= high:
        top = "2**31 - 1" if high == INT32_MAX else str(high)
        raise ValueError(f"{name} must be an int in [{low}, {top}], got {value}.")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """``value`` as a finite Python float in ``[low, high]`` (``(low, high]`` with ``low_open``).

    Bools, strings and arrays are not real numbers here (``TypeError``); NaN, infinities and
    values out of range raise ``ValueError``.

    Example:
      >>> check_real("max_norm", 1, low=0.0, low_open=True)
      1.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and number > high
    if not math.isfinite(number) or below or above:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            bounds.append(f"<= {high:g}")
        where = f" and {' and '.join(bounds)}" if bounds else ""
        raise ValueError(f"{name} must be finite{where}, got {value!r}.")
    return number


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them.

    Example:
      >>> check_choice("mode", "scan", ("stream", "scan"))
      'scan'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}.")
    return value


def check_callable(name: str, value: Any, optional: bool = True) -> Callable[..., Any] | None:
    """``value`` if it is callable (or None, when ``optional``), else ``TypeError``.

    Example:
      >>> check_callable("skip_fn", None) is None
      True
    """
    if (value is None and optional) or callable(value):
        return value
    kind = "callable or None" if optional else "callable"
    raise TypeError(f"{name} must be {kind}, got {type(value).__name__}.")


def check_mesh_axis(axis_name: Any, mesh: Any) -> None:
    """``ValueError`` unless ``axis_name`` is one of ``mesh.axis_names``.

    Example:
      >>> import jax
      >>> check_mesh_axis("data", jax.make_mesh((1,), ("data",)))
      >>> check_mesh_axis("model", jax.make_mesh((1,), ("data",)))
      Traceback (most recent call last):
      ValueError: axis_name 'model' is not an axis of the mesh ('data',).
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")


def raise_on_unknown_kwargs(
    function: str, given: Mapping[str, Any], known: Mapping[str, str]
) -> None:
    """Refuses the keyword arguments in ``given`` (those the signature of ``function`` does not
    take): one ``known`` maps to what to write instead is named with it, any other gets
    Python's own message.

    Example:
      >>> raise_on_unknown_kwargs("f", {}, {"old": "write new= instead."})  # nothing given: passes
      >>> raise_on_unknown_kwargs("f", {"old": 1}, {"old": "write new= instead."})
      Traceback (most recent call last):
      TypeError: f(old=...): write new= instead.
    """
    for name in given:
        if name not in known:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        raise TypeError(f"{function}({name}=...): {known[name]}")


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()


def check_alive(tree: Any, name: str) -> None:
    """Refuses ``tree`` (named ``name`` in the error) when it holds a deleted array: one a
    train step was given and donated, its buffers reused for the state it returned.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(2)
      >>> x.delete()
      >>> try:
      ...     check_alive({"w": x}, "state")
      ... except ValueError as err:
      ...     print(str(err).split(":")[0])
      state['w'] was deleted
    """
    if not any(_deleted(x) for x in jax.tree.leaves(tree)):
        return
    path = next(p for p, x in jax.tree_util.tree_leaves_with_path(tree) if _deleted(x))
    raise ValueError(
        f"{name}{jax.tree_util.keystr(path)} was deleted: a train step was given this state "
        "and donated it (make_train_step(..., donate=True) is the default), its buffers "
        "reused for the state it returned. Use the state the step returns (state, metrics = "
        "step(state, batch)); to keep this one too, build the step with donate=False or "
        "give it a copy (step(jax.tree.map(jnp.copy, state), batch))."
    )


def check_axis_bound(axis_name: str) -> None:
    """Refuses a synchronized layer (``axis_name``) run where no mapped axis of that name is
    bound (outside ``pmap``/``shard_map``: arrays on one device), naming the one-device case
    rather than JAX's "unbound axis name".

    Example:
      >>> check_axis_bound("data")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: AccumBatchNorm(axis_name='data') pools ... one device ...
    """
    try:
        jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"AccumBatchNorm(axis_name={axis_name!r}) pools each call's statistics over the "
            f"mapped axis {axis_name!r}, but no such axis is bound here: the layer runs outside "
            "pmap/shard_map, as on arrays on one device (a train step off any mesh). On one "
            "device there is nothing to pool: build the layer with axis_name=None; or put the "
            "arrays on a one-device mesh, jax.make_mesh((1,), ('data',)) with the batch as "
            "NamedSharding(mesh, P('data')), where make_train_step binds the data axis as on N "
            "devices."
        ) from err


def is_transformation(value: Any) -> bool:
    """Whether ``value`` is an optax transformation (it has callable ``init`` and ``update``).

    Example:
      >>> import optax
      >>> is_transformation(optax.sgd(0.1)), is_transformation({"w": 1.0})
      (True, False)
    """
    return all(callable(getattr(value, name, None)) for name in ("init", "update"))
