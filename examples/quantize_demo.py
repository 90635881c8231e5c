"""FP8 round trip: quantize a tensor with each scaling mode and format, dequantize it, and
print the error. Runs on the CPU (the core's reference path) by default and on a CUDA GPU
when one is present (pass --device cpu to force the CPU).

    python examples/quantize_demo.py [--device auto|cpu|cuda] [--rows 1024] [--cols 1024]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from transformer_engine.common import core
from transformer_engine.common.recipe import Format

FORMATS = {
    "E4M3": (Format.E4M3.max_fwd, "float8_e4m3"),
    "E5M2": (Format.E5M2.max_fwd, "float8_e5m2"),
}
MODES = ["tensor", "block_1x128", "block_128x128", "mxfp8"]


def pick_device(requested: str):
    """Returns (device name, torch module or None)."""
    if requested == "cpu":
        return "cpu", None
    try:
        import torch
    except ImportError:
        torch = None
    has_cuda = torch is not None and torch.cuda.is_available() and core().built_with_cuda()
    if requested == "cuda" and not has_cuda:
        raise SystemExit(
            "quantize_demo: --device cuda needs torch with CUDA and a core built with CUDA"
        )
    return ("cuda", torch) if has_cuda else ("cpu", None)


def scale_inv_shape(mode: str, m: int, k: int):
    return {
        "tensor": (1,),
        "block_1x128": (m, -(-k // 128)),
        "block_128x128": (-(-m // 128), -(-k // 128)),
        "mxfp8": (m, -(-k // 32)),
    }[mode]


def round_trip(x: np.ndarray, mode: str, fmt: str, device: str, torch) -> tuple[np.ndarray, float]:
    """Quantizes and dequantizes x; returns the result and the seconds the two ops took."""
    _core = core()
    fp8_max, dtype_name = FORMATS[fmt]
    m, k = x.shape
    sinv_dtype = np.uint8 if mode == "mxfp8" else np.float32

    def array(shape, dtype, fill=0):
        a = np.full(shape, fill, dtype=dtype)
        return torch.from_numpy(a).cuda() if device == "cuda" else a

    src = torch.from_numpy(x).cuda() if device == "cuda" else x
    q = array((m, k), np.uint8)
    scale_inv = array(scale_inv_shape(mode, m, k), sinv_dtype)
    fields = dict(
        dtype=getattr(_core.DType, dtype_name),
        scaling_mode=getattr(_core.ScalingMode, mode),
        scale_inv=scale_inv,
    )
    if mode == "tensor":
        amax = float(np.abs(x).max())
        fields["scale"] = array((1,), np.float32, fp8_max / amax)  # current scaling, by hand
    fp8 = _core.Tensor(q, **fields)
    out = array((m, k), np.float32)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    start = time.perf_counter()
    _core.quantize(src, fp8, stream=stream)
    _core.dequantize(fp8, out, stream=stream)
    if device == "cuda":
        torch.cuda.synchronize()
        out = out.cpu().numpy()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    args = parser.parse_args()
    device, torch = pick_device(args.device)
    rng = np.random.default_rng(0)
    # Activations with outliers: most values near 1, a few large, where block scaling helps.
    x = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    x[rng.random(x.shape) < 1e-3] *= 300.0
    print(
        f"FP8 round trip of a {args.rows}x{args.cols} float32 tensor on {device} "
        f"(core {core().__version__}, CUDA kernels: {core().built_with_cuda()})"
    )
    print(
        f"{'format':6s} {'scaling':14s} {'rel. RMS error':>15s} {'max abs error':>14s} {'time':>9s}"
    )
    for fmt in FORMATS:
        for mode in MODES:
            y, seconds = round_trip(x, mode, fmt, device, torch)
            rel_rms = float(np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x**2)))
            print(
                f"{fmt:6s} {mode:14s} {rel_rms:15.5f} {float(np.abs(y - x).max()):14.4f} "
                f"{seconds * 1e3:7.2f}ms"
            )


if __name__ == "__main__":
    main()
