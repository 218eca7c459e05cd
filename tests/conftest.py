"""Test set-up: 8 host CPU devices for the data-parallel tests, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402

# The error filters of pyproject.toml's filterwarnings, for the processes a test starts (the
# examples, the jax.distributed workers): they inherit the environment, not pytest's filters.
# Set per test, so that pytest-xdist's workers (started before any test) are not affected.
SUBPROCESS_WARNINGS = "error::DeprecationWarning,error::FutureWarning"


@pytest.fixture(autouse=True)
def _deprecations_are_errors_in_subprocesses(monkeypatch):
    current = os.environ.get("PYTHONWARNINGS", "")
    if SUBPROCESS_WARNINGS not in current:
        monkeypatch.setenv("PYTHONWARNINGS", ",".join(filter(None, [current, SUBPROCESS_WARNINGS])))
