"""Where a Transformer layer's training step leaves the GPU idle.

bench_transformer_layer.py's FP8 layer step takes longer than the sum of its kernels
(kernel_profile.py): the difference is time the GPU waits. This runs a contender's step under
torch.profiler (CPU and CUDA activities, Python stacks), reads the trace's kernels and CUDA
runtime and driver calls (cuBLASLt and cuDNN launch through the driver), and reports per
step: the span from the first kernel's start to the last one's end, the kernels' busy time
(their union), the idle time between, and the largest idle gaps.
For each gap it names the kernels around it and what the host was doing: when the kernel after
the gap was launched after the one before had ended, the GPU starved, and the gap lists the
host's longest operators between that end and the launch (with their Python frame); a
synchronizing runtime call (cudaStreamSynchronize, a pageable cudaMemcpy, ...) is listed too.
A probe for finding the cause, not a timing.

    python benchmarks/gap_probe.py --only "DelayedScaling (FP8 GEMMs)"   # results/gap_probe.json
"""

from __future__ import annotations

import json
import os
import tempfile
from bisect import bisect_right

import torch
from torch.profiler import ProfilerActivity, profile

from bench_transformer_layer import SHAPES, probe_parser, probed_contenders
from harness import write_result

_SYNCS = ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc",
          "cudaStreamWaitEvent", "cudaEventQuery")


def _trace(step, steps: int) -> list:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def analyse(events: list, steps: int, top: int) -> dict:
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    runtime = [e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e["args"].get("correlation"): e for e in runtime}
    host = sorted((e for e in spans if e.get("cat") in ("cpu_op", "python_function")),
                  key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host]
    if not kernels:
        return {"error": "no kernels in the trace"}
    busy, gaps, end = 0.0, [], kernels[0]["ts"]
    for prev, k in zip([None] + kernels[:-1], kernels, strict=True):
        start, stop = k["ts"], k["ts"] + k["dur"]
        if start > end and prev is not None:
            gaps.append((start - end, prev, k, end))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0]["ts"]
    gaps.sort(key=lambda g: -g[0])

    def host_in(t0: float, t1: float) -> list:
        """The longest host operators that ran in [t0, t1] (clipped), with their names."""
        out = []
        for e in host[:bisect_right(host_starts, t1)]:
            a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            if b > a and e["dur"] < 10 * (t1 - t0) + 1e3:
                out.append((b - a, e["name"][:140]))
        out.sort(key=lambda x: -x[0])
        return [{"us": round(us, 1), "name": n} for us, n in out[:8]]

    rows = []
    for gap, prev, k, idle_from in gaps[:top]:
        launch = launch_of.get(k["args"].get("correlation"))
        row = {"idle_us": round(gap, 1), "before": prev["name"][:120], "after": k["name"][:120]}
        if launch is not None:
            row["launched_us_after_idle_began"] = round(launch["ts"] - idle_from, 1)
            row["launch_call"] = launch["name"]
            if launch["ts"] > idle_from:  # the GPU waited for the host
                row["host_meanwhile"] = host_in(idle_from, launch["ts"])
        rows.append(row)
    syncs = [{"name": e["name"], "us": round(e["dur"], 1)} for e in runtime
             if any(s in e["name"] for s in _SYNCS) and e["dur"] > 20]
    syncs.sort(key=lambda s: -s["us"])
    return {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (span - busy) / steps, "gaps_per_step": len(gaps) / steps,
            "largest_gaps": rows, "slow_runtime_calls": syncs[:top]}


def main() -> None:
    args = probe_parser(__doc__, "gap_probe", 2, 12).parse_args()
    shape = SHAPES[0]
    rows = []
    for name, step in probed_contenders(args.only):
        row = {"impl": name, "shape_sbhfn": list(shape),
               **analyse(_trace(step, args.steps), args.steps, args.top)}
        rows.append(row)
        print(f"{name}: span {row['span_us_per_step'] / 1e3:.2f} ms, busy "
              f"{row['busy_us_per_step'] / 1e3:.2f} ms, idle {row['idle_us_per_step'] / 1e3:.2f} "
              f"ms in {row['gaps_per_step']:.0f} gaps per step")
        for g in row["largest_gaps"]:
            when = g.get("launched_us_after_idle_began")
            print(f"  {g['idle_us']:8.1f} us before {g['after'][:60]} (launched "
                  f"{'?' if when is None else f'{when:.1f}'} us in)")
            for h in g.get("host_meanwhile", [])[:4]:
                print(f"        host {h['us']:8.1f} us {h['name'][:90]}")
        for s in row["slow_runtime_calls"][:6]:
            print(f"  runtime {s['name']} {s['us']} us")
    write_result(args.name, {
        "description": "idle GPU time within a Transformer layer's training step "
                       "(torch.profiler CPU+CUDA trace, Python stacks): span, busy time, idle "
                       "gaps, the host's work before the kernels that ended the largest gaps; a "
                       "probe, not a timing",
        "config": {"steps": args.steps, "top": args.top},
        "results": rows})


if __name__ == "__main__":
    main()
