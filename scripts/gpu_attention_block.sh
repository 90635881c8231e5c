#!/usr/bin/env bash
# One GPU run for the layer nodes' attention half as attention_block.cpp's operators
# (layer_block_nodes.fused_attention_block): builds the core (CUDA, sm_90a) and the torch
# package; the CUDA tests of the nodes (the fused calls' bits against the node's calls one by
# one and the modules' path, with cuBLASLt and cuDNN); host_split_probe.py with the fused
# calls and without; then an A/B of four FP8 layers at hidden 1024 eager in one run, rounds
# on, off, on, off (the flag set in the installed package), each case in a process of its own,
# with torch's compiled and eager steps in the first round. Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_attention_block.sh OUT_DIR       # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_attention_block.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 60)) 150)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE -n 4 tests/pytorch/test_layer_block.py tests/pytorch/test_attention_packed.py
commit=${TE_GIT_COMMIT:-unset}
step probe_fused "$(upto $((budget - 60)) 60)" python3 benchmarks/host_split_probe.py \
  --out "$out/host_split_probe_fused_$commit$suffix.json"
step probe_unfused "$(upto $((budget - 60)) 60)" python3 benchmarks/host_split_probe.py --unfused \
  --out "$out/host_split_probe_unfused_$commit$suffix.json"
ab_model layer_block_nodes.py fused_attention_block True False model_attention_block \
  te_layer/fp8_delayed/eager torch/bf16/compile torch/bf16/eager
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
