"""What a train step refuses (internal): misuse gets a clear error naming the argument and the
call that works (`init_call`), never a silently wrong run.

`check_accumulate` refuses an `accumjax.accumulate` the step cannot run (another data axis, a
schedule K in scan mode) at ``step.init``, before a call reads its concrete inputs, and at
trace time; `check_weight` a ``weight_fn`` value that is not one scalar, at trace time
(`microbatch_weight_of`: a microbatch's weight, checked).
`check_step_inputs` runs once per trace, in every mode: an optimizer that
accumulates where the step cannot see it (`check_composition`), an ``rng`` that is not one key
or a loss that takes none (`check_key_argument`), self-closing BatchNorm layers, float16
without a loss scale or with ``on_nonfinite="propagate"``. `check_layout` refuses a state laid
out for another mode; `check_init_inputs` refuses at ``step.init`` what the step would refuse
later or ignore.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from accumjax._batch_norm_windows import check_no_self_closing
from accumjax._checks import is_transformation
from accumjax._config import Config
from accumjax._multisteps import check_inner_state
from accumjax._state import (
    APPLY_IF_FINITE_NOTE,
    MULTISTEPS_NOTE,
    Found,
    config_of,
    locate,
    path_string,
)
from accumjax._window import DeviceWindow, window_sum
from accumjax.accumulation_state import AccumulationState
from accumjax.loss_scale import DynamicLossScale

__all__ = [
    "check_accumulate",
    "check_composition",
    "check_init_inputs",
    "check_layout",
    "check_key_argument",
    "check_step_inputs",
    "check_weight",
    "init_call",
    "microbatch_weight_of",
    "positional_limit",
    "requires_key",
]


def check_layout(mode: str, pmap_axis: str | None, acc: AccumulationState) -> AccumulationState:
    """``acc`` if it is laid out for the step (an open window in stream mode, none in scan
    mode; one kept per data shard, `accumjax.window.DeviceWindow`, only under ``jit``), else
    a clear error naming the fix: ``mode`` and ``pmap_axis`` are the step's
    (`accumjax._loop.Setup`'s)."""
    window = acc.window
    per_shard = isinstance(window, DeviceWindow)
    if pmap_axis is not None and per_shard:
        raise ValueError(
            "make_train_step(axis_name=...) without mesh= runs under pmap, whose state is "
            "replicated per device, but this state keeps its stream window per data shard "
            "(step.init of a step under jit). Build it with this step's init: "
            "state = step.init(params, tx)."
        )
    if mode == "stream" and not per_shard and window.grad_sum is None:
        raise ValueError(
            "make_train_step(mode='stream') was given a state built for scan mode "
            "(state.opt_state.window.grad_sum is None): stream mode keeps the open window's "
            "sum between calls. Build the state with this step, state = step.init(params, "
            "tx), or convert it with accumjax.with_mode(state, 'stream')."
        )
    if mode == "scan" and (per_shard or window.grad_sum is not None):
        sums = window_sum(window)
        size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sums))
        raise ValueError(
            "make_train_step(mode='scan') was given a state that holds a stream-mode "
            f"accumulator ({size:,} bytes a shard) that scan mode never reads. Build the state "
            "with this step, state = step.init(params, tx), or convert one you have (e.g. a "
            "stream-mode checkpoint at a window boundary) with accumjax.with_mode(state, 'scan')."
        )
    return acc


def check_accumulate(config: Config | None, mode: str, axis_name: str | None) -> None:
    """Refuses an `accumjax.accumulate` (its ``config``; None for a plain optimizer, which
    every step runs) that a step of ``mode`` on the data axis ``axis_name``
    (``make_train_step``'s) cannot run: one that names another axis, or a schedule K in scan
    mode.

    Example:
      >>> import optax, accumjax
      >>> from accumjax._state import config_of
      >>> tx = accumjax.accumulate(optax.sgd(0.1), lambda count: 2)
      >>> check_accumulate(config_of(tx), "scan", None)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: mode='scan' needs an int K in accumjax.accumulate, not a schedule: ...
    """
    if config is None:
        return
    if config.axis_name not in (None, axis_name):
        raise ValueError(
            f"accumulate(axis_name={config.axis_name!r}) differs from make_train_step's "
            f"axis_name={axis_name!r}; give the axis to make_train_step only."
        )
    if mode == "scan" and config.static_every_k is None:
        raise TypeError(
            "mode='scan' needs an int K in accumjax.accumulate, not a schedule: the step "
            "splits each batch into K microbatches inside its program. For windows of "
            "varying size give the largest K and pass the window's size per call, "
            "step(state, batch, num_real_microbatches=n) (traced: no recompile). Microbatch "
            "i holds the rows i, i + K, i + 2K, ... (strided), so a short batch has its real "
            "rows in the first n of every K rows and padding in the other K - n "
            "(docs/guides/modes.md, 'A short batch'). Or use mode='stream', which takes a "
            "schedule."
        )


def check_step_inputs(
    state: Any, config: Config, rng: Any, loss_positional: int | None, f16: bool
) -> None:
    """Every trace-time check of a step's inputs (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp, optax, accumjax
      >>> state = accumjax.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.MultiSteps(optax.sgd(0.1), 2))
      >>> config = Config(inner=optax.with_extra_args_support(optax.sgd(0.1)), every_k=1)
      >>> check_step_inputs(state, config, None, 2, False)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: tx is or contains optax.MultiSteps ...
    """
    check_composition(state.opt_state, config_of(state.tx) is not None)
    _check_rng(rng)
    check_key_argument(loss_positional, 2 if state.model_state is None else 3, rng)
    if state.model_state is not None:
        check_no_self_closing(state.model_state, "make_train_step")
    if f16:  # an accumjax.NNXTrainState keeps the model's graph: its step takes the model
        _check_float16(
            state.loss_scale, config, "model" if hasattr(state, "graphdef") else "params"
        )


def check_weight(weight: jax.Array) -> jax.Array:
    """``weight``, what ``make_train_step(weight_fn=...)`` returned for one microbatch (as an
    array), if it is one scalar; else a clear error naming ``weight_fn`` (checked at trace
    time, from its shape).

    Example:
      >>> import jax.numpy as jnp
      >>> check_weight(jnp.ones(3))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: weight_fn must return a scalar, got shape (3,): ...
    """
    if weight.shape != ():
        raise ValueError(
            f"weight_fn must return a scalar, got shape {weight.shape}: "
            "make_train_step(weight_fn=fn) weighs each microbatch by one number, fn(microbatch) "
            "-> e.g. its number of real tokens, jnp.sum(microbatch['mask'])."
        )
    return weight


def microbatch_weight_of(weight_fn: Callable[[Any], Any], microbatch: Any) -> jax.Array:
    """One microbatch's weight, ``weight_fn(microbatch)`` checked to be one scalar
    (`check_weight`), as float32: the train step's (`accumjax._loop`) and the host's check of
    a short batch's (`accumjax._host`).

    Example:
      >>> import jax.numpy as jnp
      >>> microbatch_weight_of(lambda b: jnp.sum(b["mask"]), {"mask": jnp.ones(3, jnp.int32)})
      Array(3., dtype=float32)
    """
    return check_weight(jnp.asarray(weight_fn(microbatch))).astype(jnp.float32)


def init_call(f16: bool, first: str = "params") -> str:
    """The ``step.init`` call that builds a step's state, for messages (``first``: what it
    takes first, ``"model"`` for an NNX step).

    Example:
      >>> init_call(True)
      'step.init(params, tx[, loss_scale=accumjax.dynamic_loss_scale(...)])'
    """
    scale = "[, loss_scale=accumjax.dynamic_loss_scale(...)]" if f16 else ""
    return f"step.init({first}, tx{scale})"


def _check_float16(loss_scale: Any, config: Config, first: str) -> None:
    if loss_scale is None:
        raise ValueError(
            "mixed_precision='float16' keeps its dynamic loss scale in the state, but "
            "state.loss_scale is None: build the state with this step, state = "
            f"{init_call(True, first)}: it makes one when loss_scale is left out (and lays "
            "the state out for the step's mode and mesh)."
        )
    _check_detects(config)


def _check_detects(config: Config) -> None:
    if not config.detects:
        raise ValueError(
            "mixed_precision='float16' with accumulate(..., on_nonfinite='propagate'): a "
            "float16 overflow would be applied to the parameters and the loss scale never "
            "lowered. Use on_nonfinite='skip_microbatch' (the default) or 'skip_window'."
        )


def check_init_inputs(
    params: Any, tx: Any, loss_scale: Any, f16: bool, mode: str, axis_name: str | None
) -> None:
    """What ``step.init(params, tx, loss_scale=...)`` refuses (see the module docstring) for
    a step of ``mode`` on the data axis ``axis_name`` (`check_accumulate`).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> check_init_inputs(optax.sgd(0.1), {"w": jnp.zeros(2)}, None, False, "scan", None)
      ... # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: step.init takes the parameters first ...: call step.init(params, tx) (...
    """
    if is_transformation(params) or not is_transformation(tx):
        given = "an optimizer" if is_transformation(params) else f"a {type(params).__name__}"
        raise TypeError(
            "step.init takes the parameters first and the optimizer second: call "
            f"{init_call(f16)} (it was given {given} as params and a {type(tx).__name__} as tx)."
        )
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            "loss_scale must be an accumjax.DynamicLossScale (accumjax.dynamic_loss_scale()), "
            f"got {type(loss_scale).__name__}."
        )
    if loss_scale is not None and not f16:
        raise ValueError(
            "step.init(..., loss_scale=...) is for a step made with "
            "make_train_step(mixed_precision='float16'), which scales the loss; this step "
            "never reads a loss scale (float32 and bfloat16 need none). Leave loss_scale out "
            "of step.init, or make the step with mixed_precision='float16'."
        )
    config = config_of(tx)
    check_accumulate(config, mode, axis_name)
    if config is None:  # an accumulate inside: tx.init's state tells (abstractly)
        check_composition(jax.eval_shape(tx.init, params), accumulating=False)
    if f16 and config is not None:
        _check_detects(config)


def check_composition(opt_state: Any, accumulating: bool) -> None:
    """Refuses an optimizer state that accumulates where the step cannot see it.

    The step reads K and the policies from an `accumjax.accumulate` at the top of ``tx``
    (``accumulating``) and runs any other ``tx`` as a plain optimizer, an update on every call. So
    it refuses, naming the form that works: an ``optax.MultiSteps`` state anywhere; for a
    ``tx`` that is not an ``accumulate``, an `accumjax.AccumulationState` anywhere in its
    state (``optax.chain``, ``optax.masked``, ``optax.multi_transform``,
    ``optax.apply_if_finite``, ``optax.inject_hyperparams`` or a wrapper of the user's own
    around ``accumulate``); for an ``accumulate``, one in its inner state. Every combinator
    is refused: moved inside ``accumulate``, a transformation runs once per window instead of
    on every microbatch, which is the same thing only for some of them.

    Args:
      opt_state: the optimizer state (arrays, or shapes from ``jax.eval_shape(tx.init, ...)``).
      accumulating: whether ``tx`` is an ``accumulate``.

    Example:
      >>> import jax.numpy as jnp, optax, accumjax
      >>> tx = optax.chain(optax.clip(1.0), accumjax.accumulate(optax.sgd(0.1), 4))
      >>> try:
      ...     check_composition(tx.init({"w": jnp.zeros(2)}), accumulating=False)
      ... except TypeError as err:
      ...     print(str(err).split("inside: ")[1].split(";")[0])  # the form that works
      tx = accumjax.accumulate(optax.chain(..., inner), K)
    """
    found = locate(opt_state)
    if locate(opt_state, optax.MultiStepsState):
        also = f" {MULTISTEPS_NOTE}" if accumulating or found else ""  # with accumulate
        raise TypeError(
            "tx is or contains optax.MultiSteps (state.opt_state holds an "
            "optax.MultiStepsState): the train step accumulates by itself and would run it as "
            "a plain optimizer, reporting an update (metrics['updated'], state.step) on every "
            "call while MultiSteps holds its updates back. Use tx=accumjax.accumulate(inner, K) "
            f"in place of optax.MultiSteps(inner, K).{also}"
        )
    if accumulating:
        if isinstance(opt_state, AccumulationState):
            check_inner_state(opt_state.inner_tx_state)
        return
    if found:
        raise TypeError(_buried(found))


def _layers(at: Found) -> list[tuple[str, str | None]]:
    """The combinators around ``at`` (a `accumjax._state.locate` result), outermost first:
    each one's call as written around ``accumulate`` and as it works inside it (None: drop
    it), ``{}`` for what it wraps."""
    keys, nodes = at
    steps = list(zip(nodes[:-1], keys, strict=True))
    layers: list[tuple[str, str | None]] = []
    while steps:
        node, key = steps.pop(0)
        kind = type(node)
        if kind is tuple:
            index = getattr(key, "idx", 0)
            args = ", ".join(["..."] * (index > 0) + ["{}"] + ["..."] * (index < len(node) - 1))
            call = f"optax.chain({args})"
        elif kind is optax.MaskedState:
            call = "optax.masked({}, mask)"
        elif kind is optax.MultiTransformState:
            call = "optax.multi_transform({{label: {}, ...}}, param_labels)"
            del steps[:2]  # its inner_states dict and the optax.masked it makes per label
        elif kind in (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState):
            written = "optax.inject_hyperparams(lambda learning_rate: {})(learning_rate=...)"
            layers.append((written, "optax.inject_hyperparams({})(learning_rate=...)"))
            continue
        elif kind is optax.ApplyIfFiniteState:
            layers.append(("optax.apply_if_finite({}, max_consecutive_errors)", None))
            continue
        else:
            call = "your_wrapper({})"
        layers.append((call, call))
    return layers


def _fill(templates: list[str | None], inner: str) -> str:
    form = inner
    for outer in reversed(templates):
        if outer is None:
            continue
        if outer.startswith("optax.inject_hyperparams(") and form == "inner":
            form = "optax.adam"  # inject_hyperparams takes the optimizer's factory
        form = outer.replace("{}", form, 1).replace("{{", "{").replace("}}", "}")
    return form


def _buried(found: list[Found]) -> str:
    """Why the step refuses ``found`` (`check_composition`), and the form that works."""
    layers = _layers(found[0])
    written = _fill([w for w, _ in layers], "accumjax.accumulate(inner, K)")
    working = _fill([w for _, w in layers], "inner")
    paths = ", ".join(f"state.opt_state{path_string(keys)}" for keys, _ in found)
    held = (
        f"holds one: tx = {written} (its state at {paths})"
        if layers
        else "its state is an accumjax AccumulationState (your own transformation around "
        "accumulate's update, with its state?): pass accumulate itself, tx = "
        "accumjax.accumulate(your_transformation(inner), K)"
    )
    text = (
        f"tx is not accumjax.accumulate but {held}. "
        "The train step reads K and the policies only from an accumulate at the top of tx, "
        "and would run this tx as a plain optimizer, reporting an update "
        "(metrics['updated'], state.step) on every call and, in scan mode, never applying "
        "one. "
    )
    if any(isinstance(node, optax.ApplyIfFiniteState) for node in found[0][1][:-1]):
        text += f"{APPLY_IF_FINITE_NOTE} "
    if working != "inner":
        text += (
            f"Put the other transformations inside: tx = accumjax.accumulate({working}, K); "
            "they then run once per window, on the window's gradient (clipping each "
            "microbatch is accumulate(inner, K, max_norm=...))."
        )
    return text.rstrip()


def _describe(value: Any) -> str:
    """``int32[]``, ``key<fry>[3]``: an array's dtype and shape, or a value's type."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__
    return f"{dtype}{list(shape)}"


def _check_rng(rng: Any) -> None:
    """``rng`` is None, one typed key (shape ``()``) or one raw ``uint32`` key (1-D)."""
    if rng is None:
        return
    dtype, ndim = getattr(rng, "dtype", None), getattr(rng, "ndim", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == jnp.uint32
    if (typed and ndim == 0) or (raw and ndim == 1):
        return
    what = "rng must be None, one key from jax.random.key(seed), or one raw uint32[2] key "
    what += f"from jax.random.PRNGKey(seed); got {_describe(rng)}"
    if (typed and ndim) or (raw and ndim and ndim > 1):
        raise ValueError(
            f"{what}, a batch of keys. Pass one key: the step derives a key for every "
            "microbatch, device and update from it (fold_in of state.step and the indices)."
        )
    seed = dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    raise TypeError(f"{what}.{' For a seed, pass jax.random.key(seed).' if seed else ''}")


#: The kinds of parameter a positional argument binds to.
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def signature_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters, or None when it has no signature (a builtin, say).

    Example:
      >>> [p.name for p in signature_parameters(lambda params, batch: 0)]
      ['params', 'batch']
    """
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def positional_limit(fn: Callable[..., Any]) -> int | None:
    """The most positional arguments ``fn`` takes, or None (``*args``, or no signature).

    Example:
      >>> positional_limit(lambda params, batch, key=None: 0), positional_limit(print)
      (3, None)
    """
    parameters = signature_parameters(fn)
    if parameters is None or any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in POSITIONAL for p in parameters)


def requires_key(fn: Callable[..., Any], n_args: int) -> bool:
    """Whether ``fn`` has more required positional parameters than the ``n_args`` arguments
    of a call without a key (False when it has no signature).

    Example:
      >>> requires_key(lambda params, batch, key: 0, 2), requires_key(lambda p, b, key=None: 0, 2)
      (True, False)
    """
    parameters = signature_parameters(fn)
    if parameters is None:
        return False
    required = [p for p in parameters if p.kind in POSITIONAL and p.default is p.empty]
    return len(required) > n_args


def check_key_argument(limit: int | None, n_args: int, rng: Any) -> None:
    """Refuses ``rng`` for a loss that takes exactly the ``n_args`` arguments of a call
    without a key (``limit``: `positional_limit` of the loss, None to skip the check)."""
    if rng is not None and limit == n_args:
        raise TypeError(
            f"loss_fn takes no key argument but step(...) was given rng={_describe(rng)}; "
            "add a last parameter `key` to loss_fn or call step(state, batch)."
        )
