"""Where a training step's host time goes (issue 20): one te.TransformerLayer in FP8 (delayed
and current scaling) and bf16, beside the same block from torch's modules, at a shape small
enough that the GPU waits for the host.

Per case, over `--steps` steps issued back to back after warm-up (no synchronization inside):
  - host_ms_per_step: wall time of issuing the steps, per step (synchronized once at the end);
  - ops: torch.profiler's CPU self time per op or Python function (record_function ranges,
    custom ops, aten ops, autograd nodes), per step, the largest first, with call counts: what
    the dispatcher and autograd see;
  - python: cProfile's own time per Python function, per step, the largest first (a call into
    the core's binding counts towards its caller): what the Python layers cost.
  - sites (``--sites``): where the allocations (``aten::empty*``) and kernel launches of a
    step come from: torch.profiler's Python stacks, grouped by their innermost frames, the
    most frequent first, with calls per step.
The profiles are separate runs (each profiler slows what it watches); host_ms_per_step is
measured without any. On a GPU the op profile also records the CUDA runtime's calls, so a
step that waits for the GPU shows the call that waits (a synchronization, a blocking copy).
A case named ``<stack>/<recipe>/compile`` runs the block under torch.compile (default mode, the
fp8_autocast outside it, as bench_model's compile execution does).
``--shape`` runs at another [batch, sequence, hidden] (heads: hidden / 128, at least 2), e.g.
bench_model's 4 x 2048 x 1024, where the step's GPU work is real.

    python benchmarks/bench_host_profile.py                  # results/host_profile.json
    python benchmarks/bench_host_profile.py --device cpu --steps 3 --top 5   # smoke run
    python benchmarks/bench_host_profile.py --rounds 7 --cases te_layer/fp8_delayed \
        te_layer/fp8_delayed/compile    # eager against compiled host time, no profiles
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import transformer_engine.pytorch as te
from bench_model import RECIPES, TorchBlock, make_step, write

SHAPE = (1, 16, 256)  # [batch, sequence, hidden]: bench_model's module probe shape


def heads_of(hidden: int) -> int:
    return max(2, hidden // 128)


def build(case: str, device: str, hidden: int) -> tuple[torch.nn.Module, object]:
    """(the block, its FP8 recipe or None) of a case: ``te_layer/<recipe>`` or ``torch/bf16``
    (a ``/compile`` suffix is the caller's)."""
    torch.manual_seed(0)
    stack, recipe_name = case.split("/")[:2]
    if stack == "torch":
        return TorchBlock(hidden, heads_of(hidden), device), None
    layer = te.TransformerLayer(hidden, 4 * hidden, heads_of(hidden), hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                attn_input_format="bshd", params_dtype=torch.bfloat16,
                                device=device)
    factory = RECIPES[recipe_name]
    return layer, factory() if factory is not None else None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_ms(step, device: str, steps: int) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def op_profile(step, device: str, steps: int, top: int) -> list[dict]:
    _sync(device)
    # (CUDA activity: the runtime's calls, a waiting one among them, become events too)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "self_us_per_step": e.self_cpu_time_total / steps,
             "calls_per_step": e.count / steps} for e in rows[:top]]


def python_profile(step, device: str, steps: int, top: int) -> list[dict]:
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    _sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)  # own time
    out = []
    for (path, line, func), (_, calls, own, cumulative, _) in rows[:top]:
        where = func if path == "~" else f"{path.rsplit('/', 2)[-2:][-1]}:{line}({func})"
        out.append({"name": where, "own_us_per_step": own * 1e6 / steps,
                    "cumulative_us_per_step": cumulative * 1e6 / steps,
                    "calls_per_step": calls / steps})
    return out


# The host-side events whose origin --sites reports.
_SITE_OPS = ("aten::empty_strided", "aten::empty", "cudaLaunchKernel", "aten::copy_")


def site_profile(step, device: str, steps: int, top: int, depth: int = 6) -> list[dict]:
    """Per op of _SITE_OPS, the Python call sites (the ``depth`` innermost frames) of its
    calls, the most frequent first."""
    _sync(device)
    # (verbose: without it this torch records no Python stacks for the CPU ops)
    config = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True,
                 experimental_config=config) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    rows = [e for e in prof.key_averages(group_by_stack_n=depth) if e.key in _SITE_OPS]
    rows.sort(key=lambda e: e.count, reverse=True)
    return [{"name": e.key, "calls_per_step": e.count / steps,
             "self_us_per_step": e.self_cpu_time_total / steps,
             "stack": [frame for frame in e.stack][:depth]} for e in rows[:top]]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--name", default="host_profile")
    parser.add_argument("--shape", type=int, nargs=3, default=list(SHAPE),
                        metavar=("BATCH", "SEQ", "HIDDEN"))
    parser.add_argument("--sites", action="store_true",
                        help="also record where allocations and launches come from")
    parser.add_argument("--cases", nargs="*", default=["te_layer/fp8_delayed",
                                                       "te_layer/fp8_current", "te_layer/bf16",
                                                       "torch/bf16"])
    parser.add_argument("--rounds", type=int, default=0,
                        help="time the cases this many times in turn (the host's drift falls "
                             "on all alike) and record the rounds and their median, without "
                             "the profiles")
    args = parser.parse_args(argv)
    rows, steps = [], []
    batch, seq, hidden = args.shape
    for case in args.cases:
        model, fp8_recipe = build(case, args.device, hidden)
        x = torch.randn(batch, seq, hidden, device=args.device, dtype=torch.bfloat16,
                        requires_grad=True)
        forward = torch.compile(model) if case.endswith("/compile") else model
        step = make_step(model, forward, x, fp8_recipe)
        for _ in range(args.warmup):
            step()
        steps.append(step)
        rows.append({"case": case, "shape_bsh": [batch, seq, hidden], "heads": heads_of(hidden),
                     "steps": args.steps})
    if args.rounds:
        for _ in range(args.rounds):
            for row, step in zip(rows, steps, strict=True):
                row.setdefault("rounds_ms", []).append(host_ms(step, args.device, args.steps))
        for row in rows:
            row["host_ms_per_step"] = statistics.median(row["rounds_ms"])
    for row, step in zip(rows, steps, strict=True):
        if not args.rounds:
            row.update(host_ms_per_step=host_ms(step, args.device, args.steps),
                       ops=op_profile(step, args.device, args.steps, args.top),
                       python=python_profile(step, args.device, args.steps, args.top))
            if args.sites:
                row["sites"] = site_profile(step, args.device, min(args.steps, 20), args.top)
        print(f"{row['case']}: {row['host_ms_per_step']:.3f} ms per step")
    timing = "wall clock" if args.device == "cuda" else "cpu wall clock (CPU kernels included)"
    return write(args.name, {
        "description": "host time of a training step (zero_grad, forward, backward of "
                       "out.float().square().mean()) of one block at shape_bsh, issued back "
                       "to back: te_layer = te.TransformerLayer (causal, bshd, bf16 "
                       "parameters) under each recipe, torch = the same block from torch's "
                       "modules; ops = torch.profiler CPU self time per step (with the CUDA "
                       "runtime's calls on a GPU), python = cProfile own time per step "
                       "(separate runs)",
        "config": {"device": args.device, "timing": timing, "warmup": args.warmup,
                   "top": args.top, "rounds": args.rounds},
        "results": rows,
    }, args.device)


if __name__ == "__main__":
    main()
