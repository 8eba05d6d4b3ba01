#!/bin/bash
# A/B of source trees on one GPU machine: each is built in turn (pip install -e), optionally tested, and
# benched with the same kernel cases; ffa and cuDNN side by side in each (ratios decide, not the raw times of
# two builds). Trees are folders of the working tree that travel with the call (git archive snapshots, named
# in the device call's carry); the last argument is the cases.
#   bash cuda/tools/ab_bench.sh .snap .snap_b "varlen_swa1024_32k causal_4k_x8"   # from the repo root
#   bash cuda/tools/ab_bench.sh .snap_b .snap .snap_c "causal_32k"                 # three trees, in turn
# Knobs: AB_TESTS (a pytest -k expression run on each tree but the first, the baseline, unless AB_TEST_BASE=1;
# tests/test_ffa_sm90_gpu.py and tests/test_ffa_gpu.py), AB_IMPLS (default "ffa cudnn"; a column a tree's
# bench/kernel.py does not know is left empty), AB_TEST_WORKERS (pytest-xdist processes, default 4), AB_ROUNDS
# (bench/kernel.py --rounds, default 1, for the trees whose bench has it: each tree runs in its own process,
# so rounds interleave the implementations of one tree only), AB_GPU_TIME=1 (bench/kernel.py --gpu-time: each
# implementation's GPU busy time per call from a profiler trace besides the wall clock; it leaves host overhead
# out, not the clock's drift). Writes $OUT/ab_<tree>.md and
# $OUT/ab_<tree>_tests.log.
set -u
OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
ROOT=$(pwd)
CASES=${!#}
for tree in "${@:1:$#-1}"; do
  name=$(basename "$tree")
  cd "$ROOT/$tree" || exit 1
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/ab_${name}_build.log" 2>&1 || {
    echo "$tree: build failed"; tail -20 "$OUT/ab_${name}_build.log"; exit 1; }
  rm -f "$OUT/ab_${name}_build.log"
  if [ -n "${AB_TESTS:-}" ] && { [ "$tree" != "$1" ] || [ "${AB_TEST_BASE:-0}" = 1 ]; }; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${AB_TEST_TIMEOUT:-180}" python3 -m pytest -q -x -p no:cacheprovider \
      -n "${AB_TEST_WORKERS:-4}" tests/test_ffa_sm90_gpu.py tests/test_ffa_gpu.py -k "$AB_TESTS" \
      > "$OUT/ab_${name}_tests.log" 2>&1
    echo "$tree tests: rc $? $(tail -1 "$OUT/ab_${name}_tests.log")"
  fi
  echo "=== $tree"
  options=()  # what this tree's bench/kernel.py knows of them
  grep -q -- '"--rounds"' bench/kernel.py && options=(--rounds "${AB_ROUNDS:-1}")
  [ "${AB_GPU_TIME:-0}" = 1 ] && grep -q -- '"--gpu-time"' bench/kernel.py && options+=(--gpu-time)
  timeout "${AB_BENCH_TIMEOUT:-150}" python3 bench/kernel.py --no-append "${options[@]}" \
    --impls ${AB_IMPLS:-ffa cudnn} --cases $CASES 2>&1 |
    grep -E "^\| " | tee "$OUT/ab_${name}.md"
done
