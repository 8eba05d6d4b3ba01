#!/bin/bash
# One call on the GPU machine: build the package (CPU module + libmagi_jax_cuda.so), run the GPU tests, run
# the kernel benchmark. Logs and JSON go to $OUT. Knobs: TESTS (pytest args), BENCH_ARGS, *_TIMEOUT.
set -u
OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv \
  > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  echo "build failed"; tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t0=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -rfE -n "${TEST_WORKERS:-4}" \
    -p no:cacheprovider --timeout 240 --durations=12 -s tests/test_ffa_gpu.py ${TESTS:-} > "$OUT/tests.log" 2>&1
  echo "tests: rc $? in $(( $(date +%s) - t0 )) s"
  grep -E "peak GPU memory|passed|failed" "$OUT/tests.log" | tail -5
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernel.py --no-append ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench: rc $? in $(( $(date +%s) - t0 )) s"
  sed -n '/^| case/,$p' "$OUT/bench.log"
fi
