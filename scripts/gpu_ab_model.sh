#!/usr/bin/env bash
# One GPU run: an A/B of a change to the torch package's Python on one machine. Builds the core
# (CUDA, sm_90a) and the torch package as committed (A), then times the layer stack at hidden
# 1024 eager, each case in a fresh process, in rounds A, B, A, B, ..., where B is the installed
# package with PATCH applied (a patch made in the repository root, `git diff` style) and A the
# package as built. Host speed moves between machines and over hours, so only rounds of one
# run compare. The first A round also times torch's step in the same executions. Logs go to
# $1/log.txt, JSON to $1: model_ab_a{round}*.json, model_ab_b{round}*.json. TE_AB_EXECUTION:
# the execution timed (eager; compile for changes that only traced graphs see).
#
# Patches of changes waiting for such a run go in scripts/ab_patches/.
#
#   bash scripts/gpu_ab_model.sh OUT_DIR PATCH [ROUNDS]   # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_ab_model.sh OUT_DIR PATCH [ROUNDS]}
patch_file=$(realpath "${2:?usage: gpu_ab_model.sh OUT_DIR PATCH [ROUNDS]}")
rounds=${3:-2}
budget=${TE_GPU_BUDGET_S:-560}
execution=${TE_AB_EXECUTION:-eager}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
export TE_BENCH_RESULTS=$out
installed=$(torch_package)
# (the patch names files as pytorch/transformer_engine/pytorch/<file>: strip 4 levels)
patch --dry-run -s -d "$installed" -p4 < "$patch_file" >> "$log" 2>&1 || { echo "== patch does not apply" >> "$log"; exit 1; }
set -f  # the case patterns are globs for bench_model, not for the shell
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    variants=("te_layer/fp8_delayed/$execution" "te_layer/bf16/$execution")
    [ "$r$side" = 1a ] && variants+=("torch/bf16/$execution")
    [ "$side" = b ] && patch -s -d "$installed" -p4 < "$patch_file"
    # (the rounds left split the time left evenly)
    runs_left=$(( (rounds - r) * 2 + 1 )); [ "$side" = a ] && runs_left=$((runs_left + 1))
    share=$(( $(left $((budget - 5))) / runs_left ))
    step "round_$r$side" "$(upto $((budget - 5)) "$share")" python3 benchmarks/bench_model.py \
      --hidden 1024 --isolate --budget-s $((share - 10)) --module-iters 0 \
      --name "model_ab_$side$r$suffix" --variants "${variants[@]}"
    [ "$side" = b ] && patch -s -R -d "$installed" -p4 < "$patch_file"
  done
done
set +f
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
