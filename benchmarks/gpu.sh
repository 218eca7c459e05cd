#!/usr/bin/env bash
# Every benchmark on this machine's GPU, written to OUT (default benchmarks/results/gpu):
# results.json and the plots, beside (not over) the committed CPU figures.
#
#   bash benchmarks/gpu.sh [OUT]
#
# It runs from this checkout (PYTHONPATH), with the jax, flax, optax, orbax-checkpoint and
# matplotlib the machine has (no network needed), and prints the tables at the end. The
# collectives benchmark runs on 8 host CPU devices, as on a CPU machine. On an H200 the
# whole set did not finish within the 270 s it was given (where it stood was not recorded;
# OUT/results.partial.json now keeps the benchmarks that finish);
# the compile benchmark with 4 rounds took about 3 minutes there. The whole set takes about
# 15 minutes on the 2-core CPU machine with --device cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
python3 -m benchmarks.run_all --device gpu --out "$out"
python3 -m benchmarks.report "$out/results.json"
