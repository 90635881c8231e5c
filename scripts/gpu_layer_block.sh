#!/usr/bin/env bash
# One GPU run for te.TransformerLayer's step as one autograd node (layer_block.py): builds the
# core (CUDA, sm_90a) and the torch package; the CUDA tests of the node, the whole blocks and
# TransformerLayer (the node's bits against the modules' path with cuBLASLt and cuDNN), and
# that an eager step never waits for the GPU; then bench_model.py at hidden 1024, 2048, 4096:
# the layer stack eager with the node on (te_layer) and off (te_layer_modules) under delayed
# and current scaling, our bf16 and torch's blocks eager and compiled, plus the per-module
# host probe; then where the host time of one layer's step goes at hidden 1024 with the node.
# Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_layer_block.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_layer_block.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 60)) 110)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/pytorch/test_layer_block.py tests/pytorch/test_compiled_blocks.py \
  tests/pytorch/test_transformer_layer.py tests/pytorch/test_eager_step_never_waits.py
model_s=$(upto $((budget - 75)) 260)
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden 1024 2048 4096 \
  --budget-s $((model_s - 30)) --module-iters 200 --name "model_layer_block$suffix" --variants \
  'te_layer/fp8_delayed/eager' 'te_layer_modules/fp8_delayed/eager' \
  'te_layer/fp8_current/eager' 'te_layer_modules/fp8_current/eager' 'te_layer/bf16/eager' \
  'torch/bf16/eager' 'torch/bf16/compile'
step host_profile "$(left $((budget - 5)))" python3 benchmarks/bench_host_profile.py \
  --shape 4 2048 1024 --steps 50 --top 30 --cases te_layer/fp8_delayed te_layer/fp8_current \
  --name "host_profile_1024_node$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
