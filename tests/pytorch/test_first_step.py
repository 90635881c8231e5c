"""Delayed scaling's first step (first_step.py): a tensor whose amax history is still empty is
scaled from its own amax, so a first step learns as current scaling would; later steps follow
the recipe, and the fast paths run again."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step

DELAYED = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4)


def _module(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(128, 64, device="cpu")
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(128, 64, device="cpu")
    return te.LayerNormMLP(128, 256, device="cpu")


def _weight_grads(module, x, fp8: bool, call=None):
    module.zero_grad(set_to_none=True)
    with te.fp8_autocast(enabled=fp8, fp8_recipe=DELAYED):
        y = (module if call is None else call)(x)
    y.mean().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()
            if n.endswith("weight") and p.grad is not None}


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_first_step_with_a_mean_loss_learns(kind):
    # The output gradient of a mean over 64 x 64 outputs is 2.4e-4; GEMM outputs of it are
    # far below E5M2's smallest subnormal (1.5e-5) at the initial scale of 1.
    m = _module(kind)
    ref = copy.deepcopy(m)
    x = torch.randn(64, 128)
    got = _weight_grads(m, x, fp8=True)
    want = _weight_grads(ref, x, fp8=False)
    for name, g in got.items():
        w = want[name]
        assert float(g.abs().max()) > 0, f"{kind}.{name}: zero weight gradient"
        # FP8 operands (E4M3 forward, E5M2 gradient): a few per cent of the largest entry
        rel = float((g - w).abs().max() / w.abs().max())
        assert rel < 0.15, f"{kind}.{name}: relative error {rel:.3f}"


def test_first_step_scale_is_the_one_the_update_then_keeps():
    m = _module("Linear")
    x = torch.randn(64, 128) * 3
    _weight_grads(m, x, fp8=True)
    # After the step the update made the scales from the history, which holds only this
    # step's amaxes: the input's scale is the one its first cast used.
    fp8_max = 448.0
    assert torch.equal(m.scale_fwd[0], torch.tensor(fp8_max) / x.abs().max())
    assert not first_step.has_empty(m.amax_history_fwd)
    assert not first_step.has_empty(m.amax_history_bwd)


def test_second_step_uses_the_stored_scale(monkeypatch):
    m = _module("Linear")
    x = torch.randn(64, 128)
    _weight_grads(m, x, fp8=True)
    calls = []
    real = first_step.ops.delayed_scaling_update
    monkeypatch.setattr(first_step.ops, "delayed_scaling_update",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    _weight_grads(m, x * 100, fp8=True)
    assert calls == []  # no first-step scale any more


def test_marks_follow_the_module_and_come_back_with_an_empty_checkpoint():
    m = _module("LayerNormMLP")
    moved = m.to(torch.float32)  # _apply: the buffers may be new tensors
    assert first_step.has_empty(moved.amax_history_fwd)
    state = copy.deepcopy(m.state_dict())  # saved before any step: empty histories
    _weight_grads(m, torch.randn(16, 128), fp8=True)
    assert not first_step.has_empty(m.amax_history_fwd)
    m.load_state_dict(state)
    assert first_step.has_empty(m.amax_history_fwd)
    assert first_step.has_empty(m.amax_history_bwd)


def test_checkpoint_of_a_trained_module_loads_without_marks():
    m = _module("Linear")
    _weight_grads(m, torch.randn(16, 128), fp8=True)
    fresh = _module("Linear")
    fresh.load_state_dict(m.state_dict())
    assert not first_step.has_empty(fresh.amax_history_fwd)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_compiled_first_steps_equal_eager(kind):
    # Compiled, the rule runs on the device (the core's gate): the same bits as eager's host
    # rule over a first and a second step.
    eager, compiled = _module(kind), _module(kind)
    fwd = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    xs = [torch.randn(32, 128) * s for s in (1.0, 4.0)]
    for x in xs:
        a = _weight_grads(eager, x, fp8=True)
        b = _weight_grads(compiled, x, fp8=True, call=fwd)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)
        assert torch.equal(eager.scale_fwd, compiled.scale_fwd)
        assert torch.equal(eager.scale_bwd, compiled.scale_bwd)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_first_step_on_cuda_scales_as_on_the_cpu(kind):
    # The amaxes are exact and the scale is the core's formula: the same scale bit for bit on
    # both devices for the first GEMM's input; tensors made from a GEMM's result (the MLP's
    # second input, the gradients behind a GEMM) and the gradients agree to the GEMMs'
    # accumulation order.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cpu = _module(kind)
    gpu = copy.deepcopy(cpu).cuda()
    assert first_step.has_empty(gpu.amax_history_fwd)  # the marks moved with the module
    x = torch.randn(64, 128)
    a = _weight_grads(cpu, x, fp8=True)
    b = _weight_grads(gpu, x.cuda(), fp8=True)
    assert torch.equal(cpu.scale_fwd[0], gpu.scale_fwd[0].cpu())
    torch.testing.assert_close(gpu.scale_fwd.cpu(), cpu.scale_fwd, rtol=0.02, atol=0)
    torch.testing.assert_close(gpu.scale_bwd.cpu(), cpu.scale_bwd, rtol=0.02, atol=0)
    for name in a:
        assert float(b[name].abs().max()) > 0
        # (an FP8 operand made from a GEMM's result may round one FP8 step apart)
        torch.testing.assert_close(b[name].cpu(), a[name], rtol=0.02, atol=0.02 * float(
            a[name].abs().max()))


def test_compiled_steps_after_the_first_have_nothing_of_the_rule():
    # The first step's graph asks for the amaxes; the module's state of the rule then changes
    # and the compiler traces the next step again, without them (and without the gate).
    from torch._functorch.aot_autograd import aot_module_simplified

    amax_ops = []

    def backend(gm, inputs):
        def count(g, _):
            amax_ops.append(sum(1 for n in g.graph.nodes
                                if n.op == "call_function" and "transformer_engine.amax" in str(
                                    n.target)))
            return g.forward
        return aot_module_simplified(gm, inputs, fw_compiler=count, bw_compiler=count)

    torch._dynamo.reset()
    m = _module("Linear")
    f = torch.compile(m, backend=backend, fullgraph=True)
    for _ in range(3):
        _weight_grads(m, torch.randn(32, 128), fp8=True, call=f)
    # forward and backward of the first step's graph, then of the later steps' one
    assert amax_ops == [2, 0, 0, 0]


def test_fp8_weights_take_no_first_step_scale_and_leave_no_mark():
    # An fp8_model_init weight keeps its own bytes: its column is not waiting for a first-step
    # scale, and once the input's and gradient's columns are written nothing is (so the fast
    # paths serve the next steps).
    with te.fp8_model_init(enabled=True, recipe=DELAYED):
        m = te.Linear(128, 64, device="cpu")
    _weight_grads(m, torch.randn(32, 128), fp8=True)
    assert not first_step.has_empty(m.amax_history_fwd)
    assert not first_step.has_empty(m.amax_history_bwd)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_compiled_first_step_leaves_no_mutated_argument_none(kind):
    # A mutated argument left None at its default is dropped from the boxed call by some torch
    # releases, whose tracing then fails (IndexError in the op's version bump): every FP8 op
    # in the first step's graph gets a tensor there.
    seen = []

    def backend(gm, inputs):
        # (an autograd.Function's forward and backward are subgraphs of the step's graph)
        nodes = [n for g in gm.modules() if isinstance(g, torch.fx.GraphModule)
                 for n in g.graph.nodes]
        for n in nodes:
            schema = getattr(n.target, "_schema", None)
            if n.op != "call_function" or schema is None or "transformer_engine" not in str(
                    n.target):
                continue
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                    seen.append((str(n.target), arg.name, value is not None))
        return gm.forward

    torch._dynamo.reset()
    m = _module(kind)
    _weight_grads(m, torch.randn(32, 128), fp8=True, call=torch.compile(m, backend=backend,
                                                                         fullgraph=True))
    assert seen, "no FP8 op with a mutated argument in the graph"
    assert all(ok for *_, ok in seen), [s for s in seen if not s[2]]
