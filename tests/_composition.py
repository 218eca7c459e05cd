"""The optax combinators around ``accumulate`` that the modes guide's table lists, one builder
per row, and that table as the guide states it (the tests check the one against the other).

Each builder takes the ``accumulate`` transformation to wrap (or, for the row with
``optax.MultiSteps`` inside, the K of the ``accumulate`` it builds) and returns ``tx``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import optax

import accumjax
from accumjax._state import config_of

GUIDE = Path(__file__).parent.parent / "docs" / "guides" / "modes.md"
HEADING = "## Optax combinators around `accumulate`"


def own_wrapper(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """A transformation of the user's own around ``inner``: it counts its calls."""

    def init(params: Any) -> dict[str, Any]:
        return {"inner": inner.init(params), "calls": jnp.zeros((), jnp.int32)}

    def update(updates: Any, state: dict[str, Any], params: Any = None) -> Any:
        updates, inner_state = inner.update(updates, state["inner"], params)
        return updates, {"inner": inner_state, "calls": state["calls"] + 1}

    return optax.GradientTransformation(init, update)


def _first_leaf_only(params: Any) -> Any:
    """A mask (and labels) over a dict of parameters: its first key ``True`` (``"a"``)."""
    first = sorted(params)[0]
    return {name: name == first for name in params}


def _labels(params: Any) -> Any:
    return {name: "a" if flag else "b" for name, flag in _first_leaf_only(params).items()}


def _adam_in_inject(acc: Any) -> Any:
    k = config_of(acc).every_k
    return optax.inject_hyperparams(
        lambda learning_rate: accumjax.accumulate(optax.adam(learning_rate), k)
    )(learning_rate=0.1)


def _multisteps_inside(acc: Any) -> Any:
    k = config_of(acc).every_k
    return accumjax.accumulate(optax.MultiSteps(optax.sgd(0.1), 2), k)


#: The guide's first cell -> the ``tx`` it shows, around ``acc``, an ``accumulate``.
BUILDERS: dict[str, Callable[[Any], Any]] = {
    "`optax.chain(optax.clip(1.0), accumulate(inner, K))`": lambda acc: optax.chain(
        optax.clip(1.0), acc
    ),
    "`optax.chain(accumulate(inner, K), optax.scale(1.0))`": lambda acc: optax.chain(
        acc, optax.scale(1.0)
    ),
    "`optax.masked(accumulate(inner, K), mask)`": lambda acc: optax.masked(acc, _first_leaf_only),
    '`optax.multi_transform({"a": accumulate(inner, K), "b": other}, labels)`': (
        lambda acc: optax.multi_transform({"a": acc, "b": optax.sgd(0.1)}, _labels)
    ),
    "`optax.apply_if_finite(accumulate(inner, K), 3)`": lambda acc: optax.apply_if_finite(acc, 3),
    "`optax.inject_hyperparams(lambda learning_rate: accumulate(optax.adam(learning_rate), K))"
    "(learning_rate=0.1)`": _adam_in_inject,
    "a wrapper of your own, `your_wrapper(accumulate(inner, K))` (its state a pytree holding "
    "the inner one)": own_wrapper,
    "`optax.MultiSteps(accumulate(inner, K), 2)`": lambda acc: optax.MultiSteps(acc, 2),
    "`accumulate(optax.MultiSteps(inner, 2), K)`": _multisteps_inside,
}


#: Short names of the rows, in the table's order (test ids).
IDS = [
    "chain_before",
    "chain_after",
    "masked",
    "multi_transform",
    "apply_if_finite",
    "inject_hyperparams",
    "own_wrapper",
    "multisteps_around",
    "multisteps_inside",
]
ROWS = dict(zip(IDS, BUILDERS, strict=True))  # short name -> the guide's first cell


def table() -> dict[str, tuple[str, str]]:
    """The guide's table: first cell -> (what ``make_train_step`` does, your own loop)."""
    section = GUIDE.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    cells = [line[2:-2].split(" | ") for line in rows]
    return {first: (step, own) for first, step, own in cells}


def step_refusal(row: str) -> str:
    """The text the step's error must hold for ``row``: the guide's ``refused: `...` ``."""
    step = table()[row][0]
    prefix = "refused: `"
    assert step.startswith(prefix) and step.endswith("`"), step
    return step[len(prefix) : -1]
