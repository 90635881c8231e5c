#!/usr/bin/env bash
# A short GPU check that fits one 10-minute run: builds the core (CUDA, sm_90a) and the torch
# package into the current Python, then, each step within what is left of the time budget:
# the host profile of a TransformerLayer step (bench_host_profile.py), the CUDA tests of the
# compiled and fused paths, and the whole-model benchmark at hidden 1024 for the eager,
# compiled and CUDA-graph cases beside torch's. Logs go to $1/log.txt, benchmark JSON to $1.
#
#   bash scripts/gpu_quick.sh OUT_DIR        # TE_QUICK_BUDGET_S: seconds to use (590)
#
# Wheels in .whl/ (brought for a machine without network: cudnn-frontend, torchao, nox) are
# installed beside the machine's packages first. scripts/gpu_check.sh is the full check.
set -u
out=${1:?usage: gpu_quick.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
start=$(date +%s)
budget=${TE_QUICK_BUDGET_S:-590}
log=$out/log.txt
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-wheels .whl/*.whl \
    && export PYTHONPATH=/tmp/te-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
left() { echo $(( $1 - ($(date +%s) - start) )); }  # seconds from now until second $1
upto() { local l; l=$(left "$1"); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
step() {  # step NAME LIMIT_S COMMAND...: runs it within LIMIT_S, logged with its exit status
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 15 ]; then echo "== $name skipped (no time left)" >> "$log"; return; fi
  echo "== $name (limit ${limit}s, at $(( $(date +%s) - start ))s)" >> "$log"
  timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
  echo "== $name exit $? (at $(( $(date +%s) - start ))s)" >> "$log"
}
nvidia-smi -L >> "$log"
step build_common 300 python3 -m pip install --no-build-isolation --no-deps -q \
  -C cmake.define.TE_WITH_CUDA=ON -C cmake.define.TE_CUDA_ARCHITECTURES=90a ./common
step build_torch 120 env CXX=/usr/bin/g++ CC=/usr/bin/gcc python3 -m pip install \
  --no-build-isolation --no-deps -q ./pytorch
export TE_BENCH_RESULTS=$out
step host_profile "$(upto $((budget - 260)) 60)" python3 benchmarks/bench_host_profile.py --steps 100
step cuda_tests "$(upto $((budget - 170)) 110)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE tests/pytorch/test_fast_linear.py tests/pytorch/test_compiled_blocks.py \
  tests/pytorch/test_compiled_grads.py tests/pytorch/test_inference_params.py \
  tests/pytorch/test_graphed_callables.py tests/pytorch/test_compiled_forward.py \
  tests/pytorch/test_padded_packing.py tests/pytorch/test_hp_blocks.py \
  tests/pytorch/test_cross_entropy.py
model_s=$(left $((budget - 15)))
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden 1024 \
  --budget-s $((model_s - 20)) --name model --variants 'te_mha_mlp/fp8_delayed/eager' \
  'te_mha_mlp/bf16/eager' 'te_layer/fp8_delayed/eager' 'te_layer/fp8_delayed/compile' \
  'te_mha_mlp/fp8_delayed/cuda_graph' 'torch/bf16/*'
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
