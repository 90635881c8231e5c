#!/usr/bin/env bash
# The whole-model figures in one GPU run (10 minutes): builds the core (CUDA, sm_90a) and the
# torch package, then, each within what is left: te.Linear's host time (bench_linear
# --host-only, results/linear_host.json), the fp8_mha torch.compile probe (default mode), and
# the whole-model benchmark (bench_model.py) at hidden 1024, 2048 and 4096 for te.TransformerLayer
# in FP8 (delayed: eager, compiled, one captured graph; current: eager), bf16 eager, and torch's
# blocks in eager, compiled and reduce-overhead modes. Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_model.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (580)
set -u
out=${1:?usage: gpu_model.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
# what the build left, shared out: te.Linear's host time and the compile probe first (at most
# 15% each), then the model benchmark
rest=$(left "$budget")
step linear_host "$(upto $((budget - rest * 85 / 100)) 60)" python3 benchmarks/bench_linear.py \
  --host-only --name "linear_host$suffix"
step compile_probe "$(upto $((budget - rest * 70 / 100)) 70)" \
  python3 benchmarks/compile_fp8_mha_probe.py default
model_s=$(left $((budget - 10)))
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden 1024 2048 4096 \
  --budget-s $((model_s - 30)) --name "model$suffix" --variants 'te_layer/fp8_delayed/eager' \
  'te_layer/fp8_delayed/compile' 'te_layer/fp8_delayed/cuda_graph' 'te_layer/fp8_current/eager' \
  'te_layer/bf16/eager' 'torch/bf16/*'
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
