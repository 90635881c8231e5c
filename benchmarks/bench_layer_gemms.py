"""The GEMMs of one Transformer layer's training step, FP8 recipes against bf16, on one GPU.

The configuration NVIDIA publishes for its "5B" model: M = 15872 tokens, hidden 4096, FFN
16384. One layer's step runs 12 GEMMs: forward, dgrad and wgrad of its four linear layers
(QKV 4096 -> 12288, attention projection 4096 -> 4096, FC1 4096 -> 16384, FC2 16384 -> 4096).
Each layer here is a bias-free ``te.Linear`` driven forward and backward, so the FP8 figures
include every quantization (input, weight and grad_output casts with their transposes, the
scale updates); the bf16 baseline is ``torch.nn.Linear`` (cuBLAS bf16 GEMMs). Everything
between the GEMMs of a real layer (attention, norms, activations) is left out on purpose.

Timed by launches and by CUDA-graph replay (GPU time alone). The speedup of each recipe is
bf16 time / FP8 time for the whole set of 12 GEMMs.

Beside each recipe, the same 12 FP8 GEMMs alone ("gemms only": the core's GEMM on operands
quantized once, outside the timing, with the layer's scaling modes and accumulation): the
ceiling of the recipe's speedup, and with it the time its quantization takes.

    python benchmarks/bench_layer_gemms.py            # writes benchmarks/results/layer_gemms.json
    python benchmarks/bench_layer_gemms.py --smoke    # a tiny shape, any device, no file
"""

from __future__ import annotations

import argparse
import time

import torch

import transformer_engine.pytorch as te
from harness import time_cuda, time_cuda_graph, write_result
from transformer_engine.common import recipe
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.quantization import plan_of, quantize

TOKENS, HIDDEN, FFN = 15872, 4096, 16384
RECIPES = {
    "DelayedScaling": recipe.DelayedScaling(),
    "Float8CurrentScaling": recipe.Float8CurrentScaling(),
    "Float8BlockScaling": recipe.Float8BlockScaling(),
}


def layer_shapes(hidden: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the four linear layers."""
    return [("qkv", hidden, 3 * hidden), ("proj", hidden, hidden), ("fc1", hidden, ffn),
            ("fc2", ffn, hidden)]


def build(tokens: int, hidden: int, ffn: int, device: str):
    """Matching bf16 nn.Linear and te.Linear layers (same weights) with their inputs and
    output gradients."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    cases = []
    for _name, k, n in layer_shapes(hidden, ffn):
        base = torch.nn.Linear(k, n, bias=False, device=device, dtype=bf16)
        layer = te.Linear(k, n, bias=False, params_dtype=bf16, device=device)
        with torch.no_grad():
            layer.weight.copy_(base.weight)
        x = torch.randn(tokens, k, device=device, dtype=bf16, requires_grad=True)
        g = torch.randn(tokens, n, device=device, dtype=bf16)
        cases.append((base, layer, x, g))
    return cases


def step_fn(cases, fp8_recipe=None):
    """All four layers forward and backward: the 12 GEMMs (and, in FP8, their casts).

    The gradients of the leaves (input and weight) are dropped before each backward, which then
    stores them instead of adding them to the last step's: in a layer, dgrad feeds the op
    before and wgrad is written once per step, so autograd's accumulation (an elementwise add
    over every input and weight, about 1.3 ms at the 5B shapes, in bf16 and FP8 alike) is not
    part of the GEMMs' time."""
    modules = [layer if fp8_recipe is not None else base for base, layer, _, _ in cases]

    def step(i):
        for module, (_, _, x, g) in zip(modules, cases, strict=True):
            x.grad = module.weight.grad = None
            if fp8_recipe is None:
                y = module(x)
            else:
                with te.fp8_autocast(fp8_recipe=fp8_recipe):
                    y = module(x)
            y.backward(g)

    return step


def gemms_only_fn(cases, fp8_recipe):
    """The 12 FP8 GEMMs of step_fn's FP8 step as te.Linear runs them (forward with fast
    accumulation, dgrad and wgrad with split accumulation, bf16 outputs), on operands quantized
    here once with the recipe's plan (delayed scaling: scale 1, no history)."""
    plan = plan_of(fp8_recipe)
    gemms = []
    for _, layer, x, g in cases:
        ones = torch.ones(3, device=x.device)
        x, w, g = x.detach(), layer.weight.detach(), g.detach()
        qx = quantize(plan, "input", x, True, True, ones, 0)
        qw = quantize(plan, "weight", w, True, True, ones, 1)
        qg = quantize(plan, "grad_output", g, True, True, ones, 2)
        fwd, bwd = plan.fwd_dtype, plan.bwd_dtype
        gemms += [
            (qx.data, qx.scale_inv, fwd, plan.input_mode, qw.data, qw.scale_inv, fwd,
             plan.weight_mode, torch.bfloat16, None, False),
            (qg.data, qg.scale_inv, bwd, plan.grad_mode, qw.columnwise, qw.columnwise_scale_inv,
             fwd, plan.weight_mode, torch.bfloat16, None, True),
            (qg.columnwise, qg.columnwise_scale_inv, bwd, plan.grad_mode, qx.columnwise,
             qx.columnwise_scale_inv, fwd, plan.input_mode, torch.bfloat16, None, True),
        ]

    def step(i):
        for args in gemms:
            ops.gemm_fp8(*args)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape, no results file")
    args = parser.parse_args()
    tokens, hidden, ffn = (64, 32, 64) if args.smoke else (TOKENS, HIDDEN, FFN)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        raise SystemExit("bench_layer_gemms: needs a CUDA GPU (use --smoke on a CPU)")
    cases = build(tokens, hidden, ffn, device)
    flops = sum(6.0 * tokens * k * n for _, k, n in layer_shapes(hidden, ffn))
    contenders = {"bf16 nn.Linear": step_fn(cases)}
    for k, v in RECIPES.items():
        contenders[f"fp8 {k}"] = step_fn(cases, v)
        contenders[f"fp8 {k} gemms only"] = gemms_only_fn(cases, v)
    if args.smoke:
        for name, step in contenders.items():
            step(0)
            print(f"{name}: ran")
        return
    rows, medians = [], {}
    for name, step in contenders.items():
        for how, timer in (("launches", time_cuda), ("cuda_graph", time_cuda_graph)):
            start = time.perf_counter()
            t = timer(step, batch=5, repeats=10, warmup=2)
            medians[(name, how)] = t["median_ms"]
            tflops = flops / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"op": "layer_gemms_fwd_bwd", "impl": name, "timing": how,
                         "tokens": tokens, "hidden": hidden, "ffn": ffn, **t, "tflops": tflops})
            print(f"{name:28s} {how:10s} {t['median_ms']:8.3f} ms {tflops:7.1f} TFLOP/s "
                  f"({time.perf_counter() - start:.0f} s)")
    for name in contenders:
        if name.startswith("fp8"):
            for how in ("launches", "cuda_graph"):
                speedup = medians[("bf16 nn.Linear", how)] / medians[(name, how)]
                rows.append({"op": "speedup_vs_bf16", "impl": name, "timing": how,
                             "speedup": speedup})
                print(f"{name:28s} {how:10s} {speedup:.2f}x bf16")
    write_result("layer_gemms", {
        "description": "the 12 GEMMs of one Transformer layer's fwd+bwd at the 5B configuration "
                       f"(M={tokens}, hidden {hidden}, FFN {ffn}): bias-free te.Linear per FP8 "
                       "recipe (quantization included) vs bf16 nn.Linear; 'gemms only': the "
                       "same FP8 GEMMs on operands quantized beforehand",
        "results": rows,
    })


if __name__ == "__main__":
    main()
