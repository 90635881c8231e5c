"""_autograd.eager_apply: the same node, values and gradients as Function.apply, and
Function.apply itself wherever the C++ apply would differ (torch.compile, functorch)."""

import pytest
import torch

from transformer_engine.pytorch._autograd import eager_apply


class _ScaleBy(torch.autograd.Function):
    """x * factor, with a saved tensor and a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, w, factor: float):
        ctx.save_for_backward(w)
        ctx.factor = factor
        return x * w * factor

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w * ctx.factor, None, None


_apply = eager_apply(_ScaleBy)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).requires_grad_()
    w = torch.randn(8, generator=g)
    return x, w


def test_same_node_values_and_gradients():
    x, w = _inputs()
    y = _apply(x, w, 3.0)
    assert type(y.grad_fn).__name__ == "_ScaleByBackward"
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = _ScaleBy.apply(x2, w, 3.0)
    y2.sum().backward()
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)


def test_no_grad_needed_gives_a_plain_tensor():
    x, w = _inputs()
    with torch.no_grad():
        y = _apply(x, w, 2.0)
    assert y.grad_fn is None and not y.requires_grad


def test_traced_by_torch_compile_without_graph_breaks():
    x, w = _inputs()
    compiled = torch.compile(lambda a, b: _apply(a, b, 2.0), fullgraph=True, backend="eager")
    y = compiled(x, w)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x) * w * 2.0)


def test_functorch_transforms_take_function_apply():
    """Under vmap the wrapper hands the call to Function.apply, which gives its own error for
    a function without setup_context (the C++ apply would run on batched wrappers)."""
    x, w = _inputs()
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(lambda row: _apply(row, w, 2.0))(x.detach())


def test_a_finished_transforms_tensor_is_unwrapped_as_function_apply_does():
    """A tensor that escaped torch.func.grad is a dead wrapper: Function.apply unwraps it,
    and so does the wrapper, by handing the call over."""
    x, w = _inputs()
    leaked = []

    def loss(t):
        leaked.append(t)
        return t.sum()

    torch.func.grad(loss)(x.detach())
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    assert torch.equal(_apply(dead, w, 2.0), _ScaleBy.apply(dead, w, 2.0))
