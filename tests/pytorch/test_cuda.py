"""What only a GPU can show: the seed example as written, CUDA-graph capture of an FP8
training step, and FP8 availability. Every test here is marked ``cuda``."""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch
from te_torch_tests._tolerances import assert_gemm_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

pytestmark = pytest.mark.cuda


def test_fp8_is_available_on_this_gpu():
    ok, reason = te.is_fp8_available()
    if torch.cuda.get_device_capability() >= (8, 9):
        assert ok, reason
    else:
        assert not ok and "8.9" in reason


def test_seed_example_as_written():
    # The file users were given, run as it is; its globals are what it computed.
    seed = runpy.run_path(
        str(Path(__file__).resolve().parents[2] / "examples/pytorch_linear_fp8.py")
    )
    model, inp, out = seed["model"], seed["inp"], seed["out"]
    hidden_size, out_features = seed["hidden_size"], seed["out_features"]
    assert model.weight.is_cuda and out.is_cuda and out.shape == (hidden_size, out_features)
    hp = torch.nn.functional.linear(inp, model.weight, model.bias)
    assert (out - hp).abs().max() < 0.1 * hp.abs().max()
    assert torch.isfinite(model.weight.grad).all()


@pytest.mark.parametrize(
    "r",
    [recipe.DelayedScaling(), recipe.Float8CurrentScaling(), recipe.Float8BlockScaling()],
    ids=["delayed", "current", "block"],
)
def test_cuda_graph_replays_an_fp8_training_step(r):
    """fwd + bwd (and delayed scaling's exit update) captured once, replayed on new data,
    gives what the same steps give in eager: no host sync, no host-side branching on values."""
    layer = te.Linear(256, 512, params_dtype=torch.bfloat16)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)

    def step(module, inp):
        with te.fp8_autocast(fp8_recipe=r):
            y = module(inp)
        y.backward(g)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: workspaces, algorithm caches, lazy state
        for _ in range(3):
            step(layer, x)
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(layer)  # where the layer stands before the captured steps
    for p in (*layer.parameters(), *twin.parameters(), x):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture runs nothing
        y_static = step(layer, x)
    # The graph writes into the gradients it allocated at capture: keep them referenced.
    x_grad, w_grad = x.grad, layer.weight.grad
    for i in range(3):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * (i + 1))
            g.copy_(torch.randn_like(g))
        graph.replay()
        x_twin = x.detach().clone().requires_grad_()
        for p in twin.parameters():
            p.grad = None
        y_eager = step(twin, x_twin)
        torch.cuda.synchronize()
        torch.testing.assert_close(y_static, y_eager, rtol=1e-6, atol=0)
        torch.testing.assert_close(x_grad, x_twin.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(w_grad, twin.weight.grad, rtol=1e-6, atol=0)
        for a, b in zip(layer.buffers(), twin.buffers(), strict=True):
            assert torch.equal(a, b), i


def test_compiled_step_on_cuda_matches_eager():
    torch._dynamo.reset()
    eager = torch.nn.Sequential(te.Linear(256, 512), torch.nn.ReLU(), te.Linear(512, 256))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(128, 256, device="cuda")
    losses = []
    for model in (eager, compiled):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for a, b in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_module_moved_to_cuda_runs_fp8_there():
    """.cuda() moves the parameters and the delayed-scaling buffers; FP8 weights stay FP8."""
    layer = te.Linear(64, 32, device="cpu").cuda()
    with te.fp8_model_init():
        fp8_layer = te.Linear(64, 32, device="cpu")
    fp8_layer = fp8_layer.cuda()
    assert type(fp8_layer.weight) is te.Float8Tensor and fp8_layer.weight._data.is_cuda
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    for module in (layer, fp8_layer):
        assert all(b.is_cuda for b in module.buffers())
        with te.fp8_autocast():
            y = module(x)
        y.sum().backward()
        assert module.weight.grad.is_cuda and module.scale_fwd.ne(1.0).any()


def test_cuda_and_cpu_give_the_same_fp8_step():
    """The CPU path is the GPU's reference: the same FP8 operands, the same values up to the
    tensor cores' accumulation (the bound of _tolerances.py)."""
    cpu = te.Linear(128, 64, device="cpu")
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(64, 128)
    outs = []
    for module, inp in ((cpu, x), (gpu, x.cuda())):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            outs.append(module(inp))
    # |qx| @ |qw|^T within a few % of the high-precision magnitude (FP8 rounding <= 2^-4)
    magnitude = 1.1 * (x.abs().double() @ cpu.weight.detach().abs().double().t())
    magnitude += cpu.bias.detach().abs().double()
    assert_gemm_close(outs[1], outs[0], magnitude, torch.float32, "CUDA vs CPU forward")
    assert torch.equal(gpu.amax_history_fwd.cpu(), cpu.amax_history_fwd)
    assert torch.equal(gpu.scale_fwd.cpu(), cpu.scale_fwd)
