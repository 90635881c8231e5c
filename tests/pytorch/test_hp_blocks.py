"""LayerNormLinear's and LayerNormMLP's high-precision step as one autograd node (hp_blocks.py)
against the same step built from its pieces (``hp_blocks.enabled = False``): outputs and every
gradient bit for bit, over the norms, biases, activations (gated and clamped), dtypes (fp32
parameters under a bf16 input included), frozen parameters and inputs without a gradient; and
the node count that is the point of it."""

from __future__ import annotations

import copy

import pytest
import torch
from te_torch_tests._autograd_graph import graph_nodes

import transformer_engine.pytorch as te
from transformer_engine.pytorch import hp_blocks


def _module(kind: str, device: str, params_dtype, **kw):
    torch.manual_seed(0)
    if kind == "LayerNormLinear":
        m = te.LayerNormLinear(32, 48, params_dtype=params_dtype, device=device, **kw)
    else:
        m = te.LayerNormMLP(32, 64, params_dtype=params_dtype, device=device, **kw)
    with torch.no_grad():  # away from the initial values (zero biases, unit gammas)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, device=device).to(p.dtype) * 0.1)
    return m


def _step(m, x, g, enabled: bool, monkeypatch):
    monkeypatch.setattr(hp_blocks, "enabled", enabled)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = m(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def check(kind, device, dtype, params_dtype, monkeypatch, frozen=(), input_grad=True, **kw):
    m = _module(kind, device, params_dtype, **kw)
    for name, p in m.named_parameters():
        if any(name.startswith(f) for f in frozen):
            p.requires_grad_(False)
    pieces = copy.deepcopy(m)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, generator=gen).to(device=device, dtype=dtype)
    x.requires_grad_(input_grad)
    out = 48 if kind == "LayerNormLinear" else 32
    g = torch.randn(5, 3, out, generator=gen).to(device=device, dtype=dtype)
    got = _step(m, x, g, True, monkeypatch)
    want = _step(pieces, x, g, False, monkeypatch)
    names = ["output", "input grad"] + [f"{n}.grad" for n, _ in m.named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None, name
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_node_equals_the_pieces_cpu(dtype, kind, bias, normalization, monkeypatch):
    check(kind, "cpu", dtype, dtype, monkeypatch, bias=bias, normalization=normalization)


@pytest.mark.parametrize("activation", ["swiglu", "relu", "qgeglu"])
def test_mlp_activations_cpu(activation, monkeypatch):
    check("LayerNormMLP", "cpu", torch.bfloat16, torch.bfloat16, monkeypatch,
          activation=activation, zero_centered_gamma=True)


def test_clamped_swiglu_cpu(monkeypatch):
    check("LayerNormMLP", "cpu", torch.bfloat16, torch.bfloat16, monkeypatch,
          activation="clamped_swiglu", activation_params={"limit": 0.5, "alpha": 1.702})


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_fp32_parameters_under_a_bf16_input_cpu(kind, monkeypatch):
    """The weights' casts stay outside the node: their gradients come back as fp32, as the
    pieces give them."""
    check(kind, "cpu", torch.bfloat16, torch.float32, monkeypatch)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_frozen_parts_and_an_input_without_gradient_cpu(kind, monkeypatch):
    check(kind, "cpu", torch.float32, torch.float32, monkeypatch, frozen=("layer_norm",),
          input_grad=False)
    check(kind, "cpu", torch.float32, torch.float32, monkeypatch, frozen=("weight", "fc1"))


def _nodes(y: torch.Tensor) -> int:
    return sum(1 for fn in graph_nodes(y) if type(fn).__name__ != "AccumulateGrad")


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_the_step_is_one_autograd_node(kind, monkeypatch):
    m = _module(kind, "cpu", torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(hp_blocks, "enabled", True)
    assert _nodes(m(x)) == 1
    assert _nodes(m(x.view(4, 2, 32))) == 3  # and the views of the input and the output
    monkeypatch.setattr(hp_blocks, "enabled", False)
    assert _nodes(m(x)) >= 3  # norm, addmm, transpose (and the MLP's second half)


def test_what_keeps_the_pieces(monkeypatch):
    """A returned norm output and deferred weight gradients need the pieces' tensors."""
    monkeypatch.setattr(hp_blocks, "enabled", True)
    x = torch.randn(4, 32, requires_grad=True)
    m = te.LayerNormLinear(32, 16, return_layernorm_output=True, device="cpu")
    out, ln_out = m(x)
    assert _nodes(out) > 1 and ln_out.shape == (4, 32)
    m = te.LayerNormMLP(32, 64, delay_wgrad_compute=True, device="cpu")
    assert _nodes(m(x)) > 1


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_compiled_step_equals_eager_cpu(kind, monkeypatch):
    """torch.compile(fullgraph=True) traces the node (no graph break) and runs the same calls:
    the eager pieces' bits. aot_eager, as inductor's fused kernels would round differently."""
    monkeypatch.setattr(hp_blocks, "enabled", True)
    m = _module(kind, "cpu", torch.float32)
    compiled_m = copy.deepcopy(m)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=gen)
    g = torch.randn(6, 48 if kind == "LayerNormLinear" else 32, generator=gen)

    def step(forward, module):
        inp = x.clone().requires_grad_(True)
        y = forward(inp)
        y.backward(g)
        return [y.detach(), inp.grad] + [p.grad for p in module.parameters()]

    compiled = torch.compile(compiled_m, fullgraph=True, backend="aot_eager")
    traced = step(compiled, compiled_m)
    monkeypatch.setattr(hp_blocks, "enabled", False)
    for got, want in zip(traced, step(m, m), strict=True):
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_one_node_equals_the_pieces(kind, bias, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check(kind, "cuda", torch.bfloat16, torch.bfloat16, monkeypatch, bias=bias)
    check(kind, "cuda", torch.bfloat16, torch.float32, monkeypatch, bias=bias)
