"""Test set-up: 8 host CPU devices for the data-parallel tests, set before JAX starts."""

import os

# The suite is compile-bound (hundreds of small programs, each run a few times): XLA:CPU's
# LLVM backend without its optimization passes compiles them about a third faster (the
# suite's CPU time: 396 s against 530). XLA's own HLO passes (fusion, buffer assignment: the
# memory figures the tests read) run as before, and no fast math is enabled at any level.
# XLA:CPU's classic kernel emitter, not its MLIR fusion emitters, compiles each program
# faster still (docs/limits.md). The optimized HLO the tests read is the same but for the
# single instructions those emitters wrap in a fusion of their own: the fusions, collectives,
# loops and conditionals are the default's, and the temp memory may differ by up to a
# kilobyte (the memory figures of docs/limits.md are measured with the default).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_use_fusion_emitters=false"
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# Many tests compile the same programs (the same model, step and shapes, built anew). JAX's
# persistent compilation cache compiles each of them once per process: the main process makes
# a fresh directory for the run (the pytest-xdist workers inherit it through the environment),
# each process keeps its entries in a folder of its own, and the main process removes it all
# at the end. Nothing is kept across runs. A folder per process needs no lock (JAX writes an
# entry in place, and a worker once read another's half-written one) and no size limit: a
# limit turns on JAX's eviction check, which lists the whole folder at every new entry under
# that lock, and made the run slower as the cache grew (about 0.1 s a compile late in a run).
CACHE_VAR = "ACCUMJAX_TEST_JAX_CACHE"
_OWNER = pytest.StashKey[str]()


def pytest_configure(config):
    if CACHE_VAR not in os.environ:
        os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="accumjax-jax-cache-")
        config.stash[_OWNER] = os.environ[CACHE_VAR]
    process = os.environ.get("PYTEST_XDIST_WORKER", "main")
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ[CACHE_VAR], process))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1)  # no eviction, no lock


def pytest_collection_modifyitems(config, items):
    """The tests marked slow first (in collection order), the rest after them: the workers
    share out the short ones at the end, and none waits for another's long test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
    owned = config.stash.get(_OWNER, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        os.environ.pop(CACHE_VAR, None)


# The error filters of pyproject.toml's filterwarnings, for the processes a test starts (the
# jax.distributed workers): they inherit the environment, not pytest's filters. Set per test,
# so that pytest-xdist's workers (started before any test) are not affected.
SUBPROCESS_WARNINGS = "error::DeprecationWarning,error::FutureWarning"


def with_subprocess_warnings(current: str | None) -> str:
    """A ``PYTHONWARNINGS`` value: ``current`` with SUBPROCESS_WARNINGS added."""
    current = current or ""
    if SUBPROCESS_WARNINGS in current:
        return current
    return ",".join(filter(None, [current, SUBPROCESS_WARNINGS]))


@pytest.fixture(autouse=True)
def _deprecations_are_errors_in_subprocesses(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", with_subprocess_warnings(os.environ.get("PYTHONWARNINGS")))
