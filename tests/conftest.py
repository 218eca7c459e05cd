"""Test set-up: 8 host CPU devices for the data-parallel tests, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# Many tests compile the same programs (the same model, step and shapes). JAX's persistent
# compilation cache, shared by the run's pytest-xdist workers, compiles each of them once: the
# main process makes a fresh directory for the run (the workers inherit it through the
# environment) and removes it at the end. Nothing is kept across runs.
CACHE_VAR = "ACCUMJAX_TEST_JAX_CACHE"
_OWNER = pytest.StashKey[str]()


def pytest_configure(config):
    if CACHE_VAR not in os.environ:
        os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="accumjax-jax-cache-")
        config.stash[_OWNER] = os.environ[CACHE_VAR]
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VAR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size limit turns on the cache's file lock: without it, a worker can read an entry
    # another worker is still writing (JAX writes entries in place), and a truncated
    # executable aborted a worker once. 16 GiB is never reached in one run.
    jax.config.update("jax_compilation_cache_max_size", 16 * 2**30)


def pytest_unconfigure(config):
    owned = config.stash.get(_OWNER, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        os.environ.pop(CACHE_VAR, None)


# The error filters of pyproject.toml's filterwarnings, for the processes a test starts (the
# examples, the jax.distributed workers): they inherit the environment, not pytest's filters.
# Set per test, so that pytest-xdist's workers (started before any test) are not affected.
SUBPROCESS_WARNINGS = "error::DeprecationWarning,error::FutureWarning"


@pytest.fixture(autouse=True)
def _deprecations_are_errors_in_subprocesses(monkeypatch):
    current = os.environ.get("PYTHONWARNINGS", "")
    if SUBPROCESS_WARNINGS not in current:
        monkeypatch.setenv("PYTHONWARNINGS", ",".join(filter(None, [current, SUBPROCESS_WARNINGS])))
