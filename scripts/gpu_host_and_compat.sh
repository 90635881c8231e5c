#!/usr/bin/env bash
# One GPU run (10 minutes) for te.Linear's host time and the NVIDIA-compatibility features
# that run on the CPU in CI: builds the core (CUDA, sm_90a) and the torch package, then, each
# within what is left of the budget: the fp8_mha compile probe in its three modes
# (benchmarks/compile_fp8_mha_probe.py), the CUDA tests of attention sinks, CPU offload, the
# C++ autograd apply, te.Linear's compiled path and LayerNormMLP (its in-place gradient
# chunks), and te.Linear's host time against
# nn.Linear (bench_linear --host-only, results/linear_host.json). Logs go to $1/log.txt,
# benchmark JSON to $1.
#
#   bash scripts/gpu_host_and_compat.sh OUT_DIR      # TE_GPU_BUDGET_S: seconds to use (570)
set -u
out=${1:?usage: gpu_host_and_compat.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-570}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
for mode in default static eager_first; do
  step "compile_probe_$mode" "$(upto $((budget - 300)) 80)" \
    python3 benchmarks/compile_fp8_mha_probe.py "$mode"
done
step cuda_tests "$(upto $((budget - 130)) 170)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/pytorch/test_attention_sinks.py tests/pytorch/test_cpu_offload.py \
  tests/pytorch/test_eager_apply.py tests/pytorch/test_fast_linear.py \
  tests/pytorch/test_linear.py tests/pytorch/test_compiled_blocks.py \
  tests/pytorch/test_layernorm_mlp.py
export TE_BENCH_RESULTS=$out
step linear_host "$(left $((budget - 10)))" python3 benchmarks/bench_linear.py --host-only \
  --name linear_host
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
