"""The microbatch planner against XLA's own memory analysis, on CPU."""

import doctest
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import accumjax
from accumjax import planner
from accumjax.planner import (
    MicrobatchPlan,
    plan_microbatches,
    plan_microbatches_for,
    scan_step_for_k,
)

BATCH = 1024
DIMS = (16, 256, 256, 4)  # activation-heavy: memory falls steadily with K


def _loss(params, batch):
    h = batch["x"]
    for i in range(len(DIMS) - 1):
        h = h @ params[f"w{i}"]
        if i < len(DIMS) - 2:
            h = jnp.tanh(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
        for i, (a, b) in enumerate(itertools.pairwise(DIMS))
    }
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    batch = {
        "x": jnp.asarray(rng.normal(size=(BATCH, DIMS[0])), jnp.float32),
        "y": jnp.asarray(rng.integers(0, DIMS[-1], BATCH), jnp.int32),
    }
    return state, batch


def _bytes_of_k(state, batch, k):
    """Computed here from memory_analysis(), independently of the planner."""
    tx = accumjax.accumulate(optax.adam(1e-3), k)
    state = state.replace(tx=tx, opt_state=tx.init(state.params))
    step = accumjax.make_train_step(_loss, mode="scan")
    m = step.lower(state, batch).compile().memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    return total


def test_chosen_k_fits_and_next_smaller_does_not(setup):
    state, batch = setup
    b2, b4 = _bytes_of_k(state, batch, 2), _bytes_of_k(state, batch, 4)
    assert b4 < b2
    budget = (b2 + b4) // 2
    plan = plan_microbatches(_loss, state, batch, memory_budget=budget)
    assert isinstance(plan, MicrobatchPlan)
    chosen = plan.accum_steps
    candidates = [k for k in range(1, BATCH + 1) if BATCH % k == 0]
    smaller = candidates[candidates.index(chosen) - 1]
    assert _bytes_of_k(state, batch, chosen) <= budget < _bytes_of_k(state, batch, smaller)
    assert chosen == 4 and plan.microbatch_size == BATCH // 4
    assert plan.predicted_bytes == b4 and plan.budget_bytes == budget
    assert [k for k, _ in plan.tried] == [1, 2, 4]  # stops at the first fit
    assert all(b > budget for _, b in plan.tried[:-1])


def test_abstract_inputs_and_custom_candidates(setup):
    state, batch = setup
    abstract = jax.eval_shape(lambda s, b: (s, b), state, batch)
    b8 = _bytes_of_k(state, batch, 8)
    plan = plan_microbatches(_loss, *abstract, memory_budget=b8, candidates=[16, 8, 8])
    assert plan.accum_steps == 8 and plan.tried == ((8, b8),)


def test_generic_core_on_a_custom_compile():
    def compile_for_k(k):
        x = jax.ShapeDtypeStruct((k, 4096 // k, 64), jnp.float32)
        f = lambda x: jax.lax.map(lambda c: jnp.sum(jnp.sort(jnp.exp(c), axis=0) * c), x).sum()
        return jax.jit(f).lower(x).compile()

    sizes = {k: planner.compiled_memory_bytes(compile_for_k(k)) for k in (2, 4, 8)}
    assert sizes[8] < sizes[4] < sizes[2]
    plan = plan_microbatches_for(compile_for_k, [8, 2, 4], sizes[4])
    assert plan.accum_steps == 4 and plan.microbatch_size is None
    assert plan.tried == ((2, sizes[2]), (4, sizes[4]))


def test_nothing_fits_reports_the_smallest(setup):
    state, batch = setup
    b64 = _bytes_of_k(state, batch, 64)
    with pytest.raises(ValueError, match=f"smallest predicted footprint is {b64} bytes"):
        plan_microbatches(_loss, state, batch, memory_budget=1000, candidates=[32, 64])


def test_no_device_limit_on_cpu(setup):
    state, batch = setup
    assert jax.default_backend() == "cpu"
    with pytest.raises(ValueError, match="memory_budget"):
        plan_microbatches(_loss, state, batch)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory_budget": 0}, ValueError, "memory_budget"),
        ({"memory_budget": -5}, ValueError, "memory_budget"),
        ({"memory_budget": 1.5e9}, TypeError, "memory_budget"),
        ({"memory_budget": True}, TypeError, "memory_budget"),
        ({"memory_budget": 10**9, "candidates": []}, ValueError, "candidates"),
        ({"memory_budget": 10**9, "candidates": [0, 2]}, ValueError, "candidates"),
        ({"memory_budget": 10**9, "candidates": 4}, TypeError, "candidates"),
        ({"memory_budget": 10**9, "candidates": [3]}, ValueError, "candidates"),
        ({"memory_budget": 10**9, "accum_steps": 4}, TypeError, "accum_steps"),
        ({"memory_budget": 10**9, "mode": "stream"}, TypeError, "mode"),
    ],
)
def test_bad_arguments(setup, kwargs, error, match):
    state, batch = setup
    with pytest.raises(error, match=match):
        plan_microbatches(_loss, state, batch, **kwargs)


def test_bad_loss_and_batch(setup):
    state, batch = setup
    with pytest.raises(TypeError, match="loss_fn"):
        plan_microbatches(None, state, batch, memory_budget=10**9)  # type: ignore[arg-type]
    ragged = {"x": batch["x"], "y": batch["y"][:10]}
    with pytest.raises(ValueError, match="batch"):
        plan_microbatches(_loss, state, ragged, memory_budget=10**9)


def test_bad_core_arguments():
    with pytest.raises(TypeError, match="compile_for_k"):
        plan_microbatches_for(3, [1], 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_microbatches_for(lambda k: None, [1], 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        plan_microbatches_for(lambda k: None, [1], 10, batch_size=0)  # type: ignore[arg-type]


def test_scan_step_for_k_is_the_step_the_planner_measures(setup):
    state, batch = setup
    step, state_4 = scan_step_for_k(_loss, state, 4)
    assert (
        accumjax.accumulation.config_of(state_4.tx).every_k == 4
    )  # K in the optimizer, adam inside
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state_4.opt_state))
    b4 = _bytes_of_k(state, batch, 4)
    assert planner.compiled_memory_bytes(step.lower(state_4, batch).compile()) == b4
    assert plan_microbatches(_loss, state, batch, memory_budget=b4, candidates=[4]).tried == (
        (4, b4),
    )
    # An accumulate transformation gets the new K and keeps its options.
    wrapped = state.replace(tx=accumjax.accumulate(optax.sgd(0.1), 2, scaling="sum"))
    _, state_8 = scan_step_for_k(_loss, wrapped, 8)
    assert accumjax.accumulation.config_of(state_8.tx).every_k == 8
    assert accumjax.accumulation.config_of(state_8.tx).policy.scaling == "sum"
    # Initialised, it runs: one window of 4 microbatches is one optimizer update.
    state_4 = state_4.replace(opt_state=state_4.tx.init(state_4.params))
    new_state, metrics = step(state_4, batch)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize(
    ("k", "kwargs", "error", "match"),
    [
        (0, {}, ValueError, "k must be"),
        (2.0, {}, ValueError, "k must be"),
        (True, {}, ValueError, "k must be"),
        (2, {"mode": "stream"}, TypeError, "mode"),
        (2, {"accum_steps": 2}, TypeError, "accum_steps"),
    ],
)
def test_scan_step_for_k_bad_arguments(setup, k, kwargs, error, match):
    state, _ = setup
    with pytest.raises(error, match=match):
        scan_step_for_k(_loss, state, k, **kwargs)


def test_docstring_examples():
    results = doctest.testmod(planner, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0 and results.attempted > 0
