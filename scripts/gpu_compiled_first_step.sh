#!/usr/bin/env bash
# One GPU run for the compiled FP8 layer step: compiled_first_step_probe.py (which path gives
# a compiled delayed first step other bits than eager) and Inductor's code of the way that
# differed (in the log), the compiled layer tests
# (test_layer_block.py -k compiled, CUDA), compiled_overhead_probe.py (what the compiled region
# adds around the layer node's calls) and compiled_call_cost_probe.py, then an A/B of four FP8
# layers at hidden 1024 compiled with the layer node's ops (layer_block_op.on_cuda) and
# through the modules, rounds on, off, on, off (the flag set in the installed package), each
# case in a process of its own, with the eager FP8 step and torch's compiled step in the first
# round. Logs go to $1/log.txt, JSON to $1.
#
#   bash scripts/gpu_compiled_first_step.sh OUT_DIR    # TE_GPU_BUDGET_S: seconds to use (560)
set -u
out=${1:?usage: gpu_compiled_first_step.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-560}
source "$(dirname "$0")/_gpu_run.sh"
build_torch_stack
commit=${TE_GIT_COMMIT:-unset}
export TE_BENCH_RESULTS=$out
step first_step_probe "$(upto $((budget - 60)) 90)" python3 benchmarks/compiled_first_step_probe.py
# Inductor's code for the compiled first step reading q, k, v in place (the way that gave
# other bits on an H100), for reading offline beside the CPU's
step inplace_code "$(upto $((budget - 60)) 40)" env TORCH_LOGS=output_code python3 -c "import sys; \
  sys.path.insert(0, 'benchmarks'); import compiled_first_step_probe as p; \
  p.first_step('cuda', True, True, True, True)"
step compiled_tests "$(upto $((budget - 60)) 150)" python3 -m pytest -p no:cacheprovider -q \
  -m cuda -rfE tests/pytorch/test_layer_block.py tests/pytorch/test_attention_packed.py \
  -k compiled
# what the compiled region adds around the layer node's calls, one and four layers, tiny shape
step compiled_overhead "$(upto $((budget - 60)) 120)" \
  python3 benchmarks/compiled_overhead_probe.py --name "compiled_overhead_${commit}${suffix}"
step call_cost "$(upto $((budget - 60)) 60)" python3 benchmarks/compiled_call_cost_probe.py \
  --name "compiled_call_cost_${commit}${suffix}"
ab_model layer_block_op.py on_cuda True False model_layer_op te_layer/fp8_delayed/compile \
  te_layer/fp8_delayed/eager torch/bf16/compile
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
