"""The microbatch planner against XLA's own memory analysis, on CPU."""

import doctest
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax
from accumjax import planner
from accumjax._state import config_of
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


_BYTES_OF_K: dict[int, int] = {}  # K -> bytes, for the module's `setup` state and batch


def _bytes_of_k(state, batch, k):
    """Computed here from memory_analysis(), independently of the planner (once per K: the
    tests ask again for the same `setup`)."""
    if k in _BYTES_OF_K:
        return _BYTES_OF_K[k]
    step = accumjax.make_train_step(_loss, mode="scan")
    state = step.init(state.params, accumjax.accumulate(optax.adam(1e-3), k))
    m = step.lower(state, batch).compile().memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    _BYTES_OF_K[k] = total
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
    # K=4 and K=8: the programs the tests above compile (memory falls with K on this model).
    b4, b8 = _bytes_of_k(state, batch, 4), _bytes_of_k(state, batch, 8)
    assert b8 < b4
    with pytest.raises(ValueError, match=f"smallest predicted footprint is {b8} bytes"):
        plan_microbatches(_loss, state, batch, memory_budget=1000, candidates=[8, 4])


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
    assert config_of(state_4.tx).every_k == 4  # K in the optimizer, adam inside
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state_4.opt_state))
    b4 = _bytes_of_k(state, batch, 4)
    assert planner.compiled_memory_bytes(step.lower(state_4, batch).compile()) == b4
    assert plan_microbatches(_loss, state, batch, memory_budget=b4, candidates=[4]).tried == (
        (4, b4),
    )
    # An accumulate transformation gets the new K and keeps its options.
    wrapped = state.replace(tx=accumjax.accumulate(optax.sgd(0.1), 2, scaling="sum"))
    _, state_8 = scan_step_for_k(_loss, wrapped, 8)
    assert config_of(state_8.tx).every_k == 8
    assert config_of(state_8.tx).scaling == "sum"
    # Initialised by the step, it runs: one window of 4 microbatches is one optimizer update.
    new_state, metrics = step(step.init(state.params, state_4.tx), batch)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize(
    ("k", "kwargs", "error", "match"),
    [
        (0, {}, ValueError, "k must be"),
        (2.0, {}, TypeError, "k must be"),
        (True, {}, TypeError, "k must be"),
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


# ------------------------------------------------- the planner plans what users train


def _dropout_loss(params, batch, key=None):
    """``_loss`` with dropout on the hidden activations when given a key."""
    h = batch["x"]
    for i in range(len(DIMS) - 1):
        h = h @ params[f"w{i}"]
        if i < len(DIMS) - 2:
            h = jnp.tanh(h)
            if key is not None:
                key, sub = jax.random.split(key)
                h = jnp.where(jax.random.bernoulli(sub, 0.9, h.shape), h / 0.9, 0.0)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def _keyed_loss(params, batch, key):
    return _dropout_loss(params, batch, key)


def _compiled_bytes(loss_fn, state, batch, k, *args, **kwargs):
    """The K-step compiled with ``args`` (a key), measured apart from the planner's search."""
    step, state_k = scan_step_for_k(loss_fn, state, k, **kwargs)
    return planner.compiled_memory_bytes(step.lower(state_k, batch, *args).compile())


@pytest.mark.slow
def test_a_loss_with_a_key_is_planned_with_the_key(setup):
    state, batch = setup
    key = jax.random.key(0)
    free = plan_microbatches(_dropout_loss, state, batch, memory_budget=2**40, candidates=[4])
    keyed = plan_microbatches(
        _keyed_loss, state, batch, memory_budget=2**40, candidates=[4], rng=key
    )
    assert keyed.predicted_bytes > free.predicted_bytes  # the dropout masks
    assert keyed.predicted_bytes == _compiled_bytes(_keyed_loss, state, batch, 4, key)
    # A budget the key-free step fits at K=4 but the keyed one does not: a larger K.
    budget = free.predicted_bytes
    # No K=8 among the candidates: it does not fit either (on XLA:CPU here) and would only
    # add a compile (about 1.5 s); the claim is a K above 4 that fits.
    plan = plan_microbatches(
        _keyed_loss, state, batch, memory_budget=budget, candidates=[4, 16, 32], rng=key
    )
    assert plan.accum_steps > 4
    assert _compiled_bytes(_keyed_loss, state, batch, plan.accum_steps, key) <= budget
    # An abstract key plans the same step.
    abstract_key = jax.ShapeDtypeStruct((), key.dtype)
    same = plan_microbatches(
        _keyed_loss, state, batch, memory_budget=2**40, candidates=[4], rng=abstract_key
    )
    assert same.predicted_bytes == keyed.predicted_bytes


def test_a_loss_that_needs_a_key_without_rng_names_rng(setup):
    state, batch = setup
    with pytest.raises(TypeError, match="rng="):
        plan_microbatches(_keyed_loss, state, batch, memory_budget=2**40)


def test_has_aux_is_planned(setup):
    state, batch = setup

    def aux_loss(params, batch):
        loss = _loss(params, batch)
        return loss, {"loss_copy": loss}

    plan = plan_microbatches(
        aux_loss, state, batch, memory_budget=2**40, candidates=[4], has_aux=True
    )
    assert plan.predicted_bytes == _compiled_bytes(aux_loss, state, batch, 4, has_aux=True)


@pytest.mark.slow
def test_model_state_is_planned():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = accumjax.AccumBatchNorm(use_running_average=False)(nn.Dense(64)(x))
            return nn.Dense(4)(jnp.tanh(x))

    x = jnp.ones((256, 16))
    batch = {"x": x, "y": jnp.zeros((256,), jnp.int32)}
    net = Net()
    variables = jax.jit(net.init)(jax.random.key(0), x)  # one program, not one per op
    state = accumjax.TrainState.create(
        apply_fn=net.apply,
        params=variables["params"],
        tx=optax.adam(1e-3),
        model_state={"batch_stats": variables["batch_stats"]},
    )

    def loss_fn(params, model_state, batch, key):
        logits, new_state = net.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        logits = jnp.where(jax.random.bernoulli(key, 0.9, logits.shape), logits, 0.0)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, new_state

    key = jax.random.key(0)
    plan = plan_microbatches(loss_fn, state, batch, memory_budget=2**40, candidates=[4], rng=key)
    assert plan.predicted_bytes == _compiled_bytes(loss_fn, state, batch, 4, key)
    # The planned step runs, and closes the BatchNorm window it accumulated.
    step, state_4 = scan_step_for_k(loss_fn, state, 4)
    state_4 = step.init(state.params, state_4.tx, model_state=state.model_state)
    new_state, _ = step(state_4, batch, key)
    assert int(new_state.step) == 1


def _nnx_setup():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 64, rngs=rngs)
            self.norm = accumjax.NNXAccumBatchNorm(64, rngs=rngs)
            self.dropout = nnx.Dropout(0.1)
            self.head = nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x, rngs=None):
            h = jnp.tanh(self.norm(self.linear(x)))
            if rngs is not None:
                h = self.dropout(h, rngs=rngs)
            return self.head(h)

    def loss_fn(model, batch, *key):
        logits = model(batch["x"], rngs=nnx.Rngs(dropout=key[0]) if key else None)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(256, 16)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 4, 256), jnp.int32),
    }
    model = Net(nnx.Rngs(0))
    return model, accumjax.nnx_train_state(model, optax.adam(1e-3)), batch, loss_fn


@pytest.mark.slow
def test_nnx_states_are_planned_with_the_nnx_step():
    model, state, batch, loss_fn = _nnx_setup()
    step, state_4 = scan_step_for_k(loss_fn, state, 4)
    assert isinstance(state_4, accumjax.NNXTrainState) and state_4.graphdef is state.graphdef
    plan = plan_microbatches(loss_fn, state, batch, memory_budget=2**40, candidates=[4])
    assert plan.predicted_bytes == planner.compiled_memory_bytes(
        step.lower(state_4, batch).compile()
    )
    # With a key: the dropout step, planned as trained.
    key = jax.random.key(0)
    keyed = plan_microbatches(loss_fn, state, batch, memory_budget=2**40, candidates=[4], rng=key)
    assert keyed.predicted_bytes == _compiled_bytes(loss_fn, state, batch, 4, key)
    assert keyed.predicted_bytes > plan.predicted_bytes
    # The planned step runs on the state it builds, and its BatchNorm window is closed.
    new_state, metrics = step(step.init(model, state_4.tx), batch, key)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))
    assert int(new_state.model_state["norm"]["acc_step"][...]) == 0


def test_numpy_integers_are_ks(setup):
    state, batch = setup
    b4 = _bytes_of_k(state, batch, 4)
    for candidates in ([np.int64(4)], np.array([4, 8]), (np.int32(8), 4)):
        plan = plan_microbatches(_loss, state, batch, memory_budget=b4, candidates=candidates)
        assert plan.accum_steps == 4 and type(plan.accum_steps) is int
    step, state_4 = scan_step_for_k(_loss, state, np.int64(4))
    assert config_of(state_4.tx).every_k == 4
    assert planner.compiled_memory_bytes(step.lower(state_4, batch).compile()) == b4
    with pytest.raises(TypeError, match="candidates"):
        plan_microbatches(_loss, state, batch, memory_budget=b4, candidates=np.array([4.0]))


def test_a_failing_k_is_named(setup):
    state, batch = setup

    def loss_fn(params, batch):
        if batch["x"].shape[0] < 256:  # fails from K=8 on (microbatches of 128 rows)
            raise ValueError("microbatch too small for this loss")
        return _loss(params, batch)

    with pytest.raises(ValueError, match="microbatch too small") as info:
        plan_microbatches(loss_fn, state, batch, memory_budget=1000, candidates=[2, 4, 8])
    assert any("K=8" in note for note in getattr(info.value, "__notes__", []))
    assert not any("K=4" in note for note in info.value.__notes__)

    def compile_for_k(k):
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="no compiler") as info:
        plan_microbatches_for(compile_for_k, [3], 10)
    assert any("K=3" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("bad", [{"params": {}}, None, (1, 2)])
def test_a_state_that_is_not_a_train_state_names_state(setup, bad):
    _, batch = setup
    with pytest.raises(TypeError, match=r"state must be an accumjax\.TrainState"):
        plan_microbatches(_loss, bad, batch, memory_budget=2**40)
    with pytest.raises(TypeError, match=r"state must be an accumjax\.TrainState"):
        scan_step_for_k(_loss, bad, 2)


def test_multisteps_is_refused_before_any_k_is_compiled(setup):
    """The planner wraps a plain tx in accumulate(tx, K), which refuses a MultiSteps inner
    as it is built (it would take K x K' microbatches per update)."""
    state, batch = setup
    multi = accumjax.TrainState.create(
        apply_fn=None, params=state.params, tx=optax.MultiSteps(optax.sgd(0.1), 2)
    )
    with pytest.raises(TypeError, match=r"MultiSteps.*Drop MultiSteps"):
        plan_microbatches(_loss, multi, batch, memory_budget=2**40, candidates=[2])


# ----------------------------------------------------------------------------- on a mesh

N = 8


def _on_mesh(setup, kind, fsdp):
    """The module's state and batch on 8 devices: the batch split over "data", the parameters
    replicated or split over it on their first dimension (FSDP)."""
    state, batch = setup
    mesh = jax.make_mesh((N,), ("data",), axis_types=(kind,))
    params = jax.device_put(state.params, NamedSharding(mesh, P("data") if fsdp else P()))
    return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_on_a_mesh_the_plan_is_the_program_the_step_runs_per_device(setup, kind, fsdp):
    """Issue 38: called as the guide shows (no ``jax.set_mesh``), on an Explicit mesh
    (``jax.make_mesh``'s default) it raised, and on an Auto mesh it planned the unsharded
    one-device program. Its bytes are ``memory_analysis()`` of the step it plans, as the step
    runs it (state from ``step.init``), per device: exactly, and below the one-device
    program's, which a plan of the unsharded program gives."""
    params, batch = _on_mesh(setup, kind, fsdp)
    step = accumjax.make_train_step(_loss, mode="scan")
    tx = accumjax.accumulate(optax.adam(1e-3), 1)
    plan = plan_microbatches(
        _loss, step.init(params, tx), batch, memory_budget=2**40, candidates=[4]
    )
    ran = step.lower(step.init(params, accumjax.with_every_k(tx, 4)), batch).compile()
    assert plan.tried == ((4, planner.compiled_memory_bytes(ran)),) and plan.devices == N
    assert plan.predicted_bytes < _bytes_of_k(*setup, 4)  # 1.05 / 1.51 MB against 2.28 MB


def test_on_a_mesh_candidates_divide_the_rows_each_device_gets(setup):
    """The rule is global: K must divide the rows of each of the 8 devices (1024 / 8)."""
    params, batch = _on_mesh(setup, AxisType.Explicit, fsdp=False)
    state = accumjax.make_train_step(_loss, mode="scan").init(params, optax.adam(1e-3))
    rule = r"\[256\].*1024 rows on 8 devices.*a K that divides 128 \(the rows each device"
    with pytest.raises(ValueError, match=rule):
        plan_microbatches(_loss, state, batch, memory_budget=2**40, candidates=[4, 256])


# ------------------------------------------------------------------- planning the layout

WIDE = 256  # 4 dense 256 x 256 layers: 1 MiB of float32 parameters, Adam 2 MiB more
LAYOUTS = ("replicated", "zero1", "zero2")


def _wide_loss(params, batch):
    h = batch["x"]
    for i in range(4):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def _wide_on_mesh():
    """A parameter-dominated model, its parameters replicated over 8 devices and 8 rows a
    device: memory hardly falls with K here, but it falls with the optimizer's layout."""
    mesh = jax.make_mesh((N,), ("data",))
    params = {f"w{i}": jnp.zeros((WIDE, WIDE)) for i in range(4)}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch = {"x": jnp.ones((8 * N, WIDE)), "y": jnp.ones((8 * N, WIDE))}
    state = accumjax.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    return state, jax.device_put(batch, NamedSharding(mesh, P("data")))


def _bytes_with_layout(state, batch, layout, k):
    """Per-device bytes of the step a user builds with ``layout``, independently of the
    planner."""
    step = accumjax.make_train_step(_wide_loss, mode="scan", optimizer_sharding=layout)
    state = step.init(state.params, accumjax.accumulate(optax.adam(1e-3), k))
    return planner.compiled_memory_bytes(step.lower(state, batch).compile())


def test_the_planner_chooses_the_layout_that_lets_the_largest_microbatch_fit():
    """Issue 44, Must 9. Replicated does not fit the budget at the smallest K (K = 1), ZeRO-1
    does: the plan is ZeRO-1 at K = 1, and its bytes are the step built with ZeRO-1's."""
    state, batch = _wide_on_mesh()
    replicated = _bytes_with_layout(state, batch, "replicated", 1)
    zero1 = _bytes_with_layout(state, batch, "zero1", 1)
    budget = (replicated + zero1) // 2  # 5.0 MiB and 2.3 MiB a device
    plan = plan_microbatches(
        _wide_loss, state, batch, memory_budget=budget, candidates=[1, 2],
        optimizer_shardings=LAYOUTS,
    )  # fmt: skip
    assert (plan.accum_steps, plan.optimizer_sharding, plan.devices) == (1, "zero1", N)
    assert plan.predicted_bytes == zero1 <= budget < replicated
    assert plan.tried == ((1, replicated, "replicated"), (1, zero1, "zero1"))
    zero2 = _bytes_with_layout(state, batch, "zero2", 1)  # 1.6 MiB: ZeRO-2 where ZeRO-1 is not
    lean = plan_microbatches(
        _wide_loss, state, batch, memory_budget=zero2, candidates=[1], optimizer_shardings=LAYOUTS
    )
    assert (lean.optimizer_sharding, lean.predicted_bytes) == ("zero2", zero2)
    # Without the layouts, today's plan: replicated, which no candidate K lets fit.
    with pytest.raises(ValueError, match=r"smallest predicted footprint .* at K="):
        plan_microbatches(_wide_loss, state, batch, memory_budget=budget, candidates=[1, 2])


def test_the_layouts_are_tried_in_the_order_given_and_named():
    state, batch = _wide_on_mesh()
    zero2 = _bytes_with_layout(state, batch, "zero2", 1)
    plan = plan_microbatches(
        _wide_loss, state, batch, memory_budget=2**40, candidates=[1],
        optimizer_shardings=["zero2", "replicated", "zero2"],
    )  # fmt: skip
    assert plan.optimizer_sharding == "zero2" and plan.tried == ((1, zero2, "zero2"),)
    plain = plan_microbatches(_wide_loss, state, batch, memory_budget=2**40, candidates=[1])
    assert plain.optimizer_sharding == "replicated" and len(plain.tried[0]) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer_shardings": "zero1"}, TypeError, "sequence of optimizer_sharding"),
        ({"optimizer_shardings": []}, ValueError, "must not be empty"),
        ({"optimizer_shardings": ["zero3"]}, ValueError, "optimizer_sharding must be one of"),
        (
            {"optimizer_shardings": ["zero1"], "optimizer_sharding": "zero1"},
            TypeError,
            "not both",
        ),
    ],
)
def test_bad_optimizer_shardings(setup, kwargs, error, match):
    state, batch = setup
    with pytest.raises(error, match=match):
        plan_microbatches(_loss, state, batch, memory_budget=2**40, **kwargs)
