"""Where the GPU time of the JAX model stack's training step goes, kernel by kernel.

The contenders and the step are bench_transformer_layer_jax.py's ``--model`` ones (4 layers,
8192 tokens as batch 4 x sequence 2048, hidden / 128 heads, a 4 x hidden MLP, no dropout): our
Flax TransformerLayer in FP8 and bf16 beside flax's layer. torch.profiler's CUDA activity
comes from CUPTI, which records the kernels of the whole process, XLA's included (seen on
an H100: results/kernel_profile_jax_h100*.json; a contender whose run records no kernel
says so), so one contender's steps run under it and the kernels are grouped by name, with a
class per name (our core, XLA fusions, cuBLAS/cuDNN, copies). Per contender the JSON holds the
kernels' time per step beside the step's wall time (the difference: the GPU waiting for the
host or for XLA's runtime), and the top kernels. A probe for finding what to make faster, not
a timing (bench_transformer_layer_jax.py --model times the steps).

    python benchmarks/kernel_profile_jax.py --hidden 1024     # results/kernel_profile_jax.json
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import jax
import torch
from torch.profiler import ProfilerActivity, profile

import bench_transformer_layer_jax as bench
import kernel_profile
from harness import write_result

# Kernel name pattern -> class, first match wins.
_CLASSES = [
    ("core", r"^(void )?te::|transformer_engine"),
    ("attention", r"cudnn|fmha|flash|sdpa"),
    ("gemm", r"gemm|nvjet|cublas|cutlass|xmma|gmma"),
    ("copy", r"copy|memcpy|memset|transpose|concatenate|slice"),
    ("xla fusion", r"fusion|reduce|convert|broadcast|add|multiply"),
]


def kernel_class(name: str) -> str:
    return kernel_profile.kernel_class(name, _CLASSES, "other")


def profile_contender(run, steps: int, top: int) -> dict:
    for _ in range(3):
        out = run()
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    # (a CPU-only torch has no CUDA activity: the smoke run records no kernels)
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
    kernels = kernel_profile.kernels_by_name(prof, steps)
    classes: dict = defaultdict(lambda: [0.0, 0.0])
    for name, us, count in kernels:
        classes[kernel_class(name)][0] += us
        classes[kernel_class(name)][1] += count
    return {"wall_ms_per_step": wall_ms,
            "kernel_ms_per_step": sum(us for _, us, _ in kernels) / 1e3,
            "launches_per_step": sum(c for _, _, c in kernels),
            "classes": {cls: {"ms_per_step": us / 1e3, "launches_per_step": c}
                        for cls, (us, c) in sorted(classes.items(), key=lambda kv: -kv[1][0])},
            "kernels": [{"name": n[:160], "class": kernel_class(n), "us_per_step": us,
                         "launches_per_step": c} for n, us, c in kernels[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--only", action="append", default=[],
                        help="contenders whose name holds this text (repeatable; all if none)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print, write nothing")
    parser.add_argument("--name", default="kernel_profile_jax")
    parser.add_argument("--first-step-probe", action="store_true",
                        help="also FP8 delayed scaling traced without the first-step rule")
    args = parser.parse_args()
    size = (bench.SMOKE_MODEL if args.smoke else
            dict(layers=bench.MODEL_LAYERS, seq=bench.MODEL_SEQ, batch=bench.MODEL_BATCH,
                 head_dim=bench.MODEL_HEAD_DIM))
    hidden = size["hiddens"][0] if args.smoke else args.hidden
    shape = (size["seq"], size["batch"], hidden, 4 * hidden, hidden // size["head_dim"])
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    x = jax.random.normal(jax.random.PRNGKey(2), (shape[1], shape[0], hidden), jax.numpy.bfloat16)
    rows = []
    for name, (model, fp8_recipe) in bench.contenders(shape, implementation, size["layers"],
                                                       dropout=0.0,
                                                       first_step_probe=args.first_step_probe
                                                       ).items():
        if args.only and not any(o in name for o in args.only):
            continue
        run, info = bench.prepare(name, model, fp8_recipe, x)
        row = {"impl": name, "hidden": hidden, "layers": size["layers"],
               "custom_call_targets": info["custom_call_targets"],
               **profile_contender(run, args.steps, args.top)}
        if torch.cuda.is_available() and row["launches_per_step"] == 0:
            row["note"] = "the profiler recorded no kernel of this JAX step"
            print(f"{name}: {row['note']}")
        rows.append(row)
        print(f"{name}: wall {row['wall_ms_per_step']:.3f} ms, kernels "
              f"{row['kernel_ms_per_step']:.3f} ms in {row['launches_per_step']:.0f} launches")
        for cls, c in row["classes"].items():
            print(f"    {cls:12s} {c['ms_per_step']:8.3f} ms "
                  f"{c['launches_per_step']:6.0f} launches")
        for k in row["kernels"][:12]:
            print(f"      {k['us_per_step'] / 1e3:7.3f} ms x{k['launches_per_step']:4.0f} "
                  f"{k['name'][:100]}")
    if args.smoke:
        return
    write_result(args.name, {
        "description": "GPU kernels of the JAX model stack's jitted training step "
                       "(bench_transformer_layer_jax.py --model's contenders) under "
                       "torch.profiler's CUDA activity, grouped by name, beside the step's "
                       "wall time; a probe, not a timing",
        "config": {"shape_sbhfn": list(shape), "steps": args.steps, "top": args.top,
                   "jax": jax.__version__},
        "results": rows})


if __name__ == "__main__":
    main()
