"""accumjax: exact, fast gradient accumulation for JAX.

Gradient accumulation as pure ``optax`` transformations with pytree state, Flax
``AccumBatchNorm`` layers (linen and NNX) whose running statistics see the whole
accumulated batch, and a jitted ``make_train_step`` factory (stream or scan, mixed
precision, data parallel with one all-reduce per window). Every entry point runs the
same accumulation window, `accumjax.window`.
"""

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
from accumjax.batch_norm import (
    AccumBatchNorm,
    close_batch_norm_windows,
    convert_batch_norm_variables,
    sync_batch_norm,
)
from accumjax.checkpoint import restore_checkpoint
from accumjax.clipping import (
    adaptive_clip,
    adaptive_clip_grad,
    compute_norm,
    squared_norm,
    unitwise_norm,
)
from accumjax.distributed import count_collectives, data_sharding, replicate, unreplicate
from accumjax.loss_scale import (
    DynamicLossScale,
    adjust_loss_scale,
    all_finite,
    dynamic_loss_scale,
    scale_loss,
    unscale_grads,
    update_loss_scale,
)
from accumjax.nnx_batch_norm import AccumBatchNorm as NNXAccumBatchNorm
from accumjax.nnx_train_step import (
    NNXTrainState,
    NNXTrainStep,
    make_nnx_train_step,
    nnx_train_state,
    nnx_update,
)
from accumjax.planner import (
    MicrobatchPlan,
    compiled_memory_bytes,
    plan_microbatches,
    plan_microbatches_for,
    scan_step_for_k,
)
from accumjax.train_state import TrainState, with_mode
from accumjax.train_step import TrainStep, make_train_step

__version__ = "0.5.0"

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
    "compiled_memory_bytes",
    "compute_norm",
    "convert_batch_norm_variables",
    "count_collectives",
    "data_sharding",
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
    "scan_step_for_k",
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
