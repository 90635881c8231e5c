#!/usr/bin/env bash
# The JAX stack's status in one short GPU run: builds the core (CUDA, sm_90a) and the torch and
# jax packages; the CUDA tests of the scale update, the packed self-attention (bit for bit
# against the copies' attention), XLA's command buffers, the MoE token movement and router (on
# the GPU backend) and the activations (bit for bit against the CPU; the core's
# activation tests of every output kind but the FP8 value sweeps);
# bench_transformer_layer_jax.py --model for about 130 s (it writes its JSON after each hidden
# size, 1024 first: results/model_jax.json); the stack's kernels at hidden 1024
# (kernel_profile_jax.py); both with the first-step probe (FP8 delayed traced without the
# first-step rule, to show what the rule's launches cost a step); then, with the time left,
# the JAX GPT demo (GPU size) with its gradient norms (results/gpt_demo_jax_norms.json;
# TE_GPU_JAX_DEMO=0 leaves it out: about 320 s without it).
# Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_jax_status.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (590)
set -u
out=${1:?usage: gpu_jax_status.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-590}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 20)) 90)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/common/test_scaling.py tests/jax/test_cuda.py tests/jax/test_cuda_layernorm_mlp.py \
  tests/jax/test_cuda_graphs.py \
  tests/jax/test_packed_attention.py
# (the MoE token movement and router are jnp: on this machine they run on the GPU backend)
step moe_tests "$(upto $((budget - 20)) 45)" python3 -m pytest -p no:cacheprovider -q -rfE \
  tests/jax/test_permutation.py tests/jax/test_router.py tests/cross/test_same_permutation.py \
  tests/cross/test_same_router.py
step activation_tests "$(upto $((budget - 20)) 45)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/common/test_activation.py \
  -k "half_precision or nan or magnitudes or amax_only or many_tiles or degenerate or identity"
step model_jax "$(upto $((budget - 20)) 140)" python3 benchmarks/bench_transformer_layer_jax.py \
  --model --first-step-probe --name "model_jax$suffix"
step jax_profile_1024 "$(upto $((budget - 5)) 90)" python3 benchmarks/kernel_profile_jax.py \
  --hidden 1024 --first-step-probe --name "kernel_profile_jax$suffix"
if [ "${TE_GPU_JAX_DEMO:-1}" = 1 ]; then
  step gpt_demo_jax "$(left $((budget - 5)))" python3 examples/train_gpt.py --framework jax \
    --device cuda --plot "" --json "$out/gpt_demo_jax_norms$suffix.json"
fi
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
