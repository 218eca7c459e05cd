#!/usr/bin/env bash
# Every benchmark on this machine's GPU, written to OUT (default benchmarks/results/gpu):
# results.json and the plots, beside (not over) the committed CPU figures.
#
#   bash benchmarks/gpu.sh [OUT]            # the whole set
#   bash benchmarks/gpu.sh --quick [OUT]    # what the GPU checks need, in one short run
#
# It runs from this checkout (PYTHONPATH), with the jax, flax, optax, orbax-checkpoint and
# matplotlib the machine has (no network needed), and prints the tables at the end. The
# collectives and memory benchmarks run on host CPU devices, as on a CPU machine. On an H200 the
# whole set did not finish within the 270 s it was given (where it stood was not recorded;
# OUT/results.partial.json now keeps the benchmarks that finish);
# the compile benchmark with 4 rounds took about 3 minutes there. The whole set takes about
# 15 minutes on the 2-core CPU machine with --device cpu.
#
# --quick runs only the compile benchmark (2 compile rounds after the warm-up, 10 timed rounds)
# and the non-finite window benchmark (bench_nonfinite: 10 rounds), i.e.
#   python -m benchmarks.run_all --device gpu --only compile,nonfinite --quick --rounds 10
# and merges them into OUT/results.json. Meant to finish in under 4 minutes on one H200: from
# the H200 compile times in benchmarks/results/gpu/compile.json (about 24 s per compile round
# over the 3 models x 3 variants it had then) it should take about 2 minutes, not yet measured
# there. QUICK_DEVICE=cpu runs the same on the CPU (a smoke test of the script): 205 s on the
# 2-core CPU machine (183 s of it the compile benchmark), before the compile benchmark's fourth
# model (the parameter-dominated one of issue 37: 12.7 s more there with these rounds,
# 2026-12-05).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi
out="${1:-benchmarks/results/gpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ((quick)); then
  device="${QUICK_DEVICE:-gpu}"
  if [[ "$device" == gpu ]]; then
    python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
  fi
  start=$SECONDS
  python3 -m benchmarks.run_all --device "$device" --out "$out" \
    --only compile,nonfinite --quick --rounds 10
  python3 -m benchmarks.report "$out/results.json"
  echo "gpu.sh --quick: $((SECONDS - start)) s"
  exit 0
fi
python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
python3 -m benchmarks.run_all --device gpu --out "$out"
python3 -m benchmarks.report "$out/results.json"
