"""What several training steps of a module produce, for tests that compare two paths to the
same bits: every output, input gradient, parameter gradient and buffer; the fused blocks and
per-tensor recipes those tests train, and the comparison itself."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

# Per-tensor recipes (a short history and a margin, so that delayed scaling's update shows).
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4, margin=1),
    "current": lambda: recipe.Float8CurrentScaling(),
    "current-pow2-eps": lambda: recipe.Float8CurrentScaling(power_2_scale=True,
                                                            amax_epsilon=1e-3),
}

# The fused blocks over [.., 64] inputs: (dtype, bias, zero_centered_gamma, device) -> module.
BLOCKS = {
    "layernorm_linear": lambda dtype, bias, zc, dev: te.LayerNormLinear(
        64, 48, bias=bias, zero_centered_gamma=zc, params_dtype=dtype, device=dev),
    "rmsnorm_linear": lambda dtype, bias, zc, dev: te.LayerNormLinear(
        64, 48, bias=bias, normalization="RMSNorm", zero_centered_gamma=zc, params_dtype=dtype,
        device=dev),
    "layernorm_mlp": lambda dtype, bias, zc, dev: te.LayerNormMLP(
        64, 128, bias=bias, zero_centered_gamma=zc, params_dtype=dtype, device=dev),
    "rmsnorm_mlp_swiglu": lambda dtype, bias, zc, dev: te.LayerNormMLP(
        64, 128, bias=bias, normalization="RMSNorm", activation="swiglu", zero_centered_gamma=zc,
        params_dtype=dtype, device=dev),
}


def record_steps(m: torch.nn.Module, recipe, steps: int, device, dtype,
                 input_grad: bool = True) -> list:
    """``steps`` FP8 steps of ``m`` on [2, 16, 64] inputs growing step by step (so delayed
    scaling has something to follow); None for a gradient not computed (a parameter that does
    not learn, an input that needs none)."""
    seen = []
    for step in range(steps):
        x = (torch.randn(2, 16, 64, device=device) * (step + 1)).to(dtype)
        x.requires_grad_(input_grad)
        with te.fp8_autocast(fp8_recipe=recipe):
            y = m(x)
        y.backward(torch.randn_like(y))
        seen += [y.detach(), None if x.grad is None else x.grad.clone()]
        seen += [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
        seen += [b.clone() for b in m.buffers()]
    return seen


def assert_same_bits(a_list, b_list) -> None:
    """Two record_steps lists hold the same bits, item by item (None on both paths alike)."""
    assert len(a_list) == len(b_list)
    for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"item {i}: one path has no tensor"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"item {i}"
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            f"item {i} differs"


def same_bits_matrix(recipes: dict, modules: dict):
    """The parameters the fused blocks' same-bits tests run over: module, recipe, bias, dtype
    and zero-centered gamma."""
    marks = (pytest.mark.parametrize("zero_centered", [False, True],
                                     ids=["gamma", "zero-centered"]),
             pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                                     ids=["bf16", "fp32"]),
             pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"]),
             pytest.mark.parametrize("recipe_name", list(recipes)),
             pytest.mark.parametrize("module", list(modules)))

    def mark(test):
        for m in marks:
            test = m(test)
        return test

    return mark


def compiled_against_eager(m: torch.nn.Module, fp8_recipe, x: torch.Tensor, steps: int = 3):
    """(eager, compiled, op names the compiled steps ran): every output, gradient and buffer
    of ``steps`` steps of ``m`` under ``fp8_recipe`` from the state an eager first step left,
    eagerly and through torch.compile(fullgraph=True) (the profiler's names of what ran)."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    def step(t):
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            return m(t)

    step(x).float().sum().backward()  # the first step, eagerly
    state = copy.deepcopy(m.state_dict())

    def run(f):
        m.load_state_dict(state)
        seen = []
        for i in range(steps):
            for p in m.parameters():
                p.grad = None
            x.grad = None
            y = f(x * (i + 1))
            y.float().square().sum().backward()
            seen += [y.detach(), x.grad] + [p.grad for p in m.parameters()]
            seen += [b.clone() for b in m.buffers()]
        return seen

    eager = run(step)
    # (every caller's step is this one function: without a reset its compiled forms would add
    # up to dynamo's recompile limit)
    torch._dynamo.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = run(torch.compile(step, fullgraph=True))
    return eager, compiled, {e.key for e in prof.key_averages()}


def warm_up_for_capture(step, *args, times: int = 3) -> None:
    """Runs ``step(*args)`` ``times`` times on a side stream before a CUDA graph captures it,
    as torch's documentation warms up (workspaces, algorithm caches and lazy state are made
    outside the graph), then orders the current stream after it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
