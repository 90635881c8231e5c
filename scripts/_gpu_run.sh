# Shared by the one-call GPU scripts (scripts/gpu_*.sh); sourced, not run. Expects
# $out (the output folder) and $budget (seconds); leaves the working directory at the
# repository root and gives:
#   suffix         "_h100" on an H100, else "": results from an H100 go beside the H200's
#   left S         seconds from now until second S of the run
#   upto S L       the smaller of `left S` and L
#   step NAME L CMD...   runs CMD within L seconds, logged to $out/log.txt with its exit status
#   build_torch_stack    the core (CUDA, sm_90a) and the torch package, into this Python
#                        (TE_GPU_REUSE_BUILD=1: kept from the run before where it imports)
#   build_jax_stack      build_torch_stack (benchmark harnesses import torch), then the jax package
#   torch_package        the installed transformer_engine.pytorch's folder (to patch what runs)
#   set_flag FILE NAME VALUE   sets the module-level `NAME = ...` line of FILE in that folder to
#                        VALUE (True/False) and logs the line
#   ab_model FILE NAME ON OFF RESULT CASE [FIRST...]   bench_model's CASE at hidden 1024 in
#                        rounds on, off, on, off, with FILE's NAME set to ON or OFF (its own
#                        value back after), each case in a process of its own, the FIRST cases
#                        too in the first round; JSON RESULT_{on,off}{1,2}_$commit$suffix.json
#                        (expects $commit)
# Wheels in .whl/ (brought for a machine without network: cudnn-frontend, torchao, nox) are
# installed beside the machine's packages first.
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
# The results name the tree's commit. The GPU machine's copy of the tree may carry an older
# .git, which `git rev-parse` would name instead, so without TE_GIT_COMMIT from the caller the
# results say "unset" rather than a wrong commit.
export TE_GIT_COMMIT=${TE_GIT_COMMIT:-unset}
start=$(date +%s)
log=$out/log.txt
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-wheels .whl/*.whl \
    && export PYTHONPATH=/tmp/te-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
suffix=""
nvidia-smi -L 2>/dev/null | grep -q H100 && suffix=_h100
left() { echo $(( $1 - ($(date +%s) - start) )); }
upto() { local l; l=$(left "$1"); [ "$l" -lt "$2" ] && echo "$l" || echo "$2"; }
step() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 15 ]; then echo "== $name skipped (no time left)" >> "$log"; return; fi
  echo "== $name (limit ${limit}s, at $(( $(date +%s) - start ))s)" >> "$log"
  timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
  echo "== $name exit $? (at $(( $(date +%s) - start ))s)" >> "$log"
}
build_torch_stack() {
  nvidia-smi -L >> "$log"
  # TE_GPU_REUSE_BUILD=1: a machine still holding this tree's build from the run before
  # skips the build (about 160 s) when the CUDA core imports
  if [ "${TE_GPU_REUSE_BUILD:-0}" = 1 ] && python3 -c "import torch, \
      transformer_engine.pytorch as te; assert te.is_fp8_available()" >> "$log" 2>&1
  then
    echo "== build reused (at $(( $(date +%s) - start ))s)" >> "$log"
    return
  fi
  step build_common 300 python3 -m pip install --no-build-isolation --no-deps -q \
    -C cmake.define.TE_WITH_CUDA=ON -C cmake.define.TE_CUDA_ARCHITECTURES=90a ./common
  step build_torch 120 env CXX=/usr/bin/g++ CC=/usr/bin/gcc python3 -m pip install \
    --no-build-isolation --no-deps -q ./pytorch
}
torch_package() {
  python3 -c "import os, transformer_engine.pytorch as t; print(os.path.dirname(t.__file__))"
}
set_flag() {
  local file
  file="$(torch_package)/$1"
  sed -i "s/^$2 = \(True\|False\)\$/$2 = $3/" "$file"
  grep -n "^$2 = " "$file" >> "$log"
}
build_jax_stack() {
  build_torch_stack
  step build_jax 120 python3 -m pip install --no-build-isolation --no-deps -q ./jax
}
ab_model() {
  local file=$1 name=$2 on=$3 off=$4 result=$5 base=$6 was round side runs_left share
  shift 6
  was=$(sed -n "s/^$name = \(True\|False\)\$/\1/p" "$(torch_package)/$file")
  set -f  # the case patterns are globs for bench_model, not for the shell
  for round in 1 2; do
    for side in on off; do
      local variants=("$base")
      [ "$round$side" = 1on ] && variants+=("$@")
      local value=$off
      [ "$side" = on ] && value=$on
      set_flag "$file" "$name" "$value"
      runs_left=$(( (2 - round) * 2 + 1 )); [ "$side" = on ] && runs_left=$((runs_left + 1))
      share=$(( $(left $((budget - 5))) / runs_left ))
      step "model_$round$side" "$(upto $((budget - 5)) "$share")" \
        python3 benchmarks/bench_model.py --hidden 1024 --isolate --budget-s $((share - 10)) \
        --module-iters 0 \
        --name "${result}_${side}${round}_$commit$suffix" --variants "${variants[@]}"
    done
  done
  set_flag "$file" "$name" "$was"
  set +f
}
