#!/usr/bin/env bash
# The JAX model stack in one GPU run (10 minutes): builds the core (CUDA, sm_90a) and the jax
# package, then times bench_model.py's stack under jax.jit (our Flax TransformerLayer in FP8 and
# bf16 beside flax's layer with cuDNN attention, hidden 1024 / 2048 / 4096;
# results/model_jax.json), after te.Linear's host time at the seed's shape. Logs go to
# $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax_model.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (580)
set -u
out=${1:?usage: gpu_jax_model.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
export TE_BENCH_RESULTS=$out
# te.Linear's host time at the seed's shape first (a minute at most): results/linear_host_seed.json
step linear_host "$(upto $((budget - 60)) 60)" python3 benchmarks/bench_linear.py --host-only \
  --seed-shape-only --name "linear_host_seed$suffix"
step model_jax "$(left $((budget - 5)))" python3 benchmarks/bench_transformer_layer_jax.py --model \
  --name "model_jax$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
