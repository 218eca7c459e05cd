"""The accumulating train step for Flax NNX models.

:func:`make_nnx_train_step` is :func:`accumjax.make_train_step` for ``nnx.Module`` models:
the same scan and stream modes, mixed precision, data parallelism, per-microbatch keys and
step-closed :class:`accumjax.NNXAccumBatchNorm` windows, with a loss function that takes the
model itself, ``loss_fn(model, batch[, key])``. The state is an :class:`NNXTrainState`: the
model split as ``nnx.split(model, nnx.Param, ...)`` into its graph definition, its
parameters (``params``) and everything else (``model_state``: batch statistics, RNG keys
and counts, other variables). :func:`nnx_train_state` builds it from a model and an
optimizer; :func:`nnx_update` writes a trained state back into a model.

The step merges the model for every microbatch (``nnx.merge(graphdef, params,
model_state)``), calls ``loss_fn`` on it and takes the new model state back with
``nnx.split``, so the model's own mutations (BatchNorm statistics, RNG counts) follow the
window's decisions exactly as ``model_state`` does in :func:`accumjax.make_train_step`.

``nnx.Optimizer`` with :func:`accumjax.accumulate` in a step of your own is the other way
(``docs/guides/nnx.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from accumjax._checks import check_alive
from accumjax._host import TrainStep
from accumjax._step_checks import check_key_argument, positional_limit
from accumjax.loss_scale import DynamicLossScale
from accumjax.train_state import TrainState
from accumjax.train_step import make_train_step

__all__ = ["NNXTrainState", "NNXTrainStep", "make_nnx_train_step", "nnx_train_state", "nnx_update"]


class NNXTrainState(TrainState):
    """An :class:`accumjax.TrainState` that remembers the NNX model's graph definition.

    Create it with :func:`nnx_train_state`; write it back into a model with
    :func:`nnx_update`.

    Attributes:
      graphdef: the model's ``nnx.GraphDef`` (static, not a pytree leaf).
      params: ``nnx.State`` of the model's ``nnx.Param`` variables (what ``tx`` trains).
      model_state: ``nnx.State`` of every other variable (``nnx.BatchStat``, RNG keys and
        counts, ...).
      step, tx, opt_state, loss_scale: as in :class:`accumjax.TrainState` (``step`` counts
        applied updates, i.e. windows).
    """

    graphdef: Any = struct.field(pytree_node=False, default=None)


def _copy(tree: Any) -> Any:
    """Fresh buffers: the step donates the state's, and the model must keep its own."""
    return jax.tree.map(jnp.copy, tree)


def nnx_train_state(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    loss_scale: DynamicLossScale | None = None,
) -> NNXTrainState:
    """Splits ``model`` into a train state: ``nnx.split(model, nnx.Param, ...)``.

    The state holds copies of the model's arrays (the step donates the state's buffers, the
    model keeps its own). The graph definition is taken as the model is now, so put the
    model in training mode first (``model.train()``: a fresh ``nnx.MultiHeadAttention``
    has ``deterministic=None``; see ``nnx.view``).

    Args:
      model: the NNX model.
      tx: the optimizer of the ``nnx.Param`` variables, usually
        ``accumjax.accumulate(inner, K)`` (K is stated once, here).
      loss_scale: a dynamic loss scale for ``mixed_precision="float16"``.

    Returns:
      An :class:`NNXTrainState` with ``step == 0`` and ``opt_state = tx.init(params)``
      (the portable layout of `accumjax.TrainState.create`; a step's own state is
      ``make_nnx_train_step(...).init(model, tx)``).

    Example:
      >>> import optax, accumjax
      >>> from flax import nnx
      >>> from accumjax.nnx_train_step import nnx_train_state
      >>> model = nnx.Sequential(nnx.Linear(3, 16, rngs=nnx.Rngs(0)),
      ...                        accumjax.NNXAccumBatchNorm(16, rngs=nnx.Rngs(0)))
      >>> state = nnx_train_state(model, accumjax.accumulate(optax.sgd(0.1), 2))
      >>> sorted(state.params["layers"][0]), sorted(state.model_state["layers"][1])[:2]
      (['bias', 'kernel'], ['acc_count', 'acc_m2'])
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    state = NNXTrainState.create(
        apply_fn=None,
        params=_copy(params),
        tx=tx,
        model_state=_copy(model_state),
        loss_scale=loss_scale,
        graphdef=graphdef,
    )
    return cast(NNXTrainState, state)


def nnx_update(model: nnx.Module, state: NNXTrainState) -> None:
    """Writes the state's parameters and model state into ``model`` (``nnx.update``).

    The model gets copies, so it stays usable after later steps donate the state. A
    ``pmap`` state (leading device axis) is unreplicated first with
    :func:`accumjax.unreplicate`.

    Args:
      model: the model the state was split from (or one of the same structure).
      state: an :class:`NNXTrainState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from accumjax.nnx_train_step import make_nnx_train_step, nnx_train_state, nnx_update
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> state = nnx_train_state(model, optax.sgd(0.5))
      >>> step = make_nnx_train_step(lambda m, b: jnp.mean(m(b) ** 2))
      >>> state, _ = step(state, jnp.ones((4, 3)))
      >>> nnx_update(model, state)
      >>> bool(jnp.all(model.kernel[...] == state.params["kernel"][...]))
      True
    """
    if not isinstance(state, NNXTrainState):
        raise TypeError(
            f"state must be an accumjax.NNXTrainState (accumjax.nnx_train_state(model, tx)), "
            f"got {type(state).__name__}."
        )
    check_alive(state, "state")
    nnx.update(model, _copy(state.params), _copy(state.model_state))


def _functional_loss(loss_fn: Callable[..., Any], graphdef: Any, has_aux: bool) -> Any:
    """``(params, model_state, batch[, key]) -> (loss, new_model_state[, aux])`` around
    ``loss_fn(model, batch[, key])``: the form :func:`accumjax.make_train_step` takes."""

    def functional(params: Any, model_state: Any, batch: Any, *key: Any) -> Any:
        # copy=True: fresh variables at this trace level, which the model may mutate.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        out = loss_fn(model, batch, *key)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"loss_fn returned {type(out).__name__}; with has_aux=True it "
                            "must return (loss, aux).")  # fmt: skip
        if not has_aux and isinstance(out, tuple):
            raise TypeError("loss_fn returned a tuple; pass has_aux=True for (loss, aux).")
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        if has_aux:
            return out[0], (new_model_state, out[1])
        return out, new_model_state

    return functional


class NNXTrainStep:
    """``step(state, batch, rng=None)``: one :func:`accumjax.make_train_step` per graphdef;
    ``step.init(model, tx)`` builds its state."""

    def __init__(self, loss_fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self._loss_fn = loss_fn
        self._options = options
        self._steps: dict[Any, TrainStep] = {}
        # The functional loss takes ``*key``: the user's loss decides whether rng fits.
        self._positional = positional_limit(loss_fn)

    def _step(self, graphdef: Any) -> TrainStep:
        step = self._steps.get(graphdef)
        if step is None:
            loss = _functional_loss(self._loss_fn, graphdef, self._options.get("has_aux", False))
            step = self._steps[graphdef] = make_train_step(loss, **self._options)
        return step

    def _for(self, state: Any, rng: Any) -> TrainStep:
        if not isinstance(state, NNXTrainState) or state.graphdef is None:
            raise TypeError(
                "make_nnx_train_step's step expects an accumjax.NNXTrainState, got "
                f"{type(state).__name__}; create it with step.init(model, tx)."
            )
        check_key_argument(self._positional, 2, rng)  # loss_fn(model, batch[, key])
        return self._step(state.graphdef)

    def __call__(
        self, state: NNXTrainState, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> tuple[NNXTrainState, dict[str, Any]]:
        return self._for(state, rng)(state, batch, rng, num_real_microbatches)

    def lower(
        self, state: NNXTrainState, batch: Any, rng: Any = None, num_real_microbatches: Any = None
    ) -> Any:
        """``jax.jit(...).lower`` of the step (for `accumjax.collectives.count_collectives`)."""
        return self._for(state, rng).lower(state, batch, rng, num_real_microbatches)

    def layout(self, state: NNXTrainState, batch: Any = None) -> Any:
        """The layout plan the step runs ``state`` with, as `accumjax.TrainStep.layout`."""
        return self._for(state, None).layout(state, batch)

    def init(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        loss_scale: DynamicLossScale | None = None,
    ) -> NNXTrainState:
        """The state this step takes for ``model`` (split as ``nnx.split(model, nnx.Param,
        ...)``), laid out for the step's mode, mesh and precision, as
        `accumjax.TrainStep.init`. The state holds copies of the model's arrays.

        Put the model in training mode first (``model.train()``): the graph definition is
        taken as the model is now.
        """
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
        graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
        state = self._step(graphdef).init(
            params, tx, model_state=model_state, loss_scale=loss_scale
        )
        fields = {f: getattr(state, f) for f in ("step", "params", "tx", "opt_state")}
        return NNXTrainState(
            **fields,
            apply_fn=None,  # pyright: ignore[reportArgumentType]
            model_state=state.model_state,
            loss_scale=state.loss_scale,
            graphdef=graphdef,
        )


def make_nnx_train_step(
    loss_fn: Callable[..., Any],
    **options: Any,
) -> NNXTrainStep:
    """Builds a jitted ``step(state, batch, rng=None) -> (state, metrics)`` for NNX models.

    ``state`` is an :class:`NNXTrainState` (:func:`nnx_train_state`); K and every
    accumulation policy come from its optimizer, ``accumjax.accumulate(inner, K, ...)``.
    The loss function takes the model:

    * ``loss_fn(model, batch) -> loss``, or ``(loss, aux)`` with ``has_aux=True``;
    * with ``step(state, batch, rng)``: ``loss_fn(model, batch, key)``, ``key`` distinct for
      every microbatch, device and update, e.g. for ``model(x, rngs=nnx.Rngs(dropout=key))``
      with ``nnx.Dropout`` and ``nnx.MultiHeadAttention`` layers that take their key at call
      time (``MultiHeadAttention`` takes an ``nnx.Rngs``, not a bare key). (Dropout layers that hold
      their own ``nnx.Rngs`` work without ``rng``: their key and count are model state, a
      fresh key per microbatch, but the same on every data-parallel device.)

    ``model`` is the state merged for one microbatch; what ``loss_fn`` changes in it
    (``nnx.BatchStat`` and any other non-``Param`` variable) becomes the new model state,
    which must keep its structure. Step-driven :class:`accumjax.NNXAccumBatchNorm` windows
    are closed once per window, with the optimizer's decision. Everything else, the
    arguments and ``metrics``, are those of :func:`accumjax.make_train_step`.

    Args:
      loss_fn: ``loss_fn(model, batch[, key])``, see above.
      **options: the keyword arguments of :func:`accumjax.make_train_step` (``mode``,
        ``has_aux``, ``mixed_precision``, ``axis_name``, ``mesh``, ``weight_fn``,
        ``gather_params``, ...), with the same meaning.

    Returns:
      The step (its ``lower`` method lowers it for a given state and batch).

    Raises:
      TypeError: as :func:`accumjax.make_train_step`, and for a state that is not an
        :class:`NNXTrainState`, a ``loss_fn`` output that does not match ``has_aux``, or
        ``rng`` given to a ``loss_fn(model, batch)`` without a key.
      ValueError: as :func:`accumjax.make_train_step`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, accumjax
      >>> from flax import nnx
      >>> from accumjax.nnx_train_step import make_nnx_train_step, nnx_train_state, nnx_update
      >>> class Model(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.linear = nnx.Linear(3, 16, rngs=rngs)
      ...         self.norm = accumjax.NNXAccumBatchNorm(16, rngs=rngs)  # closed by the step
      ...         self.dropout = nnx.Dropout(0.1)  # its key comes with the call
      ...         self.head = nnx.Linear(16, 1, rngs=rngs)
      ...     def __call__(self, x, rngs=None):
      ...         x = self.dropout(nnx.relu(self.norm(self.linear(x))), rngs=rngs)
      ...         return self.head(x)
      >>> model = Model(nnx.Rngs(0))
      >>> def loss_fn(model, batch, key):
      ...     return jnp.mean((model(batch["x"], rngs=nnx.Rngs(dropout=key)) - batch["y"]) ** 2)
      >>> step = make_nnx_train_step(loss_fn, mode="scan")
      >>> state = step.init(model, accumjax.accumulate(optax.adam(1e-2), 4))
      >>> batch = {"x": jnp.ones((64, 3)), "y": jnp.ones((64, 1))}  # 4 microbatches of 16
      >>> state, metrics = step(state, batch, jax.random.key(1))
      >>> int(state.step), bool(metrics["updated"])
      (1, True)
      >>> nnx_update(model, state)  # the model now holds the trained state
      >>> int(model.norm.acc_step[...])  # the BatchNorm window was closed
      0
    """
    make_train_step(loss_fn, **options)  # checks loss_fn and the options here, once
    return NNXTrainStep(loss_fn, options)
