"""Module keywords of NVIDIA Transformer Engine 2.x's PyTorch API: a program passing them runs
here unchanged, or gets an error naming the module, the keyword, what is supported and what
came."""

import pytest
import torch

import transformer_engine.pytorch as te

CPU = "cpu"


# te.LayerNorm / te.RMSNorm: normalized_shape, NVIDIA's name of our hidden_size

@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
@pytest.mark.parametrize("shape", [16, (16,), [16], torch.Size([16])])
def test_norm_normalized_shape(cls, shape):
    by_new = cls(normalized_shape=shape, eps=1e-6, device=CPU)
    by_old = cls(hidden_size=16, eps=1e-6, device=CPU)
    assert by_new.hidden_size == 16 and by_new.weight.shape == (16,)
    assert by_new.eps == 1e-6
    x = torch.randn(3, 16)
    torch.testing.assert_close(by_new(x), by_old(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norm_nvidia_positional_order(cls):
    """NVIDIA's order: normalized_shape, eps, sequence_parallel, params_dtype,
    zero_centered_gamma, hidden_size."""
    m = cls(16, 1e-3, True, torch.bfloat16, True, device=CPU)
    assert (m.eps, m.sequence_parallel, m.weight.dtype, m.zero_centered_gamma) == (
        1e-3, True, torch.bfloat16, True)
    assert m.weight.sequence_parallel
    assert cls(16, device=CPU, dtype=torch.float16).weight.dtype == torch.float16


@pytest.mark.parametrize("cls, name", [(te.LayerNorm, "te.LayerNorm"), (te.RMSNorm, "te.RMSNorm")])
def test_norm_bad_shapes(cls, name):
    with pytest.raises(ValueError, match=name + r": normalized_shape must be an int or a "
                                              r"1-element tuple/list.*\(4, 4\)"):
        cls(normalized_shape=(4, 4), device=CPU)
    with pytest.raises(ValueError, match=name + r": normalized_shape must be an int or a "
                                              r"1-element.*\[\]"):
        cls(normalized_shape=[], device=CPU)
    with pytest.raises(ValueError, match=name + r": hidden_size must be positive.*2.5"):
        cls(normalized_shape=(2.5,), device=CPU)
    with pytest.raises(ValueError, match=name + r": normalized_shape \(16\) and hidden_size "
                                              r"\(8\).*must agree"):
        cls(normalized_shape=16, hidden_size=8, device=CPU)
    with pytest.raises(TypeError, match=name + r": give normalized_shape"):
        cls(device=CPU)
    with pytest.raises(ValueError, match=name + r": params_dtype .* and dtype .* must agree"):
        cls(16, params_dtype=torch.float32, dtype=torch.bfloat16, device=CPU)
