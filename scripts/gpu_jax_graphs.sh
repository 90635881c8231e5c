#!/usr/bin/env bash
# The JAX stack with our calls in XLA's command buffers, in one GPU run: builds the core (CUDA,
# sm_90a) and the torch and jax packages; the JAX CUDA tests (test_command_buffers.py among
# them: every kind of our call recorded, the same bits as with command buffers off); the
# stack's kernels at hidden 1024 (kernel_profile_jax.py); then bench_transformer_layer_jax.py
# --model at hidden 1024 / 2048 / 4096 (results/model_jax.json), and once more with XLA's command
# buffers off (results/model_jax_command_buffers_off.json: XLA reads the flag at start, so a
# second process). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax_graphs.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_jax_graphs.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack  # the core, and the torch package the benchmark harness imports
step build_jax 120 python3 -m pip install --no-build-isolation --no-deps -q ./jax
export TE_BENCH_RESULTS=$out
step jax_cuda_tests "$(upto $((budget - 200)) 170)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE -n 4 tests/jax
step jax_profile_1024 "$(upto $((budget - 130)) 80)" python3 benchmarks/kernel_profile_jax.py \
  --hidden 1024 --name "kernel_profile_jax$suffix"
step model_jax "$(upto $((budget - 120)) 160)" python3 benchmarks/bench_transformer_layer_jax.py \
  --model --name "model_jax$suffix"
step model_jax_off "$(left $((budget - 5)))" env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  python3 benchmarks/bench_transformer_layer_jax.py --model \
  --name "model_jax_command_buffers_off$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
