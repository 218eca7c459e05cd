"""`TrainState`: the state `accumjax.make_train_step` advances, a pytree the user owns.

Flax's ``flax.training.train_state.TrainState`` with two more fields, the non-trainable model
state (BatchNorm statistics and other mutable collections) and a dynamic loss scale for
float16, and an ``apply_gradients`` whose ``step`` counts applied updates (windows), not
microbatches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

import accumjax._opt_state as opt_state_lib
import accumjax._window as window_lib
from accumjax._checks import check_choice
from accumjax._moved import forward_moved
from accumjax._state import config_of
from accumjax.accumulation_state import AccumulationState
from accumjax.loss_scale import DynamicLossScale

__all__ = ["TrainState", "with_mode"]


# Exported by 0.4, internal now: resolved with a DeprecationWarning until 0.6.
__getattr__ = forward_moved(__name__)


class TrainState(train_state.TrainState):
    """Flax ``TrainState`` plus non-trainable model state and a loss scale.

    Attributes:
      step: number of optimizer updates applied (windows, not microbatches), whichever
        way the state is advanced (``make_train_step`` or ``apply_gradients``).
      apply_fn, params, tx, opt_state: as in ``flax.training.train_state.TrainState``.
      model_state: non-trainable collections (e.g. ``{"batch_stats": ...}``) or
        ``None``; when not ``None`` the loss function receives and returns it.
      loss_scale: a :class:`accumjax.DynamicLossScale`, needed by
        ``mixed_precision="float16"`` (a float16 step refuses a state without one).
    """

    model_state: Any = None
    loss_scale: DynamicLossScale | None = struct.field(pytree_node=True, default=None)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any] | None,
        params: Any,
        tx: optax.GradientTransformation,
        model_state: Any = None,
        loss_scale: DynamicLossScale | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Creates a state with ``step == 0`` and ``opt_state = tx.init(params)``.

        The state of ``apply_gradients`` and of a loop of your own. A train step builds the
        state it takes itself, laid out for its mode, mesh and precision:
        ``step.init(params, tx, model_state=...)`` (`accumjax.make_train_step`); a state from
        here works in stream mode (under ``jit`` on a mesh its gradient is then reduced on
        every call, as in a plain jitted step).

        Args:
          apply_fn: usually ``model.apply`` (kept for convenience; the step never calls it,
            so ``None`` is fine).
          params: the master parameters (float32, or float64 with x64).
          tx: the optimizer: ``accumjax.accumulate(inner, K)`` (a plain optax optimizer is
            a window of one microbatch).
          model_state: non-trainable collections, e.g. ``{"batch_stats": ...}``.
          loss_scale: a dynamic loss scale for float16 training.
          **kwargs: further fields of a subclass.

        Returns:
          A new :class:`TrainState`.

        Example:
          >>> import jax.numpy as jnp, optax, accumjax
          >>> state = accumjax.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))
          >>> int(state.step), state.model_state is None
          (0, True)
        """
        if "mode" in kwargs and "mode" not in cls.__dataclass_fields__:  # a subclass's field
            raise TypeError(
                "TrainState.create takes no mode (removed in accumjax 0.4): the mode is the "
                "step's, stated once in make_train_step(mode=...). Build the state with the "
                "step: state = step.init(params, tx, model_state=...)."
            )
        if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
            raise TypeError(
                "loss_scale must be an accumjax.DynamicLossScale (accumjax.dynamic_loss_scale()), "
                f"got {type(loss_scale).__name__}."
            )
        state = cls(
            step=jnp.zeros((), jnp.int32),
            apply_fn=cast(Callable[..., Any], apply_fn),  # None is fine: the step never calls it
            params=params,
            tx=tx,
            opt_state=tx.init(params),
            model_state=model_state,
            loss_scale=loss_scale,
            **kwargs,
        )
        return opt_state_lib.unalias(state)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """One optimizer call, as flax's; ``step`` grows only when an update was applied.

        Args:
          grads: one microbatch's gradients.
          **kwargs: other fields to replace.

        Returns:
          The new state.

        Example:
          >>> import jax.numpy as jnp, optax, accumjax
          >>> state = accumjax.TrainState.create(
          ...     apply_fn=None, params={"w": jnp.zeros(2)},
          ...     tx=accumjax.accumulate(optax.sgd(0.1), 2))
          >>> state = state.apply_gradients(grads={"w": jnp.ones(2)})
          >>> int(state.step)
          0
        """
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        applied = opt_state.updated if isinstance(opt_state, AccumulationState) else True
        step = jnp.asarray(self.step)
        return self.replace(
            step=optax.safe_increment(step)
            if applied is True
            else opt_state_lib.count_update(step, applied),
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


def with_mode(state: TrainState, mode: str) -> TrainState:
    """``state`` laid out for another mode: the accumulator added (zeros) or dropped.

    Use it for a state built for the other mode (a stream-mode checkpoint, say): restore it
    as it was saved, then ``with_mode(state, "scan")``. A window left open cannot move to
    scan mode (its partial sum would be lost), so a state in the middle of a window is
    refused (when its ``micro_step`` is concrete). Convert an unreplicated state (before
    `accumjax.replicate`). A stream state for a step on a mesh (``step.init``) is best moved
    with `accumjax.restore_checkpoint`, which keeps its layout.

    Args:
      state: an `accumjax.TrainState` (or `accumjax.NNXTrainState`).
      mode: ``"stream"`` or ``"scan"``.

    Returns:
      The state with a zero parameter-shaped stream window (``tx.init``'s) or none (scan);
      the same state when it already is so, or when its optimizer is not an
      `accumjax.accumulate`.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)},
      ...                                    tx=accumjax.accumulate(optax.sgd(0.1), 4))
      >>> accumjax.with_mode(state, "scan").opt_state.window.grad_sum is None
      True
    """
    check_choice("mode", mode, opt_state_lib.MODES)
    config, opt = config_of(state.tx), cast(Any, state.opt_state)
    if config is None:
        return state
    has_sum = window_lib.window_sum(opt.window) is not None
    if has_sum == (mode == "stream"):
        return state
    if jnp.ndim(opt.window.micro_step) != 0:
        raise ValueError(
            "with_mode takes an unreplicated state (its window's micro_step is a scalar); "
            "convert it before accumjax.replicate."
        )
    dtype = config.accumulator_dtype
    if mode == "stream":
        window = window_lib.init_window(state.params, dtype)
        return state.replace(opt_state=opt._replace(window=window, added=jnp.zeros((), bool)))
    try:  # concrete
        open_window = int(opt.window.micro_step) != 0
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        open_window = False
    if open_window:
        raise ValueError(
            "with_mode(state, 'scan'): the state is in the middle of a window "
            f"(opt_state.window.micro_step == {int(opt.window.micro_step)}); its partial sum "
            "would be lost. Finish the window in stream mode first."
        )
    window = window_lib.init_window(None, dtype)
    return state.replace(opt_state=opt._replace(window=window, added=jnp.zeros((), bool)))
