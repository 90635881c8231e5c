"""The forward steps of the fused FP8 blocks through the compiled operators
(compiled_forward.py): a norm with the GEMM after it (LayerNormLinear, LayerNormMLP's first
half) and an activation with the GEMM after it (LayerNormMLP's second half).

They are taken where they compute what the Python steps compute, and must then give the same
bits: outputs, gradients and every FP8 buffer, step after step, under delayed and current
scaling.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._train_steps import (
    BLOCKS,
    RECIPES,
    assert_same_bits,
    record_steps,
    same_bits_matrix,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import compiled_blocks, compiled_forward

MODULES = BLOCKS

STEPS = 4


def _train(device, compiled: bool, module: str, recipe_name: str, dtype, bias: bool,
           zero_centered: bool):
    """Every output, gradient and buffer of STEPS training steps, the compiled forward on or
    off."""
    compiled_forward.enabled = compiled
    compiled_blocks.enabled = False  # (the whole blocks would bypass the steps tested here)
    try:
        torch.manual_seed(0)
        m = MODULES[module](dtype, bias, zero_centered, device)
        with torch.no_grad():  # norm parameters away from their initial values
            for name, p in m.named_parameters():
                if "layer_norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        return record_steps(m, RECIPES[recipe_name](), STEPS, device, dtype)
    finally:
        compiled_forward.enabled = compiled_blocks.enabled = True


@pytest.fixture
def calls(record_calls):
    """The names of the compiled step pairs called, in order."""
    return record_calls(compiled_forward, "norm_linear", "act_linear")


@same_bits_matrix(RECIPES, MODULES)
def test_same_bits_as_the_python_steps(device, calls, module, recipe_name, bias, dtype,
                                       zero_centered):
    compiled = _train(device, True, module, recipe_name, dtype, bias, zero_centered)
    # A delayed-scaling step whose history no step has written yet (the first) takes the
    # Python steps (first_step.py); current scaling takes the operator from the first step.
    steps = STEPS - 1 if recipe_name == "delayed" else STEPS
    pairs = ["norm_linear", "act_linear"] if "mlp" in module else ["norm_linear"]
    assert calls == pairs * steps
    python = _train(device, False, module, recipe_name, dtype, bias, zero_centered)
    assert_same_bits(compiled, python)


def test_not_taken_where_the_steps_differ(calls):
    """return_layernorm_output, a token count that needs padding and block scaling take the
    Python steps."""
    for kwargs, tokens, r in [
            (dict(return_layernorm_output=True), 32, recipe.Float8CurrentScaling()),
            ({}, 24, recipe.Float8CurrentScaling()),
            ({}, 32, recipe.Float8BlockScaling())]:
        m = te.LayerNormLinear(128, 128, params_dtype=torch.bfloat16, **kwargs)
        x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=r):
            out = m(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert calls == []


def test_the_operator_checks_its_inputs():
    from transformer_engine.pytorch import _compiled
    from transformer_engine.pytorch.ops._backend import dtype_code

    ops = _compiled.ops
    x = torch.randn(32, 64)
    e4m3 = dtype_code("float8_e4m3")
    status, *_ = ops.norm_linear_fp8_forward.default(
        x, torch.ones(64), None, 0, 1e-5, False, torch.zeros(48, 64, dtype=torch.uint8),
        torch.ones(1), None, torch.ones(3), torch.zeros(4, 3), _compiled.NO_TENSOR, False,
        e4m3, False, 0.0, True, 0)
    assert status != 0
    assert "norm_linear_fp8_forward: gamma (and, for LayerNorm only, beta)" in \
        ops.last_error.default()
    status, *_ = ops.act_linear_fp8_forward.default(
        x, 1, torch.zeros(48, 64, dtype=torch.uint8), torch.ones(1), None, torch.ones(1),
        torch.zeros(4, 1), _compiled.NO_TENSOR, False, e4m3, False, 0.0, True, 0)
    assert status != 0
    assert "act_linear_fp8_forward: the forward state must have FC2's input column" in \
        ops.last_error.default()


@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-weights"])
def test_under_activation_checkpointing(module, recipe_name, frozen):
    """Under te.checkpoint the first run may take the compiled steps and the recompute the
    Python ones (delayed scaling records no amax there): both save tensors of the same shapes,
    as the checkpoint demands, and the gradients are those of the run without checkpoint."""
    def run(checkpointed: bool):
        torch.manual_seed(0)
        m = MODULES[module](torch.bfloat16, True, False, "cpu")
        if frozen:
            for name, p in m.named_parameters():
                if "weight" in name and "layer_norm" not in name:
                    p.requires_grad_(False)
        r = RECIPES[recipe_name]()
        grads = []
        for step in range(3):
            x = (torch.randn(2, 16, 64) * (step + 1)).to(torch.bfloat16).requires_grad_(True)
            with te.fp8_autocast(fp8_recipe=r):
                y = te.checkpoint(m, x) if checkpointed else m(x)
            y.float().square().mean().backward()
            grads += [x.grad] + [p.grad.clone() for p in m.parameters() if p.grad is not None]
        return grads

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)
