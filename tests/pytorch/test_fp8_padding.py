"""te.Fp8Padding / te.Fp8Unpadding (NVIDIA's pair around a grouped GEMM) and the names of
NVIDIA's PyTorch package that are re-exported here or refused by name."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te


@pytest.mark.parametrize("align", [None, 32])
def test_padding_pads_each_group_with_zero_rows_and_unpadding_restores_it(align):
    splits = [5, 0, 16, 33]
    x = torch.randn(sum(splits), 8, requires_grad=True)
    padded, padded_splits = te.Fp8Padding(4, align)(x, splits)
    a = align or 16
    assert padded_splits == [-(-m // a) * a for m in splits]
    assert padded.shape == (sum(padded_splits), 8)
    src = dst = 0
    for m, p in zip(splits, padded_splits, strict=True):
        assert torch.equal(padded[dst:dst + m], x[src:src + m])
        assert not padded[dst + m:dst + p].any()
        src, dst = src + m, dst + p
    back = te.Fp8Unpadding(4, align)(padded, splits)
    assert torch.equal(back, x)
    g = torch.randn_like(back)
    (back * g).sum().backward()
    assert torch.equal(x.grad, g)


def test_aligned_splits_pass_through_and_bad_splits_are_errors():
    x = torch.randn(32, 4)
    out, splits = te.Fp8Padding(2)(x, [16, 16])
    assert out is x and splits == [16, 16]
    with pytest.raises(ValueError, match=r"te.Fp8Padding: m_splits must hold num_gemms=2"):
        te.Fp8Padding(2)(x, [32])
    with pytest.raises(ValueError, match=r"te.Fp8Unpadding: inp must be \[32 rows"):
        te.Fp8Unpadding(2)(torch.randn(20, 4), [10, 10])
    with pytest.raises(ValueError, match="num_gemms must be an int >= 1"):
        te.Fp8Padding(0)


def test_nvidia_names_re_exported_at_the_top():
    from transformer_engine.pytorch import distributed, tensor

    assert te.CudaRNGStatesTracker is distributed.CudaRNGStatesTracker
    assert te.Float8Quantizer is tensor.Float8Quantizer
    assert te.QuantizedTensor is tensor.QuantizedTensor


@pytest.mark.parametrize("name", ["initialize_ub", "ManualOffloadSynchronizer", "onnx_export",
                                  "MXFP8Quantizer", "NVFP4Tensor"])
def test_nvidia_names_not_provided_say_so_and_keep_feature_checks_working(name):
    with pytest.raises(NotImplementedError, match=f"transformer_engine.pytorch.{name} "
                                                  r"\(NVIDIA Transformer Engine's\) is not "
                                                  "provided here"):
        getattr(te, name)
    assert not hasattr(te, name) and getattr(te, name, "absent") == "absent"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        te.no_such_name  # noqa: B018
