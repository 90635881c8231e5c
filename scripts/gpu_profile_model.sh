#!/usr/bin/env bash
# One GPU run: where the layer stack's GPU time goes. Builds the core (CUDA, sm_90a) and the
# torch package as committed, runs the layer node's CUDA tests, profiles bench_model's stack
# kernel by kernel (kernel_profile_model.py: hidden 1024, every case; hidden 4096, FP8 delayed
# and both bf16 stacks), and times the stack at 1024 (each case in a fresh process). Logs go to
# $1/log.txt, JSON to $1. (scripts/gpu_layer_op.sh is the run that decides
# layer_block_op.on_cuda.)
#
#   bash scripts/gpu_profile_model.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (480)
set -u
out=${1:?usage: gpu_profile_model.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-480}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
# (each step's deadline counts back from the budget, later steps later)
step layer_tests "$(upto $((budget - 270)) 60)" python3 -m pytest -p no:cacheprovider -q -m cuda -rfE \
  -n 4 tests/pytorch/test_layer_block.py
step kprof_1024 "$(upto $((budget - 210)) 70)" python3 benchmarks/kernel_profile_model.py --hidden 1024 \
  --name "kernel_profile_model_1024$suffix"
step kprof_4096 "$(upto $((budget - 150)) 60)" python3 benchmarks/kernel_profile_model.py --hidden 4096 \
  --cases te_layer/fp8_delayed te_layer/bf16 torch/bf16 --name "kernel_profile_model_4096$suffix"
set -f  # the case patterns are globs for bench_model, not for the shell
step bench_1024 "$(upto $((budget - 5)) 145)" python3 benchmarks/bench_model.py --hidden 1024 \
  --isolate --budget-s 130 --module-iters 200 --name "model_profile_1024$suffix" \
  --variants 'te_layer/fp8_delayed/eager' 'te_layer/bf16/eager' 'torch/bf16/eager' \
  'torch/bf16/compile' 'te_layer/fp8_delayed/compile'
set +f
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
