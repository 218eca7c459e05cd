"""Converting a ``BatchNorm`` model's variables for the same model with ``AccumBatchNorm``.

:func:`convert_batch_norm_variables` adds the window accumulators (and, for step-driven
layers, the ``momentum`` scalar) that :class:`accumjax.batch_norm.AccumBatchNorm` keeps in
``batch_stats`` next to ``mean`` and ``var``, and renames Flax's automatic layer names
``BatchNorm_<i>`` to ``AccumBatchNorm_<i>``; the other functions here are its helpers. It is
also exported as ``accumjax.convert_batch_norm_variables``.
"""

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax.core import FrozenDict

from accumjax._batch_norm_math import (
    ACCUMULATOR_NAMES,
    MOMENTUM_NAME,
    check_config,
    empty_stats_window,
    stats_window_values,
)

__all__ = ["convert_batch_norm_variables"]

# Flax's automatic names: "<class name>_<index within the parent>".
_AUTO_NAME = re.compile(r"(Accum)?BatchNorm_(\d+)")


def _is_batch_norm_stats(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is one layer's ``batch_stats`` (array leaves ``mean`` and ``var``)."""
    return all(key in node and not isinstance(node[key], Mapping) for key in ("mean", "var"))


def _path_string(path: tuple[Any, ...]) -> str:
    """A readable ``batch_stats/...`` path."""
    return "/".join(["batch_stats", *map(str, path)])


def _layer_paths(node: Mapping[str, Any], path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of all BatchNorm layers (``mean`` and ``var`` leaves) in a ``batch_stats``."""
    if _is_batch_norm_stats(node):
        return [path]
    found = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += _layer_paths(value, (*path, key))
    return found


def _auto_named(layers: list[tuple[Any, ...]], parent: tuple[Any, ...]) -> list[str]:
    """Keys of the automatically named (Accum)BatchNorm layers directly under ``parent``."""
    keys = [p[-1] for p in layers if p and p[:-1] == parent]
    return [k for k in keys if isinstance(k, str) and _AUTO_NAME.fullmatch(k)]


def _index(key: str) -> int:
    """The index in an automatic name ``BatchNorm_<i>``."""
    return int(key.rsplit("_", 1)[1])


def _default_renames(layers: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, str]]:
    """``BatchNorm_<i>`` -> ``AccumBatchNorm_<i>`` in every parent (a full swap)."""
    renames: dict[tuple[Any, ...], dict[str, str]] = {}
    for parent in dict.fromkeys(p[:-1] for p in layers if p):
        keys = _auto_named(layers, parent)
        if any(k.startswith("Accum") for k in keys) and any(k.startswith("Batch") for k in keys):
            raise ValueError(
                f"{_path_string(parent)} holds both BatchNorm_* and AccumBatchNorm_* layers "
                f"{keys}; "
                "pass target= (the new model's init variables) to map them."
            )
        renames[parent] = {k: f"Accum{k}" for k in keys if k.startswith("Batch")}
    return renames


def _target_renames(
    layers: list[tuple[Any, ...]], target_layers: list[tuple[Any, ...]]
) -> dict[tuple[Any, ...], dict[str, str]]:
    """Maps auto-named layers to the target's, parent by parent, in creation order."""
    renames: dict[tuple[Any, ...], dict[str, str]] = {}
    for parent in dict.fromkeys(p[:-1] for p in layers + target_layers if p):
        source, wanted = _auto_named(layers, parent), _auto_named(target_layers, parent)
        if sorted(source) == sorted(wanted):
            continue
        if len(source) != len(wanted) or any(k.startswith("Accum") for k in source):
            raise ValueError(
                f"{_path_string(parent)}: cannot match the unnamed norm layers of variables "
                f"{sorted(source)} with those of target {wanted}: the models differ."
            )
        for family in ("BatchNorm_", "AccumBatchNorm_"):
            indices = [_index(k) for k in wanted if k.startswith(family)]
            if indices != list(range(len(indices))):
                raise ValueError(
                    f"{_path_string(parent)}: target's {family}* keys {wanted} are not in creation "
                    "order; pass the dict returned by an eager model.init, unsorted."
                )
        renames[parent] = dict(zip(sorted(source, key=_index), wanted, strict=True))
    return renames


def _renamed(
    node: Any, renames: Mapping[tuple[Any, ...], Mapping[str, str]], path: tuple[Any, ...] = ()
) -> Any:
    """A plain-dict copy of ``node`` with keys renamed per parent path."""
    if not isinstance(node, Mapping):
        return node
    names = renames.get(path, {})
    return {
        names.get(key, key): _renamed(value, renames, (*path, key)) for key, value in node.items()
    }


def _with_accumulators(
    node: Mapping[str, Any], momentum: float | None, path: tuple[Any, ...] = ()
) -> dict[str, Any]:
    """Copies a ``batch_stats`` subtree, adding missing accumulators (and ``momentum``)."""
    if _is_batch_norm_stats(node):
        mean, var = jnp.asarray(node["mean"]), jnp.asarray(node["var"])
        if mean.shape != var.shape:
            raise ValueError(
                f"{_path_string(path)}: mean {mean.shape} and var {var.shape} shapes differ."
            )
        fresh = stats_window_values(empty_stats_window(mean.shape))
        if momentum is not None:
            fresh[MOMENTUM_NAME] = jnp.asarray(momentum, jnp.float32)
        return {**fresh, **node}
    return {
        key: _with_accumulators(value, momentum, (*path, key))
        if isinstance(value, Mapping)
        else value
        for key, value in node.items()
    }


def _overlay(source: Any, target: Any, path: str, fill: tuple[str, ...]) -> dict[str, Any]:
    """``target``'s structure with ``source``'s leaves; only ``fill`` names may be missing."""
    extra = [key for key in source if key not in target]
    if extra:
        raise ValueError(f"{path}/{extra[0]} is in variables but not in target.")
    out = {}
    for key, want in target.items():
        where = f"{path}/{key}"
        have = source.get(key)
        if key not in source:
            if key not in fill:
                raise ValueError(f"{where} is in target but not in variables.")
            out[key] = want
        elif isinstance(want, Mapping) != isinstance(have, Mapping):
            raise ValueError(f"{where} is a layer in one tree and a leaf in the other.")
        elif isinstance(want, Mapping):
            out[key] = _overlay(have, want, where, fill)
        elif jnp.shape(have) != jnp.shape(want):
            raise ValueError(
                f"{where}: shape {jnp.shape(have)} in variables, {jnp.shape(want)} in target."
            )
        else:
            out[key] = have
    return out


def _batch_stats(variables: Any, name: str) -> Mapping[str, Any]:
    """The ``batch_stats`` collection of ``variables``, checked."""
    if not isinstance(variables, Mapping) or "batch_stats" not in variables:
        raise ValueError(f"{name} must be a mapping with a 'batch_stats' collection.")
    batch_stats = variables["batch_stats"]
    if not isinstance(batch_stats, Mapping):
        raise ValueError(f"{name}['batch_stats'] must be a mapping.")
    return batch_stats


def convert_batch_norm_variables(
    variables: Mapping[str, Any],
    *,
    momentum: float | None = 0.99,
    target: Mapping[str, Any] | None = None,
) -> Mapping[str, Any]:
    """Converts a ``BatchNorm`` model's variables for the same model with ``AccumBatchNorm``.

    Every ``batch_stats`` subtree that holds ``mean`` and ``var`` arrays (one
    :class:`flax.linen.BatchNorm` layer) gets zeroed accumulators ``acc_count``,
    ``acc_mean`` and ``acc_m2`` (shaped like ``mean``, float32 or float64 with
    ``jax_enable_x64``) and an int32 ``acc_step``; ``scale``, ``bias``, ``mean``, ``var``
    and every other collection keep their values. Layer names:

    - explicit names are kept (``nn.BatchNorm(name="bn")`` -> ``AccumBatchNorm(name="bn")``);
    - automatic names ``BatchNorm_<i>`` become ``AccumBatchNorm_<i>`` in both ``params``
      and ``batch_stats``. Flax numbers unnamed submodules per class within each parent, so
      this is exact when every ``BatchNorm`` of the model is swapped.
    - When only some are swapped, pass ``target``: the new model's variables from an
      eager ``model.init`` (its key order is the creation order; ``jax.jit(model.init)``
      sorts keys). Within each parent the unnamed layers are matched in creation order,
      the result gets ``target``'s ``params`` and ``batch_stats`` structure (missing
      accumulators and ``momentum`` come from ``target``), and any mismatch (layer
      counts, names, shapes) raises a ``ValueError``.

    Without ``target``, ``momentum`` decides the layout: a float adds the float32 scalar
    ``momentum`` that step-driven layers (``accum_steps=None``, the default) keep in
    ``batch_stats``; ``None`` adds none, for self-closing layers (an int ``accum_steps``).
    A step-driven layer rewrites the scalar from its own ``momentum`` attribute on every
    training call, so its value only matters for a window closed before any call (an
    empty window, which changes nothing). With ``target``, ``momentum`` is not used.
    Entries already present are kept, so converting twice is harmless. The input is not
    modified.

    Args:
      variables: the variables of a model built with ``nn.BatchNorm`` (a dict or a
        ``FrozenDict`` with a ``batch_stats`` collection).
      momentum: the ``momentum`` scalar to add to each layer, or None for none.
      target: optional variables of the new model, to map a partial swap exactly.

    Returns:
      A new variables mapping of the same kind (``FrozenDict`` in, ``FrozenDict`` out).

    Raises:
      ValueError: if there is no ``batch_stats`` collection, it holds no layer with
        ``mean`` and ``var``, a layer's ``mean`` and ``var`` shapes differ, automatic
        names are ambiguous without ``target``, or ``variables`` cannot be matched with
        ``target``.

    Example::

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from accumjax import AccumBatchNorm, convert_batch_norm_variables
      >>> x = jnp.ones((4, 3))
      >>> old = nn.BatchNorm(use_running_average=True).init(jax.random.key(0), x)
      >>> new = convert_batch_norm_variables(old)
      >>> sorted(new["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'momentum', 'var']
      >>> y = AccumBatchNorm(use_running_average=True).apply(new, x)
      >>> sorted(convert_batch_norm_variables(old, momentum=None)["batch_stats"])
      ['acc_count', 'acc_m2', 'acc_mean', 'acc_step', 'mean', 'var']
    """
    batch_stats = _batch_stats(variables, "variables")
    layers = _layer_paths(batch_stats)
    if not layers:
        raise ValueError("variables['batch_stats'] holds no BatchNorm layer ('mean' and 'var').")
    if momentum is not None:
        check_config(None, momentum)
    if target is None:
        renames = _default_renames(layers)
    else:
        renames = _target_renames(layers, _layer_paths(_batch_stats(target, "target")))
    converted = {
        key: _renamed(value, renames) if key in ("params", "batch_stats") else value
        for key, value in variables.items()
    }
    if target is None:
        converted["batch_stats"] = _with_accumulators(converted["batch_stats"], momentum)
    else:
        fills = {"params": (), "batch_stats": (*ACCUMULATOR_NAMES, MOMENTUM_NAME)}
        for name, fill in fills.items():
            converted[name] = _overlay(converted.get(name, {}), target.get(name, {}), name, fill)
    return FrozenDict(converted) if isinstance(variables, FrozenDict) else converted
