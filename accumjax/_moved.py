"""Names a public module exported in 0.4 and no longer does: each still resolves, with a
``DeprecationWarning``, until 0.6 (a module ``__getattr__``, PEP 562). `MOVED` is the one
table of them: names now internal, and names another public module exports instead."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "forward_moved"]

#: The release that removes what 0.5 deprecated.
REMOVED_IN = "0.6"

_WINDOW = ["add_microbatch", "close_window", "denominator", "first_microbatch"]
_WINDOW += ["init_window", "local_window", "saturating_add"]
_WINDOW += ["scaled_gradient", "sum_dtype", "window_sum", "Closed"]
_WINDOW_END = ["check_state", "close_and_apply", "close_and_update", "init_state"]
_MESH = ["check_one_mesh", "data_axis", "device_window", "layout_of", "mesh_difference"]
_MESH += ["mesh_of", "names", "optimizer_state_specs", "sharding_of", "state_specs"]

#: Public module -> {name it exported in 0.4 -> where it lives now: an internal module
#: (``"_window"``), the one public module that exports it (``"collectives"``), or
#: ``"module.new_name"`` where it was renamed}.
MOVED: dict[str, dict[str, str]] = {
    "accumjax.accumulation": {
        "Config": "_config",
        "config_of": "_state",
        "window_closes": "_window_end",
        **dict.fromkeys(_WINDOW_END, "_window_end"),
        "AccumulationState": "accumulation_state",
    },
    "accumjax.accumulation_state": {
        **dict.fromkeys(["CONFIG_ATTR", "config_of"], "_state"),
        "unwrap": "_state.accumulation_state_in",
    },
    "accumjax.batch_norm": {"convert_batch_norm_variables": "batch_norm_convert"},
    "accumjax.distributed": {"count_collectives": "collectives"},
    "accumjax.scaling": dict.fromkeys(
        ["concrete_value", "microbatch_weight", "validate_scaling"], "_scaling"
    ),
    "accumjax.sharded": {
        **dict.fromkeys(_MESH, "_mesh"),
        "Layout": "_mesh.MeshLayout",
        "gather": "_mesh.gather_params",
        "place": "_mesh.lay_out",
    },
    "accumjax.train_state": dict.fromkeys(
        ["MODES", "count_update", "opt_state_for", "unalias"], "_opt_state"
    ),
    "accumjax.window": {
        **dict.fromkeys(_WINDOW, "_window"),
        **dict.fromkeys(["Microbatch", "agreed", "inspect_microbatch"], "_decision"),
        "global_norm": "_norms",
        "run_once": "_control",
        "ON_NONFINITE": "_config",
        "empty_like": "_window.emptied_window",
    },
}


def forward_moved(module: str, retired: Mapping[str, Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each of ``MOVED[module]``'s names from where it
    lives now, warning that ``module`` stops exporting it in 0.6: the warning names the
    public module to import it from, or says it is internal.

    Args:
      module: the public module's name (``__name__``).
      retired: name -> its 0.4 value, for names accumjax no longer reads (no internal
        module holds them): resolved with a warning that says so.

    Returns:
      The function to assign to the module's ``__getattr__``.

    Example:
      >>> import warnings
      >>> get = forward_moved("accumjax.window")
      >>> with warnings.catch_warnings(record=True) as seen:
      ...     warnings.simplefilter("always")
      ...     _ = get("run_once")
      >>> seen[0].category.__name__
      'DeprecationWarning'
    """
    moved = MOVED[module]

    def __getattr__(name: str) -> Any:
        if retired is not None and name in retired:
            warnings.warn(
                f"{module}.{name} is no longer read by accumjax. It leaves {module} in "
                f"{REMOVED_IN}; pin accumjax<{REMOVED_IN} if you build on it.",
                DeprecationWarning,
                stacklevel=2,
            )
            return retired[name]
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new_name = moved[name].partition(".")
        warnings.warn(_moved_message(module, name), DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"accumjax.{where}"), new_name or name)

    return __getattr__


def _moved_message(module: str, name: str) -> str:
    """The warning for ``module.name``: where to import it from when the module that keeps it
    (`MOVED`) is public, that it is internal otherwise."""
    target = MOVED[module][name]
    if target.startswith("_"):
        return (
            f"{module}.{name} is internal (accumjax.{target}, not public API) and leaves "
            f"{module} in {REMOVED_IN}: build on accumjax.accumulate and the public state "
            f"readers instead, or pin accumjax<{REMOVED_IN}."
        )
    where, _, new_name = target.partition(".")
    new_name = new_name or name
    # The top-level spelling too, where the package exports the name.
    top_level = getattr(sys.modules.get("accumjax"), "__all__", ())
    also = f" or accumjax.{new_name}" if new_name in top_level else ""
    return (
        f"{module}.{name} moved: import it from accumjax.{where} "
        f"(accumjax.{where}.{new_name}{also}); "
        f"the old name leaves {module} in {REMOVED_IN}."
    )
