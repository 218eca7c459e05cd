"""Data-parallel helpers: a batch sharding for a mesh, and pmap replication.

:func:`data_sharding` shards a batch along its leading axis over a mesh axis (the ``jax.jit``
path); :func:`replicate` and :func:`unreplicate` add and remove the leading device axis of
a ``jax.pmap`` state. Collectives are counted by :mod:`accumjax.collectives`.

Example:
  >>> import jax.numpy as jnp
  >>> from accumjax.distributed import replicate, unreplicate
  >>> state = {"w": jnp.arange(3.0)}
  >>> unreplicate(replicate(state, 2))["w"]
  Array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from accumjax._checks import check_mesh_axis
from accumjax._moved import forward_moved

__all__ = ["data_sharding", "replicate", "unreplicate"]

# Exported by 0.4, exported by accumjax.collectives only now (`count_collectives`): resolved
# with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)


def data_sharding(mesh: Mesh, axis_name: str) -> NamedSharding:
    """Sharding of a batch split along its leading axis over ``axis_name`` of ``mesh``.

    Args:
      mesh: the device mesh.
      axis_name: a mesh axis name.

    Returns:
      ``NamedSharding(mesh, PartitionSpec(axis_name))``.

    Example:
      >>> import jax, numpy as np, accumjax
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> sharding = accumjax.distributed.data_sharding(mesh, "data")
      >>> sharding.spec == jax.sharding.PartitionSpec("data")
      True
    """
    check_mesh_axis(axis_name, mesh)
    return NamedSharding(mesh, PartitionSpec(axis_name))


def replicate(tree: Any, num_devices: int | None = None) -> Any:
    """Stacks ``num_devices`` copies of every leaf along a new leading axis (for ``pmap``).

    Args:
      tree: a pytree of arrays (e.g. a :class:`accumjax.TrainState`).
      num_devices: leading size; defaults to ``jax.local_device_count()``.

    Returns:
      The pytree with each leaf of shape ``(num_devices, *leaf.shape)``.

    Example:
      >>> import jax.numpy as jnp, accumjax
      >>> accumjax.distributed.replicate({"w": jnp.ones(3)}, 2)["w"].shape
      (2, 3)
    """
    # Not flax.jax_utils.replicate(tree, jax.local_devices()[:n]) (flax 0.12.8): it places
    # the copies on the devices (a NamedSharding; here one (n, ...) array stays on the
    # default device and pmap splits it), and it returns other shapes and dtypes: with
    # n > jax.local_device_count() it makes local_device_count copies, not n; with n == 0
    # one per local device (an empty device list means "all"); Python scalar leaves lose
    # their weak type. The pmap tests pass with either (and raise no DeprecationWarning);
    # test_replicate_gives_num_devices_copies_whatever_the_device_count pins the difference.
    n = jax.local_device_count() if num_devices is None else num_devices
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *np.shape(x))), tree)


def unreplicate(tree: Any) -> Any:
    """Takes the first copy of every leaf of a ``pmap``-replicated pytree.

    Args:
      tree: a pytree whose leaves have a leading device axis.

    Returns:
      The pytree with ``leaf[0]`` for every leaf.

    Example:
      >>> import jax.numpy as jnp, accumjax
      >>> accumjax.distributed.unreplicate({"w": jnp.ones((2, 3))})["w"].shape
      (3,)
    """
    # Not flax.jax_utils.unreplicate (flax 0.12.8): it returns leaf[0] for pmap outputs (one
    # row per device along axis 0), NumPy arrays and single-device arrays, but reads the
    # first device's shard of any other leaf on several devices: a fully replicated leaf
    # comes back full-size (shape (n, ...), not leaf[0]); one split otherwise (several rows per
    # device, or along another axis) raises ValueError or comes back as the first device's
    # part only; a 0-d leaf comes back as it is (IndexError here). Pinned by
    # test_unreplicate_takes_leaf_zero_of_pmap_outputs_numpy_and_replicated_arrays. On pmap
    # outputs its shard read is faster, and gives a single-device array where leaf[0] gives
    # one replicated on every device.
    return jax.tree.map(lambda x: x[0], tree)
