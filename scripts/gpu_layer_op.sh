#!/usr/bin/env bash
# One GPU run deciding layer_block_op.on_cuda (whether graphs traced on CUDA take the FP8 layer
# ops or the modules' path): builds the core (CUDA, sm_90a) and the torch package as committed
# (on_cuda as the tree has it), times the layer stack at hidden 1024 eager and compiled, then
# sets on_cuda in the installed package, runs the ops' CUDA tests and times the compiled step
# again, and profiles one layer's host time eager against compiled (rounds in turn) at
# [1, 16, 256] and [4, 2048, 1024]. Same machine, so the three step times compare. Logs go to
# $1/log.txt, JSON to $1: model_layer_op_off*.json, model_layer_op_on*.json,
# host_profile_layer_op_{tiny,1024}*.json.
#
#   bash scripts/gpu_layer_op.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (480)
set -u
out=${1:?usage: gpu_layer_op.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-480}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
set -f  # the case patterns are globs for bench_model, not for the shell
step bench_off "$(upto $((budget - 150)) 130)" python3 benchmarks/bench_model.py --hidden 1024 \
  --isolate --budget-s 110 --module-iters 200 --name "model_layer_op_off$suffix" \
  --variants 'te_layer/fp8_delayed/eager' 'te_layer/fp8_delayed/compile'
set +f
set_flag layer_block_op.py on_cuda True
step op_tests "$(upto $((budget - 110)) 90)" python3 -m pytest -p no:cacheprovider -q -m cuda -rfE \
  -n 4 tests/pytorch/test_layer_block.py -k "compiled"
set -f
step bench_on "$(upto $((budget - 60)) 70)" python3 benchmarks/bench_model.py --hidden 1024 \
  --isolate --budget-s 60 --module-iters 0 --name "model_layer_op_on$suffix" \
  --variants 'te_layer/fp8_delayed/compile'
set +f
for shape in "1 16 256 tiny" "4 2048 1024 1024"; do
  # shellcheck disable=SC2086  # the four words of one case
  set -- $shape
  step "profile_$4" "$(upto $((budget - 5)) 60)" python3 benchmarks/bench_host_profile.py --shape "$1" "$2" "$3" \
    --steps 20 --warmup 10 --rounds 5 --name "host_profile_layer_op_$4$suffix" \
    --cases te_layer/fp8_delayed te_layer/fp8_delayed/compile
done
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
