#!/usr/bin/env bash
# The fused residual + dropout checked and timed in one GPU run: builds the core (CUDA, sm_90a)
# and the torch package, then the CUDA tests of the op (bit for bit against the CPU) and of
# TransformerLayer, then the TransformerLayer benchmark at the getting-started shape, whose
# layer has hidden dropout 0.1 (results/transformer_layer.json). Logs go to $1/log.txt, JSON to
# $1.
#
#   bash scripts/gpu_dropout_add.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (300)
set -u
out=${1:?usage: gpu_dropout_add.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-300}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 60)) 60)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/common/test_dropout.py tests/pytorch/test_dropout_add.py \
  tests/pytorch/test_transformer_layer.py
step bench_layer "$(left $((budget - 5)))" python3 benchmarks/bench_transformer_layer.py \
  --main-shape-only --skip "torch layer bf16 eager" --name "transformer_layer$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
