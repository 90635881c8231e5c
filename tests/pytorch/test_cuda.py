"""What only a GPU can show: the seed example as written, CUDA-graph capture of an FP8
training step, and FP8 availability. Every test here is marked ``cuda``."""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch
from te_torch_tests._tolerances import assert_gemm_close
from te_torch_tests._train_steps import warm_up_for_capture

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

pytestmark = pytest.mark.cuda


def test_fp8_is_available_on_this_gpu():
    ok, reason = te.is_fp8_available(return_reason=True)
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

    warm_up_for_capture(step, layer, x)
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


def _saved_step(module, inp, r):
    """One forward + backward under r; returns the output and copies of what autograd saved
    (in the order of the autograd function's save_for_backward), taken when it was saved: a
    fused backward frees what its node made once it has read it (release.py)."""
    saved = []

    def pack(t):
        saved.append(t.detach().clone())
        return t

    x = inp.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.fp8_autocast(fp8_recipe=r):
            y = module(x)
    y.square().mean().backward()
    return y.detach(), saved, x.grad


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_layernorm_mlp_on_cuda_matches_the_cpu(act):
    """The norm and activation kernels give the CPU's bits: the FP8 ln_out (FC1's input) and
    the FP8 FC1 weight the CUDA step saves equal the CPU's byte for byte, and its FP8 FC2 input
    is what the CPU kernel makes of the CUDA fc1_out. fc1_out itself comes from a GEMM, which
    the tensor cores accumulate differently (FP8_TENSOR_CORE_RTOL): the output is compared
    within that difference carried through the activation (with one FP8 rounding flip) and
    FC2 (_tolerances)."""
    from te_torch_tests._tolerances import FP8_EPS, GEMM_RTOL, act_error, assert_bounded
    from te_torch_tests._tolerances import FP8_TENSOR_CORE_RTOL as TC

    from transformer_engine.pytorch import ops

    torch.manual_seed(0)
    cpu = te.LayerNormMLP(256, 512, activation=act, device="cpu")
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(128, 256)
    r = recipe.DelayedScaling()
    y_cpu, s_cpu, _ = _saved_step(cpu, x, r)
    y_gpu, s_gpu, g_gpu = _saved_step(gpu, x.cuda(), r)
    # (a first delayed step scales FC2's input from its own amax, the scale the update then
    # writes: first_step.py)
    a_scale = gpu.scale_fwd[2:3].clone()
    # save_for_backward: x, mu, rsigma, gamma, ln_col, ln_col_sinv, w1_col, w1_col_sinv, h,
    # a_col, a_col_sinv, w2_col, w2_col_sinv
    for i in (1, 2, 4, 5, 6, 7, 11, 12):
        assert torch.equal(s_gpu[i].cpu(), s_cpu[i]), i
    h_gpu = s_gpu[8]
    _, a_col, _, _ = ops.activation_forward_fp8(h_gpu.cpu(), act, a_scale.cpu(), "float8_e4m3",
                                                False, True)
    assert torch.equal(s_gpu[9].cpu(), a_col)
    assert torch.equal(gpu.amax_history_fwd[:, [0, 1, 3]].cpu(), cpu.amax_history_fwd[:, [0, 1, 3]])
    h = s_cpu[8].double()
    ln = ops.norm_forward(x, cpu.layer_norm_weight.detach(), cpu.layer_norm_bias.detach(),
                          "layernorm", 1e-5, False)[0].double()
    w1, w2 = cpu.fc1_weight.detach().double(), cpu.fc2_weight.detach().double()
    a = ops.activation_forward(s_cpu[8], act).double()
    e_h = (TC + GEMM_RTOL[torch.float32]) * 1.1 * (ln.abs() @ w1.abs().t())
    base = {"swiglu": "silu"}.get(act)
    e_a = act_error(h, e_h, act, base)
    e_a = e_a + 2 * FP8_EPS["float8_e4m3"] * (a.abs() + e_a)
    bound = 1.1 * e_a @ w2.abs().t() + (TC + GEMM_RTOL[torch.float32]) * 1.1 * (
        (a.abs() + e_a) @ w2.abs().t())
    assert_bounded(y_gpu, y_cpu, bound, "CUDA vs CPU LayerNormMLP output")
    assert torch.isfinite(g_gpu).all()


def test_layernorm_linear_on_cuda_matches_the_cpu():
    """The FP8 ln_out (written by the norm kernel) is the CPU's byte for byte; the output
    differs by the tensor cores' accumulation only."""
    torch.manual_seed(0)
    cpu = te.LayerNormLinear(256, 512, normalization="RMSNorm", device="cpu")
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(128, 256)
    r = recipe.DelayedScaling()
    y_cpu, s_cpu, _ = _saved_step(cpu, x, r)
    y_gpu, s_gpu, _ = _saved_step(gpu, x.cuda(), r)
    # save_for_backward: x, mu, rsigma, gamma, ln_col, ln_col_sinv, w_col, w_col_sinv
    for i in range(1, 8):
        assert torch.equal(s_gpu[i].cpu(), s_cpu[i]), i
    from transformer_engine.pytorch import ops

    ln = ops.norm_forward(x, cpu.layer_norm_weight.detach(), None, "rmsnorm", 1e-5, False)[0]
    # |q(ln)| @ |q(w)|^T is within 1.1x of the high-precision magnitude (FP8 rounds by <= 2^-4)
    magnitude = 1.1 * (ln.abs().double() @ cpu.weight.detach().abs().double().t())
    magnitude += cpu.bias.detach().abs().double()
    assert_gemm_close(y_gpu, y_cpu, magnitude, torch.float32, "CUDA vs CPU forward")
    assert torch.equal(gpu.amax_history_fwd.cpu(), cpu.amax_history_fwd)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize(
    "r",
    [recipe.DelayedScaling(), recipe.Float8CurrentScaling(), recipe.Float8BlockScaling()],
    ids=["delayed", "current", "block"],
)
def test_cuda_graph_replays_a_layernorm_mlp_step(r, act):
    """The fused block's fwd + bwd (with both GEMMs' scale updates) captures into a CUDA
    graph, so nothing in it syncs with the host or branches on values; replays give what
    eager steps give."""
    mlp = te.LayerNormMLP(256, 512, activation=act, params_dtype=torch.bfloat16)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)

    def step(module, inp):
        with te.fp8_autocast(fp8_recipe=r):
            y = module(inp)
        y.backward(g)
        return y

    warm_up_for_capture(step, mlp, x)
    twin = copy.deepcopy(mlp)
    for p in (*mlp.parameters(), *twin.parameters(), x):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step(mlp, x)
    x_grad, w1_grad = x.grad, mlp.fc1_weight.grad
    for i in range(2):
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
        torch.testing.assert_close(w1_grad, twin.fc1_weight.grad, rtol=1e-6, atol=0)
        for a, b in zip(mlp.buffers(), twin.buffers(), strict=True):
            assert torch.equal(a, b), i
