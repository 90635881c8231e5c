"""te.MultiheadAttention and te.TransformerLayer split over a tensor-parallel group
(set_parallel_mode=True), with and without sequence parallelism, on torch.distributed (gloo,
CPU processes): each rank's results against the unsplit module's (_tp_rank_mha.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from te_torch_tests._tp_world import run_world

_RANK_SCRIPT = Path(__file__).resolve().parent / "_tp_rank_mha.py"


@pytest.mark.slow
def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)
