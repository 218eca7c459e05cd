"""An `accumulate`'s static config (internal): the inner transformation, K, the window's
policy, the data axis; and the per-microbatch transformation the policy may apply.

A `Config` is static: part of the program, never of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

import accumjax._scaling as scaling_lib
from accumjax._checks import INT32_MAX, is_transformation

__all__ = [
    "ON_NONFINITE",
    "Config",
    "OnNonfinite",
    "Schedule",
    "SkipFn",
    "check_microbatch_transform",
    "scheduled_k",
    "transform_state",
    "transformed_gradient",
]

OnNonfinite = Literal["skip_microbatch", "skip_window", "propagate"]
ON_NONFINITE: tuple[str, ...] = ("skip_microbatch", "skip_window", "propagate")
SkipFn = Callable[[Any, Any], Any]
Schedule = Callable[[jax.Array], jax.typing.ArrayLike]


def scheduled_k(schedule: Callable[[jax.Array], Any], update_count: jax.Array) -> jax.Array:
    """The K ``schedule`` gives after ``update_count`` updates, as it gives it; a
    ``TypeError`` when it is not an integer.

    Example:
      >>> import jax.numpy as jnp
      >>> int(scheduled_k(lambda n: n + 2, jnp.zeros((), jnp.int32)))
      2
    """
    every_k = jnp.asarray(schedule(update_count))
    if not jnp.issubdtype(every_k.dtype, jnp.integer):
        raise TypeError(f"every_k schedule must return an integer K, got dtype {every_k.dtype}.")
    return every_k


class Config(NamedTuple):
    """Everything static about one `accumulate` transformation: its inner transformation, K,
    how its window treats the microbatches (the policy), its data axis. Read by the window,
    the window end and `make_train_step`.

    Attributes:
      inner: the inner transformation (with extra-args support).
      every_k: K as given: an int, or a schedule.
      axis_name: the mapped axis of the once-per-window reduction and of the decisions about
        each microbatch, or None.
      scaling: ``"mean"``, ``"sum"``, ``"weighted"`` or ``"sum_over_k"`` (see
        `accumjax.scaling`).
      max_norm: clip each microbatch gradient's global norm to this before adding, or None.
      on_nonfinite: ``"skip_microbatch"``, ``"skip_window"`` or ``"propagate"``.
      skip_fn: ``skip_fn(grads, params) -> bool``: the user's reason to skip a microbatch.
      accumulator_dtype: minimum accumulator precision (``None``: the parameters' dtypes).
      microbatch_transform: a stateless optax transformation applied to each microbatch's
        gradient before it is added (`transformed_gradient`), or None. It sees what
        ``max_norm`` and ``skip_fn`` see: the microbatch's gradient as the loss gives it (on
        a mesh the whole microbatch's), before its weight and the window's division.

    Example:
      >>> import optax
      >>> config = Config(inner=optax.with_extra_args_support(optax.sgd(0.1)), every_k=4)
      >>> config.static_every_k, config.scaling, config.detects, config.reads
      (4, 'mean', True, False)
    """

    inner: optax.GradientTransformationExtraArgs
    every_k: int | Schedule
    axis_name: str | None = None
    scaling: scaling_lib.Scaling = "mean"
    max_norm: float | None = None
    on_nonfinite: OnNonfinite = "skip_microbatch"
    skip_fn: SkipFn | None = None
    accumulator_dtype: Any = jnp.float32
    microbatch_transform: optax.GradientTransformation | None = None

    @property
    def static_every_k(self) -> int | None:
        """K when it is an int, else None (a schedule)."""
        return self.every_k if isinstance(self.every_k, int) else None

    def every_k_at(self, update_count: jax.Array) -> jax.Array:
        """K of the window that starts after ``update_count`` updates, int32 (>= 1)."""
        if isinstance(self.every_k, int):
            return jnp.asarray(self.every_k, jnp.int32)
        every_k = scheduled_k(self.every_k, update_count)
        return jnp.clip(every_k, 1, INT32_MAX).astype(jnp.int32)

    @property
    def detects(self) -> bool:
        """Whether non-finite microbatches and sums are looked for."""
        return self.on_nonfinite != "propagate"

    @property
    def reads(self) -> bool:
        """Whether the decision reads the gradient's values (``max_norm``, ``skip_fn``,
        ``microbatch_transform``): on a mesh, the whole microbatch's gradient."""
        readers = (self.max_norm, self.skip_fn, self.microbatch_transform)
        return any(r is not None for r in readers)

    @property
    def waits(self) -> bool:
        """Whether a gradient waits for the decision about it before it is added (a config
        that detects or skips): its window stays clean of what it leaves out. Scan mode adds
        each gradient as it comes instead and decides at the window's end (`close_window`'s
        decisions)."""
        return self.detects or self.skip_fn is not None


def check_microbatch_transform(transform: Any, max_norm: Any) -> None:
    """Refuses a ``microbatch_transform`` that is not an optax transformation, or that comes
    with ``max_norm`` (the same thing twice), naming the fix. (Its state is checked at
    ``init``, where the parameters are known: `transform_state`.)

    Example:
      >>> import optax
      >>> check_microbatch_transform(optax.clip_by_global_norm(1.0), None)
    """
    if transform is None:
        return
    if not is_transformation(transform):
        raise TypeError(
            "microbatch_transform must be an optax GradientTransformation (init and update), "
            f"e.g. accumjax.adaptive_clip(0.01), got {transform!r}."
        )
    if max_norm is not None:
        raise ValueError(
            "give max_norm or microbatch_transform, not both: max_norm=c is "
            "microbatch_transform=optax.clip_by_global_norm(c); to clip by both, chain them: "
            "microbatch_transform=optax.chain(..., optax.clip_by_global_norm(c))."
        )


def transform_state(transform: optax.GradientTransformation, params: Any) -> Any:
    """The state a ``microbatch_transform`` runs with: its ``init(params)``, which must hold
    no array (it runs on every microbatch and keeps nothing between them), else a
    ``ValueError`` naming the fix.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> transform_state(optax.clip_by_global_norm(1.0), {"w": jnp.zeros(2)})
      EmptyState()
    """
    state = transform.init(params)
    kept = jax.tree.leaves(state)
    if kept:
        raise ValueError(
            "microbatch_transform must be stateless (its init state holds no array: clipping "
            "such as optax.clip_by_global_norm or accumjax.adaptive_clip), but its init "
            f"state {type(state).__name__} holds {len(kept)} array(s). It runs on every "
            "microbatch and keeps nothing between them: put a stateful transformation in "
            "the inner optimizer, accumulate(optax.chain(..., inner), K)."
        )
    return state


def transformed_gradient(transform: optax.GradientTransformation, grads: Any, params: Any) -> Any:
    """``transform``'s update of one microbatch's gradient, from its (empty) state:
    ``update(grads, init(params), params)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> clip = optax.clip_by_global_norm(1.0)
      >>> transformed_gradient(clip, {"w": jnp.array([3.0, 4.0])}, None)["w"]
      Array([0.6, 0.8], dtype=float32)
    """
    state = transform_state(transform, grads if params is None else params)
    return transform.update(grads, state, params)[0]
