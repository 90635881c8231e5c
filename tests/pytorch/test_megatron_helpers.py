"""NVIDIA TE's helpers that Megatron-LM calls beside the modules: tex.thd_get_partitioned_indices
(a packed batch split over context-parallel ranks) against the chunk layout written out here,
the multi-tensor L2 norm and scale (gradient clipping) against plain torch, get_dummy_wgrad's
shared buffer, and DotProductAttention's cp_comm_type attribute and num_splits keyword."""

from __future__ import annotations

import pytest
import torch
import transformer_engine_torch as tex
from te_torch_tests._tolerances import GEMM_RTOL

import transformer_engine.pytorch as te
from transformer_engine.pytorch.context_parallel_thd import gather_index
from transformer_engine.pytorch.module.base import get_dummy_wgrad
from transformer_engine.pytorch.optimizers import (
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
)

# --- thd_get_partitioned_indices ----------------------------------------------------------


def _layout(lengths: list[int], cp: int, rank: int) -> list[int]:
    """Rank ``rank``'s rows: every sequence cut into 2 * cp chunks, chunks rank and
    2 * cp - 1 - rank of each sequence in turn."""
    rows, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            rows += range(start + c * chunk, start + (c + 1) * chunk)
        start += length
    return rows


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[8], [16, 8, 0, 32], [24, 40, 8], [0, 8, 0]])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_partitioned_indices_are_the_chunk_layout(lengths, cp):
    cu, total = _cu(lengths), sum(lengths)
    per_rank = []
    for rank in range(cp):
        got = tex.thd_get_partitioned_indices(cu, total, cp, rank)
        assert got.dtype == torch.int32 and got.shape == (total // cp,)
        assert got.tolist() == _layout(lengths, cp, rank)
        per_rank.append(got)
    # the ranks' rows together are every row once
    assert sorted(torch.cat(per_rank).tolist()) == list(range(total))


@pytest.mark.parametrize("cp", [2, 4])
def test_partitioned_indices_match_the_attention_layout(cp):
    """The rows a rank takes are the rows DotProductAttention's thd context parallelism treats
    as that rank's: its all-gather puts them back at their global places."""
    cu, total = _cu([16, 8, 40]), 64
    rows = total // cp
    where = gather_index(cu, cp, rows)  # global row -> row in the rank-major all-gather
    for rank in range(cp):
        idx = tex.thd_get_partitioned_indices(cu, total, cp, rank).long()
        assert torch.equal(where[idx], rank * rows + torch.arange(rows))


def test_partitioned_indices_past_the_last_sequence_as_nvidia():
    """More rows than cu_seqlens covers: NVIDIA's kernel continues the last sequence's second
    chunk (rank 0: 6, 7 then 8, 9; rank 1: 4, 5 then 6, 7)."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert tex.thd_get_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 9]
    assert tex.thd_get_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 6, 7]
    # total_tokens may come as an integer 0-d tensor (cu_seqlens_padded[-1]), not as a float,
    # as with NVIDIA's binding
    assert tex.thd_get_partitioned_indices(cu, cu[-1], 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(TypeError):
        tex.thd_get_partitioned_indices(cu, 8.0, 2, 1)


def test_partitioned_indices_refuse_what_nvidias_refuses():
    cu = _cu([8, 8])
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 8"):
        tex.thd_get_partitioned_indices(_cu([8, 4, 4]), 16, 4, 0)
    with pytest.raises(ValueError, match="total_tokens must be a positive multiple"):
        tex.thd_get_partitioned_indices(cu, 12, 4, 0)
    with pytest.raises(ValueError, match="rank in \\[0, world_size\\)"):
        tex.thd_get_partitioned_indices(cu, 16, 2, 2)
    with pytest.raises(TypeError, match="1-D int32"):
        tex.thd_get_partitioned_indices(cu.float(), 16, 2, 0)
    with pytest.raises(AttributeError, match="thd_get_partitioned_indices"):
        tex.thd_read_half_tensor  # noqa: B018 (NVIDIA's internals stay out)


# --- multi_tensor_l2norm / multi_tensor_scale ---------------------------------------------

# A norm here is a float32 sum of K <= 256 non-negative squares (153 elements below), whose
# error is bounded by the fp32-accumulation term of the GEMM tolerance (the square root then
# halves the relative error).
NORM_RTOL = GEMM_RTOL[torch.float32]


def _grads(device, dtypes=(torch.float32, torch.bfloat16, torch.float32)):
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 8), (16,), (3, 5, 7)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dt)
            for s, dt in zip(shapes, dtypes, strict=True)]


def _flag(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def test_l2norm_is_the_norm_of_all_tensors(device):
    grads, flag = _grads(device), _flag(device)
    want = torch.stack([g.double().norm() for g in grads])
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], True)
    assert total.dtype == per_tensor.dtype == torch.float32
    assert total.shape == (1,) and per_tensor.shape == (3,)
    assert torch.allclose(per_tensor.cpu().double(), want.cpu(), rtol=NORM_RTOL, atol=0)
    assert abs(total.item() - want.norm().item()) <= NORM_RTOL * want.norm().item()
    # Megatron-LM's call: no per-tensor norms (an empty tensor, as NVIDIA's)
    total2, empty = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], False)
    assert torch.equal(total2, total) and empty.shape == (0,) and empty.dtype == torch.float32
    assert flag.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_sets_the_flag_on_a_non_finite_value(device, bad):
    grads, flag = _grads(device), _flag(device)
    grads[2][1, 2, 3] = bad
    total, _ = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], False)
    assert not torch.isfinite(total).item() and flag.item() == 1
    # the flag is only ever set: a finite call leaves it at 1
    multi_tensor_applier(multi_tensor_l2norm, flag, [_grads(device)], False)
    assert flag.item() == 1


def test_l2norm_of_no_tensors_is_zero(device):
    flag = _flag(device)
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm, flag, [[]], True)
    assert total.tolist() == [0.0] and per_tensor.shape == (0,)
    assert total.device == flag.device and flag.item() == 0


def test_scale_in_place_and_across_dtypes(device):
    grads, flag = _grads(device), _flag(device)
    want = [g * 0.3 for g in grads]
    multi_tensor_applier(multi_tensor_scale, flag, [grads, grads], 0.3)  # clip_grads' call
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    # out of place, each output the float32 product rounded once to its dtype
    src = _grads(device, (torch.float32, torch.bfloat16, torch.float16))
    dst = [torch.empty_like(s, dtype=dt)
           for s, dt in zip(src, (torch.bfloat16, torch.float32, torch.float32), strict=True)]
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.3)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s.float() * 0.3).to(d.dtype))
    # scale 1: a copy (Megatron-LM's model <-> main parameter copies)
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(d.dtype)) for s, d in zip(src, dst, strict=True))
    assert flag.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_scale_sets_the_flag_on_a_non_finite_input(device, bad):
    src, flag = _grads(device), _flag(device)
    src[0][2, 3] = bad
    dst = [torch.zeros_like(s) for s in src]
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.5)
    assert flag.item() == 1
    # the outputs are written anyway, as NVIDIA's are
    assert all(torch.equal(d, s * 0.5) for s, d in zip(src[1:], dst[1:], strict=True))


def test_scale_flags_inputs_not_overflowing_products(device):
    """NVIDIA's kernel checks the inputs: a finite value whose product overflows sets nothing."""
    src, flag = [torch.full((4,), 3e38, device=device)], _flag(device)
    dst = [torch.empty(4, device=device)]
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 10.0)
    assert torch.isinf(dst[0]).all() and flag.item() == 0


def test_scale_of_no_tensors_does_nothing_and_pairs_must_match(device):
    flag = _flag(device)
    multi_tensor_applier(multi_tensor_scale, flag, [[], []], 0.5)
    assert flag.item() == 0
    with pytest.raises(ValueError, match="one tensor each per pair"):
        multi_tensor_applier(multi_tensor_scale, flag, [_grads(device), []], 0.5)


def test_applier_passes_nvidias_chunk_size():
    seen = []
    out = multi_tensor_applier(lambda *args: seen.append(args) or "done", "flag", [["t"]], 7)
    assert out == "done" and seen == [(2048 * 32, "flag", [["t"]], 7)]


# --- get_dummy_wgrad ----------------------------------------------------------------------


def test_dummy_wgrad_is_one_shared_buffer_per_shape_and_dtype():
    a = get_dummy_wgrad([3, 5], torch.float32)
    b = get_dummy_wgrad([3, 5], torch.float32)
    assert a is not b and a.data_ptr() == b.data_ptr()  # new tensor objects, one storage
    assert a.shape == (3, 5) and a.dtype == torch.float32 and not a.requires_grad
    assert a.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert get_dummy_wgrad([5, 3], torch.float32).data_ptr() != a.data_ptr()
    assert get_dummy_wgrad([3, 5], torch.bfloat16).data_ptr() != a.data_ptr()


def test_dummy_wgrad_is_zeroed_only_when_asked():
    get_dummy_wgrad([2, 7], torch.float32).fill_(4.0)
    # without zero, what the last user wrote is still there (NVIDIA's does not clear it)
    assert (get_dummy_wgrad([2, 7], torch.float32) == 4.0).all()
    assert (get_dummy_wgrad([2, 7], torch.float32, zero=True) == 0).all()


# --- DotProductAttention: cp_comm_type, num_splits ----------------------------------------


def test_dpa_keeps_cp_comm_type():
    """Megatron-LM reads it back to re-set the group: set_context_parallel_group(..., comm)."""
    assert te.DotProductAttention(2, 8, device="cpu").cp_comm_type == "p2p"
    attn = te.DotProductAttention(2, 8, device="cpu", cp_comm_type="a2a")
    assert attn.cp_comm_type == "a2a"
    attn.set_context_parallel_group(None, None, None, "all_gather")
    assert attn.cp_comm_type == "all_gather"
    attn.set_context_parallel_group(None, None, None, attn.cp_comm_type)
    assert attn.cp_comm_type == "all_gather"


def test_dpa_num_splits_one_changes_nothing_and_more_raise():
    attn = te.DotProductAttention(2, 8, qkv_format="bshd", device="cpu")
    q, k, v = (torch.randn(2, 6, 2, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    want = attn(q, k, v)
    for splits in (None, 1):
        assert torch.equal(attn(q, k, v, num_splits=splits), want)
    with pytest.raises(NotImplementedError, match="num_splits=2 is not implemented"):
        attn(q, k, v, num_splits=2)
