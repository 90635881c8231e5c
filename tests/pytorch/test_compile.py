"""torch.compile(fullgraph=True) of an FP8 training step: no graph break, same as eager."""

from __future__ import annotations

import copy

import pytest
import torch
from te_torch_tests._tolerances import COMPILE_RTOL

import transformer_engine.pytorch as te
from transformer_engine.common import recipe


def _mlp():
    return torch.nn.Sequential(te.Linear(32, 64, device="cpu"), torch.nn.ReLU(),
                               te.Linear(64, 16, device="cpu"))


# The default history length (other lengths: test_compile_history_len.py, where unused state
# is sized at the autocast's entry, outside the compiled graph).
@pytest.mark.slow  # inductor compiles C++ for each graph
@pytest.mark.parametrize("r", [recipe.DelayedScaling(), recipe.Float8CurrentScaling(),
                               recipe.Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_compiled_fp8_training_step_matches_eager(r):
    torch._dynamo.reset()
    eager = _mlp()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)  # a graph break raises
    for step in range(3):
        x = torch.randn(32, 32)
        target = torch.randn(32, 16)
        losses = []
        for model in (eager, compiled):
            with te.fp8_autocast(fp8_recipe=r):
                loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=COMPILE_RTOL, atol=0)
        pairs = zip(compiled_model.named_parameters(), eager.parameters(), strict=True)
        for (name, a), b in pairs:
            where = f"{name} grad at step {step}"
            torch.testing.assert_close(a.grad, b.grad, rtol=COMPILE_RTOL, atol=1e-7,
                                       msg=lambda m, where=where: f"{where}: {m}")
            with torch.no_grad():  # the same SGD step on both, in eager
                a.sub_(0.1 * a.grad)
                b.sub_(0.1 * b.grad)
            a.grad = b.grad = None
        for a, b in zip(compiled_model.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b)  # amax histories and scales, bit for bit


@pytest.mark.slow
def test_compiled_step_with_fp8_weights_matches_eager():
    """Float8Tensor parameters (fp8_model_init) trace through torch.compile as well."""
    torch._dynamo.reset()
    with te.fp8_model_init():
        eager = _mlp()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(32, 32, requires_grad=True)
    grads = []
    for model in (eager, compiled):
        x.grad = None
        with te.fp8_autocast():
            loss = model(x).square().mean()
        loss.backward()
        grads.append((loss.detach(), x.grad, *(p.grad for p in model.parameters())))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=COMPILE_RTOL, atol=1e-7)
    assert type(compiled_model[0].weight) is te.Float8Tensor



def test_eager_fast_path_takes_parameters_not_subclasses():
    """Eager calls skip the custom-op dispatcher for plain tensors and nn.Parameters (a
    module's bias reaches the GEMM as its Parameter), never for other tensor subclasses,
    which must see the registered op."""
    from transformer_engine.pytorch.ops import _backend

    class Sub(torch.Tensor):
        pass

    plain, param = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    assert _backend.plain_eager([plain, param, None, 3])
    assert not _backend.plain_eager([plain, plain.as_subclass(Sub)])


def _stack(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.float32, device="cpu")
    if kind == "TransformerLayer":
        return te.TransformerLayer(64, 128, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                   attn_input_format="bshd", **kw)
    return torch.nn.Sequential(
        te.MultiheadAttention(64, 2, input_layernorm=True, attention_dropout=0.0,
                              qkv_format="bshd", **kw),
        te.LayerNormMLP(64, 128, **kw))


# Dynamo alone (the "eager" backend): what breaks a graph is in the trace, not in inductor.
@pytest.mark.parametrize("kind", ["MHA+LayerNormMLP", "TransformerLayer"])
@pytest.mark.parametrize("make", [recipe.DelayedScaling, recipe.Float8CurrentScaling, None],
                         ids=["delayed", "current", "bf16"])
def test_whole_stack_step_traces_as_one_graph(kind, make):
    torch._dynamo.reset()
    r = make() if make else None  # a recipe no eager forward has met before the trace
    eager = _stack(kind)
    traced_model = copy.deepcopy(eager)
    traced = torch.compile(traced_model, backend="eager", fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 16, 64)
        for model in (traced, eager):
            with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
                model(x).float().square().mean().backward()
        for (name, a), b in zip(traced_model.named_parameters(), eager.parameters(),
                                strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=COMPILE_RTOL, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")
            a.grad = b.grad = None


def test_autocast_first_entered_in_a_compiled_step(monkeypatch):
    """A compiled step whose fp8_autocast is the process's first asks FP8 availability outside
    the graph: on a GPU the first answer needs device queries Dynamo cannot trace (the
    device's name), stood in for here by a function it may not trace."""
    from transformer_engine.pytorch import fp8

    calls = []

    @torch.compiler.disable
    def untraceable():
        calls.append(1)
        return True, "a test device"

    monkeypatch.setattr(fp8, "_fp8_availability", untraceable)
    monkeypatch.setattr(fp8, "_AVAILABLE", {})
    torch.manual_seed(0)
    layer = te.Linear(16, 16)
    x = torch.randn(16, 16)

    def step(x):
        with te.fp8_autocast(enabled=True):
            return layer(x)

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert calls and out.shape == (16, 16)


def _runs_in_a_fresh_process(code: str) -> None:
    """Runs ``code`` in a new Python process, which must print 'ran' and exit 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]


def test_first_fp8_step_of_a_process_compiled():
    """A fresh process whose first FP8 step is a compiled te.MultiheadAttention: the native
    binding is first loaded while Dynamo traces, which must leave no guard on it."""
    code = (
        "import torch\n"
        "import transformer_engine.pytorch as te\n"
        "from transformer_engine.common import recipe\n"
        "m = te.MultiheadAttention(64, 4, input_layernorm=True)\n"
        "f = torch.compile(m, backend='eager', fullgraph=True)\n"
        "for _ in range(2):\n"
        "    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):\n"
        "        y = f(torch.randn(16, 2, 64))\n"
        "    y.sum().backward()\n"
        "print('ran')\n")
    _runs_in_a_fresh_process(code)


def test_workspace_made_outside_the_calling_thread():
    """The GEMM workspace's allocation runs on a thread of its own (so a CUDA graph pool the
    caller allocates into does not get it), and what it raises reaches the caller."""
    import threading

    from transformer_engine.pytorch.ops import _backend

    made_on = _backend._outside_graph_pools(threading.get_ident)
    assert made_on != threading.get_ident()

    def fail():
        raise MemoryError("no room")

    with pytest.raises(MemoryError, match="no room"):
        _backend._outside_graph_pools(fail)


@pytest.mark.cuda
def test_reduce_overhead_as_the_first_fp8_steps_of_a_process():
    """torch.compile(mode="reduce-overhead") of FP8 TransformerLayer steps in a fresh process:
    the first GEMM (in the graphs' warm-up call) makes the process's GEMM workspace, which
    must not come from the graphs' pool (the mode refuses a pool tensor that outlives the
    call). Three steps, the same loss as eager steps from the same weights; gradients are
    reset before each step, as a training loop's zero_grad does (the mode's gradients live in
    its graphs' memory, which the next replay rewrites, so they cannot accumulate)."""
    code = (
        "import copy, torch\n"
        "import transformer_engine.pytorch as te\n"
        "from transformer_engine.common import recipe\n"
        "torch.manual_seed(0)\n"
        "eager = te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0,\n"
        "                            params_dtype=torch.bfloat16, device='cuda')\n"
        "model = copy.deepcopy(eager)\n"
        "def step(m, x):\n"
        "    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):\n"
        "        return m(x)\n"
        "compiled = torch.compile(lambda x: step(model, x), mode='reduce-overhead')\n"
        "for i in range(3):\n"
        "    model.zero_grad(set_to_none=True); eager.zero_grad(set_to_none=True)\n"
        "    x = torch.randn(128, 2, 256, device='cuda', dtype=torch.bfloat16)\n"
        "    a = compiled(x).float().square().mean(); a.backward()\n"
        "    b = step(eager, x).float().square().mean(); b.backward()\n"
        "    torch.testing.assert_close(a, b, rtol=2e-2, atol=0)\n"
        "print('ran')\n")
    _runs_in_a_fresh_process(code)
