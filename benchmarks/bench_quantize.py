"""Fused FP8 quantize (+amax) and quantize+transpose through the core, side by side with
the same cast in torch eager and under torch.compile.

Effective bandwidth counts the bytes a fused kernel must move: the bf16 input read (2 B per
element) plus the FP8 output written (1 B, and 1 B more for the transposed copy).

    python benchmarks/bench_quantize.py            # writes benchmarks/results/quantize.json
"""

from __future__ import annotations

import argparse

import torch

from harness import (
    H200_COPY_TBPS,
    measure_copy_tbps,
    rotating,
    time_cuda,
    time_cuda_graph,
    write_result,
)
from transformer_engine.common import core

SHAPES = [(8192, 8192), (16384, 4096)]
E4M3_MAX = 448.0


def torch_cast(x: torch.Tensor, scale: torch.Tensor):
    amax = x.abs().amax().float()
    q = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, amax


def torch_cast_transpose(x: torch.Tensor, scale: torch.Tensor):
    q, amax = torch_cast(x, scale)
    return q, q.t().contiguous(), amax


def bench_shape(m: int, k: int, compiled: dict) -> list[dict]:
    _core = core()

    def stream() -> int:  # read at call time: CUDA graph capture runs on a side stream
        return torch.cuda.current_stream().cuda_stream

    scale = torch.tensor([3.0], device="cuda")

    def make():
        return (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),)

    inputs = [s[0] for s in rotating(make)]
    n = len(inputs)
    q = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    qt = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    scale_inv = torch.empty(1, device="cuda")
    amax = torch.empty(1, device="cuda")
    rowwise = _core.Tensor(
        q, dtype=_core.DType.float8_e4m3, scale=scale, scale_inv=scale_inv, amax=amax
    )
    both = _core.Tensor(
        q,
        dtype=_core.DType.float8_e4m3,
        scale=scale,
        scale_inv=scale_inv,
        amax=amax,
        columnwise_data=qt,
    )

    cases = {
        ("quantize", "transformer_engine"): lambda i: _core.quantize(
            inputs[i % n], rowwise, stream=stream()
        ),
        ("quantize", "torch_eager"): lambda i: torch_cast(inputs[i % n], scale),
        ("quantize", "torch_compile"): lambda i: compiled["cast"](inputs[i % n], scale),
        ("quantize_transpose", "transformer_engine"): lambda i: _core.quantize(
            inputs[i % n], both, stream=stream()
        ),
        ("quantize_transpose", "torch_eager"): lambda i: torch_cast_transpose(inputs[i % n], scale),
        ("quantize_transpose", "torch_compile"): lambda i: compiled["cast_transpose"](
            inputs[i % n], scale
        ),
    }
    rows = []
    for (op, impl), fn in cases.items():
        for timing, timer in (("launches", time_cuda), ("cuda_graph", time_cuda_graph)):
            t = timer(fn)
            nbytes = m * k * (2 + 1 + (1 if op == "quantize_transpose" else 0))
            tbps = nbytes / (t["median_ms"] * 1e-3) / 1e12
            rows.append(
                {
                    "op": op,
                    "impl": impl,
                    "timing": timing,
                    "shape": [m, k],
                    "input_dtype": "bfloat16",
                    "output_dtype": "float8_e4m3",
                    "bytes_moved": nbytes,
                    **t,
                    "effective_tbps": tbps,
                    "percent_of_h200_copy": 100 * tbps / H200_COPY_TBPS,
                }
            )
            print(
                f"{op:20s} {impl:20s} {m}x{k} {timing:10s}: {t['median_ms']:.4f} ms {tbps:.2f} TB/s"
            )
    # The core's bits must equal torch's cast, else the comparison is meaningless.
    _core.quantize(inputs[0], both, stream=stream())
    ref_q, ref_qt, ref_amax = torch_cast_transpose(inputs[0], scale)
    torch.cuda.synchronize()
    rows.append(
        {
            "op": "check",
            "shape": [m, k],
            "rowwise_equal_to_torch": bool(torch.equal(q, ref_q.view(torch.uint8))),
            "columnwise_equal_to_torch": bool(torch.equal(qt, ref_qt.view(torch.uint8))),
            "amax_equal_to_torch": bool(torch.equal(amax, ref_amax.reshape(1))),
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="quantize")
    args = parser.parse_args()
    compiled = {
        "cast": torch.compile(torch_cast),
        "cast_transpose": torch.compile(torch_cast_transpose),
    }
    copy_tbps = measure_copy_tbps()
    print(f"device copy: {copy_tbps:.2f} TB/s")
    rows = []
    for m, k in SHAPES:
        rows += bench_shape(m, k, compiled)
    write_result(
        args.name,
        {
            "description": "FP8 E4M3 quantize (+amax) and quantize+transpose of bf16, "
            "per-tensor scale",
            "target_tbps": 3.6,
            "h200_copy_tbps_baseline": H200_COPY_TBPS,
            "measured_copy_tbps": copy_tbps,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
