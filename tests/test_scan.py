"""Scan mode's window loop (accumjax._scan): the microbatches run in a loop with a known trip
count of K (issue 28).

On XLA:GPU a ``while`` loop whose trip count is unknown copies its predicate to the host on
every iteration: one host round trip per microbatch. With the default policy the common path
(a finite window) runs its K microbatches in one loop of known trip count K; only the rare
re-run of a non-finite window may loop on data. Read from the compiled HLO, for several K, on
one device and on a mesh (the sharded jit path).
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
_CALLS = re.compile(
    r"\b(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-, %]+)\}?"
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


@pytest.mark.parametrize("where", ["one device", "mesh"])
@pytest.mark.parametrize("k", [2, 4, 8])
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
    assert len(known) == 1, [count for count, _ in loops]
    (microbatches,) = known
    # Every matmul of the model runs in that loop: none in a loop of unknown trip count but
    # through it, none outside (the gradient is compiled once).
    total = _matmuls(computations, computations)
    assert total > 0 and _matmuls(computations, microbatches) == total
    for count, names in loops:
        if count is None and _matmuls(computations, names):
            assert microbatches <= names  # the loop over passes: it runs the known loop


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
