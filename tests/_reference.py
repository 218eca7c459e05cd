"""Fixed references the tests share: what each accumulation policy must make of a window,
computed by hand in float64 NumPy (no accumjax, no JAX).

The model is linear regression, ``pred = x @ w + b``, with a masked squared loss: per row
``e_r = sum_o (pred_ro - y_ro)**2``, the microbatch's loss ``sum_r m_r e_r / sum_r m_r`` (a
mean, the default) or ``sum_r m_r e_r`` (``total=True``, for ``scaling="sum"``). Its gradient
is closed-form: with ``d = 2 m[:, None] (pred - y) / sum(m)`` (without the division for a
total), ``dw = x.T @ d`` and ``db = sum_r d_r``. A NaN target ``y[r, o]`` makes column ``o``
of ``dw`` and ``db[o]`` NaN and leaves the other column finite, as JAX's gradient does.

`window` applies a policy of `accumjax.accumulate` to K microbatches as its documentation
states: a microbatch with a NaN/Inf gradient is left out (``"skip_microbatch"``) or drops the
window (``"skip_window"``) or is added as it is (``"propagate"``); each kept microbatch is
clipped to ``max_norm`` by its own global norm; ``skip_norm`` stands for a ``skip_fn`` that
skips a microbatch whose whole gradient's norm exceeds it; the sum of the kept ones is divided
by their number (``"mean"``: the mean of the microbatches used), 1 (``"sum"``), K
(``"sum_over_k"``, kept or not) or their weight, ``sum m`` (``"weighted"``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax

FEATURES, OUTPUTS = 8, 2


def policies(max_norm: float, skip_norm: float) -> dict[str, dict[str, Any]]:
    """``accumulate``'s keyword arguments of each policy the tests check against the
    reference, by name: the non-finite policies, the scalings, ``max_norm`` and a ``skip_fn``
    that skips a microbatch whose gradient's norm is above ``skip_norm``."""
    return {
        "skip_microbatch": {},
        "skip_window": {"on_nonfinite": "skip_window"},
        "propagate": {"on_nonfinite": "propagate"},
        "sum_over_k": {"scaling": "sum_over_k"},
        "sum": {"scaling": "sum"},
        "weighted": {"scaling": "weighted"},
        "max_norm": {"max_norm": max_norm},
        "skip_fn": {"skip_fn": lambda g, p: optax.tree.norm(g) > skip_norm},
    }


def problem(rows: int, seed: int = 0) -> tuple[dict, dict]:
    """float32 parameters ``{"w": (8, 2), "b": (2,)}`` and a batch ``{"x", "y", "m"}`` of
    ``rows`` rows (``m``: every row weighs 1)."""
    rng = np.random.default_rng(seed)
    params = {
        "w": rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32),
        "b": rng.normal(size=OUTPUTS).astype(np.float32),
    }
    batch = {
        "x": rng.normal(size=(rows, FEATURES)).astype(np.float32),
        "y": rng.normal(size=(rows, OUTPUTS)).astype(np.float32),
        "m": np.ones(rows, np.float32),
    }
    return params, batch


def loss(params: Any, batch: Any, total: bool = False) -> Any:
    """The loss the train step differentiates (JAX): the masked mean (or total) squared error."""
    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)
    summed = jnp.sum(err * batch["m"])
    return summed if total else summed / jnp.sum(batch["m"])


def total_loss(params: Any, batch: Any) -> Any:
    """`loss` with ``total=True``: the loss for ``scaling="sum"``."""
    return loss(params, batch, total=True)


def _wide(tree: dict) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def value_and_grad(params: dict, batch: dict, total: bool = False) -> tuple[float, dict]:
    """`loss` and its gradient in float64 NumPy, closed-form."""
    p, b = _wide(params), _wide(batch)
    residual = b["x"] @ p["w"] + p["b"] - b["y"]
    scale = 1.0 if total else 1.0 / np.sum(b["m"])
    value = float(np.sum(np.sum(residual**2, axis=-1) * b["m"]) * scale)
    with np.errstate(invalid="ignore"):  # NaN targets: NaN gradients, as JAX's
        d = 2.0 * scale * b["m"][:, None] * residual
        return value, {"w": b["x"].T @ d, "b": np.sum(d, axis=0)}


def global_norm(tree: dict) -> float:
    return float(np.sqrt(sum(np.sum(np.square(v)) for v in tree.values())))


def microbatches(batch: dict, k: int) -> list[dict]:
    """The K strided microbatches of ``batch`` (microbatch i holds rows i, i + K, ...), as the
    scan step splits a batch."""
    return [{key: v[i::k] for key, v in batch.items()} for i in range(k)]


class Window(NamedTuple):
    """What a policy must make of one window.

    Attributes:
      gradient: the window gradient the inner optimizer sees (float64), None when the window
        is not applied.
      loss: the scan step's loss metric, the mean of the added microbatches' losses weighted
        by their weights (NaN when none is added).
      losses: each microbatch's loss (the stream step's loss metric, call by call).
      counts: `accumjax.stats`' counts after the window: ``num_nonfinite``,
        ``skipped_microbatches``, ``skipped_windows``, ``total_cycles``.
    """

    gradient: dict | None
    loss: float
    losses: list[float]
    counts: dict[str, int]

    @property
    def grad_norm(self) -> float:
        """The metric ``grad_norm`` of the closing call (0.0 without an update)."""
        return 0.0 if self.gradient is None else global_norm(self.gradient)

    def params_after(self, params: dict, lr: float) -> dict:
        """``params`` after one SGD step of ``lr`` on the window gradient (float64)."""
        p = _wide(params)
        if self.gradient is None:
            return p
        return {k: p[k] - lr * self.gradient[k] for k in p}


def window(params: dict, micro: list[dict], **policy: Any) -> Window:
    """The reference for one window of ``micro`` (the model's microbatches, ``"m"`` their
    rows' weights) under a policy of `accumjax.accumulate`, from ``params``; ``policy``:
    `window_of`'s keywords ``scaling``, ``max_norm``, ``on_nonfinite`` and ``skip_norm``."""
    total = policy.get("scaling") == "sum"
    values, grads = zip(*(value_and_grad(params, mb, total) for mb in micro), strict=True)
    weights = [float(np.sum(np.asarray(mb["m"], np.float64))) for mb in micro]
    return window_of(list(grads), losses=list(values), weights=weights, **policy)


def window_of(
    grads: list[dict],
    *,
    losses: list[float] | None = None,
    weights: list[float] | None = None,
    scaling: str = "mean",
    max_norm: float | None = None,
    on_nonfinite: str = "skip_microbatch",
    skip_norm: float | None = None,
) -> Window:
    """The reference for one window of K microbatch gradients ``grads`` (their ``losses``,
    and their ``weights`` for ``"weighted"``), as `window` (``skip_norm``: a ``skip_fn``
    skipping a microbatch whose gradient's global norm exceeds it)."""
    losses = [float("nan")] * len(grads) if losses is None else losses
    weights = [1.0] * len(grads) if weights is None else weights
    nonfinite = skipped = 0
    kept = []
    for grad, value, weight in zip(grads, losses, weights, strict=True):
        grad = _wide(grad)
        norm = global_norm(grad)
        if on_nonfinite != "propagate" and not np.isfinite(norm):
            nonfinite, skipped = nonfinite + 1, skipped + 1
            continue
        if skip_norm is not None and norm > skip_norm:
            skipped += 1
            continue
        clip = 1.0 if max_norm is None else min(1.0, max_norm / norm)
        kept.append((weight if scaling == "weighted" else 1.0, clip, grad, value))
    total = sum(w for w, _, _, _ in kept)
    denominator = {"mean": len(kept), "sum": 1.0, "sum_over_k": len(grads), "weighted": total}
    gradient = None
    if kept and total > 0:
        names = kept[0][2]
        gradient = {
            k: sum(w * c * g[k] for w, c, g, _ in kept) / denominator[scaling] for k in names
        }
        finite = np.isfinite(global_norm(gradient))
        dropped = on_nonfinite == "skip_window" and nonfinite > 0
        if dropped or (not finite and on_nonfinite != "propagate"):
            gradient = None
    loss = sum(w * v for w, _, _, v in kept) / total if total > 0 else float("nan")
    counts = {
        "num_nonfinite": nonfinite,
        "skipped_microbatches": skipped,
        "skipped_windows": int(gradient is None),
        "total_cycles": int(gradient is not None),
    }
    return Window(gradient, loss, list(losses), counts)


# ----------------------------------------------------------------------------- an MLP


def mlp_loss(params: Any, batch: Any) -> Any:
    """The mean squared error (JAX) of the one-hidden-layer MLP ``tanh(x @ w1 + b1) @ w2`` on
    ``batch["x"]`` against ``batch["y"]``."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def mlp_params(
    rng: np.random.Generator, sizes: tuple[int, int, int], scales: tuple[float, float]
) -> dict:
    """float32 parameters of `mlp_loss`'s MLP of ``sizes`` (inputs, hidden, outputs): ``w1``
    then ``w2`` drawn from ``rng``'s standard normal and multiplied by ``scales``, ``b1``
    zeros."""
    inputs, hidden, outputs = sizes
    return {
        "w1": rng.normal(size=(inputs, hidden)).astype(np.float32) * scales[0],
        "b1": np.zeros(hidden, np.float32),
        "w2": rng.normal(size=(hidden, outputs)).astype(np.float32) * scales[1],
    }


def mlp_problem(
    rows: int, sizes: tuple[int, int, int], scales: tuple[float, float]
) -> tuple[dict, dict]:
    """`mlp_params` drawn from seed 0, then a float32 batch of ``rows`` rows of standard
    normal inputs ``x`` and targets ``y``."""
    rng = np.random.default_rng(0)
    params = mlp_params(rng, sizes, scales)
    batch = {
        "x": rng.normal(size=(rows, sizes[0])).astype(np.float32),
        "y": rng.normal(size=(rows, sizes[2])).astype(np.float32),
    }
    return params, batch


# ----------------------------------------------------------------------------- GradientAccumulator

# GradientAccumulator v0.5.2 (andreped/GradientAccumulator, TensorFlow), as its source reads:
# `GradientAccumulateModel.train_step` (accumulators.py) takes the gradient of each
# microbatch's loss divided by accum_steps, clips it with `agc.adaptive_clip_grad` when
# use_agc=True (clip_factor 0.01, eps 1e-3 by default), adds it to the accumulator and applies
# the sum every accum_steps calls. `agc.unitwise_norm` reduces nothing for rank 0-1 (one unit),
# axis 0 for rank 2 and 3, axes (0, 1, 2) for rank 4 and (0, 1, 2, 3) for rank 5.


def ga_unitwise_norm(x: np.ndarray) -> np.ndarray:
    """`agc.unitwise_norm` of GradientAccumulator v0.5.2, in float64."""
    axes = {0: None, 1: None, 2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}[x.ndim]
    return np.sqrt(np.sum(np.square(x), axis=axes, keepdims=axes is not None))


def ga_adaptive_clip_grad(params: dict, grads: dict, clip_factor: float, eps: float) -> dict:
    """`agc.adaptive_clip_grad` of GradientAccumulator v0.5.2, in float64: a unit whose
    gradient norm is not below ``clip_factor * max(|param unit|, eps)`` is scaled to it."""
    out = {}
    for k, g in grads.items():
        limit = np.maximum(ga_unitwise_norm(params[k]), eps) * clip_factor
        norm = ga_unitwise_norm(g)
        out[k] = np.where(norm < limit, g, g * (limit / np.maximum(norm, 1e-6)))
    return out


def ga_agc_training(
    params: dict, windows: list[list[dict]], lr: float, clip_factor: float, eps: float
) -> tuple[dict, float]:
    """``GradientAccumulateModel(accum_steps=K, use_agc=True, clip_factor, eps)`` with plain
    SGD of ``lr`` over ``windows`` (each a list of K microbatches of `loss`): per microbatch
    the gradient of ``loss / K``, clipped, summed; one SGD step a window. Returns the float64
    parameters and the fraction of gradient entries clipping changed (a test checks that
    clipping happened, and not everywhere)."""
    p, clipped, entries = _wide(params), 0, 0
    for micro in windows:
        k = len(micro)
        total = {name: np.zeros_like(v) for name, v in p.items()}
        for mb in micro:
            grad = {name: g / k for name, g in value_and_grad(p, mb)[1].items()}
            agc = ga_adaptive_clip_grad(p, grad, clip_factor, eps)
            clipped += sum(int(np.sum(agc[n] != grad[n])) for n in grad)
            entries += sum(g.size for g in grad.values())
            total = {name: total[name] + agc[name] for name in p}
        p = {name: p[name] - lr * total[name] for name in p}
    return p, clipped / entries
