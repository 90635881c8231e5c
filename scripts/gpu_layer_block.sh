#!/usr/bin/env bash
# One GPU run for te.TransformerLayer's step as one autograd node (layer_block.py): builds the
# core (CUDA, sm_90a) and the torch package; the CUDA tests of the node (FP8 and bf16), the
# whole blocks, the high-precision blocks and TransformerLayer (the node's bits against the
# modules' path with cuBLASLt and cuDNN), and that an eager step never waits for the GPU; then
# bench_model.py at hidden 1024 and 2048, each case in a process of its own (--isolate): the
# layer stack eager with the node on (te_layer) and off (te_layer_modules) under delayed and
# current scaling and in bf16, and torch's blocks eager and compiled, plus the per-module host
# probe. Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_layer_block.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (560)
#   TE_GPU_VARIANTS: the bench cases' patterns instead of the default (unquoted, no spaces in one)
#   TE_GPU_HIDDEN: the hidden sizes instead of "1024 2048"
set -u
out=${1:?usage: gpu_layer_block.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 60)) 180)" python3 -m pytest -p no:cacheprovider -v -m cuda \
  -rfE -n 4 tests/pytorch/test_layer_block.py tests/pytorch/test_compiled_blocks.py \
  tests/pytorch/test_hp_blocks.py tests/pytorch/test_transformer_layer.py \
  tests/pytorch/test_eager_step_never_waits.py tests/pytorch/test_graphed_callables.py \
  tests/pytorch/test_cuda.py
model_s=$(left $((budget - 5)))
set -f  # the case patterns are globs for bench_model, not for the shell
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden ${TE_GPU_HIDDEN:-1024 2048} --isolate \
  --budget-s $((model_s - 40)) --module-iters 200 --name "model_layer_block$suffix" --variants \
  ${TE_GPU_VARIANTS:-'te_layer/*/eager' 'te_layer_modules/*/eager' 'torch/bf16/eager' 'torch/bf16/compile'}
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
