#!/usr/bin/env bash
# The JAX mixture-of-experts pieces on a GPU in one short run: builds the core (CUDA, sm_90a)
# and the torch and jax packages; the token movement and router tests (jnp, on the GPU
# backend here) with their cross-framework twins, the grouped GEMM tests (CUDA ones included);
# then jax/examples/train_moe.py on the GPU in bf16 and with --fp8 (the experts' grouped GEMMs
# in FP8 over token_dispatch_padded). Logs go to $1/log.txt.
#
#   bash scripts/gpu_jax_moe.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (500)
set -u
out=${1:?usage: gpu_jax_moe.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-500}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
step moe_tests "$(upto $((budget - 20)) 90)" python3 -m pytest -p no:cacheprovider -q -rfE \
  tests/jax/test_permutation.py tests/jax/test_router.py tests/jax/test_grouped_dense.py \
  tests/cross/test_same_permutation.py tests/cross/test_same_router.py
python3 -c "import jax; print('jax devices:', jax.devices())" >> "$log" 2>&1
step train_moe "$(upto $((budget - 20)) 90)" python3 jax/examples/train_moe.py
step train_moe_fp8 "$(upto $((budget - 5)) 90)" python3 jax/examples/train_moe.py --fp8
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
