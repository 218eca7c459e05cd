"""optax.MultiSteps' names, and where accumjax has them (internal).

A user moving from ``optax.MultiSteps`` writes its argument names, its ``should_skip_update_fn``
functions and its attributes; each gets an error that names the accumjax replacement, as the
migration table (docs/guides/migrating.md) has it. `Transformation` is the type
`accumjax.accumulate` returns: optax's ``GradientTransformationExtraArgs`` whose missing
attributes that ``MultiSteps`` has say where accumjax keeps them.
"""

from __future__ import annotations

import functools
from typing import Any

import optax

from accumjax._state import MULTISTEPS_NOTE, locate, path_string

__all__ = [
    "MULTISTEPS_ARGS",
    "MULTISTEPS_ATTRS",
    "Transformation",
    "check_inner",
    "check_inner_state",
    "check_skip_fn",
]

_GUIDE = "(docs/guides/migrating.md, 'From optax.MultiSteps')"
_SKIP_NOT_FINITE = (
    "non-finite microbatches are skipped by default (on_nonfinite='skip_microbatch'; "
    "'skip_window' drops the whole window), counted, and the window goes on"
)

#: optax.MultiSteps' arguments and what `accumulate` takes instead.
MULTISTEPS_ARGS = {
    "every_k_schedule": "optax.MultiSteps' name; accumulate takes K, an int or a schedule "
    f"update_count -> K, as every_k: accumulate(inner, every_k=k) {_GUIDE}.",
    "use_grad_mean": "optax.MultiSteps' name; write scaling='mean' for use_grad_mean=True, "
    "scaling='sum' for False (also 'sum_over_k' and 'weighted') " + _GUIDE + ".",
    "should_skip_update_fn": "optax.MultiSteps' name. For optax.skip_not_finite leave it "
    f"out: {_SKIP_NOT_FINITE}. For a test of your own write skip_fn=fn with "
    "fn(grads, params) -> bool (MultiSteps' fn took (updates, gradient_step, params) and "
    f"returned (skip, aux)) {_GUIDE}.",
}

#: optax.MultiSteps' attributes (and its state's fields) and where accumjax has them.
MULTISTEPS_ATTRS = {
    "has_updated": "read the state: accumjax.has_updated(state)",
    "gradient_transformation": "accumulate returns an optax.GradientTransformationExtraArgs "
    "already: use it as it is",
    "gradient_step": "the updates applied are the state's: state.update_count "
    "(accumjax.stats(state).total_cycles)",
    "mini_step": "the window's calls are the state's: state.window.micro_step "
    "(accumjax.stats(state).current_step)",
    "inner_opt_state": "the inner optimizer's state is the state's: state.inner_tx_state",
    "acc_grads": "the window's gradient is the state's: accumjax.accumulated_gradients(state) "
    "(state.window.grad_sum is a sum, not a running mean)",
}


def check_skip_fn(skip_fn: Any) -> None:
    """Refuses optax's ``should_skip_update_fn`` functions, which take other arguments.

    Example:
      >>> import optax
      >>> check_skip_fn(lambda grads, params: False)  # accumulate's form
      >>> try:
      ...     check_skip_fn(optax.skip_not_finite)
      ... except TypeError as err:
      ...     print(str(err).split(":")[0])
      skip_fn=optax.skip_not_finite is an optax.MultiSteps should_skip_update_fn
    """
    fn = skip_fn.func if isinstance(skip_fn, functools.partial) else skip_fn
    if fn is optax.skip_not_finite:
        fix = f"leave skip_fn out: {_SKIP_NOT_FINITE}"
    elif fn is optax.skip_large_updates:
        fix = (
            "write skip_fn=lambda grads, params: optax.tree.norm(grads) ** 2 > "
            "max_squared_norm (counted in skipped_microbatches, the window goes on)"
        )
    else:
        return
    raise TypeError(
        f"skip_fn=optax.{fn.__name__} is an optax.MultiSteps "
        "should_skip_update_fn: it takes (updates, gradient_step, params) and returns (skip, "
        "aux), and a skipped call does not count towards the window. accumulate's skip_fn "
        f"takes (grads, params) and returns a bool: {fix} {_GUIDE}."
    )


class Transformation(optax.GradientTransformationExtraArgs):
    """optax's ``GradientTransformationExtraArgs``, whose attributes that ``optax.MultiSteps``
    (or its state) has name where accumjax keeps them."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        fix = MULTISTEPS_ATTRS.get(name)
        if fix is None:
            raise AttributeError(
                f"'GradientTransformationExtraArgs' object has no attribute {name!r}"
            )
        raise AttributeError(
            f"accumulate's transformation has no {name} (optax.MultiSteps' name): {fix} {_GUIDE}."
        )


def check_inner(inner: Any) -> None:
    """Refuses an ``optax.MultiSteps`` given to `accumjax.accumulate` as its inner."""
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(f"accumulate's inner is an optax.MultiSteps. {MULTISTEPS_NOTE}")


def check_inner_state(inner_state: Any) -> None:
    """Refuses an inner state that accumulates too: ``optax.MultiSteps``' (built with
    ``.gradient_transformation()``, or inside a chain) or another `accumulate`'s."""
    multi = locate(inner_state, optax.MultiStepsState)
    if multi:
        raise TypeError(
            f"accumulate's inner holds optax.MultiSteps (its state at "
            f"inner_tx_state{path_string(multi[0][0])}). {MULTISTEPS_NOTE}"
        )
    nested = locate(inner_state)
    if nested:
        raise TypeError(
            f"accumulate's inner holds another accumulate (its state at "
            f"inner_tx_state{path_string(nested[0][0])}): each update would take K x K' "
            "microbatches. "
            "State K once: accumjax.accumulate(inner, K) with the product of the two Ks."
        )
