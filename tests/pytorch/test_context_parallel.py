"""Context parallelism of te.DotProductAttention, te.MultiheadAttention (with RoPE) and
te.TransformerLayer on torch.distributed (gloo, CPU processes): each rank's rows against
attention over the whole sequence, in fp32 and FP8 (_cp_rank.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from te_torch_tests._tp_world import run_world

_RANK_SCRIPT = Path(__file__).resolve().parent / "_cp_rank.py"


@pytest.mark.slow
def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)


@pytest.mark.slow
def test_four_ranks():
    run_world(_RANK_SCRIPT, 4)
