#!/usr/bin/env bash
# The GPU checks of the project, for a CUDA machine with torch installed (no network needed):
# builds and installs the core with its CUDA kernels into the current Python, runs the C++
# tests, the CUDA tests (pytest -m cuda), records the kernels' SASS instruction counts, runs
# the benchmarks, then the CUDA tests again under compute-sanitizer memcheck. Logs go to $1,
# benchmark JSON to $TE_BENCH_RESULTS (default: $1).
#
#   bash scripts/gpu_check.sh OUT_DIR [pytest args...]
#
# Wheels in .whl/ (brought for a machine without network) are installed first, beside the
# machine's packages. TE_GPU_SKIP names steps to leave out (e.g. "ctest sass memcheck
# pytest_jax_on_gpu"), TE_BENCHES the benchmarks to run (default: every benchmarks/bench_*.py),
# TE_GPU_ARCHS the CUDA architectures to build (default: the core's list), so a short run can
# pick what it needs.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [pytest args...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, remembers a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$out/$name.log"
  [ $rc -eq 0 ] || { echo "== $name FAILED (exit $rc)"; status=1; }
  return $rc
}

nvidia-smi -L
skip() { [[ " ${TE_GPU_SKIP:-} " == *" $1 "* ]]; }
# Wheels brought along for a machine without network (e.g. cudnn-frontend's headers for the
# fused attention, torchao as a benchmark peer) go into a side folder on the path.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-wheels .whl/*.whl \
    && export PYTHONPATH=/tmp/te-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
# The common wheel first: the jax wheel's FFI extension compiles against the installed core.
step install bash -c "python3 -m pip install --no-build-isolation --no-deps --force-reinstall \
  -C cmake.define.TE_WITH_CUDA=ON ${TE_GPU_ARCHS:+-C cmake.define.TE_CUDA_ARCHITECTURES=$TE_GPU_ARCHS} \
  ./common && python3 -m pip install --no-build-isolation \
  --no-deps --force-reinstall ./pytorch ./jax" || exit 1
skip ctest || step ctest bash -c "cmake -S cpp -B build/gpu-ctest -G Ninja -DTE_BUILD_TESTS=ON -DTE_WITH_CUDA=ON \
  -DTE_CUDA_ARCHITECTURES=90a \
  && cmake --build build/gpu-ctest && ctest --test-dir build/gpu-ctest --output-on-failure"
step pytest_cuda python3 -m pytest -p no:cacheprovider -m cuda tests -q -rfE "$@"
# On a GPU, jax runs every test of tests/jax on the device: the CUDA handlers throughout.
skip pytest_jax_on_gpu || step pytest_jax_on_gpu python3 -m pytest -p no:cacheprovider -m "not cuda" tests/jax -q -rfE "$@"
skip seed_pytorch || step seed_pytorch python3 examples/pytorch_linear_fp8.py
skip seed_jax || step seed_jax python3 jax/examples/jax_dense_fp8.py
lib=$(python3 -c "import transformer_engine.common as c, pathlib; print(next(pathlib.Path(c.__file__).parent.glob('lib/libtransformer_engine.so*')))")
skip sass || step sass bash -c "for arch in sm_90a sm_89 sm_80; do echo \$arch: \
  F2FP=\$(cuobjdump -arch \$arch -sass $lib | grep -c F2FP) \
  LDG128=\$(cuobjdump -arch \$arch -sass $lib | grep -c 'LDG.E.128') \
  STG128=\$(cuobjdump -arch \$arch -sass $lib | grep -c 'STG.E.128'); done"
for bench in ${TE_BENCHES:-benchmarks/bench_*.py}; do
  step "$(basename "$bench" .py)" env TE_BENCH_RESULTS="${TE_BENCH_RESULTS:-$out}" python3 "$bench"
done
skip memcheck || step memcheck timeout ${TE_MEMCHECK_TIMEOUT:-240} compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -p no:cacheprovider -m "cuda and not slow" -q -x "$@" tests/common/test_quantize.py \
  tests/common/test_block_quantize.py tests/common/test_scaling.py tests/common/test_transpose.py \
  tests/common/test_gemm.py tests/common/test_norm.py tests/common/test_activation.py
exit $status
