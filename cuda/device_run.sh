#!/bin/bash
# One call on the GPU machine: build the package (CPU module + libmagi_jax_cuda.so), the unit check of the sm90
# building blocks (TMA + swizzle + descriptors + wgmma + TMA store, no JAX), the smoke tests under a hard
# timeout (a barrier bug hangs instead of failing; its log says so), the GPU tests, then the kernel benchmark.
# Logs and JSON go to $OUT.
# Tests: tests/test_ffa_sm90_gpu.py and tests/test_ffa_gpu.py (the default sm90 kernels) and
# tests/test_range_ops_gpu.py (the transfers' packing kernels); MMA=1 adds
# tests/test_ffa_mma_gpu.py (the same suite on the mma.sync kernels). QUICK=1: only a subset (what is
# particular to sm90, each mask type, GQA, softcap, both dtypes, head dim 256 by mask type, the two key
# sources, the chained dQ, sm_margin, L2 sections, the merged forward), tests 240 s, bench 170 s.
# Knobs: TEST_K (a pytest -k expression), TESTS (more pytest args), TEST_FILES, BENCH_ARGS, *_TIMEOUT, SKIP_TESTS, SKIP_BENCH, TEST_WORKERS,
# GPUS=2 (two pytest processes, head dim 256 on GPU 1 and the rest on GPU 0: about half the time on the
# 2-GPU machine). At most 8 files come back from a call: gpu.txt, build.log (with the unit check),
# smoke.log, tests.log, bench.log, kernel_bench.json, kernel_bench.md, and one more (ncu_profile.sh's).
#   QUICK=1 bash cuda/device_run.sh             # about 6 minutes
#   SKIP_BENCH=1 MMA=1 TEST_WORKERS=8 bash cuda/device_run.sh   # every kernel test, both kernel families
# Every one-GPU test on libraries built beforehand, in ~5 minutes: cuda/gpu_suite.sh.
set -u
OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
TEST_FILES=${TEST_FILES:-"tests/test_ffa_sm90_gpu.py tests/test_ffa_gpu.py tests/test_range_ops_gpu.py$([ "${MMA:-0}" = 1 ] && echo ' tests/test_ffa_mma_gpu.py')"}
BENCH_ARGS=${BENCH_ARGS:---impls ffa ffa_mma cudnn}
TEST_TIMEOUT=${TEST_TIMEOUT:-360}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}  # bench/kernel.py times 3 rounds
if [ "${QUICK:-0}" = 1 ]; then
  QUICK_K="persistent or repeatable or agree or (each_type_alone and 128-bfloat16) or mixed_types or (gqa and 8-2) or softcap or (256 and each_type_alone) or two_key or chained or nothing or empty or sm_margin or l2_sections or merged or multiple_of_four or packed or tile_orders"
  TEST_K=${TEST_K:-$QUICK_K}
  TEST_TIMEOUT=${TEST_TIMEOUT_QUICK:-240}
  BENCH_TIMEOUT=${BENCH_TIMEOUT_QUICK:-170}
  TEST_WORKERS=${TEST_WORKERS:-8}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv \
  > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  echo "build failed"; tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
# The building blocks alone, no JAX: seconds.
nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icuda cuda/tools/sm90_unit.cu -o /tmp/sm90_unit \
  > /tmp/unit.log 2>&1 && timeout -k 5 60 /tmp/sm90_unit >> /tmp/unit.log 2>&1
echo "unit: rc $?"; tail -5 /tmp/unit.log; cat /tmp/unit.log >> "$OUT/build.log"
# Head dims 64/128 first (a failure or hang stops the call), then head dim 256 apart (reported only).
smoke() {  # smoke NAME K_EXPRESSION
  local t0=$(date +%s)
  echo "=== $1" >> "$OUT/smoke.log"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${SMOKE_TIMEOUT:-150}" python3 -m pytest -q -x -rfE \
    -p no:cacheprovider -s tests/test_ffa_sm90_gpu.py -k "$2" > /tmp/$1.log 2>&1
  local rc=$?
  echo "$1: rc $rc in $(( $(date +%s) - t0 )) s$([ $rc = 124 ] && echo ' (TIMED OUT: a hang, see NOTES.md sm90 debugging)')"
  tail -12 /tmp/$1.log
  cat /tmp/$1.log >> "$OUT/smoke.log"
  return $rc
}
smoke smoke "smoke and not 256" || exit 1
smoke smoke_d256 "smoke and 256"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  eval "TEST_ARGS=(${TESTS:-})"  # TESTS may hold a quoted -k expression
  t0=$(date +%s)
  # -v: every test's name and outcome is in the log even when the timeout cuts the run short.
  run_tests() {  # run_tests GPU K_EXPRESSION LOG (pytest keeps only the last -k: one expression)
    CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$TEST_TIMEOUT" python3 -m pytest -v -rfE \
      -n "${TEST_WORKERS:-4}" -p no:cacheprovider --timeout 240 --durations=12 -s $TEST_FILES "${TEST_ARGS[@]}" \
      ${2:+-k "$2"} > "$3" 2>&1
  }
  K=${TEST_K:-}
  if [ "${GPUS:-1}" = 2 ]; then
    run_tests 1 "${K:+($K) and }256" /tmp/tests1.log & run_tests 0 "${K:+($K) and }not 256" /tmp/tests0.log
    wait
    cat /tmp/tests0.log /tmp/tests1.log > "$OUT/tests.log"
  else
    run_tests 0 "$K" "$OUT/tests.log"
  fi
  echo "tests: in $(( $(date +%s) - t0 )) s;" \
    "$(grep -c ' PASSED ' "$OUT/tests.log") passed, $(grep -cE ' (FAILED|ERROR) ' "$OUT/tests.log") failed"
  grep -E "peak GPU memory|passed|failed" "$OUT/tests.log" | tail -3
  grep -E " (FAILED|ERROR) |node down" "$OUT/tests.log" | sed 's/.*::/  /' | head -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  t0=$(date +%s)
  timeout "$BENCH_TIMEOUT" python3 bench/kernel.py --no-append $BENCH_ARGS > "$OUT/bench.log" 2>&1
  echo "bench: rc $? in $(( $(date +%s) - t0 )) s"
  sed -n '/^| case/,$p' "$OUT/bench.log"
fi
