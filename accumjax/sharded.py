"""The layout of a train step's call on a mesh: `MeshLayout`, what ``step.layout(state)``
returns and ``accumjax.stats(state, layout=...)`` reads (the mesh, its data axis, each
parameter leaf's row of the layout plan).

Example:
  >>> import accumjax.sharded
  >>> accumjax.sharded.MeshLayout._fields[:2]
  ('mesh', 'axis')
"""

from __future__ import annotations

from accumjax._mesh import MeshLayout
from accumjax._moved import forward_moved

__all__ = ["MeshLayout"]

# Exported by 0.4, internal now: resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)
