#!/usr/bin/env bash
# One GPU run for the whole-model status: builds the core (CUDA, sm_90a) and the torch and jax
# packages; the CUDA tests of the fused residual + dropout (bit for bit against the CPU) and
# TransformerLayer; the JAX model stack's kernels at hidden 1024 (kernel_profile_jax.py); then
# bench_model.py at hidden 1024 and 2048 with every execution mode of te.TransformerLayer in
# FP8 delayed (eager, compiled, one captured graph), FP8 current and bf16 eager, and torch's
# blocks (eager, compiled, reduce-overhead). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_model_status.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_model_status.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 60)) 70)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/common/test_dropout.py tests/pytorch/test_dropout_add.py \
  tests/pytorch/test_transformer_layer.py
step jax_profile_1024 "$(upto $((budget - 60)) 130)" python3 benchmarks/kernel_profile_jax.py \
  --hidden 1024 --name "kernel_profile_jax$suffix"
model_s=$(left $((budget - 5)))
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden 1024 2048 \
  --budget-s $((model_s - 30)) --module-iters 200 --name "model_status$suffix" --variants \
  'te_layer/fp8_delayed/eager' 'te_layer/fp8_delayed/compile' 'te_layer/fp8_delayed/cuda_graph' \
  'te_layer/fp8_current/eager' 'te_layer/bf16/eager' 'torch/bf16/*'
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
