#!/usr/bin/env bash
# Why torch.compile(fullgraph=True) of te.MultiheadAttention under fp8_mha fails on the GPU
# machine's torch: builds the core (CUDA, sm_90a) and the torch package, then runs
# benchmarks/compile_fp8_mha_probe.py in its three modes and the failing CUDA test. Logs go
# to $1/log.txt.
#
#   bash scripts/gpu_compile_probe.sh OUT_DIR      # TE_GPU_BUDGET_S: seconds to use (570)
set -u
out=${1:?usage: gpu_compile_probe.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-570}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
for mode in default static eager_first; do
  step "compile_probe_$mode" "$(upto $((budget - 100)) 100)" \
    python3 benchmarks/compile_fp8_mha_probe.py "$mode"
done
step fp8_mha_compile_test "$(left $((budget - 5)))" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/pytorch/test_fp8_mha.py -k compiles
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
