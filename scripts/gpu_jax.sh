#!/usr/bin/env bash
# A GPU check of the JAX package that fits one 10-minute run: builds the core (CUDA, sm_90a),
# the torch and jax packages, then, each within what is left of the budget: the JAX GPT probe
# (benchmarks/gpt_jax_probe.py: the demo's first steps in bf16, with XLA's GEMM, in FP8 and in
# fp32), the JAX GEMM tests on the device, and the CUDA tests of the CUDA-graph helpers.
# Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax.sh OUT_DIR        # TE_JAX_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_jax.sh OUT_DIR}
budget=${TE_JAX_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
export TE_BENCH_RESULTS=$out
step graph_helpers "$(upto $((budget - 420)) 40)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE tests/pytorch/test_graph_helpers.py
step gpt_jax_probe "$(left $((budget - 60)))" python3 benchmarks/gpt_jax_probe.py --steps 8
step jax_gemm_tests "$(left $((budget - 10)))" python3 -m pytest -p no:cacheprovider -q -rfE \
  tests/jax/test_cuda.py tests/jax/test_dense.py tests/jax/test_ops.py
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
