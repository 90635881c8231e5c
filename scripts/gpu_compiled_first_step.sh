#!/usr/bin/env bash
# One GPU run: the compiled layer tests that compare a torch.compile'd FP8 delayed-scaling
# stack with eager (test_layer_block.py -k compiled, CUDA) with the eager node's fused calls
# on and off (layer_block_nodes.fused_attention_block), to tell whether those calls are what
# a failure comes from; then host_split_probe.py with the fused calls and without. Logs go to
# $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_compiled_first_step.sh OUT_DIR    # TE_GPU_BUDGET_S: seconds to use (400)
set -u
out=${1:?usage: gpu_compiled_first_step.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-400}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
commit=${TE_GIT_COMMIT:-unset}
set_flag layer_block_nodes.py fused_attention_block False
step compiled_tests_unfused "$(upto $((budget - 30)) 60)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/pytorch/test_layer_block.py -k "compiled and delayed"
set_flag layer_block_nodes.py fused_attention_block True
step compiled_tests_fused "$(upto $((budget - 5)) 60)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/pytorch/test_layer_block.py -k "compiled and delayed"
step probe_fused "$(upto $((budget - 40)) 50)" python3 benchmarks/host_split_probe.py \
  --out "$out/host_split_probe_fused_$commit$suffix.json"
step probe_unfused "$(upto $((budget - 5)) 50)" python3 benchmarks/host_split_probe.py --unfused \
  --out "$out/host_split_probe_unfused_$commit$suffix.json"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
