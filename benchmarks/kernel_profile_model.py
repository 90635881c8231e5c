"""Where the GPU time of bench_model.py's training step goes, kernel by kernel.

The stack and step are bench_model.py's (4 blocks, 8192 tokens, bf16 parameters, loss
out.float().square().mean()). Per case and hidden size: a few warm-up steps, then ``--steps``
eager steps under torch.profiler's CUDA activity, the kernels grouped by name (as
kernel_profile.py does), and beside them the step's CUDA-event time from the same process, so
that the GPU's idle share of a step (launch gaps) shows as step time minus kernel time. A probe
for choosing which kernels to fuse or speed up, not a timing to quote as a speed.

    python benchmarks/kernel_profile_model.py --hidden 4096    # results/kernel_profile_model.json
    python benchmarks/kernel_profile_model.py --hidden 1024 --cases te_layer/bf16 torch/bf16
    python benchmarks/kernel_profile_model.py --compile --layer-ops on   # torch.compile's step,
        # a traced te.TransformerLayer as the layer node's ops (layer_block_op.on_cuda)
"""

from __future__ import annotations

import argparse

import torch

import harness
from bench_model import BATCH, HEAD_DIM, RECIPES, SEQ, build, make_step
from kernel_profile import profile_step, report
from transformer_engine.pytorch import layer_block, layer_block_op

CASES = ("te_layer/fp8_delayed", "te_layer/fp8_current", "te_layer/bf16", "torch/bf16")


def profile_case(case: str, hidden: int, steps: int, top: int, compiled: bool) -> dict:
    stack, recipe_name = case.split("/")
    layer_block.enabled = True
    model = build(stack, hidden, hidden // HEAD_DIM, "cuda")
    x = torch.randn(BATCH, SEQ, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fp8_recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] is not None else None
    if compiled:
        torch._dynamo.reset()
    step = make_step(model, torch.compile(model) if compiled else model, x, fp8_recipe)
    # (compiled: the warm-up steps include the first step's graph and the later steps' one)
    timed = harness.time_cuda(step, batch=2, repeats=steps, warmup=3 if compiled else 2)
    profiled = profile_step(step, steps, top)
    profiled["gpu_idle_us_per_step"] = timed["median_ms"] * 1e3 - profiled["kernel_us_per_step"]
    del model, x, step
    torch.cuda.empty_cache()
    return {"case": case, "hidden": hidden, "shape_bsh": [BATCH, SEQ, hidden],
            "execution": "compile" if compiled else "eager",
            "layer_ops_on_cuda": layer_block_op.on_cuda,
            "step_median_ms": timed["median_ms"], **profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--name", default="kernel_profile_model")
    parser.add_argument("--compile", action="store_true",
                        help="profile the step of torch.compile(model) (default mode)")
    parser.add_argument("--layer-ops", choices=("on", "off"),
                        help="a traced te.TransformerLayer on CUDA as the layer node's ops "
                             "(on) or through its modules (off); default: the package's choice")
    args = parser.parse_args()
    if args.layer_ops is not None:
        layer_block_op.on_cuda = args.layer_ops == "on"
    rows = []
    for hidden in args.hidden:
        for case in args.cases:
            row = profile_case(case, hidden, args.steps, args.top, args.compile)
            rows.append(row)
            report(f"hidden {hidden} {case} (step {row['step_median_ms']:.3f} ms, GPU idle "
                   f"{row['gpu_idle_us_per_step'] / 1e3:.3f} ms)", row, args.top)
    harness.write_result(args.name, {
        "description": "GPU kernel time per training step of bench_model.py's 4-block stack "
                       "(eager, or compiled where execution says so), by kernel name "
                       "(torch.profiler CUDA activity, after warm-up), "
                       "with the step's CUDA-event median from the same process; "
                       "gpu_idle_us_per_step = step time minus kernel time: a probe of where "
                       "the time goes, not a timing",
        "config": {"steps": args.steps, "top": args.top, "batch": BATCH, "seq": SEQ,
                   "head_dim": HEAD_DIM},
        "results": rows})


if __name__ == "__main__":
    main()
