"""Smoke tests: every script in examples/ runs to completion and prints its key claim."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def run_example(name: str, devices: int = 1, args: tuple[str, ...] = ()) -> str:
    """Runs ``examples/<name> *args`` from the repository root and returns its stdout."""
    env = dict(os.environ)
    # conftest.py asks for 8 host devices; give each example only what it needs.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if devices > 1:
        flags.append(f"{DEVICE_COUNT_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    # Import this checkout's accumjax even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"{name} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
        f"--- stderr ---\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


@pytest.mark.slow
def test_digits_cnn_accum_bn():
    out = run_example("digits_cnn_accum_bn.py")
    assert "accumulated training matches full-batch training: True" in out
    assert "running BN stats after the first update" in out


@pytest.mark.slow
def test_token_weighted_sequence():
    out = run_example("token_weighted_sequence.py")
    assert "weighted scaling reproduces the full-batch token-mean gradient: True" in out


@pytest.mark.slow
def test_data_parallel_8_devices():
    out = run_example("data_parallel_8_devices.py", devices=8)
    assert "all-reduce ops per update: accumjax 1," in out
    assert "matches the single-device full batch: True" in out


@pytest.mark.slow
def test_checkpoint_resume():
    out = run_example("checkpoint_resume.py")
    assert "bit-identical: True" in out


@pytest.mark.slow
def test_fsdp_8_devices():
    out = run_example("fsdp_8_devices.py", devices=8)
    assert "collectives per window (K=4): all-reduce 1, reduce-scatter 3, all-gather 3" in out
    assert "FSDP accumulation matches the single-device run: True" in out


@pytest.mark.slow
def test_nnx_digits():
    out = run_example("nnx_digits.py")
    assert "running BN stats after the first update" in out
    assert "accumulated training matches full-batch training: True" in out


@pytest.mark.slow
def test_demo_runs_quick():
    # examples/demo.py is the one-command demo in the README; --quick trains 2 epochs. It exits
    # non-zero (failing run_example) if the two runs' parameters differ beyond its tolerance.
    out = run_example("demo.py", args=("--quick",))
    assert "epoch   loss full    loss K=8  max |dparam|" in out
    assert "XLA temp memory per step: full batch" in out
    assert "accumulated training matches full-batch training (max |dparam| <= 0.0001): True" in out
