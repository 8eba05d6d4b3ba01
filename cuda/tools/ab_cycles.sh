#!/bin/bash
# A/B of source trees by one kernel's cycles (Nsight Compute): each tree is built in turn (pip install -e),
# optionally tested, then per case the kernel's elapsed cycles (sm__cycles_elapsed.max) and instructions
# executed in one call (the third: ncu_case.py makes three of each case, all cases in one process). Cycles
# repeat to a fraction of a percent from call to call where the wall clock cannot tell 2-4% (cuda/NOTES.md,
# "Groups of slices in the forward").
# The clocks are left as they are (--clock-control none: the device README asks for it).
#   bash cuda/tools/ab_cycles.sh .snap_a .snap_b "causal_32k varlen_swa1024_32k"   # from the repo root
# Knobs: AB_KERNEL (ncu -k regex, default FlashFwdSm90Kernel), AB_MODE (fwd or fwd+bwd, default fwd),
# AB_NCU_TIMEOUT (seconds per ncu run, default 70), AB_TESTS (a pytest -k expression on
# tests/test_ffa_sm90_gpu.py and tests/test_ffa_gpu.py, run on each tree but the first), AB_TEST_TIMEOUT,
# AB_TEST_WORKERS. Writes $OUT/cycles.md and $OUT/cyc_<tree>_tests.log.
set -u
OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
ROOT=$(pwd)
CASES=${!#}
echo "| tree | case | cycles | instructions |" | tee "$OUT/cycles.md"
echo "|---|---|---|---|" | tee -a "$OUT/cycles.md"
for tree in "${@:1:$#-1}"; do
  name=$(basename "$tree")
  cd "$ROOT/$tree" || exit 1
  python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/cyc_build.log 2>&1 || {
    echo "$tree: build failed"; tail -20 /tmp/cyc_build.log; exit 1; }
  if [ -n "${AB_TESTS:-}" ] && [ "$tree" != "$1" ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${AB_TEST_TIMEOUT:-180}" python3 -m pytest -q -x -p no:cacheprovider \
      -n "${AB_TEST_WORKERS:-4}" tests/test_ffa_sm90_gpu.py tests/test_ffa_gpu.py -k "$AB_TESTS" \
      > "$OUT/cyc_${name}_tests.log" 2>&1
    echo "$tree tests: rc $? $(tail -1 "$OUT/cyc_${name}_tests.log")"
  fi
  # Every case in one process (ncu_case.py calls each three times; the third is measured): one process start
  # per tree. Under a limit per case: a build that hangs (a barrier count wrong) costs a minute, not the call.
  n=$(echo $CASES | wc -w)
  timeout $(( ${AB_NCU_TIMEOUT:-70} * n )) ncu --clock-control none \
    --metrics sm__cycles_elapsed.max,smsp__inst_executed.sum --csv -k "regex:${AB_KERNEL:-FlashFwdSm90Kernel}" \
    python3 cuda/tools/ncu_case.py $CASES "${AB_MODE:-fwd}" > /tmp/cyc.csv 2>&1
  rc=$?
  python3 cuda/tools/ncu_csv.py /tmp/cyc.csv --every 3 --labels $CASES | sed "s/^| /| $name | /" \
    | tee -a "$OUT/cycles.md"
  [ $rc = 0 ] || echo "| $name | rc $rc$([ $rc = 124 ] && echo ': TIMED OUT (a hang?)') | | |" | tee -a "$OUT/cycles.md"
done
