"""An eager training step of our modules never makes the host wait for the GPU.

A synchronization inside a step serializes the host's issuing with the GPU's work, which is
what makes a host-bound step slow (and a step that grows with the model's size on the host).
torch's sync debug mode turns every synchronizing torch call (``.item()``, a device-to-host
copy, ``nonzero``, a blocking stream wait) into an error. The step here: a stack of two
TransformerLayers (hidden dropout on, as bench_model's) and a loss, after warm-up steps, under
each recipe of the model benchmark and in bf16. CUDA only: on the CPU nothing synchronizes.
"""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

pytestmark = pytest.mark.cuda

RECIPES = {"delayed": lambda: recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling,
           "bf16": lambda: None}


@pytest.mark.parametrize("name", list(RECIPES))
def test_transformer_layer_step_has_no_synchronization(name):
    cuda = torch.device("cuda", torch.cuda.current_device())
    fp8_recipe = RECIPES[name]()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(
        te.TransformerLayer(256, 1024, 2, self_attn_mask_type="causal", attn_input_format="bshd",
                            hidden_dropout=0.1, attention_dropout=0.0,
                            params_dtype=torch.bfloat16, device=cuda)
        for _ in range(2)))
    x = torch.randn(2, 128, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)

    def step():
        for p in layers.parameters():
            p.grad = None
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = layers(x)
        out.float().square().mean().backward()

    for _ in range(3):  # first steps: plans, workspaces, first-step scales
        step()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(p.grad is not None for p in layers.parameters())
