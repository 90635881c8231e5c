#!/usr/bin/env bash
# Whether an eager FP8 step waits for the GPU, in one GPU run: builds the core (CUDA, sm_90a)
# and the torch package; the CUDA test that runs an eager TransformerLayer step under torch's
# sync debug mode; bench_host_profile.py at bench_model's hidden 1024 shape (4 x 2048 tokens)
# for FP8 delayed and current scaling and bf16, with the CUDA runtime's calls in the op profile
# (results/host_profile_1024.json); then the PyTorch GPT demo (GPU size) with its gradient norms
# (results/gpt_demo_torch_norms.json), with the time left. Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_host_waits.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (400)
set -u
out=${1:?usage: gpu_host_waits.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-400}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step no_sync_test "$(upto $((budget - 150)) 60)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE tests/pytorch/test_eager_step_never_waits.py
step host_profile_1024 "$(upto $((budget - 110)) 90)" python3 benchmarks/bench_host_profile.py \
  --shape 4 2048 1024 --steps 20 --warmup 5 --cases te_layer/fp8_delayed te_layer/fp8_current te_layer/bf16 \
  --name "host_profile_1024$suffix"
step gpt_demo "$(left $((budget - 5)))" python3 examples/train_gpt.py --framework torch \
  --device cuda --plot "" --json "$out/gpt_demo_torch_norms$suffix.json"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
