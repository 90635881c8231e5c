#!/usr/bin/env bash
# Our FFI handlers inside XLA's command buffers (CUDA graphs), in one GPU run: builds the core
# (CUDA, sm_90a) and the torch and jax packages; the JAX CUDA tests (test_cuda_graphs.py: the
# same FP8 steps with command buffers on and off give the same bits); then
# bench_transformer_layer_jax.py --model twice, each in its own process with the flax bf16
# stack beside it: with XLA's default command buffer kinds (where XLA forms graphs with custom
# calls it may capture ours, results/model_jax_graphs.json) and with CUSTOM_CALL left out of
# them (every custom call launched from the host, as before the handlers were marked:
# results/model_jax_graphs_off.json). At 1dea7a2 on an H100 the two steps were alike.
# Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax_graphs.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (590)
set -u
out=${1:?usage: gpu_jax_graphs.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-590}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 20)) 90)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/jax/test_cuda_graphs.py tests/jax/test_cuda.py \
  tests/jax/test_cuda_layernorm_mlp.py tests/jax/test_packed_attention.py
half=$(( ($(left $((budget - 10))) ) / 2 ))
step model_jax_graphs "$(upto $((budget - 10)) "$half")" python3 \
  benchmarks/bench_transformer_layer_jax.py --model --name "model_jax_graphs$suffix"
step model_jax_graphs_off "$(left $((budget - 5)))" env \
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN" python3 \
  benchmarks/bench_transformer_layer_jax.py --model --name "model_jax_graphs_off$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
