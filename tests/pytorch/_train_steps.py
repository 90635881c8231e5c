"""What several training steps of a module produce, for tests that compare two paths to the
same bits: every output, input gradient, parameter gradient and buffer."""

from __future__ import annotations

import torch

import transformer_engine.pytorch as te


def record_steps(m: torch.nn.Module, recipe, steps: int, device, dtype) -> list:
    """``steps`` FP8 steps of ``m`` on [2, 16, 64] inputs growing step by step (so delayed
    scaling has something to follow); None for a parameter without a gradient."""
    seen = []
    for step in range(steps):
        x = (torch.randn(2, 16, 64, device=device) * (step + 1)).to(dtype)
        x.requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=recipe):
            y = m(x)
        y.backward(torch.randn_like(y))
        seen += [y.detach(), x.grad]
        seen += [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
        seen += [b.clone() for b in m.buffers()]
    return seen
