#!/bin/bash
# Every one-GPU test in one device call, on libraries built beforehand (cuda/device_run.sh builds and benches
# too): about 5 minutes on an H100 (49th session; tests/conftest.py turns XLA's GEMM autotuning off, which had
# made these files 3x slower under 8 workers). Each group runs under its own timeout with -v, so a cut call still
# names what passed; logs go to $OUT.
#   LIB=so/main bash cuda/gpu_suite.sh   # LIB: a folder holding libmagi_jax_cuda.so and _ffi_cpu*.so
set -u
cd "$(dirname "$0")/.."  # PYTHONPATH and the test paths are the repository root's
OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
[ -n "${LIB:-}" ] && cp "$LIB"/_ffi_cpu*.so "$LIB"/libmagi_jax_cuda.so magi_jax/
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
status=0  # 1 once a group fails or times out
run_group() {  # run_group NAME TIMEOUT PYTEST_ARGS...
  local name=$1 limit=$2 t0=$(date +%s)
  shift 2
  timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --durations=8 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || status=1
  echo "$name: rc $rc in $(( $(date +%s) - t0 )) s; $(grep -c ' PASSED' "$OUT/$name.log") passed," \
    "$(grep -cE ' (FAILED|ERROR)' "$OUT/$name.log") failed"
  grep -E " (FAILED|ERROR) " "$OUT/$name.log" | sed 's/.*::/  /' | head -20
  pkill -9 -f "python3 -m pytest" || true  # xdist workers outlive a pytest killed by its timeout
}
# The sm90 file at 4 workers: 8 of its tests at once run an H100's 80 GB out. The 1M-token tests alone (~20 GB).
run_group ffa 200 -n 8 tests/test_ffa_gpu.py tests/test_range_ops_gpu.py tests/test_nn.py \
  tests/test_max_logit_gpu.py -k "not one_million"
run_group sm90 180 -n 4 tests/test_ffa_sm90_gpu.py
run_group mma 150 -n 8 tests/test_ffa_mma_gpu.py -k "not one_million"
run_group one_million 60 tests/test_ffa_gpu.py tests/test_ffa_mma_gpu.py -k one_million
exit $status
