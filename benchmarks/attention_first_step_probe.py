"""FP8 attention's first steps with and without delayed scaling's first-step rule, against bf16.

For te.DotProductAttention under DelayedScaling(fp8_dpa=True), per step and per tensor (o, dq,
dk, dv): the largest error in units of the FP8 tolerance (atol + rtol |bf16|, the tests'
ATTENTION_FP8_TOL) and the RMSE relative to the bf16 tensor's RMS, for a module that takes
the rule (its first step scales q, k, v and d_o from their own amaxes) and one whose marks are
taken first (scale 1, as NVIDIA's first step). Shows whether the rule moves the error's
distribution or only which element is largest. Prints; writes nothing.

    python benchmarks/attention_first_step_probe.py [--device cuda] [--steps 4]
"""

from __future__ import annotations

import argparse

import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step

ATOL, RTOL = 0.5, 0.05


def inputs(device, step, b, s, h, d):
    g = torch.Generator().manual_seed(10 + step)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device, torch.bfloat16).requires_grad_()
               for _ in range(3))
    grad = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(50 + step))
    return q, k, v, grad.to(device, torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fmt", default="HYBRID")
    args = p.parse_args()
    b, s, h, d = (2, 256, 8, 128) if args.device == "cuda" else (1, 33, 2, 16)
    r = recipe.DelayedScaling(fp8_dpa=True, fp8_format=getattr(recipe.Format, args.fmt))
    for rule in (True, False):
        attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal",
                                      device=args.device)
        if not rule:
            first_step.written_elsewhere_all(attn.amax_history_fwd)
            first_step.written_elsewhere_all(attn.amax_history_bwd)
        for step in range(args.steps):
            q, k, v, g = inputs(args.device, step, b, s, h, d)
            attn(q, k, v).backward(g)
            want = [attn(q, k, v).detach()] + [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            with te.fp8_autocast(fp8_recipe=r):
                out = attn(q, k, v)
            out.backward(g)
            got = [out.detach()] + [t.grad for t in (q, k, v)]
            cells = []
            for name, a, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
                a, w = a.float().cpu(), w.float().cpu()
                err = (a - w).abs()
                ratio = (err / (ATOL + RTOL * w.abs())).max().item()
                rel_rmse = (err.pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()
                cells.append(f"{name} {ratio:.2f}x/{rel_rmse:.3f}")
            print(f"rule={rule!s:5} step {step}: " + "  ".join(cells), flush=True)
        print(f"rule={rule}: scale_fwd {attn.scale_fwd.tolist()} scale_bwd "
              f"{attn.scale_bwd.tolist()}", flush=True)


if __name__ == "__main__":
    main()
