#!/usr/bin/env bash
# One GPU run deciding layer_block_nodes.fold_residual_grads (the layer node adding its
# backward's residual gradients inside the norms' backward): builds the core (CUDA, sm_90a) and
# the torch package as committed, runs the norm and layer node CUDA tests (the folded backward
# against the modules' bits among them), profiles the FP8 stack at hidden 4096 kernel by kernel
# with the fold off and on (the norm backward's time against the adds it saves), then times
# the stack at 1024 in rounds off / on (scripts/gpu_ab_model.sh with
# scripts/ab_patches/fold_residual_grads.patch). The activations' CUDA tests of 16-bit outputs
# and bench_activation's bf16 GELU against torch's come first: the norms and activations share
# the hardware 16-bit conversion (cuda_utils.cuh, pack_hp8), and the A/B's bf16 steps time it
# in the model. Logs go to $1/log.txt and $1/ab/log.txt, JSON to $1:
# activation_bf16*.json, kernel_profile_model_fold_{off,on}_4096*.json, ab/model_ab_{a,b}*.json.
#
#   bash scripts/gpu_fold.sh OUT_DIR [ROUNDS]   # TE_GPU_BUDGET_S: seconds to use (560); ROUNDS of
#                                               # the A/B (2; 0: none, for a later call)
set -u
out=${1:?usage: gpu_fold.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
rounds=${2:-2}
late=$(( rounds > 0 ? 0 : 160 ))  # (without the A/B, its share goes to the steps before it)
step tests "$(upto $((budget - 300 + late)) 180)" python3 -m pytest -p no:cacheprovider -q -m cuda -rfE -n 4 \
  tests/common/test_norm.py tests/pytorch/test_layer_block.py tests/common/test_activation.py
step act_bench "$(upto $((budget - 270 + late)) 40)" python3 benchmarks/bench_activation.py --only-bf16 \
  --name "activation_bf16$suffix"
# (fold off: the bf16 layer too, whose GELU and norms take the 16-bit stores)
for fold in off on; do
  cases=(te_layer/fp8_delayed te_layer/bf16)
  [ "$fold" = on ] && { set_flag layer_block_nodes.py fold_residual_grads True; cases=(te_layer/fp8_delayed); }
  deadline=$((budget - 230 + late)); [ "$fold" = on ] && deadline=$((budget - 170 + late))
  step "kprof_$fold" "$(upto "$deadline" 100)" python3 \
    benchmarks/kernel_profile_model.py --hidden 4096 --cases "${cases[@]}" \
    --name "kernel_profile_model_fold_${fold}_4096$suffix"
done
set_flag layer_block_nodes.py fold_residual_grads False
[ "$rounds" = 0 ] && { echo "== done at $(( $(date +%s) - start ))s" >> "$log"; exit 0; }
TE_GPU_REUSE_BUILD=1 TE_GPU_BUDGET_S=$(left $((budget - 5))) bash "$(dirname "$0")/gpu_ab_model.sh" \
  "$out/ab" "$(dirname "$0")/ab_patches/fold_residual_grads.patch" "$rounds"
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
