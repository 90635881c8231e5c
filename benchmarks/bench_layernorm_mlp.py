"""The Transformer's MLP block, one training step (forward + backward), side by side on one GPU.

16384 tokens, hidden 4096, ffn 16384, bf16 activations and parameters, LayerNorm, for gelu
(tanh form) and swiglu (FC1 writes 2 x ffn):
  - te.LayerNormMLP under fp8_autocast(DelayedScaling): the norm and the activation write
    the GEMM inputs in FP8, the backward's activation kernel writes FC1's FP8 grad_output
    with its bias gradient;
  - te.LayerNormMLP in bf16 (no autocast);
  - the same block from nn.LayerNorm + nn.Linear + F.gelu / silu-gated + nn.Linear in bf16
    under torch.compile (the fusions inductor finds itself).
A step's FLOPs are those of its six GEMMs (3 x 2 M H F1 + 3 x 2 M F H, F1 = 2F when gated).
Each te contender's output and input gradient are compared with the compiled bf16 block's,
and the time ratios to it recorded (benchmarks never assert).

    python benchmarks/bench_layernorm_mlp.py          # writes benchmarks/results/layernorm_mlp.json
    python benchmarks/bench_layernorm_mlp.py --smoke  # tiny, any device, eager baseline, no file
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

SHAPE = (16384, 4096, 16384)  # tokens M, hidden H, ffn F
SMOKE_SHAPE = (32, 64, 128)
ACTIVATIONS = ("gelu", "swiglu")
RECIPE = recipe.DelayedScaling()


class TorchMLP(torch.nn.Module):
    """The block from torch's own modules, initialized from a te.LayerNormMLP."""

    def __init__(self, te_mlp: te.LayerNormMLP):
        super().__init__()
        h, f1 = te_mlp.hidden_size, te_mlp.fc1_weight.shape[0]
        kw = dict(device=te_mlp.fc1_weight.device, dtype=te_mlp.fc1_weight.dtype)
        self.activation = te_mlp.activation
        self.norm = torch.nn.LayerNorm(h, eps=te_mlp.cfg.eps, **kw)
        self.fc1 = torch.nn.Linear(h, f1, **kw)
        self.fc2 = torch.nn.Linear(te_mlp.ffn_hidden_size, h, **kw)
        with torch.no_grad():
            self.norm.weight.copy_(te_mlp.layer_norm_weight)
            self.norm.bias.copy_(te_mlp.layer_norm_bias)
            self.fc1.weight.copy_(te_mlp.fc1_weight)
            self.fc1.bias.copy_(te_mlp.fc1_bias)
            self.fc2.weight.copy_(te_mlp.fc2_weight)
            self.fc2.bias.copy_(te_mlp.fc2_bias)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.activation == "swiglu":
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


def _step_fn(module, x, grad_out, fp8_recipe=None):
    def step(i):
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            y = module(x)
        y.backward(grad_out)
        return y

    return step


def _outputs(step, x):
    x.grad = None
    y = step(0).float()
    return y, x.grad.float()


def bench_activation(act: str, shape, smoke: bool, compile_: bool) -> list[dict]:
    m, h, f = shape
    on_gpu = torch.cuda.is_available() and not smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = torch.bfloat16
    torch.manual_seed(0)
    te_mlp = te.LayerNormMLP(h, f, activation=act, params_dtype=bf16, device=device)
    torch_mlp = TorchMLP(te_mlp)
    x = torch.randn(m, h, device=device, dtype=bf16, requires_grad=True)
    grad_out = torch.randn(m, h, device=device, dtype=bf16)
    f1 = te_mlp.fc1_weight.shape[0]
    flops = 3 * (2.0 * m * h * f1 + 2.0 * m * f * h)
    baseline = "nn.LayerNorm + nn.Linear bf16 torch.compile"
    contenders = {
        "te.LayerNormMLP DelayedScaling FP8": _step_fn(te_mlp, x, grad_out, RECIPE),
        "te.LayerNormMLP bf16": _step_fn(te_mlp, x, grad_out),
    }
    if compile_:
        contenders[baseline] = _step_fn(torch.compile(torch_mlp, dynamic=False), x, grad_out)
    else:
        contenders[baseline.replace("torch.compile", "eager")] = _step_fn(torch_mlp, x, grad_out)
        baseline = baseline.replace("torch.compile", "eager")
    reference = _outputs(contenders[baseline], x)
    rows = []
    for impl, step in contenders.items():
        row = {"op": "layernorm_mlp_fwd_bwd", "impl": impl, "activation": act,
               "shape_mhf": [m, h, f]}
        y, dx = _outputs(step, x)
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        row.update(output_rel_err_vs_baseline=rel(y, reference[0]),
                   dgrad_rel_err_vs_baseline=rel(dx, reference[1]))
        if on_gpu:
            from harness import time_cuda

            start = time.perf_counter()
            t = time_cuda(step, batch=5, repeats=8, warmup=2)
            row.update(t, tflops=flops / (t["median_ms"] * 1e-3) / 1e12)
            print(f"{impl:48s} {act:6s}: {t['median_ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                  f"({time.perf_counter() - start:.0f} s)")
        else:
            print(f"{impl:48s} {act:6s}: ran (no GPU timing); output rel err vs baseline "
                  f"{row['output_rel_err_vs_baseline']:.3g}")
        rows.append(row)
    if on_gpu:
        base_ms = next(r["median_ms"] for r in rows if r["impl"] == baseline)
        for row in rows:
            row["speedup_vs_baseline"] = base_ms / row["median_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on any device, print, write nothing")
    parser.add_argument("--no-compile", action="store_true",
                        help="the torch baseline in eager instead of torch.compile")
    parser.add_argument("--name", default="layernorm_mlp")
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    rows = []
    for act in ACTIVATIONS:
        # the smoke run skips inductor's compile, which takes minutes on a small CPU
        rows += bench_activation(act, shape, args.smoke, not (args.no_compile or args.smoke))
    payload = {
        "description": "the MLP block's training step (fwd + bwd), bf16, LayerNorm: "
                       "te.LayerNormMLP DelayedScaling FP8 and bf16 beside the torch modules' "
                       "block under torch.compile; speedup_vs_baseline = baseline ms / ms",
        "config": {"tokens": shape[0], "hidden": shape[1], "ffn": shape[2],
                   "dtype": "bfloat16", "recipe": repr(RECIPE), "activations": ACTIVATIONS},
        "results": rows,
    }
    if args.smoke or not torch.cuda.is_available():
        print(json.dumps(payload, indent=1)[:3000])
        return
    from harness import write_result

    write_result(args.name, payload)


if __name__ == "__main__":
    main()
