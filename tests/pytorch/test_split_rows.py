"""Split weights (parameters_split, attention's separate q/k/v weights) are read by the GEMM
as one tensor without a copy, and give the gradients a concatenation gives."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.module._split_rows import join_rows


def _qkv(dtype=torch.float32):
    torch.manual_seed(0)
    return te.Linear(32, 96, parameters_split=("query", "key", "value"), params_dtype=dtype,
                     device="cpu")


def test_split_weights_are_read_without_a_copy():
    m = _qkv()
    weight, bias = m._weight_and_bias()
    assert weight.shape == (96, 32) and bias.shape == (96,)
    assert weight.data_ptr() == m.query_weight.data_ptr()
    assert bias.data_ptr() == m.query_bias.data_ptr()
    assert torch.equal(weight, torch.cat([m.query_weight, m.key_weight, m.value_weight]))


@pytest.mark.parametrize("convert", ["double", "to_bf16", "none"])
def test_split_weights_gradients_match_a_concatenation(convert):
    m = _qkv()
    if convert == "double":
        m = m.double()
    elif convert == "to_bf16":
        m = m.to(torch.bfloat16)
    names = ("query_weight", "key_weight", "value_weight")
    # After a conversion the blocks are packed back to back again.
    assert m._weight_and_bias()[0].data_ptr() == m.query_weight.data_ptr()
    x = torch.randn(4, 32, dtype=m.query_weight.dtype)
    grad = torch.randn(4, 96, dtype=x.dtype)
    m(x).backward(grad)
    weight = torch.cat([getattr(m, n).detach() for n in names]).requires_grad_()
    bias = torch.cat([m.query_bias, m.key_bias, m.value_bias]).detach().requires_grad_()
    torch.nn.functional.linear(x, weight, bias).backward(grad)
    for i, n in enumerate(names):
        assert torch.equal(getattr(m, n).grad, weight.grad[32 * i:32 * (i + 1)])
    assert torch.equal(m.key_bias.grad, bias.grad[32:64])


def test_an_optimizer_step_reaches_the_joined_weight():
    m = _qkv()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert torch.equal(m._weight_and_bias()[0][32:64], m.key_weight)


def test_blocks_apart_are_concatenated():
    a = torch.nn.Parameter(torch.randn(3, 4))
    b = torch.nn.Parameter(torch.randn(5, 4))
    joined, = join_rows([a, b])
    assert torch.equal(joined, torch.cat([a, b])) and joined.data_ptr() != a.data_ptr()
    joined.sum().backward()
    assert torch.equal(a.grad, torch.ones(3, 4)) and torch.equal(b.grad, torch.ones(5, 4))
    assert join_rows([a])[0] is a


def test_weight_and_bias_join_in_one_node_and_split_their_gradients():
    """A split layer's weight and bias blocks (back to back in one storage each) join in one
    autograd node; a gradient reaching only one of them splits into that one's blocks."""
    m = _qkv()
    weight, bias = m._weight_and_bias()
    assert weight.grad_fn is bias.grad_fn  # one node for both
    assert weight.data_ptr() == m.query_weight.data_ptr()
    assert bias.data_ptr() == m.query_bias.data_ptr()
    (weight * 2).sum().backward()
    assert torch.equal(m.key_weight.grad, torch.full((32, 32), 2.0))
    assert m.key_bias.grad is None


def test_loaded_state_keeps_the_blocks_back_to_back():
    src, dst = _qkv(), _qkv()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    dst.load_state_dict(src.state_dict())
    weight = dst._weight_and_bias()[0]
    assert weight.data_ptr() == dst.query_weight.data_ptr()
    assert torch.equal(weight, src._weight_and_bias()[0])
