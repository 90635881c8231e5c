#!/usr/bin/env bash
# The one GPU run of a session whose machine may come only once (10 minutes): builds the core
# (CUDA, sm_90a) and the torch package, then, most needed first, each within what is left:
# the CUDA tests of the newest features (attention sinks, CPU offload, the C++ autograd
# apply, te.Linear's compiled path, LayerNormMLP, the compiled blocks; the distributed rank
# scripts on one GPU over NCCL), the TransformerLayer benchmark (speed and peak memory
# against torch; results/transformer_layer.json) and te.Linear's host time (bench_linear
# --host-only, results/linear_host.json). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_session.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (575)
set -u
out=${1:?usage: gpu_session.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-575}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
# what the build left, shared out: the tests first, then the layer benchmark
rest=$(left "$budget")
step cuda_tests "$(upto $((budget - rest * 7 / 10)) 100)" \
  python3 -m pytest -p no:cacheprovider -q -m cuda -rfE -n 4 \
  tests/pytorch/test_attention_sinks.py tests/pytorch/test_cpu_offload.py \
  tests/pytorch/test_eager_apply.py tests/pytorch/test_fast_linear.py \
  tests/pytorch/test_linear.py tests/pytorch/test_compiled_blocks.py \
  tests/pytorch/test_layernorm_mlp.py
step nccl_world "$(upto $((budget - rest * 55 / 100)) 50)" \
  python3 -m pytest -p no:cacheprovider -q -m cuda -rfE tests/pytorch/test_parallel_worlds.py
step bench_layer "$(left $((budget - 20)))" python3 benchmarks/bench_transformer_layer.py \
  --name "transformer_layer$suffix" --skip "torch layer bf16 eager" \
  ${TE_LAYER_MAIN_ONLY:+--main-shape-only}
step linear_host "$(left $((budget - 2)))" python3 benchmarks/bench_linear.py --host-only \
  --name "linear_host$suffix"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
