#!/usr/bin/env bash
# The GPT training demo (examples/train_gpt.py, GPU size) in both frameworks in one GPU run (10
# minutes): builds the core (CUDA, sm_90a) and the torch and jax packages, then runs the PyTorch
# demo and the JAX demo, each FP8 (delayed scaling) beside bf16 from the same weights and
# batches: results/gpt_demo_torch.json / gpt_demo_jax.json with their loss-curve PNGs. Logs go to
# $1/log.txt, JSON and PNG to $1.
#
#   bash scripts/gpu_gpt_demos.sh OUT_DIR   # TE_GPU_BUDGET_S: seconds (580); TE_GPT_ARGS: more
#                                           # arguments for both demos (e.g. "--lr 3e-4")
set -u
out=${1:?usage: gpu_gpt_demos.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
build_jax_stack
# shellcheck disable=SC2086  # TE_GPT_ARGS is a list of arguments
step demo_torch "$(upto $((budget - 150)) 200)" python3 examples/train_gpt.py --framework torch \
  --device cuda ${TE_GPT_ARGS:-} --json "$out/gpt_demo_torch$suffix.json" \
  --plot "$out/gpt_demo_torch$suffix.png"
# shellcheck disable=SC2086
step demo_jax "$(left $((budget - 5)))" python3 examples/train_gpt.py --framework jax \
  --device cuda ${TE_GPT_ARGS:-} --json "$out/gpt_demo_jax$suffix.json" \
  --plot "$out/gpt_demo_jax$suffix.png"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
