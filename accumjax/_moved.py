"""Names a public module exported in 0.4 and no longer does: each still resolves, with a
``DeprecationWarning``, until 0.6 (a module ``__getattr__``, PEP 562)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REMOVED_IN", "forward_moved"]

#: The release that removes what 0.5 deprecated.
REMOVED_IN = "0.6"


def forward_moved(
    module: str, moved: Mapping[str, str], retired: Mapping[str, Any] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each of ``moved``'s names from the internal
    module it moved to, warning that ``module`` stops exporting it in 0.6.

    Args:
      module: the public module's name (``__name__``).
      moved: name -> the internal module (``"_window"``) that holds it now.
      retired: name -> its 0.4 value, for names accumjax no longer reads (no internal
        module holds them): resolved with a warning that says so.

    Returns:
      The function to assign to the module's ``__getattr__``.

    Example:
      >>> import warnings
      >>> get = forward_moved("accumjax.window", {"run_once": "_window"})
      >>> with warnings.catch_warnings(record=True) as seen:
      ...     warnings.simplefilter("always")
      ...     _ = get("run_once")
      >>> seen[0].category.__name__
      'DeprecationWarning'
    """

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
        warnings.warn(
            f"{module}.{name} is internal since accumjax 0.5 (accumjax.{moved[name]}, not "
            f"public API) and leaves {module} in {REMOVED_IN}: build on accumjax.accumulate and "
            f"the public state readers instead, or pin accumjax<{REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f"accumjax.{moved[name]}"), name)

    return __getattr__
