"""residual + dropout(x) as one autograd node (dropout_add_fn.py) over the core's fused op:
the values and gradients against the mask the op reports, TransformerLayer's use of it in
training only, reproducibility under torch.manual_seed, and tracing by torch.compile. The
core op itself is checked bit for bit against a numpy reference in tests/common/test_dropout.py.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._autograd_graph import node_names

import transformer_engine.pytorch as te
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.dropout_add_fn import _DropoutAdd, dropout_add, fuses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 33, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(64, 33, device=device, dtype=dtype, requires_grad=True)
    rng = torch.tensor([11, 5], dtype=torch.int64, device=device)
    y = _DropoutAdd.apply(x, r, rng, 0.2)
    # each element's factor (1 / (1 - p) or 0), as the op applies it: dropout of ones in fp32
    factor = ops.dropout_add_forward(torch.ones(64, 33, device=device), None, rng, 0.2)
    assert set(factor.unique().tolist()) == {0.0, (1 / torch.tensor(0.8)).item()}
    assert torch.equal(y, (r.float() + x.float() * factor).to(dtype))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(r.grad, g)
    assert torch.equal(x.grad, (g.float() * factor).to(dtype))


def test_reproducible_under_manual_seed():
    x, r = torch.randn(1000), torch.randn(1000)
    torch.manual_seed(3)
    a = dropout_add(x, r, 0.5)
    torch.manual_seed(3)
    b = dropout_add(x, r, 0.5)
    c = dropout_add(x, r, 0.5)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert abs((a != r).float().mean().item() - 0.5) < 0.06


def test_fuses_only_like_tensors():
    x = torch.randn(4, 8)
    assert fuses(x, torch.randn(4, 8))
    assert not fuses(x, torch.randn(1, 8))  # broadcasting: the caller's plain addition
    assert not fuses(x, torch.randn(4, 8, dtype=torch.float64))


def test_transformer_layer_fuses_hidden_dropout_in_training(monkeypatch):
    """Through the modules, the layer's residual + dropout is the fused op's node; the layer's
    one-node step (layer_block.py) calls the same op inside its node instead
    (test_layer_block.py compares the two bit for bit)."""
    from transformer_engine.pytorch import layer_block

    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.1, attention_dropout=0.0,
                                params_dtype=torch.float32, device="cpu")
    x = torch.randn(6, 2, 32, requires_grad=True)
    assert "LayerHPBackward" in node_names(layer(x))
    monkeypatch.setattr(layer_block, "enabled", False)
    out = layer(x)
    assert "_DropoutAddBackward" in node_names(out)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    layer.eval()
    with torch.no_grad():
        a, b = layer(x), layer(x)
    assert torch.equal(a, b)  # no dropout outside training


def test_traced_by_torch_compile():
    def f(x, r):
        return dropout_add(x, r, 0.3) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, r = torch.randn(16, 16), torch.randn(16, 16)
    torch.manual_seed(1)
    eager = f(x, r)
    torch.manual_seed(1)
    assert torch.equal(compiled(x, r), eager)
