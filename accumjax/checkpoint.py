"""Restoring a train state on another number of devices: `restore_checkpoint`.

A state saved with orbax restores through orbax's own route (``restore(path, target)``) on
the topology that wrote it. A stream-mode window kept per data shard
(`accumjax.window.DeviceWindow`) has one partial sum per device along the data axis, so its
shape follows the number of devices: `restore_checkpoint` restores such a checkpoint on any
number of devices, mid-window or at a window boundary, into the layout of ``target`` (usually
``step.init(...)`` on the new topology, or its abstract form). A window's partial sums add up
to its sum, so moving them is exact up to the order of that addition: on 4 devices each
shard takes the sum of two of 8; on 1 device the one shard takes all 8; from 1 to 8 the
first shard takes the sum and the others start empty. It also moves a window between the
layouts of ``TrainState.create`` (one parameter-shaped sum), ``step.init`` and scan mode (no
window: only at a window boundary).

Orbax (``orbax-checkpoint``) is not a dependency of accumjax: it is imported here, when
called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

import accumjax._window as window_lib
from accumjax._layout import partial_sums_shape
from accumjax._state import every_k_changed, every_k_of_tag

__all__ = ["restore_checkpoint"]

_WINDOWS = (window_lib.Window, window_lib.DeviceWindow)
_SUMS = tuple(window_lib.sums_name(cls) for cls in _WINDOWS)


def _is_window(x: Any) -> bool:
    return isinstance(x, _WINDOWS)


def _key(entry: Any) -> Any:
    """One key path entry as orbax's metadata tree is indexed."""
    for name in ("name", "key", "idx"):
        if hasattr(entry, name):
            value = getattr(entry, name)
            return value if name == "idx" else str(value)
    raise TypeError(f"unsupported key path entry {entry!r}")


def _stored_at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The stored metadata at ``path`` (KeyError/IndexError when absent)."""
    for entry in path:
        tree = tree[_key(entry)]
    return tree


def _sharding(leaf: Any, mesh: Any) -> Sharding | None:
    """``leaf``'s concrete sharding: its own, or its abstract mesh's spec on ``mesh``."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        if mesh is None or tuple(mesh.axis_names) != tuple(sharding.mesh.axis_names):
            raise ValueError(
                "the target's shardings name an abstract mesh (jax.eval_shape gives these): "
                "pass the concrete one, restore_checkpoint(path, target, mesh=mesh), or build "
                "the target with step.init on jax.ShapeDtypeStruct parameters."
            )
        return NamedSharding(mesh, sharding.spec)
    if isinstance(sharding, Sharding):
        return sharding
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def _like(shape: tuple[int, ...], dtype: Any, sharding: Sharding | None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _spec_of(sharding: Any, ndim: int) -> tuple[Any, ...]:
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


class _Plan:
    """What to read from the checkpoint (a tree shaped as stored) and how to turn what was
    read into the target (a function per target leaf or window)."""

    def __init__(self, stored: Any, mesh: Any) -> None:
        self.stored = stored
        self.mesh = mesh
        self.read: dict[tuple[Any, ...], jax.ShapeDtypeStruct] = {}

    def leaf(self, path: tuple[Any, ...], target: Any) -> Callable[[Any], Any]:
        try:
            stored = _stored_at(self.stored, path)
        except KeyError:
            if _key(path[-1]) != "every_k_tag":
                raise
            return self._tag(path, target)
        if target is None or stored is None:
            if (target is None) != (stored is None):
                raise ValueError(_mismatch(path, stored, target))
            return lambda read: None
        sharding = _sharding(target, self.mesh)
        if tuple(stored.shape) != tuple(target.shape):
            raise ValueError(
                _every_k_mismatch(path, stored, target) or _mismatch(path, stored, target)
            )
        self.read[path] = _like(tuple(stored.shape), target.dtype, sharding)
        return lambda read: read[path]

    def _tag(self, path: tuple[Any, ...], target: Any) -> Callable[[Any], Any]:
        """The `accumjax.AccumulationState.every_k_tag` of a checkpoint saved without one (by
        an earlier accumjax): the target's, once the stored ``every_k`` (read with the
        state's other leaves) agrees with the target's int K."""
        every_k = next(p for p in self.read if p[:-1] == path[:-1] and _key(p[-1]) == "every_k")
        sharding = _sharding(target, self.mesh)

        def build(read: Any) -> Any:
            uses = every_k_of_tag(tuple(target.shape)) if len(target.shape) < 2 else None
            made = int(jax.device_get(read[every_k]).flat[0])
            if uses is not None and made != uses:
                raise ValueError(
                    f"the checkpoint does not fit the target: {every_k_changed(made, uses)}"
                )
            return jax.device_put(jnp.zeros(target.shape, target.dtype), sharding)

        return build

    def window(self, path: tuple[Any, ...], target: Any) -> Callable[[Any], Any]:
        stored = _stored_at(self.stored, path)
        counts = {
            name: self.leaf((*path, _Attr(name)), getattr(target, name))
            for name in window_lib.COUNTERS
        }
        name = next((n for n in _SUMS if stored.get(n) is not None), None)
        sums_path = (*path, _Attr(name)) if name else None
        target_sums = window_lib.sums_of(target)
        sums: Callable[[Any], Any]
        if target_sums is None:  # scan mode: no window to move (checked open below)
            sums = lambda read: None
        else:
            per_shard = isinstance(target, window_lib.DeviceWindow)
            sums = self._sums(sums_path, name, target_sums, per_shard)

        def build(read: Any) -> Any:
            values = {n: f(read) for n, f in counts.items()}
            if target_sums is None and name is not None:
                step = int(jax.device_get(values["micro_step"]))
                if step != 0:
                    raise ValueError(
                        f"the checkpoint's window{jax.tree_util.keystr(path)} is open "
                        f"(micro_step == {step}): a scan-mode state has no window to hold its "
                        "partial sums. Restore it into a stream-mode state (step.init of a "
                        "stream step) and finish the window, or use a checkpoint saved at a "
                        "window boundary."
                    )
            return window_lib.retyped(target._replace(**values), type(target), sums(read))

        return build

    def _sums(
        self, path: tuple[Any, ...] | None, name: str | None, target: Any, per_shard: bool
    ) -> Callable[[Any], Any]:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
        makers = [self._sum(path, name, p, t, per_shard) for p, t in leaves]
        return lambda read: jax.tree.unflatten(treedef, [m(read) for m in makers])

    def _sum(
        self, path: Any, name: str | None, sub: Any, target: Any, per_shard: bool
    ) -> Callable[[Any], Any]:
        """One sum leaf: read as stored, then moved into the target's shards."""
        sharding = _sharding(target, self.mesh)
        shape = tuple(target.shape)
        if path is None:  # a scan-mode checkpoint: the window is empty
            return lambda read: jax.device_put(jnp.zeros(shape, target.dtype), sharding)
        full = (*path, *sub)
        stored = _stored_at(self.stored, full)
        stored_shape = tuple(stored.shape)
        stored_shards = name == window_lib.sums_name(window_lib.DeviceWindow)
        old, full_shape = _held(stored_shape, stored_shards)
        new, target_full_shape = _held(shape, per_shard)
        if full_shape != target_full_shape:
            raise ValueError(_mismatch(full, stored, target))
        spec = _spec_of(sharding, len(shape))
        rest = spec[1:] if per_shard else spec
        lead = spec[0] if per_shard and old % new == 0 and new > 1 else None
        read_spec = (lead, *rest) if stored_shards else rest
        mesh = getattr(sharding, "mesh", None)
        read_sharding = sharding if mesh is None else NamedSharding(mesh, PartitionSpec(*read_spec))
        self.read[full] = _like(stored_shape, target.dtype, read_sharding)

        def move(read: Any) -> Any:
            x = read[full]
            total = jnp.sum(x, axis=0) if stored_shards else x
            if not per_shard:
                return jax.device_put(total.astype(target.dtype), sharding)
            if stored_shards and old % new == 0:  # each new shard sums old ones, in place
                grouped = jnp.sum(jnp.reshape(x, (new, old // new, *full_shape)), axis=1)
            else:  # the first shard takes the sum, the others start empty
                grouped = jnp.zeros(shape, target.dtype).at[0].set(total.astype(target.dtype))
            return jax.device_put(grouped.astype(target.dtype), sharding)

        return move


def _held(shape: tuple[int, ...], per_shard: bool) -> tuple[int, tuple[int, ...]]:
    """How many sums a window's sum leaf holds and the parameter's shape: a per-shard
    window's as the layout plan laid them out (`accumjax._layout.partial_sums_shape`), one
    otherwise."""
    return partial_sums_shape(shape) if per_shard else (1, shape)


class _Attr:
    """A key path entry naming a field (as ``jax.tree_util.GetAttrKey``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f".{self.name}"


def _mismatch(path: tuple[Any, ...], stored: Any, target: Any) -> str:
    where = "".join(repr(p) if isinstance(p, _Attr) else jax.tree_util.keystr((p,)) for p in path)
    got = None if stored is None else tuple(stored.shape)
    want = None if target is None else tuple(target.shape)
    return (
        f"state{where}: the checkpoint holds {got}, the target {want}. restore_checkpoint "
        "moves a stream window between numbers of devices and layouts; other leaves must "
        "match. Build the target from the same model and optimizer (a pmap state, with its "
        "leading device axis, restores on the same number of local devices)."
    )


def _every_k_mismatch(path: tuple[Any, ...], stored: Any, target: Any) -> str | None:
    """For an `accumjax.AccumulationState.every_k_tag`, that the checkpoint was made for
    another K; else None (a ``pmap`` state's tags, with their device axis, get the general
    message)."""
    if _key(path[-1]) != "every_k_tag":
        return None
    try:
        made, uses = every_k_of_tag(tuple(stored.shape)), every_k_of_tag(tuple(target.shape))
    except ValueError:
        return None
    return f"the checkpoint does not fit the target: {every_k_changed(made, uses)}"


def _read_tree(read: dict[tuple[Any, ...], Any]) -> dict[Any, Any]:
    """The flat ``read`` plan as the nested dicts and lists orbax restores into."""
    root: dict[Any, Any] = {}
    for path, value in read.items():
        node = root
        for entry in path[:-1]:
            node = node.setdefault(_key(entry), {})
        node[_key(path[-1])] = value
    return root


def _as_stored(node: Any, stored: Any) -> Any:
    """The read plan ``node`` (nested dicts) shaped as the stored tree: its lists as lists,
    and a stored array that is not needed (a window a scan-mode target drops) read on one
    device (orbax's standard checkpointer reads every array)."""
    if isinstance(stored, list | tuple):
        return [_as_stored((node or {}).get(i), s) for i, s in enumerate(stored)]
    if isinstance(stored, dict):
        return {k: _as_stored((node or {}).get(k), v) for k, v in stored.items()}
    if stored is None or node is not None:
        return node
    one = NamedSharding(Mesh(np.array(jax.local_devices()[:1]), ("one",)), PartitionSpec())
    return _like(tuple(stored.shape), stored.dtype, one)


def restore_checkpoint(
    directory: Any, target: Any, *, mesh: Any = None, checkpointer: Any = None
) -> Any:
    """Restores an orbax checkpoint of a train state into ``target``'s layout, on any number
    of devices.

    Args:
      directory: the checkpoint's directory (as given to orbax's ``save``).
      target: the state to restore into: its structure, shapes, dtypes and shardings say
        what is wanted, e.g. ``step.init(params, tx)`` on the new devices (arrays, or
        ``jax.ShapeDtypeStruct`` leaves from ``step.init`` on abstract parameters; nothing of its
        values is read), or ``jax.eval_shape`` of that call with ``mesh``.
      mesh: the concrete mesh for a target whose shardings name an abstract mesh, or whose
        leaves have none (then placed replicated on it); None: the target's own.
      checkpointer: an ``orbax.checkpoint`` checkpointer; ``StandardCheckpointer()`` if
        None.

    Returns:
      The restored state, shaped and placed as ``target``. An open stream window is moved
      between numbers of data shards; between layouts (``TrainState.create``'s one sum, a
      train step's per-shard sums, scan mode's none) it is moved too.

    Raises:
      ValueError: for an open window restored into a scan-mode target, and for any other
        leaf whose stored shape differs from the target's, naming it.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, accumjax
      >>> step = accumjax.make_train_step(lambda p, b: jnp.sum((p["w"] - b) ** 2))
      >>> tx = accumjax.accumulate(optax.sgd(0.25), 2)
      >>> state, _ = step(step.init({"w": jnp.zeros(2)}, tx), jnp.ones(2))  # mid-window
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> with ocp.StandardCheckpointer() as checkpointer:  # waits for the save
      ...     checkpointer.save(path, state)
      >>> restored = accumjax.restore_checkpoint(path, step.init({"w": jnp.zeros(2)}, tx))
      >>> state, _ = step(restored, jnp.ones(2))  # closes the window
      >>> state.params["w"]
      Array([0.5, 0.5], dtype=float32)
    """
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer() if checkpointer is None else checkpointer
    metadata = checkpointer.metadata(directory)
    stored = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    if not isinstance(stored, (dict, list, tuple)):
        raise ValueError(
            f"no saved tree found in {directory}: is the save finished? (orbax saves "
            "asynchronously: call checkpointer.wait_until_finished() or use it as a context "
            "manager before restoring)"
        )
    plan = _Plan(stored, mesh)
    nodes, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: x is None or _is_window(x)
    )
    makers = [
        (plan.window if _is_window(node) else plan.leaf)(tuple(path), node) for path, node in nodes
    ]
    wanted = _as_stored(_read_tree(plan.read), stored)
    restored = checkpointer.restore(directory, wanted)
    read = {path: _stored_at(restored, path) for path in plan.read}
    return jax.tree.unflatten(treedef, [make(read) for make in makers])
