"""Where the GPU time of one Transformer layer's training step goes, kernel by kernel.

The contenders are bench_transformer_layer.py's (the getting-started shape by default: seq
2048, batch 8, hidden 4096, ffn 16384, 32 heads): each runs a few warm-up steps, then
``--steps`` steps under torch.profiler's CUDA activity. Per contender the JSON holds the
kernels' total GPU time per step, grouped by kernel name, the largest first, with launches
per step, and the step's summed kernel time; a kernel name's class (GEMM, attention, copy,
norm, activation, cast, elementwise) sums those. A probe for finding what to make faster,
not a timing to quote as a speed (the profiler adds its own cost; bench_transformer_layer.py
times the step).

    python benchmarks/kernel_profile.py                       # results/kernel_profile.json
    python benchmarks/kernel_profile.py --only "FP8 attention" --top 30
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_transformer_layer import SHAPES, probe_parser, probed_contenders
from harness import write_result

# Kernel name pattern -> class, first match wins.
_CLASSES = [  # (attention first: cuDNN's attention kernels have "wgmma" in their names)
    ("attention", r"flash|fmha|sdpa|attn|attention|cudnn"),
    ("gemm", r"gemm|gmma|cutlass|sm90_xmma|nvjet|cublas"),
    ("copy", r"copy|Memcpy|cat|transpose"),
    ("norm", r"norm"),
    ("activation", r"gelu|silu|swiglu|relu|activation"),
    ("cast", r"cast|quantiz|fp8|amax|scale"),
]


def kernel_class(name: str, classes=_CLASSES, other: str = "elementwise/other") -> str:
    """The first class of ``classes`` ((class, pattern) pairs) whose pattern a kernel's name
    matches (case-insensitive), else ``other``."""
    low = name.lower()
    for cls, pattern in classes:
        if re.search(pattern, low):
            return cls
    return other


def kernels_by_name(prof, steps: int) -> list:
    """(name, us per step, launches per step) of the CUDA kernels a profile recorded over
    ``steps`` steps, the longest first."""
    per_name: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name][0] += e.device_time
            per_name[e.name][1] += 1
    return sorted(((name, us / steps, n / steps) for name, (us, n) in per_name.items()),
                  key=lambda r: -r[1])


def profile_step(step, steps: int, top: int) -> dict:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    kernels = kernels_by_name(prof, steps)
    classes: dict = defaultdict(float)
    for name, us, _ in kernels:
        classes[kernel_class(name)] += us
    return {"kernel_us_per_step": sum(us for _, us, _ in kernels),
            "classes_us_per_step": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": name[:160], "class": kernel_class(name), "us_per_step": us,
                         "launches_per_step": n} for name, us, n in kernels[:top]]}


def report(label: str, row: dict, top: int = 12) -> None:
    """Prints a profile_step row: its kernel time, its classes and its ``top`` kernels."""
    print(f"{label}: {row['kernel_us_per_step'] / 1e3:.2f} ms of kernels per step")
    for cls, us in row["classes_us_per_step"].items():
        print(f"    {cls:18s} {us / 1e3:7.2f} ms")
    for k in row["kernels"][:top]:
        print(f"      {k['us_per_step'] / 1e3:7.3f} ms x{k['launches_per_step']:4.0f} "
              f"{k['name'][:110]}")


def main() -> None:
    args = probe_parser(__doc__, "kernel_profile", 3, 25).parse_args()
    shape = SHAPES[0]
    rows = []
    for name, step in probed_contenders(args.only):
        row = {"impl": name, "shape_sbhfn": list(shape),
               **profile_step(step, args.steps, args.top)}
        rows.append(row)
        report(name, row)
    write_result(args.name, {
        "description": "GPU kernel time per training step of one Transformer layer, by kernel "
                       "name (torch.profiler CUDA activity, after 3 warm-up steps): a probe of "
                       "where the time goes, not a timing",
        "config": {"steps": args.steps, "top": args.top},
        "results": rows})


if __name__ == "__main__":
    main()
