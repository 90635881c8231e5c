#!/usr/bin/env bash
# How far apart FP8 and bf16 end from one seed to the next: the GPT demo (examples/train_gpt.py,
# GPU size) with other seeds (weights and batch order) than the committed runs' seed 0, in one
# GPU run: the PyTorch demo at seeds 1 and 2, then the JAX demo at seed 1, with the time left.
# Builds the core (CUDA, sm_90a) and the torch and jax packages first. Writes
# gpt_demo_{torch,jax}_seed<N>.json (no plots); logs to $1/log.txt.
#
#   bash scripts/gpu_gpt_seeds.sh OUT_DIR   # TE_GPU_BUDGET_S: seconds (580)
set -u
out=${1:?usage: gpu_gpt_seeds.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
for seed in 1 2; do
  step "torch_seed$seed" "$(upto $((budget - 100)) 110)" python3 examples/train_gpt.py \
    --framework torch --device cuda --seed "$seed" --plot "" \
    --json "$out/gpt_demo_torch${suffix}_seed$seed.json"
done
step jax_seed1 "$(left $((budget - 5)))" python3 examples/train_gpt.py --framework jax \
  --device cuda --seed 1 --plot "" --json "$out/gpt_demo_jax${suffix}_seed1.json"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
