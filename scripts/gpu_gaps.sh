#!/usr/bin/env bash
# Where the getting-started layer's training step leaves the GPU idle, in one GPU run: builds
# the core (CUDA, sm_90a) and the torch package, then gap_probe.py on our FP8 and bf16 layers
# and compiled torch's (results/gap_probe.json). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_gaps.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (300)
set -u
out=${1:?usage: gpu_gaps.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-300}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step gaps "$(left $((budget - 5)))" python3 benchmarks/gap_probe.py --name "gap_probe$suffix" \
  --only "DelayedScaling (FP8 GEMMs)" --only "TransformerLayer bf16" \
  --only "torch.compile (nn.Linear, nn.LayerNorm, SDPA)"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
