"""The backward of the FP8 linear layers through the compiled operator (compiled_grads.py).

te.Linear's Python path, LayerNormLinear and LayerNormMLP's second GEMM take it where it
computes what their Python steps compute, and must then give the same bits: outputs, gradients
and every FP8 buffer, step after step, under delayed and current scaling. Through an
activation's derivative (which no module sends it today) it is checked against the same steps
directly.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._train_steps import assert_same_bits, record_steps

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import compiled_blocks, compiled_grads, fast_linear

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4, margin=1),
    "delayed-most-recent": lambda: recipe.DelayedScaling(amax_history_len=4,
                                                         amax_compute_algo="most_recent"),
    "current": lambda: recipe.Float8CurrentScaling(),
}

MODULES = {
    "linear": lambda dtype, bias, dev: te.Linear(64, 48, bias=bias, params_dtype=dtype,
                                                 device=dev),
    "layernorm_linear": lambda dtype, bias, dev: te.LayerNormLinear(
        64, 48, bias=bias, params_dtype=dtype, device=dev),
    "rmsnorm_linear": lambda dtype, bias, dev: te.LayerNormLinear(
        64, 48, bias=bias, normalization="RMSNorm", params_dtype=dtype, device=dev),
    "layernorm_mlp_gelu": lambda dtype, bias, dev: te.LayerNormMLP(
        64, 128, bias=bias, params_dtype=dtype, device=dev),
    "layernorm_mlp_swiglu": lambda dtype, bias, dev: te.LayerNormMLP(
        64, 128, bias=bias, activation="swiglu", normalization="RMSNorm", params_dtype=dtype,
        device=dev),
    "layernorm_mlp_relu": lambda dtype, bias, dev: te.LayerNormMLP(
        64, 128, bias=bias, activation="relu", params_dtype=dtype, device=dev),
}

STEPS = 4


def _train(device, compiled: bool, module: str, recipe_name: str, dtype, bias: bool,
           frozen: bool = False):
    """Every output, gradient and buffer of STEPS training steps, the compiled backward on or
    off (te.Linear's compiled forward off: this is about the backward alone)."""
    compiled_grads.enabled = compiled
    compiled_blocks.enabled = False  # (the whole blocks would bypass the steps tested here)
    fast_linear.enabled = False
    try:
        torch.manual_seed(0)
        m = MODULES[module](dtype, bias, device)
        if frozen:
            for p in m.parameters():
                if p.dim() == 2:
                    p.requires_grad_(False)
        return record_steps(m, RECIPES[recipe_name](), STEPS, device, dtype)
    finally:
        compiled_grads.enabled = fast_linear.enabled = compiled_blocks.enabled = True


@pytest.fixture
def calls(record_calls):
    """The compiled operator's calls."""
    return record_calls(compiled_grads, "linear_grads")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_same_bits_as_the_python_steps(device, calls, module, recipe_name, bias, dtype):
    compiled = _train(device, True, module, recipe_name, dtype, bias)
    # A delayed-scaling backward whose history no step has written yet (the first) takes the
    # Python steps (first_step.py); current scaling takes the operator from the first step.
    steps = STEPS - 1 if recipe_name.startswith("delayed") else STEPS
    assert len(calls) == steps  # (LayerNormMLP: its second GEMM's backward)
    assert_same_bits(compiled, _train(device, False, module, recipe_name, dtype, bias))


@pytest.mark.parametrize("module", ["linear", "layernorm_linear", "layernorm_mlp_gelu"])
def test_frozen_weights(device, calls, module):
    """Only dgrad needed (frozen weights): the operator runs without its wgrad GEMMs."""
    compiled = _train(device, True, module, "delayed", torch.bfloat16, True, frozen=True)
    assert len(calls) > 0
    assert_same_bits(compiled, _train(device, False, module, "delayed", torch.bfloat16, True,
                                       frozen=True))


def test_not_taken_under_a_user_callable_or_block_scaling(calls):
    """A recipe whose scale update is not the core's, and block scaling, take the Python
    steps."""
    def amax_of(history):
        return history.amax(dim=0)

    for r in (recipe.DelayedScaling(amax_compute_algo=amax_of),
              recipe.Float8BlockScaling()):
        m = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16)
        for _ in range(2):
            x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
            with te.fp8_autocast(fp8_recipe=r):
                m(x).sum().backward()
    assert calls == []


@pytest.mark.parametrize("act", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_through_an_activation_same_bits_as_the_steps(device, act, recipe_name, bias):
    """linear_grads through act'(h) (LayerNormMLP's first GEMM's backward) against linear_fn's
    steps: grad_to_fp8, the scale update, backward_gemms."""
    from transformer_engine.pytorch.linear_fn import backward_gemms, grad_to_fp8, update_backward
    from transformer_engine.pytorch.quantization import plan_of, quantize

    torch.manual_seed(1)
    m, k, n = 32, 48, 64
    gated = act == "swiglu"
    plan = plan_of(RECIPES[recipe_name]())
    h = torch.randn(m, 2 * n if gated else n, device=device, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(h.shape[1], k, device=device, dtype=torch.bfloat16)
    qx = quantize(plan, "input", x, False, True, torch.ones(1, device=device))
    qw = quantize(plan, "weight", w, False, True, torch.ones(1, device=device))
    saved = (qx.columnwise, qx.columnwise_scale_inv, qw.columnwise, qw.columnwise_scale_inv)

    a = (torch.rand(4, 2, device=device) * 10, torch.full((2,), 2.0, device=device),
         torch.full((2,), 0.5, device=device))  # (history, scale, scale_inv)
    b = tuple(t.clone() for t in a)
    gi, gw, gb = compiled_grads.linear_grads(g, h, act, saved, plan, a, 0, True,
                                             (True, True, bias), (torch.bfloat16,) * 3)
    q, dbias = grad_to_fp8(plan, g, h, act, b[1], 0, True, True, bias, b[0])
    if plan.kind == "delayed":
        update_backward(b, plan, None, None)
    ri, rw = backward_gemms(plan, q, saved[2], saved[3], saved[0], saved[1], torch.bfloat16,
                            torch.bfloat16, True, True)
    rb = dbias.to(torch.bfloat16) if bias else None
    assert_same_bits([gi, gw, gb, *a], [ri, rw, rb, *b])
