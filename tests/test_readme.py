"""The README's Python blocks run as written, in order, in one namespace; its quick start (your
own optax loop, then make_train_step) runs unchanged on 8 host devices, where only the arrays'
placement differs, and gives one device's values."""

import functools
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import accumjax

README = Path(__file__).parent.parent / "README.md"
# The line of the first block after which the arrays exist and nothing has used them yet.
PLACEMENT = "# The arrays lie on one device here."
QUICK_START = 2  # the own loop, the scan step


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = _blocks()
    assert len(blocks) >= QUICK_START
    # The quick start's blocks (the first block run in two pieces, as one), then the rest:
    # the quick start's run is shared with the one-device run of the test below.
    namespace = dict(_one_device_quick_start())
    for block in blocks[QUICK_START:]:
        exec(compile(block, str(README), "exec"), namespace)
    assert int(accumjax.stats(namespace["opt_state"]).total_cycles) == 50  # your own loop
    assert int(namespace["state"].step) == 20  # make_train_step, scan mode


def _quick_start(mesh):
    """The quick start's blocks in a namespace of their own, the arrays on ``mesh`` (or where
    the README leaves them)."""
    first, *rest = _blocks()[:QUICK_START]
    at = first.index(PLACEMENT)
    head, tail = first[:at], first[at:]
    namespace: dict = {}
    exec(compile(head, str(README), "exec"), namespace)
    if mesh is not None:
        data, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        namespace["x"], namespace["y"] = jax.device_put((namespace["x"], namespace["y"]), data)
        namespace["params"] = jax.device_put(namespace["params"], whole)
    for block in [tail, *rest]:
        exec(compile(block, str(README), "exec"), namespace)
    return namespace


@functools.cache
def _one_device_quick_start() -> dict:
    """The quick start where the README leaves the arrays, run once per process (both tests
    read it; neither changes it: the later blocks rebind names in a copy, and donate none of
    its arrays)."""
    return _quick_start(None)


@pytest.mark.slow
def test_the_quick_start_is_the_same_program_on_one_device_and_eight():
    # Auto axes: the quick start slices x with basic indexing, which JAX refuses on an
    # Explicit axis (jax.make_mesh's default) without out_sharding, a matter of JAX's.
    assert jax.device_count() >= 8
    one = _one_device_quick_start()
    eight = _quick_start(Mesh(np.array(jax.devices()[:8]), ("data",)))
    assert eight["x"].sharding.spec == P("data")
    structure = lambda s: jax.tree.structure(s.replace(tx=None))  # tx: one per run
    assert structure(eight["state"]) == structure(one["state"])
    shapes = lambda s: [np.shape(x) for x in jax.tree.leaves(s.replace(opt_state=None))]
    assert shapes(eight["state"]) == shapes(one["state"])
    metrics = lambda m: {k: np.shape(v) for k, v in m.items()}
    assert metrics(eight["metrics"]) == metrics(one["metrics"]) == dict.fromkeys(one["metrics"], ())
    for name in ("updated", "skipped_microbatches", "nonfinite_microbatches"):  # exact counts
        assert int(eight["metrics"][name]) == int(one["metrics"][name]) == int(name == "updated")
    # Both runs give one device's values (float32 sums in another order: 1e-5 after 200 Adam
    # steps of the optax loop, then 20 of the scan step).
    for got, want in [
        (eight["params"], one["params"]),
        (eight["state"].params, one["state"].params),
    ]:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(eight["state"].step) == int(one["state"].step) == 20
