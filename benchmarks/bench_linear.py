"""One linear layer's training step (forward + dgrad + wgrad) side by side on one GPU.

Contenders, at 16384 tokens 8192 -> 8192 and at the seed's 2048 tokens 768 -> 3072, bf16:
  - te.Linear under fp8_autocast: DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
    by launches and (DelayedScaling, Float8CurrentScaling) replayed as a CUDA graph, and
    DelayedScaling under torch.compile (which removes the module's Python, not the GEMMs');
  - nn.Linear bf16, eager and under torch.compile;
  - torchao Float8Linear (tensorwise) under torch.compile, when torchao is importable;
  - the floor: the three FP8 GEMMs alone as torch._scaled_mm on operands quantized beforehand.
A step's FLOPs are those of its three GEMMs (6 M N K). Each te recipe's output and gradients
are compared with the bf16 layer's and the relative errors recorded (benchmarks never assert).

    python benchmarks/bench_linear.py      # writes benchmarks/results/linear.json
    python benchmarks/bench_linear.py --host-only --name linear_host   # host time and memory
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import transformer_engine.pytorch as te
from harness import time_cuda, time_cuda_graph, write_result
from transformer_engine.common import recipe
from transformer_engine.pytorch import fast_linear

SHAPES = [(16384, 8192, 8192), (2048, 768, 3072)]  # (tokens M, in_features K, out_features N)
RECIPES = {
    "DelayedScaling": recipe.DelayedScaling(),
    "Float8CurrentScaling": recipe.Float8CurrentScaling(),
    "Float8BlockScaling": recipe.Float8BlockScaling(),
}
GRAPHED = ("DelayedScaling", "Float8CurrentScaling")


def _step_fn(layer, x, grad_out, fp8_recipe=None):
    """A training step of one layer: forward, then backward into x.grad and the params."""

    def step(i):
        if fp8_recipe is None:
            y = layer(x)
        else:
            with te.fp8_autocast(fp8_recipe=fp8_recipe):
                y = layer(x)
        y.backward(grad_out)

    return step


def _scaled_mm_floor(m: int, k: int, n: int):
    """The three GEMMs of the step as torch._scaled_mm (cuBLASLt), operands already FP8 in
    the layouts it needs: row-major first operand, column-major second."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x8 = torch.randn(m, k, device="cuda").to(e4)
    w8 = torch.randn(n, k, device="cuda").to(e4)
    g8 = torch.randn(m, n, device="cuda").to(e5)
    w_t8, g_t8, x_t8 = w8.t().contiguous(), g8.t().contiguous(), x8.t().contiguous()
    one = torch.ones((), device="cuda")
    bf16 = torch.bfloat16

    def step(i):
        torch._scaled_mm(x8, w8.t(), one, one, out_dtype=bf16, use_fast_accum=True)
        torch._scaled_mm(g8, w_t8.t(), one, one, out_dtype=bf16)  # dgrad [M, K]
        torch._scaled_mm(g_t8, x_t8.t(), one, one, out_dtype=bf16)  # wgrad [N, K]

    return step


def _torchao_step(base: torch.nn.Linear, x, grad_out):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        return None, f"torchao not importable: {err}"
    model = torch.nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return _step_fn(torch.compile(model, dynamic=False), x, grad_out), None


def _errors(layer, base, x, grad_out, fp8_recipe) -> dict:
    """Relative max errors of an FP8 step's output and gradients against the bf16 layer's."""
    results = []
    for module, r in ((layer, fp8_recipe), (base, None)):
        xi = x.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            y = module(xi)
        y.backward(grad_out)
        results.append((y.float(), xi.grad.float(), module.weight.grad.float()))
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return {
        f"{name}_rel_err": rel(a, b)
        for name, a, b in zip(("output", "dgrad", "wgrad"), *results, strict=True)
    }


def _host_us(fn, calls: int = 40, rounds: int = 25) -> float:
    """Host time of one call of ``fn``, in microseconds: calls are issued back to back and
    timed before the GPU is waited for, so at small shapes (GPU work of a few microseconds)
    this is the Python + launch cost alone. Few calls per round: CUDA's launch queue (about
    a thousand launches) must not fill, or the host waits for the GPU and the figure is the
    GPU's time (200 calls of a te.Linear forward, several launches each, filled it). The best
    of ``rounds`` rounds: the host's noise (other processes, clocks) only ever adds time."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best / calls * 1e6


def _host_forward_us(layer, x, fp8_recipe=None) -> float:
    """Host time of one training-mode forward (its own autocast, exit update included)."""

    def forward():
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            return layer(x)

    return _host_us(forward)


def _host_forward_in_autocast_us(layer, x, fp8_recipe) -> float:
    """Host time of one training-mode forward inside an autocast that stays open: a model's
    layers share one autocast and its one exit update, so per layer this is what a forward
    costs (the update is measured with each forward in _host_forward_us)."""
    with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
        return _host_us(lambda: layer(x))


def _peak_step_bytes(step) -> int:
    """Peak of CUDA memory allocated during one training step, above what was held before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(0)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def host_and_memory(m: int, k: int, n: int) -> list[dict]:
    """Host overhead of a forward (te.Linear FP8 vs nn.Linear) and peak memory of a step (FP8
    vs bf16), plus the bytes per element of fp8_model_init weights."""
    bf16 = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=bf16, requires_grad=True)
    grad_out = torch.randn(m, n, device="cuda", dtype=bf16)
    base = torch.nn.Linear(k, n, device="cuda", dtype=bf16)
    layer = te.Linear(k, n, params_dtype=bf16)
    rows = []
    for impl, module, r in (
        ("te.Linear DelayedScaling", layer, RECIPES["DelayedScaling"]),
        ("te.Linear DelayedScaling, Python path", layer, RECIPES["DelayedScaling"]),
        ("te.Linear Float8CurrentScaling", layer, RECIPES["Float8CurrentScaling"]),
        ("nn.Linear bf16 eager", base, None),
    ):
        # The compiled forward (fast_linear.py) is te.Linear's default where it is built;
        # the Python path is what every forward took before it.
        fast_linear.enabled = not impl.endswith("Python path")
        us = _host_forward_us(module, x, r)
        step = _step_fn(module, x, grad_out, r)
        step_us = _host_us(lambda step=step: step(0))
        peak = _peak_step_bytes(step)
        rows.append({"op": "host_forward_us", "impl": impl, "shape_mkn": [m, k, n], "host_us": us})
        in_autocast = _host_forward_in_autocast_us(module, x, r)
        rows.append({"op": "host_forward_in_open_autocast_us", "impl": impl, "shape_mkn": [m, k, n],
                     "host_us": in_autocast})
        rows.append({"op": "host_step_us", "impl": impl, "shape_mkn": [m, k, n],
                     "host_us": step_us})
        rows.append(
            {"op": "peak_step_memory", "impl": impl, "shape_mkn": [m, k, n], "peak_bytes": peak}
        )
        print(
            f"{impl:40s} {m}x{k}->{n}: forward host {us:.1f} us (in an open autocast "
            f"{in_autocast:.1f}), step host {step_us:.1f} us, "
            f"step peak {peak / 2**20:.1f} MiB"
        )
    fast_linear.enabled = True
    with te.fp8_model_init():
        fp8_layer = te.Linear(k, n, params_dtype=bf16)
    w = fp8_layer.weight
    data = getattr(w, "_data", None)
    nbytes = data.untyped_storage().nbytes() if data is not None else w.untyped_storage().nbytes()
    rows.append(
        {
            "op": "fp8_model_init_weight",
            "impl": "te.Linear",
            "shape_mkn": [m, k, n],
            "weight_type": type(w).__name__,
            "bytes_per_element": nbytes / w.numel(),
        }
    )
    print(f"fp8_model_init weight: {type(w).__name__}, {nbytes / w.numel():.3f} bytes per element")
    return rows


def bench_shape(m: int, k: int, n: int, quick: bool, compile_: bool) -> list[dict]:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=bf16, requires_grad=True)
    grad_out = torch.randn(m, n, device="cuda", dtype=bf16)
    base = torch.nn.Linear(k, n, device="cuda", dtype=bf16)
    layer = te.Linear(k, n, params_dtype=bf16)
    with torch.no_grad():
        layer.weight.copy_(base.weight)
        layer.bias.copy_(base.bias)
    timing = dict(batch=5, repeats=8, warmup=2) if quick or m * n * k > 1 << 38 else {}
    cases: dict = {}
    for name, r in RECIPES.items():
        cases[(f"te.Linear {name}", "launches")] = _step_fn(layer, x, grad_out, r)
    for name in GRAPHED:
        cases[(f"te.Linear {name}", "cuda_graph")] = _step_fn(layer, x, grad_out, RECIPES[name])
    cases[("nn.Linear bf16 eager", "launches")] = _step_fn(base, x, grad_out)
    compiled_names = (
        "te.Linear DelayedScaling torch.compile",
        "nn.Linear bf16 torch.compile",
        "torchao Float8Linear tensorwise torch.compile",
    )
    if compile_:
        te_compiled = torch.compile(layer, fullgraph=True, dynamic=False)  # the Python glue
        bf16_compiled = torch.compile(copy.deepcopy(base), dynamic=False)
        ao_step, ao_error = _torchao_step(base, x, grad_out)
        steps = (
            _step_fn(te_compiled, x, grad_out, RECIPES["DelayedScaling"]),
            _step_fn(bf16_compiled, x, grad_out),
            ao_step or ao_error,
        )
    else:
        steps = ("skipped: --no-compile",) * 3
    for name, step in zip(compiled_names, steps, strict=True):
        cases[(name, "launches")] = step
    cases[("torch._scaled_mm x3 (GEMM floor)", "launches")] = _scaled_mm_floor(m, k, n)

    rows = []
    flops = 6.0 * m * n * k
    for (impl, how), fn in cases.items():
        row = {"op": "linear_fwd_dgrad_wgrad", "impl": impl, "shape_mkn": [m, k, n], "timing": how}
        if isinstance(fn, str):
            rows.append({**row, "skipped": fn})
            print(f"{impl:48s} {m}x{k}->{n}: skipped ({fn})")
            continue
        timer = time_cuda_graph if how == "cuda_graph" else time_cuda
        start = time.perf_counter()
        try:
            t = timer(fn, **timing)
        except Exception as err:  # noqa: BLE001 - a contender that cannot run here is recorded
            rows.append({**row, "error": f"{type(err).__name__}: {err}"})
            print(f"{impl:48s} {m}x{k}->{n} {how}: {type(err).__name__}: {err}")
            continue
        tflops = flops / (t["median_ms"] * 1e-3) / 1e12
        rows.append({**row, **t, "tflops": tflops})  # of the three GEMMs, 6 M N K
        print(
            f"{impl:48s} {m}x{k}->{n} {how:10s}: {t['median_ms']:8.3f} ms {tflops:7.1f} "
            f"TFLOP/s  ({time.perf_counter() - start:.0f} s with compilation)"
        )
    for name, r in RECIPES.items():
        errors = _errors(layer, base, x, grad_out, r)
        rows.append(
            {
                "op": "check_vs_nn_linear_bf16",
                "impl": f"te.Linear {name}",
                "shape_mkn": [m, k, n],
                **errors,
            }
        )
        print(f"te.Linear {name} vs bf16: {errors}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="linear")
    parser.add_argument("--quick", action="store_true", help="fewer timed repeats")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="only the host overhead and memory rows (write them under another --name)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile contenders (their compilation dominates)",
    )
    parser.add_argument("--seed-shape-only", action="store_true",
                        help="only the seed's shape (2048 tokens 768 -> 3072)")
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    for m, k, n in SHAPES[1:] if args.seed_shape_only else SHAPES:
        rows += host_and_memory(m, k, n)
        if not args.host_only:
            rows += bench_shape(m, k, n, args.quick, not args.no_compile)
    print(f"all contenders in {time.perf_counter() - start:.0f} s")
    write_result(
        args.name,
        {
            "description": "one linear layer's training step (forward + dgrad + wgrad), bf16 "
            "activations: te.Linear per FP8 recipe (launches and CUDA graph replay) "
            "beside nn.Linear bf16 (eager, torch.compile), torchao Float8Linear "
            "tensorwise (torch.compile) and the three torch._scaled_mm GEMMs alone",
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
