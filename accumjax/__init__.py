"""accumjax: exact, fast gradient accumulation for JAX.

Gradient accumulation as ``optax`` transformations (`accumulate`), Flax ``AccumBatchNorm``
layers whose statistics see the whole accumulated batch, and a jitted `make_train_step`.
The names whose modules need flax load on first use, so the optax transformation alone
(``import accumjax.accumulation``) does not import flax.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from accumjax._moved import REMOVED_IN
from accumjax.accumulation import accumulate, with_every_k
from accumjax.accumulation_state import (
    AccumulationState,
    AccumulationStats,
    accumulated_gradients,
    has_updated,
    reset,
    should_update,
    stats,
)
from accumjax.checkpoint import restore_checkpoint
from accumjax.clipping import (
    adaptive_clip,
    adaptive_clip_grad,
    compute_norm,
    squared_norm,
    unitwise_norm,
)
from accumjax.distributed import replicate, unreplicate
from accumjax.loss_scale import (
    DynamicLossScale,
    adjust_loss_scale,
    all_finite,
    dynamic_loss_scale,
    scale_loss,
    unscale_grads,
    update_loss_scale,
)

if TYPE_CHECKING:
    from accumjax.batch_norm import (
        AccumBatchNorm,
        close_batch_norm_windows,
        sync_batch_norm,
    )
    from accumjax.batch_norm_convert import convert_batch_norm_variables
    from accumjax.nnx_batch_norm import AccumBatchNorm as NNXAccumBatchNorm
    from accumjax.nnx_train_step import (
        NNXTrainState,
        NNXTrainStep,
        make_nnx_train_step,
        nnx_train_state,
        nnx_update,
    )
    from accumjax.planner import MicrobatchPlan, plan_microbatches, plan_microbatches_for
    from accumjax.train_state import TrainState, with_mode
    from accumjax.train_step import TrainStep, make_train_step

__version__ = "0.5.0"

# The names whose modules import flax, loaded on first access (PEP 562), so that the optax
# transformation (`import accumjax.accumulation`) does not import flax: name -> (module,
# attribute).
_LAZY = {
    "AccumBatchNorm": ("batch_norm", "AccumBatchNorm"),
    "close_batch_norm_windows": ("batch_norm", "close_batch_norm_windows"),
    "convert_batch_norm_variables": ("batch_norm_convert", "convert_batch_norm_variables"),
    "sync_batch_norm": ("batch_norm", "sync_batch_norm"),
    "NNXAccumBatchNorm": ("nnx_batch_norm", "AccumBatchNorm"),
    "NNXTrainState": ("nnx_train_step", "NNXTrainState"),
    "NNXTrainStep": ("nnx_train_step", "NNXTrainStep"),
    "make_nnx_train_step": ("nnx_train_step", "make_nnx_train_step"),
    "nnx_train_state": ("nnx_train_step", "nnx_train_state"),
    "nnx_update": ("nnx_train_step", "nnx_update"),
    "MicrobatchPlan": ("planner", "MicrobatchPlan"),
    "plan_microbatches": ("planner", "plan_microbatches"),
    "plan_microbatches_for": ("planner", "plan_microbatches_for"),
    "TrainState": ("train_state", "TrainState"),
    "with_mode": ("train_state", "with_mode"),
    "TrainStep": ("train_step", "TrainStep"),
    "make_train_step": ("train_step", "make_train_step"),
}

# Top-level names deprecated in 0.5, removed in 0.6: name -> the module that keeps it.
_DEPRECATED = {
    "count_collectives": "collectives",
    "data_sharding": "distributed",
    "compiled_memory_bytes": "planner",
    "scan_step_for_k": "planner",
}


def __getattr__(name: str) -> Any:
    """Loads a flax-dependent public name or a submodule on first access; warns for a
    deprecated name."""
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f"accumjax.{module}"), attribute)
        globals()[name] = value
        return value
    if name in _DEPRECATED:
        path = f"accumjax.{_DEPRECATED[name]}.{name}"
        warnings.warn(
            f"accumjax.{name} is deprecated and will be removed in accumjax {REMOVED_IN}; "
            f"use {path}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f"accumjax.{_DEPRECATED[name]}"), name)
    if not name.startswith("_") and importlib.util.find_spec(f"accumjax.{name}") is not None:
        return importlib.import_module(f"accumjax.{name}")  # a submodule: accumjax.window
    raise AttributeError(f"module 'accumjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (`__all__`) and the module's own attributes."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AccumBatchNorm",
    "AccumulationState",
    "AccumulationStats",
    "DynamicLossScale",
    "MicrobatchPlan",
    "NNXAccumBatchNorm",
    "NNXTrainState",
    "NNXTrainStep",
    "TrainState",
    "TrainStep",
    "accumulate",
    "accumulated_gradients",
    "adaptive_clip",
    "adaptive_clip_grad",
    "adjust_loss_scale",
    "all_finite",
    "close_batch_norm_windows",
    "compute_norm",
    "convert_batch_norm_variables",
    "dynamic_loss_scale",
    "has_updated",
    "make_nnx_train_step",
    "make_train_step",
    "nnx_train_state",
    "nnx_update",
    "plan_microbatches",
    "plan_microbatches_for",
    "replicate",
    "reset",
    "restore_checkpoint",
    "scale_loss",
    "should_update",
    "squared_norm",
    "stats",
    "sync_batch_norm",
    "unitwise_norm",
    "unreplicate",
    "unscale_grads",
    "update_loss_scale",
    "with_every_k",
    "with_mode",
]
