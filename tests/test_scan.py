"""Scan mode's window loop (accumjax._scan): the microbatches run in a loop with a known trip
count of K (issues 28 and 32).

On XLA:GPU a ``while`` loop whose trip count is unknown copies its predicate to the host on
every iteration: one host round trip per microbatch. Every policy runs its K microbatches in
one loop of known trip count K, deciding about each as it comes, and nothing else loops on
data. Read from the compiled HLO, for several K, on one device and on a mesh (the sharded jit
path), and from the step lowered for CUDA.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+)")
_CALLS = re.compile(  # one name, or a list of %-names ("condition=%c, body=%b": two matches)
    r"\b(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(text):
    """``{name: [instruction lines]}`` of an HLO module's text."""
    out, current = {}, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            current = out.setdefault(header.group(1), [])
            continue
        if line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return out


def _reaches(computations, name, seen=None):
    """The computations ``name`` runs, itself included (bodies, branches, fusions, calls)."""
    seen = set() if seen is None else seen
    if name in seen or name not in computations:
        return seen
    seen.add(name)
    for line in computations[name]:
        for group in _CALLS.findall(line):
            for callee in group.replace("%", "").split(","):
                _reaches(computations, callee.strip(), seen)
    return seen


def _loops(compiled):
    """Each ``while`` loop of the program: ``(known trip count or None, computations its body
    runs)``, and every computation's lines."""
    computations = _computations(compiled.as_text())
    loops = []
    for lines in computations.values():
        for line in lines:
            body = _WHILE.search(line)
            if body:
                trips = _TRIPS.search(line)
                count = int(trips.group(1)) if trips else None
                loops.append((count, _reaches(computations, body.group(1))))
    return loops, computations


def _matmuls(computations, names):
    return sum(" dot(" in line for n in names for line in computations[n])


def _problem(k):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32),
        "w2": rng.normal(size=(16, 2)).astype(np.float32),
    }
    x = rng.normal(size=(8 * k, 8)).astype(np.float32)
    return params, {"x": x, "y": x[:, :2]}


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


# K=4 (and every policy) is read from the step lowered for CUDA below.
@pytest.mark.parametrize("where", ["one device", "mesh"])
@pytest.mark.parametrize("k", [2, 8])
def test_the_microbatches_run_in_a_loop_of_known_trip_count_k(k, where):
    params, batch = _problem(k)
    if where == "mesh":
        mesh = jax.make_mesh((8,), ("data",))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    step = accumjax.make_train_step(_loss, mode="scan")  # on_nonfinite="skip_microbatch"
    state = step.init(params, accumjax.accumulate(optax.adam(1e-3), k))
    loops, computations = _loops(step.lower(state, batch).compile())
    known = [names for count, names in loops if count == k]
    # The window's pass, and its second pass for a window whose devices refused a microbatch
    # (issue 37), inside a loop of at most one trip (on this CPU; a conditional on a GPU). On
    # one device the window's sum decides (issue 44): the first pass reads no gradient, and
    # only a window whose sum is not finite reads them, in a pass of its own before the second.
    passes = 3 if where == "one device" else 2
    assert len(known) == passes, [count for count, _ in loops]
    rerun = [names for count, names in loops if count is None and _matmuls(computations, names)]
    rerun = max(rerun, key=len)  # the outermost: a window run again
    (first,) = [names for names in known if not names <= rerun]
    again = [names for names in known if names <= rerun]
    # Every matmul of the model runs in these loops, none outside, and the loop of unknown
    # trip count runs them only in the passes after the first.
    total = _matmuls(computations, computations)
    assert total > 0 and _matmuls(computations, first.union(*again)) == total
    per_pass = _matmuls(computations, first)
    assert [_matmuls(computations, names) for names in again] == [per_pass] * (passes - 1)
    assert per_pass * passes == total
    assert first.isdisjoint(rerun) and _matmuls(computations, rerun) == total - per_pass


@pytest.mark.parametrize(
    "case",
    ["skip_microbatch", "propagate", "unroll=True", "unroll=2", "num_real_microbatches", "aux"],
)
def test_the_loss_is_traced_once(case):
    """Issue 28: trace and compile time. The scan step traces the model's loss (and so its
    gradient) once in every configuration; a second trace is a second copy of the model's
    tracing time (the passes' shapes were once taken from a trace of their own, a weakly
    typed argument made the loop's trace miss its cache)."""
    params, batch = _problem(4)
    traces = []

    def loss(params, batch):
        traces.append(None)
        value = _loss(params, batch)
        return (value, {"loss": value}) if case == "aux" else value

    policy = "propagate" if case == "propagate" else "skip_microbatch"
    unroll = {"unroll=True": True, "unroll=2": 2}.get(case, 1)
    step = accumjax.make_train_step(loss, mode="scan", unroll=unroll, has_aux=case == "aux")
    state = step.init(params, accumjax.accumulate(optax.adam(1e-3), 4, on_nonfinite=policy))
    extra = {"num_real_microbatches": jnp.int32(3)} if case == "num_real_microbatches" else {}
    step.lower(state, batch, **extra)
    assert len(traces) == 1


# ----------------------------------------------------------------------------- on a CUDA GPU

_POLICIES = {
    "skip_microbatch": {},
    "skip_window": {"on_nonfinite": "skip_window"},
    "propagate": {"on_nonfinite": "propagate"},
    "weighted": {"scaling": "weighted"},
    "max_norm": {"max_norm": 1.0},
    "skip_fn": {"skip_fn": lambda g, p: optax.tree.norm(g) > 1e3},
    "microbatch_transform": {"microbatch_transform": accumjax.adaptive_clip(0.1)},
}


def _cuda_program(step, state, batch, devices):
    """The step lowered for CUDA (``jax.export`` on this CPU machine) and compiled by XLA:CPU
    (a CUDA GPU is not needed to read the control flow): the optimized HLO text."""
    exported = jax.export.export(jax.jit(lambda s, b: step(s, b)), platforms=["cuda"])(state, batch)
    backend = jax.extend.backend.get_backend("cpu")
    options = jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=devices)
    options.executable_build_options.use_spmd_partitioning = devices > 1
    compiled = backend.compile_and_load(
        exported.mlir_module(), backend.devices()[:devices], options
    )
    return compiled.hlo_modules()[0].to_string()


def _common_path(text):
    """The ``while`` loops (their known trip counts, None where unknown) and the conditionals
    a program runs outside any conditional's branch."""
    computations = _computations(text)
    (entry,) = [
        _COMPUTATION.match(line.replace("ENTRY ", "", 1)).group(1)
        for line in text.splitlines()
        if line.startswith("ENTRY")
    ]
    loops, conditionals, seen = [], 0, set()

    def walk(name):
        nonlocal conditionals
        if name in seen or name not in computations:
            return
        seen.add(name)
        for line in computations[name]:
            if " conditional(" in line:
                conditionals += 1
                continue  # its branches: the rare path
            if _WHILE.search(line):
                trips = _TRIPS.search(line)
                loops.append(int(trips.group(1)) if trips else None)
            for group in _CALLS.findall(line):
                for callee in group.replace("%", "").split(","):
                    walk(callee.strip())

    walk(entry)
    return loops, conditionals


@pytest.mark.parametrize("where", ["one device", "mesh"])
@pytest.mark.parametrize("mode", ["scan", "stream"])
@pytest.mark.parametrize("policy", list(_POLICIES))
def test_on_a_cuda_gpu_no_loop_waits_on_the_data(policy, mode, where):
    """Issue 32: XLA:GPU copies a ``while`` loop's predicate to the host and blocks on it at
    every check (``WhileThunk``) unless the trip count is known, and a conditional's on every
    execution (``ConditionalThunk``). For every policy, in both modes, on one device and on a
    mesh, the step lowered for CUDA runs only loops of known trip count (the K microbatches in
    scan mode) and one conditional (the window's end): one host wait per step, none per
    microbatch, and no loop whose trip count depends on the data."""
    params, batch = _problem(4)
    devices = 8 if where == "mesh" else 1
    if mode == "stream":
        batch = jax.tree.map(lambda a: a[:16], batch)
    weight_fn = (lambda b: jnp.sum(b["y"] ** 2)) if policy == "weighted" else None
    step = accumjax.make_train_step(_loss, mode=mode, weight_fn=weight_fn)
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("data",))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state = step.init(params, accumjax.accumulate(optax.adam(1e-3), 4, **_POLICIES[policy]))
    loops, conditionals = _common_path(_cuda_program(step, state, batch, devices))
    assert loops == ([4] if mode == "scan" else []), loops
    # Stream mode: the window's end. Scan mode selects its update (it runs on nearly every
    # step) and branches only to run a window again, for a policy that skips one microbatch
    # of a window whose microbatches were added as they came (issue 37).
    runs_again = _POLICIES[policy].get("on_nonfinite", "skip_microbatch") == "skip_microbatch"
    runs_again = runs_again and policy not in ("max_norm", "skip_fn", "microbatch_transform")
    assert conditionals == (1 if mode == "stream" or runs_again else 0)
