"""Test set-up: 8 host CPU devices for the data-parallel tests, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)
