#!/usr/bin/env bash
# The block-scaled FP8 GEMM's variant sweep in one GPU run (10 minutes): builds the C++ core
# (CUDA, sm_90a) with CUTLASS's headers (the nvidia-cutlass wheel, brought in .whl_cutlass/) and
# its tests, runs test_hopper_block_scaled_gemm (the production kernel and each configuration of
# the hand-written one against the CPU path, the production kernel against cuBLASLt too), then
# sweep_block_scaled_gemm (cpp/tests/hopper: every configuration beside cuBLASLt,
# results/hopper_block_scaled_sweep.json). Logs go to $1/log.txt, JSON to $1. It also
# counts the FP8 WGMMAs (QGMMA) in the SASS of the hand-written kernel (block_scaled_wgmma.cu).
# A second call on a machine that still holds the build rebuilds only what changed.
#
#   bash scripts/gpu_hopper_sweep.sh OUT_DIR        # TE_GPU_BUDGET_S: seconds to use (580)
#   TE_SWEEP_VARIANTS=0,7,8: time only these variants (sweep_block_scaled_gemm.cpp's indices)
set -u
out=${1:?usage: gpu_hopper_sweep.sh OUT_DIR}
budget=${TE_GPU_BUDGET_S:-580}
source "$(dirname "$0")/_gpu_run.sh"
nvidia-smi -L >> "$log"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-cutlass .whl_cutlass/*.whl \
  >> "$log" 2>&1
cutlass=/tmp/te-cutlass/cutlass_library/source/include
step configure 60 cmake -S cpp -B /tmp/te-cpp-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTE_WITH_CUDA=ON -DTE_CUDA_ARCHITECTURES=90a -DTE_WITH_CUTLASS=ON \
  -DTE_CUTLASS_INCLUDE="$cutlass" -DTE_BUILD_TESTS=ON
step build "$(upto $((budget - 150)) 420)" cmake --build /tmp/te-cpp-build -j 16 \
  --target test_hopper_block_scaled_gemm sweep_block_scaled_gemm
obj=$(find /tmp/te-cpp-build -name "block_scaled_wgmma.cu.o" | head -1)
[ -n "$obj" ] && echo "QGMMA in block_scaled_wgmma's SASS: $(cuobjdump -sass "$obj" | grep -c QGMMA)" \
  >> "$log"
step test_block_scaled "$(upto $((budget - 110)) 90)" /tmp/te-cpp-build/test_hopper_block_scaled_gemm
step sweep "$(left $((budget - 5)))" /tmp/te-cpp-build/sweep_block_scaled_gemm \
  "$out/hopper_block_scaled_sweep$suffix.json" "${TE_GIT_COMMIT:-}" ${TE_SWEEP_VARIANTS:-}
echo "== done at $(( $(date +%s) - start ))s" >> "$log"
