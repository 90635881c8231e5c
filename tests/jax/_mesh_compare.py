"""How a training step on a mesh is compared with the same step on one device, for the layer
tests over 8 CPU devices (test_sharding_mesh, test_context_parallel, test_sequence_parallel).

Each leaf of the step's results (outputs, gradients, FP8 state) is either bitwise equal (a
value no split dimension sums, or a maximum over shards) or within ``layer_step_tolerance``:
(bound on the largest difference, bound on the difference's norm), relative to the one-device
tensor's largest magnitude and norm. fp32: the partitioned sums in another order, 1e-5. bf16
without FP8: each partial sum rounded to bf16 before the all-reduce, 2e-2. bf16 with FP8: where
a bf16 sum over a split moves an element across an FP8 rounding boundary, the next FP8 GEMM
rounds it one E4M3 / E5M2 step (6% / 12%) away, and through an attention block and an MLP such
flips compound (measured up to 18% of the largest magnitude, 8% in norm): 2.5e-1 and 1e-1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable


def layer_step_tolerance(case: str) -> tuple:
    """(largest, norm) for a case named model-mesh-recipe-dtype."""
    _, _, fp8, dtype = case.split("-")
    if dtype == "float32":
        return 1e-5, 1e-5
    return (2e-2, 2e-2) if fp8 == "none" else (2.5e-1, 1e-1)


def assert_matches_one_device(case: str, leaves: dict, bitwise: Callable[[str], bool]) -> None:
    """Every leaf bitwise where ``bitwise(leaf)``, else within the case's tolerance; the FP8
    state present exactly for delayed scaling."""
    largest, norm = layer_step_tolerance(case)
    assert any("fp8_metas" in leaf for leaf in leaves) == ("delayed" in case)
    for leaf, cmp in leaves.items():
        if bitwise(leaf):
            assert cmp["equal"], f"{case} {leaf}: not bitwise equal ({cmp})"
            continue
        bound = largest * max(cmp["ref_max_abs"], 1e-30)
        assert cmp["max_abs_diff"] <= bound, f"{case} {leaf}: {cmp} beyond {largest}"
        assert cmp["rel_norm_diff"] <= norm, f"{case} {leaf}: {cmp} beyond {norm} in norm"


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collectives(hlo: str) -> list:
    """[kind, [[dtype, shape], ...]] of every collective in the compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            arrays = [[dt, [int(d) for d in dims.split(",") if d]]
                      for dt, dims in _ARRAY.findall(match.group(1))]
            found.append([match.group(2), arrays])
    return found


def run_script(script: Path, *args: str) -> dict:
    """Runs one of the mesh scripts in a process of its own (it sets its host device count,
    which must come before jax's import) and returns the JSON object of its last line."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the script sets its own device count
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=script.parent)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])
