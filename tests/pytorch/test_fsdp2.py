"""te modules under torch's FSDP2 (fully_shard) on gloo CPU processes: gradients of a sharded
stack of te.TransformerLayer equal the unsharded stack's, in fp32 and FP8 (_fsdp_rank.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from te_torch_tests._tp_world import run_world

_RANK_SCRIPT = Path(__file__).resolve().parent / "_fsdp_rank.py"


@pytest.mark.slow
def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)
