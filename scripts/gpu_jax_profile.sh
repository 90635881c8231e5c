#!/usr/bin/env bash
# Where the JAX model stack's step spends its GPU time, in one GPU run: builds the core (CUDA,
# sm_90a) and the torch and jax packages, then kernel_profile_jax.py at hidden 1024 (our Flax
# TransformerLayer in FP8 and bf16 beside flax's; results/kernel_profile_jax.json) and, with
# the time left, at 4096 (kernel_profile_jax_h4096.json). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax_profile.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (400)
set -u
out=${1:?usage: gpu_jax_profile.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-400}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
step build_jax 120 python3 -m pip install --no-build-isolation --no-deps -q ./jax
export TE_BENCH_RESULTS=$out
step profile_1024 "$(upto $((budget - 90)) 150)" python3 benchmarks/kernel_profile_jax.py \
  --hidden 1024 --name "kernel_profile_jax$suffix"
step profile_4096 "$(left $((budget - 5)))" python3 benchmarks/kernel_profile_jax.py \
  --hidden 4096 --name "kernel_profile_jax_h4096$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
