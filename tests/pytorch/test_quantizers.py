"""Quantizers and the quantized tensor at NVIDIA's module paths
(transformer_engine.pytorch.tensor): the same bytes as the ops they stand for."""

from __future__ import annotations

import pytest
import torch

from transformer_engine.common import recipe
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    QuantizedTensor,
)
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer as Same


def _x():
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3


def test_paths_name_the_same_classes():
    assert Same is Float8Quantizer
    assert QuantizedTensor is Float8Tensor is Float8BlockwiseQTensor


def test_delayed_quantizer_uses_its_scale_and_writes_the_amax():
    x = _x()
    scale, amax = torch.full((1,), 8.0), torch.zeros(1)
    q = Float8Quantizer(scale, amax, torch.float8_e4m3fn)(x)
    data, col, sinv, want_amax = ops.quantize(x, scale, "float8_e4m3", True, True)
    assert isinstance(q, QuantizedTensor) and q.dtype == x.dtype and q.shape == x.shape
    assert torch.equal(q._data, data) and torch.equal(q._scale_inv, sinv)
    assert torch.equal(q.transpose_data()[0], col)
    assert torch.equal(amax, want_amax)
    torch.testing.assert_close(q.dequantize(), x, rtol=0.07, atol=1 / 8 * 2**-6)


def test_current_scaling_quantizer_equals_float8_tensor_quantize():
    x = _x().to(torch.bfloat16)
    qz = Float8CurrentScalingQuantizer(recipe.Format.E4M3, "cpu", columnwise=False)
    q = qz.quantize(x)
    want = Float8Tensor.quantize(x)
    assert torch.equal(q._data, want._data) and torch.equal(q._scale_inv, want._scale_inv)
    assert q._transpose is None
    assert float(qz.amax) == float(x.float().abs().max())


def test_block_quantizer_scales_per_block():
    x = _x()
    q = Float8BlockQuantizer("float8_e4m3", block_scaling_dim=2)(x)
    assert q._scaling_mode == "block_128x128" and q._scale_inv.shape == (1, 2)
    one_by = Float8BlockQuantizer("float8_e4m3", block_scaling_dim=1)(x)
    assert one_by._scale_inv.shape == (64, 2)
    torch.testing.assert_close(q.dequantize(), x, rtol=0.07, atol=0.05)


def test_update_quantized_writes_into_the_existing_tensor():
    x = _x()
    qz = Float8CurrentScalingQuantizer("float8_e5m2", "cpu", columnwise=False)
    dst = qz.make_empty(x.shape, dtype=torch.float32, device="cpu")
    data = dst._data
    out = qz.quantize(x, out=dst)
    assert out is dst and dst._data is data  # the same buffers
    assert torch.equal(dst._data, qz(x)._data)


def test_bad_arguments_name_the_quantizer_and_argument():
    with pytest.raises(TypeError, match="Float8Quantizer: fp8_dtype must be one of"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), torch.int8)
    with pytest.raises(TypeError, match="Float8Quantizer: scale must be a float32 tensor"):
        Float8Quantizer(torch.ones(2), torch.zeros(1), "float8_e4m3")
    with pytest.raises(TypeError, match="Float8CurrentScalingQuantizer: the tensor to quantize"):
        Float8CurrentScalingQuantizer("float8_e4m3", "cpu")(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="with_amax_reduction"):
        Float8CurrentScalingQuantizer("float8_e4m3", "cpu", with_amax_reduction=True)
    with pytest.raises(ValueError, match="block_scaling_dim must be 1 or 2"):
        Float8BlockQuantizer("float8_e4m3", block_scaling_dim=3)


def test_tex_dtype_names_the_formats():
    """NVIDIA's programs import its extension as ``tex`` and pass ``tex.DType.kFloat8E4M3``:
    the module exists with DType (the core's codes), and its FP8 members serve as fp8_dtype."""
    import transformer_engine_torch as tex

    from transformer_engine.pytorch.ops._backend import dtype_code

    for member, ours in [(tex.DType.kFloat8E4M3, "float8_e4m3"),
                         (tex.DType.kFloat8E5M2, "float8_e5m2"),
                         (tex.DType.kBFloat16, "bfloat16"), (tex.DType.kFloat32, "float32")]:
        assert int(member) == dtype_code(ours)
    x = _x()
    by_tex = Float8Quantizer(torch.full((1,), 8.0), torch.zeros(1), tex.DType.kFloat8E5M2)(x)
    by_name = Float8Quantizer(torch.full((1,), 8.0), torch.zeros(1), "float8_e5m2")(x)
    assert torch.equal(by_tex._data, by_name._data)
    with pytest.raises(TypeError, match="tex.DType.kFloat8E4M3"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), tex.DType.kBFloat16)
    with pytest.raises(AttributeError, match="gives only DType"):
        tex.quantize  # noqa: B018 (NVIDIA's internals are not reproduced)
