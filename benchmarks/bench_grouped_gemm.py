"""The experts' GEMMs of a mixture-of-experts layer: the core's grouped GEMM against a loop of
per-expert GEMMs and against one GEMM of the same total size, and te.GroupedLinear's step
against a loop of te.Linear layers.

Shapes (DeepSeek-V3-like): hidden 7168, expert FFN 2048 (FC1 gated: N = 4096), 8192 tokens
routed top-8 (65536 rows) over 8 or 64 experts, the rows per expert drawn from a multinomial
(seed 0) and rounded to multiples of 16 (as Fp8Padding pads them). Contenders, D = A @ B^T with
a bf16 output, FP8 E4M3 per tensor (each expert its own scales) and bf16:

  - ``grouped``: one ``te_grouped_gemm`` call over the experts (``_core.grouped_gemm``);
  - ``loop``: one ``te_gemm`` call per expert;
  - ``single``: one ``te_gemm`` of all rows against one expert's weight (the same FLOPs in one
    GEMM: the ceiling a grouped kernel aims at);
  - ``hopper``: our Hopper grouped kernel, every expert in one launch
    (``_core.hopper_grouped_gemm``; CUTLASS, sm_90a), when the core was built with it
    (``_core.hopper_gemm_available()``). It promotes its FP8 partial sums to fp32 every 128 of
    K whatever use_split_accumulator says, where ``grouped`` and ``loop`` run cuBLASLt's fast
    accumulation.

Each is timed by launches and by CUDA-graph replay, interleaved (harness.time_cuda_interleaved).
Targets (the issue's): grouped >= 1.3x loop and >= 0.9x single. Then the module step, FP8
current and delayed scaling, forward and backward of te.GroupedLinear(64 experts) against 64
te.Linear.

    python benchmarks/bench_grouped_gemm.py            # writes results/grouped_gemm.json
    python benchmarks/bench_grouped_gemm.py --smoke    # tiny shapes on the CPU, nothing written
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from transformer_engine.common import core

HIDDEN, FFN, TOKENS, TOP_K = 7168, 2048, 8192, 8
GEMMS = {"fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}  # K, N


def expert_rows(total: int, experts: int, granule: int = 16, seed: int = 0) -> list[int]:
    """Rows per expert: a multinomial draw of ``total`` rows, each rounded up to ``granule``."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(total, np.full(experts, 1.0 / experts))
    return [int(-(-c // granule) * granule) for c in counts]


def _stream(device) -> int:
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def fp8_operand(_core, x: torch.Tensor, device):
    """Per-tensor E4M3 of x through the core (scale = 448 / amax): a Tensor handle."""
    scale = (448.0 / x.abs().amax().float().clamp_min(1e-12)).reshape(1)
    data = torch.empty(x.shape, dtype=torch.uint8, device=device)
    t = _core.Tensor(data, dtype=_core.DType.float8_e4m3, scale=scale,
                     scale_inv=torch.empty(1, device=device))
    _core.quantize(x, t, stream=_stream(device))
    return t


def gemm_cases(rows: list[int], k: int, n: int, device, workspace) -> tuple[dict, dict]:
    """The contenders of one GEMM shape, as {(op, impl): fn(i)}, and the FLOPs of each op."""
    _core = core()
    total = sum(rows)
    a = torch.randn(total, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(len(rows), n, k, device=device, dtype=torch.bfloat16) * 0.02
    a_parts = list(torch.split(a, rows))
    a8 = [fp8_operand(_core, x, device) for x in a_parts]
    w8 = [fp8_operand(_core, w[g], device) for g in range(len(rows))]
    a_all8 = fp8_operand(_core, a, device)
    d = torch.empty(total, n, device=device, dtype=torch.bfloat16)
    d_parts = list(torch.split(d, rows))
    ws = workspace

    def s() -> int:  # at call time: a CUDA graph is captured on a stream of its own
        return _stream(device)

    def loop(xs, ws_):
        return lambda i: [_core.gemm(x, y, o, workspace=ws, stream=s())
                          for x, y, o in zip(xs, ws_, d_parts, strict=True)]

    def grouped(xs, ws_):
        return lambda i: _core.grouped_gemm(xs, ws_, d_parts, workspace=ws, stream=s())

    def hopper(xs, ws_):
        return lambda i: _core.hopper_grouped_gemm(xs, ws_, d_parts, workspace=ws, stream=s())

    cases = {
        ("fp8_tensor", "grouped"): grouped(a8, w8),
        ("fp8_tensor", "loop"): loop(a8, w8),
        ("fp8_tensor", "single"): lambda i: _core.gemm(a_all8, w8[0], d, workspace=ws, stream=s()),
        ("bf16", "grouped"): grouped(a_parts, list(w)),
        ("bf16", "loop"): loop(a_parts, list(w)),
        ("bf16", "single"): lambda i: _core.gemm(a, w[0], d, workspace=ws, stream=s()),
    }
    info = {"check": (a_parts, w, d_parts, grouped(a_parts, list(w)))}
    if _core.hopper_gemm_available() and device.type == "cuda":  # the kernel has no CPU path
        # Its workspace (TMA descriptors and the groups' argument arrays) is checked, not
        # assumed, to fit in the gemm workspace that every contender shares.
        need = _core.hopper_grouped_gemm_workspace_size(len(rows))
        if ws is None or ws.numel() < need:
            raise ValueError(f"hopper_grouped_gemm needs {need} bytes of workspace for "
                             f"{len(rows)} groups, got {0 if ws is None else ws.numel()}")
        cases[("fp8_tensor", "hopper")] = hopper(a8, w8)
        cases[("bf16", "hopper")] = hopper(a_parts, list(w))
        info["check_hopper"] = (a_parts, w, d_parts, hopper(a_parts, list(w)))
    info["flops"] = 2.0 * total * n * k
    return cases, info


def check_grouped(check) -> float:
    """max |grouped bf16 - torch per expert| / max |torch|."""
    a_parts, w, d_parts, run = check
    run(0)
    want = torch.cat([x.float() @ w[g].float().t() for g, x in enumerate(a_parts)])
    got = torch.cat(d_parts).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def module_cases(rows: list[int], device) -> dict:
    """te.GroupedLinear (FC1 of the experts) forward + backward under FP8 current and delayed
    scaling (delayed: every expert's cast of one role in one core call), against the same
    experts as separate te.Linear layers."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    k, n = GEMMS["fc1"]
    experts = len(rows)
    x = torch.randn(sum(rows), k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(sum(rows), n, device=device, dtype=torch.bfloat16)
    cases = {}
    for name, r in (("current", recipe.Float8CurrentScaling()),
                    ("delayed", recipe.DelayedScaling())):
        grouped = te.GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16,
                                   device=device)
        singles = [te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
                   for _ in range(experts)]

        def grouped_step(i, grouped=grouped, r=r):
            with te.fp8_autocast(fp8_recipe=r):
                y = grouped(x, rows)
            y.backward(g)

        def loop_step(i, singles=singles, r=r):
            with te.fp8_autocast(fp8_recipe=r):
                y = torch.cat([m(p) for m, p in zip(singles, torch.split(x, rows), strict=True)])
            y.backward(g)

        cases[(f"module_fc1_fp8_{name}", "te.GroupedLinear")] = grouped_step
        cases[(f"module_fc1_fp8_{name}", "te.Linear loop")] = loop_step
    return cases


def smoke() -> None:
    """Every contender once at tiny shapes on the CPU (the core's CPU path): the script runs."""
    global HIDDEN, FFN, GEMMS
    HIDDEN, FFN = 64, 32
    GEMMS = {"fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}
    device = torch.device("cpu")
    rows = expert_rows(96, 4)
    for name, (k, n) in GEMMS.items():
        cases, info = gemm_cases(rows, k, n, device, None)
        for fn in cases.values():
            fn(0)
        err = check_grouped(info["check"])
        assert err < 1e-2, (name, err)
    for fn in module_cases(rows, device).values():
        fn(0)
    print("smoke ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="grouped_gemm")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--experts", type=int, nargs="*", default=[8, 64])
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    from harness import time_cuda_interleaved, write_result

    device = torch.device("cuda")
    workspace = torch.empty(core().gemm_workspace_size(), dtype=torch.uint8, device=device)
    results = []
    for experts in args.experts:
        rows = expert_rows(TOKENS * TOP_K, experts)
        for name, (k, n) in GEMMS.items():
            cases, info = gemm_cases(rows, k, n, device, workspace)
            err = check_grouped(info["check"])
            checks = {"grouped_bf16_max_rel_diff_vs_torch": err}
            if "check_hopper" in info:
                try:
                    checks["hopper_bf16_max_rel_diff_vs_torch"] = check_grouped(
                        info["check_hopper"])
                except RuntimeError as e:  # not an sm_90 device: its timing rows say so too
                    checks["hopper_error"] = str(e)
            for timing, graph in (("launches", False), ("cuda_graph", True)):
                times = time_cuda_interleaved(cases, graph=graph, repeats=10)
                for (op, impl), t in times.items():
                    row = {"experts": experts, "gemm": name, "op": op, "impl": impl,
                           "shape_kn": [k, n], "rows": sum(rows), "timing": timing, **t}
                    if "median_ms" in t:
                        row["tflops"] = info["flops"] / (t["median_ms"] * 1e-3) / 1e12
                    results.append(row)
                    print(experts, name, op, impl, timing, t.get("median_ms"), row.get("tflops"))
            results.append({"experts": experts, "gemm": name, "op": "check", **checks})
        if experts == 64:
            times = time_cuda_interleaved(module_cases(rows, device), repeats=5, batch=2)
            for (op, impl), t in times.items():
                results.append({"experts": experts, "op": op, "impl": impl,
                                "timing": "launches", **t})
                print(experts, op, impl, t.get("median_ms"))
    write_result(args.name, {
        "description": "MoE expert GEMMs: the core's grouped GEMM vs a loop of per-expert GEMMs "
                       "vs one GEMM of the same size (FP8 per-tensor and bf16, bf16 output), "
                       "and our Hopper grouped kernel where the core has it, "
                       "and te.GroupedLinear vs a loop of te.Linear (FP8 current and "
                       "delayed scaling)",
        "shapes": {"hidden": HIDDEN, "expert_ffn": FFN, "tokens": TOKENS, "top_k": TOP_K},
        "results": results,
    })


if __name__ == "__main__":
    main()
