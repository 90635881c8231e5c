"""The distributed features on torch.distributed (gloo, CPU processes), each in a world of
rank processes that check themselves against the unsplit modules (run_world):

- ``_tp_rank_sp.py``: sequence parallelism of te.Linear (column, row), te.LayerNormLinear and
  te.LayerNormMLP, fp32 and FP8 (delayed scaling with fp8_group, current scaling): the
  gathers move FP8 bytes (uint8, the whole tensor's quantization), the norm runs on the shard;
  a gather in the wrong order or a reduce-scatter without the sum fails;
- ``_tp_rank_mha.py``: tensor (and sequence) parallelism of te.MultiheadAttention and
  te.TransformerLayer (self, cross, GQA attention), fp32 and FP8;
- ``_cp_rank.py``: context parallelism of te.DotProductAttention, te.MultiheadAttention with
  RoPE and te.TransformerLayer against attention over the whole sequence, fp32 and FP8, under
  each cp_comm_type (all_gather, p2p, a2a; a2a+p2p on 4 ranks);
- ``_fsdp_rank.py``: FSDP2 (fully_shard) of a te.TransformerLayer stack, fp32, current and
  delayed scaling, and its meta-device init; the FP8 all-gather of fp8_model_init weights and
  of high-precision weights under te.distributed.fp8_all_gather (the modules get the whole
  weight's FP8 bytes exactly; uint8 gathers, half of bf16's bytes);
- ``_ddp_rank.py``: DistributedDataParallel of the stack, fp32, current and delayed scaling,
  fp8_model_init weights: each step (gradients, SGD update) as on the whole batch;
- ``_dcp_rank.py``: a distributed checkpoint (torch.distributed.checkpoint) of the FSDP2
  stack with its FP8 state and FP8 weights, loaded into a fresh one: the next step equal bit
  for bit;
- ``_tp_rank_late_group.py``: modules built with tp_size and no group, given it later by
  set_tensor_parallel_group (NVIDIA's way): the same parameters, outputs and gradients as
  built with it.

(te.Linear's and the LayerNorm blocks' tensor parallelism: test_tensor_parallel*.py.)

The same scripts run on one rank too, where the modules run unsplit (tensor and sequence
parallelism take effect from two ranks, as in NVIDIA's) but DDP, FSDP2, the distributed
checkpoint, the amax reductions and context parallelism still go through the process group:
over gloo on the CPU, and over NCCL on one GPU (``cuda``-marked; TE_WORLD_DEVICE=cuda).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from te_torch_tests._tp_world import run_world

HERE = Path(__file__).resolve().parent
WORLDS = [("_tp_rank_sp.py", 2), ("_tp_rank_sp.py", 4), ("_tp_rank_mha.py", 2),
          ("_cp_rank.py", 2), ("_cp_rank.py", 4), ("_fsdp_rank.py", 2), ("_fsdp_rank.py", 4),
          ("_ddp_rank.py", 2), ("_ddp_rank.py", 4), ("_dcp_rank.py", 2), ("_dcp_rank.py", 4),
          ("_tp_rank_late_group.py", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("script, world", WORLDS,
                         ids=[f"{s[1:-3]}-{w}-ranks" for s, w in WORLDS])
def test_every_rank_agrees_with_the_unsplit_modules(script, world):
    run_world(HERE / script, world)


ONE_RANK = ["_tp_rank_sp.py", "_tp_rank_mha.py", "_cp_rank.py", "_fsdp_rank.py", "_ddp_rank.py",
            "_dcp_rank.py"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ONE_RANK, ids=[s[1:-3] for s in ONE_RANK])
def test_one_rank_world(script, monkeypatch):
    monkeypatch.setitem(os.environ, "TE_WORLD_DEVICE", "cpu")
    run_world(HERE / script, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("script", ONE_RANK, ids=[s[1:-3] for s in ONE_RANK])
def test_one_gpu_nccl_world(script, monkeypatch):
    """The rank scripts on GPU 0 over NCCL: every collective with CUDA tensors."""
    monkeypatch.setitem(os.environ, "TE_WORLD_DEVICE", "cuda")
    run_world(HERE / script, 1)
