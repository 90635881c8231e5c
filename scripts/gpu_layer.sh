#!/usr/bin/env bash
# A GPU check of one Transformer layer's step that fits one 10-minute run: builds the core
# (CUDA, sm_90a) and the torch package, then, each step within what is left of the budget:
# the CUDA tests of the layer's blocks, the memory of the getting-started layer's step
# measured on the GPU (memory_probe.py, with the live sets at the peaks), its kernels
# (kernel_profile.py), where the host's allocations and launches come from
# (bench_host_profile.py --sites), and the TransformerLayer benchmark (speed and peak memory
# against torch). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_layer.sh OUT_DIR        # TE_LAYER_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_layer.sh OUT_DIR}
budget=${TE_LAYER_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step cuda_tests "$(upto $((budget - 330)) 60)" python3 -m pytest -p no:cacheprovider -q -m cuda \
  -rfE tests/pytorch/test_hp_blocks.py tests/pytorch/test_layernorm_mlp.py \
  tests/pytorch/test_grouped_linear.py
step memory "$(upto $((budget - 300)) 60)" python3 benchmarks/memory_probe.py --device cuda \
  --seq 2048 --batch 8 --hidden 4096 --ffn 16384 --heads 32 --live --recipes bf16,delayed,delayed_mha
step kernels "$(upto $((budget - 240)) 70)" python3 benchmarks/kernel_profile.py \
  --only DelayedScaling --only "TransformerLayer bf16"
step host_sites "$(upto $((budget - 200)) 40)" python3 benchmarks/bench_host_profile.py \
  --steps 50 --top 60 --sites --name host_sites --cases te_layer/fp8_delayed te_layer/bf16
step bench_layer "$(left $((budget - 10)))" python3 benchmarks/bench_transformer_layer.py
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
