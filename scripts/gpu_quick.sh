#!/usr/bin/env bash
# A short GPU check that fits one 10-minute run: builds the core (CUDA, sm_90a) and the torch
# package into the current Python, then, each step within what is left of the time budget:
# the host profile of a TransformerLayer step (bench_host_profile.py), the CUDA tests of the
# compiled and fused paths, and the whole-model benchmark at hidden 1024 for the eager,
# compiled and CUDA-graph cases beside torch's. Logs go to $1/log.txt, benchmark JSON to $1.
#
#   bash scripts/gpu_quick.sh OUT_DIR        # TE_QUICK_BUDGET_S: seconds to use (590)
#
# scripts/gpu_check.sh is the full check.
set -u
out=${1:?usage: gpu_quick.sh OUT_DIR}
budget=${TE_QUICK_BUDGET_S:-590}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
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
