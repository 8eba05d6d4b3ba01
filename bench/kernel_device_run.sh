#!/bin/bash
# One call on a one-GPU device machine (issue 4's measure): issue 4's seven cases beside cuDNN and tokamax, as
# the issue asks (one run), on libraries built beforehand. The machine reaches no registry, so tokamax and its
# dependencies travel as wheels in .whl/ (carry [".whl", "so"]); fetch them here once with
#   PYENV_VERSION=$(pyenv versions --bare | grep "^3\.12" | tail -1) python3.12 -m pip download -q --no-deps \
#     --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl tokamax==0.0.17 einshape \
#     qwix immutabledict tensorboardx pydantic pydantic_core annotated_types typing_inspection typing_extensions
#   LIB=so/main bash bench/kernel_device_run.sh   # ~5 min; LIB: a folder with libmagi_jax_cuda.so, _ffi_cpu*.so
#   CASES="varlen_swa1024_32k" LIB=so/main bash bench/kernel_device_run.sh   # some of the cases (~1 min each)
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/magi_out}
mkdir -p "$OUT"
[ -n "${LIB:-}" ] && cp "$LIB"/_ffi_cpu*.so "$LIB"/libmagi_jax_cuda.so magi_jax/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
CASES=${CASES:-varlen_causal_64k causal_32k varlen_block_causal_32k varlen_swa1024_32k shared_question_16k \
  causal_4k_x8 causal_16k_d256}
timeout 500 python3 bench/kernel.py --rounds 2 --impls ffa cudnn tokamax --cases $CASES 2>&1 \
  | tee "$OUT/issue4.log" | grep "^|\|target\|met\|MISSED"
