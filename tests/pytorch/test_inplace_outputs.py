"""Every module's output may be modified in place (nn.ReLU(inplace=True), a residual ``+=``),
in high precision and in FP8, whatever the input's rank: autograd forbids that on views a custom
autograd function returns, so the modules give outputs their leading dimensions outside their
functions (module/base.py, with_leading_dims)."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

MODULES = {
    "LayerNorm": lambda d: te.LayerNorm(64, device=d, params_dtype=torch.bfloat16),
    "RMSNorm": lambda d: te.RMSNorm(64, device=d, params_dtype=torch.bfloat16),
    "Linear": lambda d: te.Linear(64, 32, device=d, params_dtype=torch.bfloat16),
    "LayerNormLinear": lambda d: te.LayerNormLinear(64, 32, device=d, params_dtype=torch.bfloat16),
    "LayerNormLinear-ln-out": lambda d: te.LayerNormLinear(
        64, 32, device=d, params_dtype=torch.bfloat16, return_layernorm_output=True),
    "LayerNormMLP": lambda d: te.LayerNormMLP(64, 128, device=d, params_dtype=torch.bfloat16),
    "LayerNormMLP-swiglu": lambda d: te.LayerNormMLP(64, 128, device=d, activation="swiglu",
                                                     params_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["high-precision", "fp8"])
@pytest.mark.parametrize("shape", [(16, 64), (2, 8, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("name", list(MODULES))
def test_output_takes_in_place_ops(device, name, shape, fp8):
    m = MODULES[name](device)
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling()):
        out = m(x)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(y.shape[:-1] == x.shape[:-1] for y in outs)
    # The main output only: the norm output that return_layernorm_output adds is saved by the
    # high-precision GEMM after it, and torch forbids modifying a saved tensor in any model.
    outs[0].relu_()
    sum(y.float().sum() for y in outs).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
