"""Sequence parallelism (MeshResource.tpsp_resource with TransformerLayer's
enable_sequence_parallel) over an 8-device CPU mesh, dp 2 x tpsp 4, against one device.

Under tpsp the kernels split as under tp (QKV and FC1 column parallel, the output projection
and FC2 row parallel), and the residual stream between the blocks is split along the
sequence: each block's input is all-gathered along the sequence before its GEMMs, and its
row-parallel output summed over the axis and split again. The mesh runs happen in
``_mesh_context_script.py`` (one subprocess). Tolerances as the tensor-parallel steps of
``test_sharding_mesh.py`` (the same sums over the same split): 1e-5 in fp32; bf16 with FP8
within the FP8 rounding flips those tests measured (2.5e-1 of the largest magnitude, 1e-1 in
norm).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from te_jax_tests._mesh_compare import assert_matches_one_device, run_script

_SCRIPT = Path(__file__).resolve().parent / "_mesh_context_script.py"
_CASES = ["layer_sp-dp2_tpsp4-none-float32", "layer_sp-dp2_tpsp4-delayed-bfloat16",
          "layer_sp_sbhd-dp2_tpsp4-current-float32"]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_script(_SCRIPT, *_CASES)


@pytest.mark.parametrize("case", _CASES)
def test_sequence_parallel_layer_step_equals_the_one_device_step(runs, case):
    # The kernels' amaxes and the layer input's are maxima over the shards of the same values:
    # exact. The MLP's input follows the attention's row-parallel sum, whose order differs:
    # it gets the tolerance.
    assert_matches_one_device(
        case, runs[case]["leaves"],
        lambda leaf: "fp8_metas" in leaf and ("kernel" in leaf or "['attention']" in leaf)
        and "grad_" not in leaf)


@pytest.mark.parametrize("case", _CASES)
def test_the_stream_is_gathered_along_the_sequence_and_no_weight_moves(runs, case):
    """The only activations gathered are the residual stream's, along the sequence: this
    device's 4 batch rows, the whole sequence of 24, the hidden 64 (XLA may give the gathered
    buffer another shape of those elements, e.g. [8, 12, 64] for seq-first). No collective
    moves a whole kernel (they split over tpsp as over tp)."""
    run = runs[case]
    gathered = [shape for kind, arrays in run["collectives"] if kind == "all-gather"
                for _, shape in arrays]
    assert gathered and all(shape[-1] == 64 and int(np.prod(shape)) == 4 * 24 * 64
                            for shape in gathered), gathered
    shapes = set()
    for shape in run["kernels"].values():
        k, n = shape[0], int(np.prod(shape[1:]))
        shapes.update({tuple(shape), (k, n), (n, k)})
    moved = [(kind, shape) for kind, arrays in run["collectives"] if kind != "all-reduce"
             for _, shape in arrays if tuple(shape) in shapes]
    assert not moved, moved
