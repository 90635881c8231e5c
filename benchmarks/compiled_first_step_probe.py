"""Which path gives a compiled FP8 first step other bits than eager: two te.TransformerLayers
(hidden 64, 4 heads, causal, bf16 parameters, the layer tests' stack) under DelayedScaling take
one training step each way below, and each way's output and input gradient are compared with
the eager layer node's, bit for bit (with the largest difference where they differ):

  eager node          layer_block's node (the default eager path)
  eager modules       layer_block off: the modules one by one
  eager modules, copy the same with q, k, v copied dense (attention_fn.packed_enabled off)
  compiled            torch.compile(fullgraph=True): a delayed first step traces the modules
                      (q, k, v copied dense: multihead_attention.traced_in_place off)
  compiled, in place  the same with the traced step reading q, k, v in place (on)

A compiled first step that differs from "eager modules" points at the trace; one that equals
"eager modules" but not "eager node" at the node. Prints; writes nothing.

    python benchmarks/compiled_first_step_probe.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import attention_fn, layer_block
from transformer_engine.pytorch.module import multihead_attention


def stack(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(
        te.TransformerLayer(64, 128, 4, params_dtype=torch.bfloat16, device=device,
                            self_attn_mask_type="causal", hidden_dropout=0.0,
                            attention_dropout=0.0) for _ in range(2)))


def first_step(device: str, compiled: bool, node: bool, packed: bool,
               traced_in_place: bool = False) -> list:
    layer_block.enabled, attention_fn.packed_enabled = node, packed
    multihead_attention.traced_in_place = traced_in_place
    try:
        torch._dynamo.reset()
        m = stack(device)
        forward = torch.compile(m, fullgraph=True) if compiled else m
        torch.manual_seed(1)
        x = torch.randn(2, 16, 64, device=device).to(torch.bfloat16).requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            y = forward(x)
        y.backward(torch.randn_like(y))
        return [y.detach(), x.grad]
    finally:
        layer_block.enabled, attention_fn.packed_enabled = True, True
        multihead_attention.traced_in_place = False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    ways = {"eager node": (False, True, True), "eager modules": (False, False, True),
            "eager modules, copy": (False, False, False), "compiled": (True, True, True),
            "compiled, in place": (True, True, True, True)}
    seen = {name: first_step(args.device, *how) for name, how in ways.items()}
    want = seen["eager node"]
    for name, got in seen.items():
        cells = []
        for what, a, b in zip(("y", "dx"), got, want, strict=True):
            same = torch.equal(a.view(torch.int16), b.view(torch.int16))
            diff = (a.float() - b.float()).abs().max().item()
            cells.append(f"{what} {'same bits' if same else f'differs (max {diff:.3g})'}")
        print(f"{name:22s} " + ", ".join(cells))


if __name__ == "__main__":
    main()
