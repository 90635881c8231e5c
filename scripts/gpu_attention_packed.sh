#!/usr/bin/env bash
# q, k, v read in place from the QKV projection's output, checked and timed in one GPU run
# (10 minutes): builds the core (CUDA, sm_90a) and the torch package, then, each within what is
# left: the CUDA tests of attention (the packed path against the dense one on cuDNN and the CUDA
# math path; DotProductAttention, FP8 attention, TransformerLayer), the TransformerLayer
# benchmark at the getting-started shape (results/transformer_layer.json), the model stack's FP8
# eager step beside compiled torch at hidden 1024 and 4096 (results/model_packed.json), and the
# kernels of the layer's FP8 step (kernel_profile.py: the q/k/v copies and the gradients'
# concatenation gone). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_attention_packed.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (580)
set -u
out=${1:?usage: gpu_attention_packed.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 360)) 100)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/pytorch/test_attention_packed.py tests/pytorch/test_attention.py \
  tests/pytorch/test_fp8_mha.py tests/pytorch/test_transformer_layer.py
step bench_layer "$(upto $((budget - 170)) 200)" python3 benchmarks/bench_transformer_layer.py \
  --main-shape-only --skip "torch layer bf16 eager" --name "transformer_layer$suffix"
model_s=$(upto $((budget - 60)) 150)
step bench_model "$model_s" python3 benchmarks/bench_model.py --hidden 1024 4096 \
  --budget-s $((model_s - 20)) --name "model_packed$suffix" \
  --variants 'te_layer/fp8_delayed/eager' 'torch/bf16/compile'
step kernels "$(left $((budget - 5)))" python3 benchmarks/kernel_profile.py \
  --only DelayedScaling --name "kernel_profile$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
