"""Smoke tests: every script in examples/ runs to completion and prints its key claim."""

import contextlib
import importlib.util
import io
import os
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, args: tuple[str, ...] = ()) -> str:
    """Runs ``examples/<name> *args`` as ``__main__`` in this process and returns its stdout;
    an exit status other than 0 fails.

    In this process, not a new one: no second start of Python and JAX (seconds an example),
    and programs compiled once serve again (in memory and conftest.py's compilation cache).
    The process has conftest.py's 8 host CPU devices: the 8-device examples need them (they
    check the count), the others compute on the first. No example changes a global JAX
    setting; the XLA_FLAGS the 8-device ones extend for a process of their own are restored.
    """
    path = ROOT / "examples" / name
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(sys, "argv", [str(path), *args])
        patch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit_:
            assert exit_.code in (0, None), f"{name} exited with {exit_.code}\n{out.getvalue()}"
    return out.getvalue()


# Each example, its arguments and the lines its output must contain (its key claims).
# --quick: digits_cnn_accum_bn.py trains 30 updates, not 150; nnx_digits.py 8 epochs, not 25;
# demo.py (the one-command demo in the README) 2 epochs. demo.py exits non-zero (failing
# run_example) if the two runs' parameters differ beyond its tolerance.
CLAIMS = {
    "digits_cnn_accum_bn.py": (
        ["--quick"],
        [
            "accumulated training matches full-batch training: True",
            "running BN stats after the first update",
        ],
    ),
    "token_weighted_sequence.py": (
        [],
        ["weighted scaling reproduces the full-batch token-mean gradient: True"],
    ),
    "data_parallel_8_devices.py": (
        [],
        [
            "gradient all-reduces per update: accumjax 1,",
            "all-reduces per update, of any size: 1",
            "matches the single-device full batch: True",
        ],
    ),
    "checkpoint_resume.py": ([], ["bit-identical: True"]),
    "fsdp_8_devices.py": (
        [],
        [
            "collectives per window (K=4): all-reduce 1, reduce-scatter 12, all-gather 3",
            "FSDP accumulation matches the single-device run: True",
        ],
    ),
    "nnx_digits.py": (
        ["--quick"],
        [
            "running BN stats after the first update",
            "accumulated training matches full-batch training: True",
        ],
    ),
    "demo.py": (
        ["--quick"],
        [
            "epoch   loss full    loss K=8  max |dparam|",
            "XLA temp memory per step: full batch",
            "accumulated training matches full-batch training (max |dparam| <= 0.0001): True",
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CLAIMS)
def test_example_runs_and_prints_its_claims(name):
    args, claims = CLAIMS[name]
    out = run_example(name, args=tuple(args))
    for claim in claims:
        assert claim in out, f"{name} did not print {claim!r}\n{out}"


def _transformer_lm():
    spec = importlib.util.spec_from_file_location(
        "transformer_lm", ROOT / "examples" / "transformer_lm.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_transformer_example_is_the_same_program_on_one_device_and_eight():
    # The example unchanged but for where its arrays lie (train(mode, mesh)): the same
    # metric keys and shapes, state structure and values on 1 and 8 host devices, and a
    # checkpoint saved mid-window on 8 devices finishes on one as the uninterrupted run.
    import jax
    import numpy as np

    lm = _transformer_lm()
    assert jax.device_count() >= 8
    mesh = jax.make_mesh((8,), ("data",))
    for mode in ("scan", "stream"):
        one, one_losses, one_metrics = lm.train(mode)
        eight, eight_losses, eight_metrics = lm.train(mode, mesh)
        shapes = lambda m: {k: np.shape(v) for k, v in m.items()}
        assert shapes(eight_metrics) == shapes(one_metrics) == dict.fromkeys(one_metrics, ())
        structure = lambda state: jax.tree.structure(state.replace(tx=None))  # tx: static
        assert structure(eight) == structure(one)
        # float32 sums over 8 devices' rows, reduced once: another order of the same sums.
        np.testing.assert_allclose(eight_losses, one_losses, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(eight.params), jax.tree.leaves(one.params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    resumed, resumed_losses, _ = lm.train("stream", mesh, checkpoint_at=lm.K + 2)
    np.testing.assert_allclose(resumed_losses, one_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(one.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
