#!/usr/bin/env bash
# The compiled training step on CUDA in one GPU run: builds the core (CUDA, sm_90a) and the
# torch package; the CUDA tests of test_compile.py (reduce-overhead as a process's first FP8
# steps among them) and test_attention_packed.py (q, k, v read in place, eager and compiled);
# the kernels of four te.TransformerLayer at hidden 1024 (FP8 delayed) per
# step, eager and under torch.compile's default mode with the traced layer as the layer
# node's ops and through its modules, each in its own process
# (results/kernel_profile_compiled_{eager,ops_on,ops_off}.json), to see whether the ops'
# compiled step does more GPU work than the eager node or only waits longer on the host;
# then bench_model.py's reduce-overhead and compiled cases of that stack, each in a fresh
# process (results/model_compiled_1024.json). Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_compiled_step.sh OUT_DIR      # TE_GPU_BUDGET_S: seconds to use (560)
#   TE_GPU_PROFILES="ops_off": only these kernel profiles (of eager, ops_off, ops_on)
set -u
out=${1:?usage: gpu_compiled_step.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
step compile_tests "$(upto $((budget - 20)) 120)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/pytorch/test_compile.py tests/pytorch/test_attention_packed.py
profile() {  # NAME ARGS...
  local name=$1; shift
  step "profile_$name" "$(upto $((budget - 20)) 90)" python3 benchmarks/kernel_profile_model.py \
    --hidden 1024 --cases te_layer/fp8_delayed --name "kernel_profile_compiled_$name$suffix" "$@"
}
profiles=${TE_GPU_PROFILES:-eager ops_off ops_on}
[[ " $profiles " == *" eager "* ]] && profile eager
[[ " $profiles " == *" ops_off "* ]] && profile ops_off --compile --layer-ops off
[[ " $profiles " == *" ops_on "* ]] && profile ops_on --compile --layer-ops on
set -f  # (bench_model's case patterns are globs)
step model_compiled "$(left $((budget - 5)))" python3 benchmarks/bench_model.py --hidden 1024 \
  --isolate --budget-s "$(( $(left $((budget - 5))) - 15 ))" --module-iters 0 \
  --name "model_compiled_1024$suffix" \
  --variants "te_layer/fp8_delayed/reduce_overhead" "te_layer/fp8_delayed/compile" \
  "te_layer/fp8_delayed/eager" "torch/bf16/compile" "torch/bf16/reduce_overhead"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
