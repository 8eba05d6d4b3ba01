#!/bin/bash
# One call on the 2-GPU device machine (issue 6): build the package, run the gpu-marked distributed tests,
# profile the overlapped forward+backward (compiled schedule + jax.profiler trace summary, once per variant of
# XLA flags / environment), then run bench/dist.py. Logs go to $OUT (at most 8 files come back: summary.txt,
# build.log, tests.log, profile.log, hlo_<variant>_<pass>.txt, bench.log or compare.log, dist_bench.json).
#
#   bash bench/dist_device_run.sh                       # all steps (may pass the 10-minute limit of one call)
#   bash bench/dist_device_run.sh build tests           # then, on the same (warm) machine:
#   bash bench/dist_device_run.sh build profile bench   # (the second build is incremental: seconds)
#   bash bench/dist_device_run.sh build compare         # magi variants side by side, default flags and limit 2
# On 4 or 8 GPUs (issue 8), one call per line (each under the 10-minute limit):
#   BENCH_ARGS="--masks varlen_causal varlen_full varlen_block_causal" bash bench/dist_device_run.sh build bench
#   BENCH_ARGS="--masks varlen_causal varlen_full varlen_block_causal --tokens-per-gpu 16384" bash ... build bench
#   BENCH_ARGS="--dp 2 --masks varlen_causal varlen_block_causal" bash ... build bench     # 8 GPUs: dp 2 x cp 4
#   python3 bench/calibrate.py     # fits the cost model, prints predicted against measured per stage and rank
#
# Knobs: TESTS (extra pytest args), BENCH_ARGS, PROFILE_ARGS, PROFILE_VARIANTS ("name:VAR=v VAR='v w';..."),
# PROFILE_PASSES (default "fwd+bwd"; "fwd fwd+bwd" profiles the forward alone too), PROFILE_METHODS (default
# "magi"; "magi single" profiles the single-GPU baseline's step too),
# COMPARE_METHODS (default "magi magi_bwd_fused magi_margin0 single"), COMPARE_CALLS (bench/dist.py --calls values,
# one compare each; default "10"), *_TIMEOUT (seconds per step). Every step
# is time-limited so that partial results come back.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/magi_dist_out}
mkdir -p "$OUT"
STEPS=${*:-build tests profile bench}
SUMMARY="$OUT/summary.txt"
# Default variants: the sm90 kernels with jax's default flags, and with two async collectives in flight (the
# K and V all-to-alls of a stage; with the default limit of one, XLA runs the second synchronously).
LIMIT2=--xla_gpu_experimental_parallel_collective_overlap_limit=2
PROFILE_VARIANTS=${PROFILE_VARIANTS:-"default:MAGI_JAX_FFA_KERNEL=sm90;limit2:MAGI_JAX_FFA_KERNEL=sm90 XLA_FLAGS=$LIMIT2"}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  echo "steps: $STEPS"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -5
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
} > "$SUMMARY"

step() {  # step NAME TIMEOUT LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
  return $rc
}

for s in $STEPS; do
  case $s in
    build)
      : > "$OUT/build.log"
      step build "${BUILD_TIMEOUT:-240}" "$OUT/build.log" \
        python3 -m pip install --no-build-isolation --no-deps -e . || { tail -30 "$OUT/build.log"; exit 1; }
      python3 -c "from magi_jax import _ffi; print('CUDA library:', _ffi.HAS_CUDA_LIBRARY)" >> "$SUMMARY" 2>&1
      ;;
    tests)
      : > "$OUT/tests.log"
      eval "test_args=(${TESTS:-})"  # quotes allowed: TESTS='-k "not range_ops and not packed"'
      step tests "${TEST_TIMEOUT:-300}" "$OUT/tests.log" \
        python3 -m pytest -q -rfE -p no:cacheprovider --durations=10 -s tests/test_dist_gpu.py "${test_args[@]}"
      grep -E "passed|failed|error" "$OUT/tests.log" | tail -3 >> "$SUMMARY"
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30 >> "$SUMMARY"
      ;;
    profile)
      : > "$OUT/profile.log"
      # One process per variant "name:VAR=value VAR=value" (XLA reads its flags once per process).
      IFS=';' read -ra variants <<< "$PROFILE_VARIANTS"
      for entry in "${variants[@]}"; do
        variant=${entry%%:*}
        eval "assignments=(${entry#*:})"  # quotes allowed: XLA_FLAGS='--a --b'
        dir=/tmp/magi_dist_trace_$variant
        rm -rf "$dir"
        for pass in ${PROFILE_PASSES:-fwd+bwd}; do
          for method in ${PROFILE_METHODS:-magi}; do
            echo "=== profile $variant, $method, $pass: ${assignments[*]}" >> "$OUT/profile.log"
            step "profile ($variant, $method, $pass)" "${PROFILE_TIMEOUT:-120}" "$OUT/profile.log" \
              env "${assignments[@]}" python3 bench/dist.py --profile "$dir" --profile-only --masks varlen_causal \
              --profile-pass "$pass" --profile-method "$method" ${PROFILE_ARGS:-}
          done
          hlo="$dir/hlo/magi_${pass/+/_}.txt"
          [ -f "$hlo" ] && cp "$hlo" "$OUT/hlo_${variant}_${pass/+/_}.txt"
        done
      done
      grep -E "^(===|profile|collectives|async collectives|  all|  collective|/device|.*NCCL kernels|  span|  GPU idle)" \
        "$OUT/profile.log" >> "$SUMMARY"
      ;;
    bench)
      : > "$OUT/bench.log"
      lines=$(wc -l < BENCHMARKS.md)
      step bench "${BENCH_TIMEOUT:-360}" "$OUT/bench.log" python3 bench/dist.py ${BENCH_ARGS:-}
      echo "--- appended to BENCHMARKS.md:" >> "$SUMMARY"
      tail -n +"$((lines + 1))" BENCHMARKS.md >> "$SUMMARY"
      ;;
    compare)
      # One process per flag setting (XLA reads its flags once); varlen causal only, nothing appended.
      : > "$OUT/compare.log"
      for calls in ${COMPARE_CALLS:-10}; do
        for flags in "" "$LIMIT2"; do
          echo "=== XLA_FLAGS='$flags' --calls $calls" >> "$OUT/compare.log"
          step "compare (XLA_FLAGS='$flags', --calls $calls)" "${COMPARE_TIMEOUT:-120}" "$OUT/compare.log" \
            env XLA_FLAGS="$flags" python3 bench/dist.py --no-append --masks varlen_causal --calls "$calls" \
            --methods ${COMPARE_METHODS:-magi magi_bwd_fused magi_margin0 single}
        done
      done
      grep -E "^(===|\| varlen)" "$OUT/compare.log" >> "$SUMMARY"
      ;;
    *) echo "unknown step $s (build, tests, profile, bench, compare)" | tee -a "$SUMMARY" ;;
  esac
done
cat "$SUMMARY"
