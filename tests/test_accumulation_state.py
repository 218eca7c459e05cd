"""`accumjax.stats` (accumjax.accumulation_state) on a mesh: the window's size as the layout
plan lays it out.

On 8 host devices each layout of one problem keeps its window where its row of the plan
(`accumjax._layout`) says: a full-size partial sum per device where the accumulator is whole
(replicated, ZeRO-1), one sum split over the devices where it is split (ZeRO-2, FSDP).
``memory_bytes`` counts every device's together, and each device holds 1/8 of it; a
scan-mode train state, which holds no window, is sized by the plan it is given
(``step.layout(state)``).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax
import accumjax._mesh as mesh_lib

N = 8
# "w" splits over 8 devices (ZeRO's dimension 0; FSDP's placement), "b" does not (3 rows):
# it stays whole on each device in every layout. A bfloat16 leaf is summed in float32.
SHAPES = {"w": ((8, 4), jnp.float32), "b": ((3,), jnp.bfloat16)}
W_BYTES, B_BYTES = 8 * 4 * 4, 3 * 4  # one sum of each, float32
PARAMETERS = 8 * 4 + 3
TX = accumjax.accumulate(optax.adam(1e-2), 4)

# layout: (optimizer_sharding, "w" placed split over the devices (FSDP), reduce_scatter)
LAYOUTS = {
    "replicated": ("replicated", False, "microbatch"),
    "zero1": ("zero1", False, "microbatch"),
    "zero2": ("zero2", False, "microbatch"),
    "fsdp": ("replicated", True, "microbatch"),
    "fsdp-window": ("replicated", True, "window"),
}
# memory_bytes: every device's sums together (N per leaf whole on each device, 1 split).
EXPECTED = {
    "replicated": N * (W_BYTES + B_BYTES),
    "zero1": N * (W_BYTES + B_BYTES),
    "zero2": W_BYTES + N * B_BYTES,
    "fsdp": W_BYTES + N * B_BYTES,
    "fsdp-window": N * (W_BYTES + B_BYTES),
}


def _params(fsdp):
    mesh = jax.make_mesh((N,), ("data",))
    specs = {"w": P("data", None) if fsdp else P(), "b": P()}
    return {
        k: jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, specs[k]))
        for k, (shape, dtype) in SHAPES.items()
    }


def _state(name, mode):
    choice, fsdp, reduce_scatter = LAYOUTS[name]
    scan: dict[str, Any] = {"reduce_scatter": reduce_scatter} if mode == "scan" else {}
    step = accumjax.make_train_step(
        lambda p, b: jnp.sum(p["w"]) * jnp.mean(b), mode=mode, optimizer_sharding=choice, **scan
    )
    state = step.init(_params(fsdp), TX)
    plan = step.layout(state)
    # The step's plan: the one `mesh_lib.layout_of` builds for its choices.
    built = mesh_lib.layout_of(
        state.params, None, optimizer_sharding=choice, reduce_scatter=reduce_scatter
    )
    assert plan is not None and built is not None and plan.leaves == built.leaves
    return state, plan


def _per_device_bytes(window):
    """The bytes of one device's shards of a held window's sums."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(window.partial_sums)
    )


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "fsdp-window"])
def test_stats_of_a_stream_window_on_8_devices_counts_every_device_sums(name):
    state, plan = _state(name, "stream")
    opt: Any = state.opt_state
    window = opt.window
    s = accumjax.stats(state)
    assert (s.num_parameters, s.memory_bytes) == (PARAMETERS, EXPECTED[name])
    # Each device holds 1/N of it, as the docstring says.
    assert _per_device_bytes(window) * N == s.memory_bytes
    # The window as the plan laid it out; given the plan, stats measures the same window.
    whole_w = dict(zip(sorted(SHAPES), plan.leaves, strict=True))["w"].accumulator is None
    assert window.partial_sums["w"].shape == ((N,) if whole_w else (1,)) + (8, 4)
    assert accumjax.stats(state, plan) == s
    assert accumjax.stats(state.opt_state) == s


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stats_of_a_scan_state_on_8_devices_sizes_the_sums_its_plan_makes(name):
    state, plan = _state(name, "scan")
    s = accumjax.stats(state, plan)
    assert (s.num_parameters, s.memory_bytes) == (PARAMETERS, EXPECTED[name])
    if name != "fsdp-window":  # the stream window of the same layout: the same size
        assert s.memory_bytes == accumjax.stats(_state(name, "stream")[0]).memory_bytes
    # Without the plan: one device's sums (no layout read from the state on its own).
    one = accumjax.stats(state)
    assert (one.num_parameters, one.memory_bytes) == (PARAMETERS, W_BYTES + B_BYTES)


def test_stats_of_a_parameter_shaped_window_on_8_devices_counts_its_one_sum():
    # TrainState.create's window (tx.init's) is one parameter-shaped sum, however placed.
    state = accumjax.TrainState.create(apply_fn=None, params=_params(False), tx=TX)
    s = accumjax.stats(state)
    assert (s.num_parameters, s.memory_bytes) == (PARAMETERS, W_BYTES + B_BYTES)


def test_a_layout_that_is_not_a_plan_is_refused_naming_step_layout():
    state = accumjax.accumulate(optax.sgd(0.1), 2).init({"w": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"stats\(layout=\.\.\.\).*step\.layout\(state\)"):
        accumjax.stats(state, "zero2")


def test_a_plan_of_another_state_is_refused_naming_step_layout():
    # The plan of an 8-device scan state, given with a state on 4 devices, on one device, or
    # with other parameters: refused, not sized by the wrong plan.
    state, plan = _state("zero2", "scan")
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    on4 = state.replace(params=jax.device_put(state.params, NamedSharding(mesh4, P())))
    on1 = state.replace(params=jax.device_put(state.params, jax.devices()[0]))
    for other in (on4, on1):
        with pytest.raises(ValueError, match=r"plan splits over 8 devices.*step\.layout\(state\)"):
            accumjax.stats(other, plan)
    fewer = state.replace(params={"w": state.params["w"]})
    with pytest.raises(ValueError, match=r"the plan has 2 parameter leaves, the state 1"):
        accumjax.stats(fewer, plan)
