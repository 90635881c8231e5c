"""Sequence parallelism (sequence_parallel=True with tensor parallelism) on torch.distributed
(gloo, CPU processes): te.Linear column and row, te.LayerNormLinear and te.LayerNormMLP, in
fp32 and FP8 (current scaling), each rank's shards against the unsplit module
(_tp_rank_sp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from te_torch_tests._tp_world import run_world

_RANK_SCRIPT = Path(__file__).resolve().parent / "_tp_rank_sp.py"


@pytest.mark.slow
def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)


@pytest.mark.slow
def test_four_ranks():
    run_world(_RANK_SCRIPT, 4)
