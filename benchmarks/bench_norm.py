"""LayerNorm / RMSNorm forward with FP8 output (and its transpose) through the core, side by
side with torch's norm + cast in eager mode and under torch.compile; the backward beside
torch's. Two widths: 8192, and 4096 (the LayerNormMLP benchmark's hidden size).

Effective bandwidth counts the bytes a fused kernel must move: the bf16 input read (2 B per
element) and the FP8 output written (1 B, and 1 B more for the transposed copy); the backward
reads x and dy and writes dx (6 B per element).

    python benchmarks/bench_norm.py         # writes benchmarks/results/norm.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from harness import H200_COPY_TBPS, measure_copy_tbps, time_cuda, time_cuda_graph, write_result
from transformer_engine.common import core

SHAPES = [(16384, 8192), (16384, 4096)]
E4M3_MAX = 448.0


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def torch_norm(norm: str, x, g, b):
    if norm == "layernorm":
        return F.layer_norm(x, x.shape[-1:], g, b, 1e-5)
    return F.rms_norm(x, x.shape[-1:], g, 1e-5)


def torch_norm_cast(norm: str, x, g, b, scale, transpose: bool):
    y = torch_norm(norm, x, g, b)
    amax = y.abs().amax().float()
    q = (y.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q, q.t().contiguous(), amax) if transpose else (q, amax)


def bench(norm: str, shape: tuple[int, int], compiled: dict) -> list[dict]:
    _core = core()
    m, n = shape
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    beta = b if norm == "layernorm" else None
    scale = torch.tensor([4.0], device="cuda")
    q = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    qt = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    mu = torch.empty(m, device="cuda") if norm == "layernorm" else None
    rsigma = torch.empty(m, device="cuda")
    kind = getattr(_core.Norm, norm)

    def ours(transpose: bool):
        out = _core.Tensor(
            q,
            dtype=_core.DType.float8_e4m3,
            scale=scale,
            scale_inv=torch.empty(1, device="cuda"),
            amax=torch.empty(1, device="cuda"),
            columnwise_data=qt if transpose else None,
        )
        return lambda i: _core.norm_forward(
            kind, x, g, beta, output_fp8=out, mu=mu, rsigma=rsigma, stream=stream()
        )

    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    dg = torch.empty_like(g)
    db = torch.empty_like(g) if norm == "layernorm" else None
    ws = torch.empty(_core.norm_backward_workspace_size(m, n), dtype=torch.uint8, device="cuda")
    ours(False)(0)

    def ours_backward(i):
        _core.norm_backward(
            kind,
            dy,
            x,
            mu,
            rsigma,
            g,
            grad_input=dx,
            grad_gamma=dg,
            grad_beta=db,
            workspace=ws,
            stream=stream(),
        )

    xg = x.detach().requires_grad_()
    gg = g.detach().requires_grad_()
    bg = b.detach().requires_grad_() if norm == "layernorm" else None
    y_torch = torch_norm(norm, xg, gg, bg)

    def torch_backward(i):
        torch.autograd.grad(
            y_torch, [xg, gg] + ([bg] if bg is not None else []), dy, retain_graph=True
        )

    cases = {
        ("forward_fp8", "transformer_engine"): (ours(False), 3),
        ("forward_fp8", "torch_eager"): (
            lambda i: torch_norm_cast(norm, x, g, beta, scale, False),
            3,
        ),
        ("forward_fp8", "torch_compile"): (
            lambda i: compiled[(norm, False)](norm, x, g, beta, scale, False),
            3,
        ),
        ("forward_fp8_transpose", "transformer_engine"): (ours(True), 4),
        ("forward_fp8_transpose", "torch_eager"): (
            lambda i: torch_norm_cast(norm, x, g, beta, scale, True),
            4,
        ),
        ("forward_fp8_transpose", "torch_compile"): (
            lambda i: compiled[(norm, True)](norm, x, g, beta, scale, True),
            4,
        ),
        ("backward", "transformer_engine"): (ours_backward, 6),
        ("backward", "torch_eager"): (torch_backward, 6),
    }
    rows = []
    for (op, impl), (fn, bytes_per_element) in cases.items():
        timers = [("launches", time_cuda)]
        if impl != "torch_eager" or op != "backward":
            timers.append(("cuda_graph", time_cuda_graph))
        for timing, timer in timers:
            t = timer(fn)
            nbytes = m * n * bytes_per_element
            tbps = nbytes / (t["median_ms"] * 1e-3) / 1e12
            rows.append(
                {
                    "op": f"{norm}_{op}",
                    "impl": impl,
                    "timing": timing,
                    "shape": [m, n],
                    "input_dtype": "bfloat16",
                    "bytes_moved": nbytes,
                    **t,
                    "effective_tbps": tbps,
                    "percent_of_h200_copy": 100 * tbps / H200_COPY_TBPS,
                }
            )
            print(
                f"{norm:9s} {m}x{n} {op:22s} {impl:20s} {timing:10s}: {t['median_ms']:.4f} ms "
                f"{tbps:.2f} TB/s"
            )
    # The comparison counts only if the results agree with torch's.
    ours(True)(0)
    ref_q, ref_qt, _ = torch_norm_cast(norm, x, g, beta, scale, True)
    torch.cuda.synchronize()
    diff = (q.view(torch.float8_e4m3fn).float() - ref_q.float()).abs()
    rows.append(
        {
            "op": f"{norm}_check",
            "shape": [m, n],
            "fp8_bytes_equal_to_torch_fraction": (q == ref_q.view(torch.uint8))
            .float()
            .mean()
            .item(),
            "fp8_max_abs_diff_vs_torch": diff.max().item(),
            "transpose_is_transpose": bool(torch.equal(qt, q.t().contiguous())),
        }
    )
    print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="norm")
    args = parser.parse_args()
    compiled = {
        key: torch.compile(torch_norm_cast)
        for key in [(nm, t) for nm in ("layernorm", "rmsnorm") for t in (False, True)]
    }
    copy_tbps = measure_copy_tbps()
    rows = []
    for shape in SHAPES:
        for norm in ("layernorm", "rmsnorm"):
            rows += bench(norm, shape, compiled)
    write_result(
        args.name,
        {
            "description": "LayerNorm / RMSNorm of 16384x8192 and 16384x4096 bf16 with FP8 "
            "E4M3 output (+ transpose) and the backward, vs torch eager and torch.compile",
            "target_tbps": 3.4,
            "h200_copy_tbps_baseline": H200_COPY_TBPS,
            "measured_copy_tbps": copy_tbps,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
