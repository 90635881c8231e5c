"""The core's GEMM (cuBLASLt) side by side with torch's at the shapes of BASELINES.md.

Contenders, each D[M, N] = A[M, K] @ B[N, K]^T with a bf16 output:
  - transformer_engine FP8 E4M3 per-tensor (fast accumulation, as for a forward GEMM, and
    split accumulation, as for dgrad/wgrad), and block-scaled FP8 (1x128 x 128x128);
  - our Hopper kernel for the block-scaled FP8 GEMM (CUTLASS, sm_90a: ``_core.hopper_gemm``),
    impl "hopper", when the core was built with it (``_core.hopper_gemm_available()``);
  - torch._scaled_mm (cuBLASLt itself: the ceiling of a per-tensor FP8 GEMM);
  - transformer_engine bf16 and torch bf16 (`a @ b.t()`).
Each is timed by launches (host cost overlapping, as in training) and by CUDA graph replay
(GPU time alone), the contenders of a shape in interleaved rounds (the GPU's clock drifts
with its power draw; see harness.time_cuda_interleaved). Results are checked against torch
before they are written.

    python benchmarks/bench_gemm.py       # writes benchmarks/results/gemm.json
"""

from __future__ import annotations

import argparse

import torch

from harness import time_cuda_interleaved, write_result
from transformer_engine.common import core

# BASELINES.md's shapes, and the seed example's forward GEMM (2048 tokens, 768 -> 3072).
SHAPES = [
    (8192, 8192, 8192),
    (16384, 8192, 8192),
    (4096, 4096, 4096),
    (8192, 3072, 768),
    (2048, 3072, 768),
]


def stream() -> int:
    """torch's current stream as the core takes it; the private call skips building a
    torch.cuda.Stream (microseconds per call, which a small GEMM would be charged for)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def fp8_operand(_core, x: torch.Tensor):
    """Per-tensor E4M3 of x through the core (scale = 448 / amax)."""
    scale = (448.0 / x.abs().amax().float()).reshape(1)
    data = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    t = _core.Tensor(
        data, dtype=_core.DType.float8_e4m3, scale=scale, scale_inv=torch.empty(1, device="cuda")
    )
    _core.quantize(x, t, stream=stream())
    return t


def block_operand(_core, x: torch.Tensor, mode: str):
    m, k = x.shape
    rows = m if mode == "block_1x128" else -(-m // 128)
    data = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    t = _core.Tensor(
        data,
        dtype=_core.DType.float8_e4m3,
        scaling_mode=getattr(_core.ScalingMode, mode),
        scale_inv=torch.empty(rows, -(-k // 128), device="cuda"),
    )
    _core.quantize(x, t, stream=stream())
    return t


def bench_shape(m: int, n: int, k: int, workspace: torch.Tensor) -> list[dict]:
    _core = core()
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa, qb = fp8_operand(_core, a), fp8_operand(_core, b)
    ba, bb = block_operand(_core, a, "block_1x128"), block_operand(_core, b, "block_128x128")
    a8 = qa.data.view(torch.float8_e4m3fn)
    b8 = qb.data.view(torch.float8_e4m3fn)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    # The fast forms of d and the workspace, made once, as the torch ops make them
    # (ops._backend.raw): a DLPack export per call would charge the benchmark's own host time
    # to the core at small shapes.
    from transformer_engine.pytorch.ops._backend import raw

    d_raw, ws_raw = raw(d), raw(workspace)

    def ours(x, y, split=False):
        return lambda i: _core.gemm(
            x, y, d_raw, use_split_accumulator=split, workspace=ws_raw, stream=stream()
        )

    def scaled_mm(fast):
        return lambda i: torch._scaled_mm(
            a8, b8.t(), qa.scale_inv, qb.scale_inv, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    cases = {
        ("fp8_tensor_fast_accum", "transformer_engine"): ours(qa, qb),
        ("fp8_tensor_fast_accum", "torch._scaled_mm"): scaled_mm(True),
        ("fp8_tensor_split_accum", "transformer_engine"): ours(qa, qb, split=True),
        ("fp8_tensor_split_accum", "torch._scaled_mm"): scaled_mm(False),
        ("fp8_block_1x128_128x128", "transformer_engine"): ours(ba, bb),
        ("bf16", "transformer_engine"): ours(a, b),
        ("bf16", "torch"): lambda i: torch.matmul(a, b.t()),
    }
    if _core.hopper_gemm_available():
        cases[("fp8_block_1x128_128x128", "hopper")] = lambda i: _core.hopper_gemm(
            ba, bb, d_raw, workspace=ws_raw, stream=stream()
        )
    rows = []
    flops = 2.0 * m * n * k
    for timing, graph in (("launches", False), ("cuda_graph", True)):
        times = time_cuda_interleaved(cases, graph=graph)
        for (op, impl), t in times.items():
            if "error" in t:  # a contender this device or build cannot run
                rows.append({"op": op, "impl": impl, "shape_mnk": [m, n, k], "error": t["error"]})
                print(f"{op:26s} {impl:20s} {m}x{n}x{k}: {t['error']}")
                continue
            tflops = flops / (t["median_ms"] * 1e-3) / 1e12
            rows.append(
                {
                    "op": op,
                    "impl": impl,
                    "shape_mnk": [m, n, k],
                    "timing": timing,
                    "output_dtype": "bfloat16",
                    **t,
                    "tflops": tflops,
                }
            )
            print(
                f"{op:26s} {impl:20s} {m}x{n}x{k} {timing:10s}: {t['median_ms']:.4f} ms "
                f"{tflops:7.1f} TFLOP/s"
            )
    # The comparison only counts if the results agree.
    _core.gemm(qa, qb, d, workspace=workspace, stream=stream())
    ref = scaled_mm(True)(0).float()
    ours_fp8 = d.float()
    _core.gemm(ba, bb, d, workspace=workspace, stream=stream())
    ours_block = d.float()
    exact = a.float() @ b.float().t()
    scale = exact.abs().max().item()
    hopper = {}
    if _core.hopper_gemm_available():
        try:
            _core.hopper_gemm(ba, bb, d, workspace=workspace, stream=stream())
            hopper["fp8_block_hopper_max_abs_diff_vs_cublaslt_relative"] = (
                (d.float() - ours_block).abs().max().item() / scale
            )
        except RuntimeError as err:  # not an sm_90 device: the timing rows say so too
            hopper["fp8_block_hopper_error"] = str(err)
    rows.append(
        {
            **hopper,
            "op": "check",
            "shape_mnk": [m, n, k],
            "fp8_tensor_max_abs_diff_vs_scaled_mm_relative": (ours_fp8 - ref).abs().max().item()
            / scale,
            "fp8_tensor_max_abs_err_vs_bf16_inputs_fp32_relative": (ours_fp8 - exact)
            .abs()
            .max()
            .item()
            / scale,
            "fp8_block_max_abs_err_vs_bf16_inputs_fp32_relative": (ours_block - exact)
            .abs()
            .max()
            .item()
            / scale,
        }
    )
    print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="gemm")
    args = parser.parse_args()
    _core = core()
    workspace = torch.empty(_core.gemm_workspace_size(), dtype=torch.uint8, device="cuda")
    rows = []
    for m, n, k in SHAPES:
        rows += bench_shape(m, n, k, workspace)
    write_result(
        args.name,
        {
            "description": "D = A @ B^T, bf16 output: the core's cuBLASLt GEMM (FP8 per-tensor, "
            "FP8 block-scaled, bf16) beside torch._scaled_mm and torch bf16, and our Hopper "
            "block-scaled kernel where the core has it",
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
