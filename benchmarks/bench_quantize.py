"""Fused FP8 quantize (+amax) and quantize+transpose through the core, side by side with
the same cast in torch eager and under torch.compile; and the block-scaled casts of
Float8BlockScaling (1x128 blocks of the data and of its transpose, as activations and
gradients need; 128x128 blocks, as weights do) beside the same math under torch.compile.

Effective bandwidth counts the bytes a fused kernel must move: the bf16 input read (2 B per
element) plus the FP8 output written (1 B, and 1 B more for the transposed copy); the block
scales (4 B per 128 elements) are left out.

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


def _block_scale(amax: torch.Tensor) -> torch.Tensor:
    """E4M3_MAX / amax (1 where amax is 0), by a true division: a Python number over a tensor
    is a reciprocal and a multiply in torch, which rounds differently."""
    return torch.where(amax > 0, torch.full_like(amax, E4M3_MAX).div(amax), torch.ones_like(amax))


def torch_block_1x128(x: torch.Tensor):
    """1x128-block E4M3 of x [M, K]: data and fp32 scale_inv per block (amax epsilon 0)."""
    m, k = x.shape
    xb = x.float().view(m, k // 128, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = _block_scale(amax)
    q = (xb * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(m, k)
    return q, torch.ones_like(scale).div(scale).view(m, k // 128)


def torch_block_1x128_both(x: torch.Tensor):
    """The row-wise 1x128 cast and that of the transpose, as the core writes them in one pass."""
    return torch_block_1x128(x), torch_block_1x128(x.t().contiguous())


def torch_block_128x128_both(x: torch.Tensor):
    """128x128-block E4M3 of x and its transpose (the same blocks, transposed bytes)."""
    m, k = x.shape
    xb = x.float().view(m // 128, 128, k // 128, 128)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    scale = _block_scale(amax)
    q = (xb * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(m, k)
    return q, q.t().contiguous(), torch.ones_like(scale).div(scale).view(m // 128, k // 128)


def bench_block(m: int, k: int, compiled: dict) -> list[dict]:
    """The block casts with their transposes: the core's tiled kernel against torch.compile."""
    _core = core()
    inputs = [s[0] for s in rotating(lambda: (torch.randn(m, k, device="cuda",
                                                         dtype=torch.bfloat16),))]
    n = len(inputs)
    q = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    qt = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    outs = {}
    for mode, grid, grid_t in (("block_1x128", (m, k // 128), (k, m // 128)),
                               ("block_128x128", (m // 128, k // 128), (k // 128, m // 128))):
        outs[mode] = _core.Tensor(
            q, dtype=_core.DType.float8_e4m3, scaling_mode=getattr(_core.ScalingMode, mode),
            scale_inv=torch.empty(grid, device="cuda"), columnwise_data=qt,
            columnwise_scale_inv=torch.empty(grid_t, device="cuda"))

    def ours(mode):
        return lambda i: _core.quantize(inputs[i % n], outs[mode],
                                        stream=torch.cuda.current_stream().cuda_stream)

    cases = {
        ("quantize_block_1x128_transpose", "transformer_engine"): ours("block_1x128"),
        ("quantize_block_1x128_transpose", "torch_compile"):
            lambda i: compiled["block_1x128"](inputs[i % n]),
        ("quantize_block_128x128_transpose", "transformer_engine"): ours("block_128x128"),
        ("quantize_block_128x128_transpose", "torch_compile"):
            lambda i: compiled["block_128x128"](inputs[i % n]),
    }
    rows = []
    nbytes = m * k * (2 + 1 + 1)
    for (op, impl), fn in cases.items():
        for timing, timer in (("launches", time_cuda), ("cuda_graph", time_cuda_graph)):
            t = timer(fn)
            tbps = nbytes / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"op": op, "impl": impl, "timing": timing, "shape": [m, k],
                         "input_dtype": "bfloat16", "output_dtype": "float8_e4m3",
                         "bytes_moved": nbytes, **t, "effective_tbps": tbps,
                         "percent_of_h200_copy": 100 * tbps / H200_COPY_TBPS})
            print(f"{op:34s} {impl:20s} {m}x{k} {timing:10s}: {t['median_ms']:.4f} ms "
                  f"{tbps:.2f} TB/s")
    # The core's 1x128 bytes and scales must equal the torch math's, else the comparison is
    # meaningless.
    _core.quantize(inputs[0], outs["block_1x128"], stream=torch.cuda.current_stream().cuda_stream)
    (ref_q, ref_s), (ref_qt, _) = torch_block_1x128_both(inputs[0])
    torch.cuda.synchronize()
    rows.append({"op": "check_block_1x128", "shape": [m, k],
                 "rowwise_equal_to_torch": bool(torch.equal(q, ref_q.view(torch.uint8))),
                 "columnwise_equal_to_torch": bool(torch.equal(qt, ref_qt.view(torch.uint8))),
                 "scale_inv_equal_to_torch": bool(torch.equal(outs["block_1x128"].scale_inv,
                                                              ref_s))})
    return rows


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
        "block_1x128": torch.compile(torch_block_1x128_both),
        "block_128x128": torch.compile(torch_block_128x128_both),
    }
    copy_tbps = measure_copy_tbps()
    print(f"device copy: {copy_tbps:.2f} TB/s")
    rows = []
    for m, k in SHAPES:
        rows += bench_shape(m, k, compiled)
        rows += bench_block(m, k, compiled)
    write_result(
        args.name,
        {
            "description": "FP8 E4M3 quantize (+amax) and quantize+transpose of bf16, "
            "per-tensor scale; block-scaled (1x128, 128x128) quantize+transpose",
            "target_tbps": 3.6,
            "h200_copy_tbps_baseline": H200_COPY_TBPS,
            "measured_copy_tbps": copy_tbps,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
