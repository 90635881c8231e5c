"""te.ops under NVIDIA's fusible-operation names: the basic operations as modules of this
package (same numbers as the core's activations and te.Linear), clear errors for the rest."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import ops

# te.ops name -> the core's activation of the same definition
CORE_ACTIVATIONS = {"GELU": "gelu", "QGELU": "qgelu", "ReLU": "relu", "SReLU": "srelu",
                    "SiLU": "silu", "GEGLU": "geglu", "SwiGLU": "swiglu", "ReGLU": "reglu",
                    "QGEGLU": "qgeglu", "SReGLU": "sreglu"}


@pytest.mark.parametrize("name", sorted(CORE_ACTIVATIONS))
def test_activations_compute_what_the_core_computes(name):
    x = torch.randn(32, 64, dtype=torch.float32)
    got = getattr(te.ops, name)()(x)
    want = ops.activation_forward(x, CORE_ACTIVATIONS[name])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gated_activations_need_an_even_last_dimension():
    with pytest.raises(ValueError, match="te.ops.SwiGLU: a gated activation needs an even"):
        te.ops.SwiGLU()(torch.randn(4, 7))


def test_linear_is_te_linear_with_nvidia_keywords():
    torch.manual_seed(0)
    a = te.ops.Linear(64, 32, device="cpu", dtype=torch.float32)
    b = te.Linear(64, 32, device="cpu")
    b.load_state_dict(a.state_dict())
    assert [n for n, _ in a.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in te.ops.BasicLinear(64, 32, device="cpu").named_parameters()] == \
        ["weight"]
    x = torch.randn(16, 64)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)


def test_sequence_trains_in_fp8_and_names_its_parameters():
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.LayerNorm(64, device="cpu"),
                              te.ops.Linear(64, 128, device="cpu"), te.ops.SwiGLU(),
                              te.ops.BasicLinear(64, 32, device="cpu"),
                              te.ops.Bias(32, device="cpu"), te.ops.ConstantScale(0.5),
                              te.ops.Reshape((-1, 4, 8)))
    x = torch.randn(16, 64, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        y = model(x)
    y.float().square().mean().backward()
    assert y.shape == (16, 4, 8)
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "4.bias"]
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0
               for p in model.parameters())
    # the same chain of plain torch ops, in high precision, is within FP8 error
    ln, lin1, _, lin2, bias = list(model)[:5]
    with torch.no_grad():
        h = torch.nn.functional.layer_norm(x, (64,), ln.weight, ln.bias, 1e-5)
        h = h @ lin1.weight.T + lin1.bias
        a, g = h.chunk(2, dim=-1)
        want = ((torch.nn.functional.silu(a) * g) @ lin2.weight.T + bias.bias) * 0.5
    rel = float((y.detach().reshape(16, 32) - want).abs().max() / want.abs().max())
    assert rel < 0.1, rel


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(amax_history_len=4),
                                        recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_sequential_fuses_a_norm_and_the_linear_after_it(norm, fp8_recipe, bias):
    """te.ops.Sequential(norm, Linear) in FP8 is te.LayerNormLinear with the same parameters:
    the same bits, step after step (outputs, gradients, FP8 state), and the forward of neither
    module runs on its own."""
    torch.manual_seed(0)
    ops_norm = getattr(te.ops, norm)(64, device="cpu", zero_centered_gamma=True)
    linear = (te.ops.Linear(64, 48, device="cpu") if bias
              else te.ops.BasicLinear(64, 48, device="cpu"))
    model = te.ops.Sequential(ops_norm, linear)
    fused = te.LayerNormLinear(64, 48, bias=bias, normalization=norm, zero_centered_gamma=True,
                               device="cpu")
    with torch.no_grad():
        ops_norm.weight.normal_()
        fused.layer_norm_weight.copy_(ops_norm.weight)
        if norm == "LayerNorm":
            ops_norm.bias.normal_()
            fused.layer_norm_bias.copy_(ops_norm.bias)
        fused.weight.copy_(linear.weight)
        if bias:
            linear.bias.normal_()
            fused.bias.copy_(linear.bias)
    ops_norm.forward = linear.forward = None  # (the fused pair calls neither)
    for step in range(3):
        x = torch.randn(2, 16, 64) * (step + 1)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            ya, yb = model(xa), fused(xb)
        assert torch.equal(ya, yb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ops_norm.weight.grad, fused.layer_norm_weight.grad)
    assert torch.equal(linear.weight.grad, fused.weight.grad)
    if bias:
        assert torch.equal(linear.bias.grad, fused.bias.grad)
    if norm == "LayerNorm":
        assert torch.equal(ops_norm.bias.grad, fused.layer_norm_bias.grad)
    for a, b in zip(linear.buffers(), fused.buffers(), strict=True):
        assert torch.equal(a, b)


def test_nvidia_operations_not_here_name_themselves():
    with pytest.raises(NotImplementedError, match="te.ops.MakeExtraOutput .*not implemented"):
        te.ops.MakeExtraOutput  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Bogus'"):
        te.ops.Bogus  # noqa: B018
    with pytest.raises(NotImplementedError, match="te.ops.Linear: tensor_parallel_mode"):
        te.ops.Linear(8, 8, device="cpu", tensor_parallel_mode="column")
    with pytest.raises(ValueError, match="te.ops.Bias: size must be a positive int"):
        te.ops.Bias(0, device="cpu")


def _expert_mlp(experts: int, hidden: int, ffn: int) -> te.ops.Sequential:
    return te.ops.Sequential(
        te.ops.GroupedLinear(experts, hidden, 2 * ffn, bias=False, device="cpu"),
        te.ops.SwiGLU(),
        te.ops.GroupedLinear(experts, ffn, hidden, bias=False, device="cpu"))


def test_grouped_linear_takes_its_split_sizes_as_an_extra_input():
    torch.manual_seed(0)
    mlp = _expert_mlp(4, 64, 32)
    assert isinstance(mlp[0], te.ops.BasicOperation) and mlp[0].num_groups == 4
    assert [n for n, _ in mlp[0].named_parameters()][:2] == ["gemms.0.weight", "gemms.1.weight"]
    assert {"0.weight0", "0.weight3", "2.weight0"} <= set(mlp.state_dict())  # NVIDIA's names
    x = torch.randn(64, 64)
    sizes = torch.tensor([16, 0, 32, 16])  # (an empty group)
    got = mlp(x, sizes, sizes)
    parts = []
    for g, rows in enumerate(torch.split(x, sizes.tolist())):
        a, b = (rows @ getattr(mlp[0], f"weight{g}").t()).chunk(2, dim=-1)
        parts.append((torch.nn.functional.silu(a) * b) @ getattr(mlp[2], f"weight{g}").t())
    torch.testing.assert_close(got, torch.cat(parts), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp(x, [16, 0, 32, 16], sizes.tolist()), got, rtol=0, atol=0)


def test_grouped_linear_in_fp8_is_te_grouped_linear():
    torch.manual_seed(0)
    mlp = _expert_mlp(2, 64, 32)
    x = torch.randn(32, 64, requires_grad=True)
    sizes = [16, 16]
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        got = mlp(x, torch.tensor(sizes), torch.tensor(sizes))
        want = mlp[2](mlp[1](te.GroupedLinear.forward(mlp[0], x, sizes)), sizes)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())


def test_grouped_linear_refusals_name_the_argument():
    mlp = _expert_mlp(2, 64, 32)
    with pytest.raises(ValueError, match="operations take 2 extra inputs .*got 1"):
        mlp(torch.randn(8, 64), [4, 4])
    with pytest.raises(TypeError, match="split_sizes must be a 1-D integer tensor"):
        mlp[0](torch.randn(8, 64), torch.tensor([4.0, 4.0]))
    with pytest.raises(NotImplementedError, match="single_grouped_weight=True is not supported"):
        te.ops.GroupedLinear(2, 64, 64, single_grouped_weight=True, device="cpu")
    with pytest.raises(NotImplementedError, match="scale_bias=True is not supported"):
        te.ops.GroupedLinear(2, 64, 64, scale_bias=True, device="cpu")
