"""Fused activations through the core (GELU and SwiGLU, forward with FP8 output + transpose,
backward with dbias + FP8 cast + transpose), side by side with the same work in torch eager and
under torch.compile.

Effective bandwidth counts the bytes a fused kernel must move, per element of the activation
output [M, N] (bf16 in, E4M3/E5M2 out, both the row-wise and the transposed copy):
    gelu forward     2 (x) + 1 + 1                      = 4 B
    swiglu forward   4 (a, b) + 1 + 1                   = 6 B
    gelu backward    2 (grad_output) + 2 (x) + 1 + 1    = 6 B   (+ dbias, negligible)
    swiglu backward  2 (grad_output) + 4 (a, b) + 2 + 2 = 10 B  (grad_input is [M, 2N])

The bf16 layers' path (bf16 in, bf16 out, no FP8: `ops.activation_forward` and
`ops.activation_backward`, as te.TransformerLayer's bf16 node calls them) is timed too, against
torch's F.gelu and aten.gelu_backward, eager and compiled, at the same shape:
    gelu forward bf16   2 (x) + 2                       = 4 B
    gelu backward bf16  2 (grad_output) + 2 (x) + 2     = 6 B

    python benchmarks/bench_activation.py          # writes benchmarks/results/activation.json
    python benchmarks/bench_activation.py --only-bf16 --name activation_bf16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from harness import H200_COPY_TBPS, measure_copy_tbps, time_cuda, time_cuda_graph, write_result
from transformer_engine.common import core

M = N = 16384
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
BYTES_PER_ELEMENT = {
    ("gelu", "forward"): 4,
    ("swiglu", "forward"): 6,
    ("gelu", "backward"): 6,
    ("swiglu", "backward"): 10,
}
TIMING = {"batch": 5, "repeats": 10, "warmup": 2}


def _cast_transpose(y: torch.Tensor, scale: torch.Tensor, fmax: float, dtype):
    amax = y.abs().amax().float()
    q = (y.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous(), amax


def torch_gelu_fwd(x, scale):
    return _cast_transpose(F.gelu(x, approximate="tanh"), scale, E4M3_MAX, torch.float8_e4m3fn)


def torch_swiglu_fwd(x, scale):
    a, b = x.chunk(2, dim=-1)
    return _cast_transpose(F.silu(a) * b, scale, E4M3_MAX, torch.float8_e4m3fn)


def torch_gelu_bwd(g, x, scale):
    grad = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    q, qt, amax = _cast_transpose(grad, scale, E5M2_MAX, torch.float8_e5m2)
    return q, qt, amax, grad.float().sum(0)


def torch_swiglu_bwd(g, x, scale):
    a, b = x.chunk(2, dim=-1)
    grad = torch.cat([torch.ops.aten.silu_backward(g * b, a), g * F.silu(a)], dim=-1)
    q, qt, amax = _cast_transpose(grad, scale, E5M2_MAX, torch.float8_e5m2)
    return q, qt, amax, grad.float().sum(0)


TORCH = {
    ("gelu", "forward"): torch_gelu_fwd,
    ("swiglu", "forward"): torch_swiglu_fwd,
    ("gelu", "backward"): torch_gelu_bwd,
    ("swiglu", "backward"): torch_swiglu_bwd,
}


def _stream() -> int:  # read at call time: CUDA graph capture runs on a side stream
    return torch.cuda.current_stream().cuda_stream


def timed_rows(cases: dict, base: dict, nbytes: int, timers) -> list[dict]:
    """One row per implementation of ``cases`` and timer of ``timers`` ((name, harness timer)
    pairs): ``base`` with the timing, its effective bandwidth over ``nbytes``, or the error a
    path raised (a benchmark records what it saw)."""
    rows = []
    for impl, fn in cases.items():
        for timing, timer in timers:
            row = {**base, "impl": impl, "timing": timing, "bytes_moved": nbytes}
            try:
                t = timer(fn, **TIMING)
            except Exception as e:  # noqa: BLE001 - a benchmark records what it saw
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{row['op']:20s} {impl:20s} {timing:10s}: {row['error']}")
                rows.append(row)
                continue
            tbps = nbytes / (t["median_ms"] * 1e-3) / 1e12
            row.update(t, effective_tbps=tbps, percent_of_h200_copy=100 * tbps / H200_COPY_TBPS)
            rows.append(row)
            print(f"{row['op']:20s} {impl:20s} {timing:10s}: {t['median_ms']:.4f} ms "
                  f"{tbps:.2f} TB/s")
    return rows


def bench(act: str, direction: str, compiled) -> list[dict]:
    _core = core()
    gated = act == "swiglu"
    k = 2 * N if gated else N
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if direction == "backward" else None
    out_cols = k if direction == "backward" else N
    fp8 = _core.DType.float8_e4m3 if direction == "forward" else _core.DType.float8_e5m2
    scale = torch.tensor([2.0], device="cuda")
    q = torch.empty(M, out_cols, dtype=torch.uint8, device="cuda")
    qt = torch.empty(out_cols, M, dtype=torch.uint8, device="cuda")
    amax = torch.empty(1, device="cuda")
    scale_inv = torch.empty(1, device="cuda")
    dbias = torch.empty(out_cols, device="cuda")
    out = _core.Tensor(
        q, dtype=fp8, scale=scale, scale_inv=scale_inv, amax=amax, columnwise_data=qt
    )
    which = getattr(_core.Activation, act)
    if direction == "forward":

        def ours(i):
            _core.activation_forward(which, x, out, stream=_stream())

        args = (x, scale)
    else:

        def ours(i):
            _core.activation_backward(which, g, x, out, dbias=dbias, stream=_stream())

        args = (g, x, scale)
    cases = {
        "transformer_engine": ours,
        "torch_eager": lambda i: TORCH[act, direction](*args),
        "torch_compile": lambda i: compiled[act, direction](*args),
    }
    out_dtype = "float8_e4m3" if direction == "forward" else "float8_e5m2"
    rows = timed_rows(cases, {"op": f"{act}_{direction}", "shape": [M, k],
                              "input_dtype": "bfloat16", "output_dtype": out_dtype},
                      BYTES_PER_ELEMENT[act, direction] * M * N,
                      (("launches", time_cuda), ("cuda_graph", time_cuda_graph)))
    # How close torch's bytes are to ours (torch rounds its activation to bf16 before the cast,
    # the core casts the fp32 value, so a few bytes differ by one code).
    ours(0)
    ref = TORCH[act, direction](*args)
    torch.cuda.synchronize()
    rows.append(
        {
            "op": f"{act}_{direction}",
            "impl": "check",
            "rowwise_bytes_equal_to_torch": float((q == ref[0].view(torch.uint8)).float().mean()),
            "columnwise_bytes_equal_to_torch": float(
                (qt == ref[1].view(torch.uint8)).float().mean()
            ),
            "amax_relative_difference": float((amax - ref[2]).abs() / ref[2]),
        }
    )
    if direction == "backward":
        rel = ((dbias - ref[3]).abs().max() / ref[3].abs().max()).item()
        rows[-1]["dbias_max_difference_relative_to_max"] = rel
    return rows


def torch_gelu_fwd_bf16(x):
    return F.gelu(x, approximate="tanh")


def torch_gelu_bwd_bf16(g, x):
    return torch.ops.aten.gelu_backward(g, x, approximate="tanh")


def bench_bf16(direction: str) -> list[dict]:
    """GELU with a bf16 output, ours (the torch package's ops) beside torch's, and whether the
    two give the same bits."""
    from transformer_engine.pytorch import ops

    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    if direction == "forward":
        args, peer = (x,), torch_gelu_fwd_bf16
        ours = lambda i: ops.activation_forward(x, "gelu")  # noqa: E731
    else:
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        args, peer = (g, x), torch_gelu_bwd_bf16
        ours = lambda i: ops.activation_backward(g, x, "gelu", False)[0]  # noqa: E731
    compiled = torch.compile(peer)
    cases = {"transformer_engine": ours, "torch_eager": lambda i: peer(*args),
             "torch_compile": lambda i: compiled(*args)}
    rows = timed_rows(cases, {"op": f"gelu_{direction}_bf16", "shape": [M, N],
                              "input_dtype": "bfloat16", "output_dtype": "bfloat16"},
                      (4 if direction == "forward" else 6) * M * N, (("launches", time_cuda),))
    same = (ours(0) == peer(*args)).float().mean().item()
    rows.append({"op": f"gelu_{direction}_bf16", "impl": "check", "equal_to_torch": same})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="activation")
    parser.add_argument("--only-bf16", action="store_true",
                        help="only the bf16-output GELU against torch's")
    args = parser.parse_args()
    copy_tbps = measure_copy_tbps()
    print(f"device copy: {copy_tbps:.2f} TB/s")
    rows = []
    if not args.only_bf16:
        compiled = {key: torch.compile(fn) for key, fn in TORCH.items()}
        for direction in ("forward", "backward"):
            for act in ("gelu", "swiglu"):
                rows += bench(act, direction, compiled)
                torch.cuda.empty_cache()  # the previous case's tensors are gone
    for direction in ("forward", "backward"):
        rows += bench_bf16(direction)
        torch.cuda.empty_cache()
    write_result(
        args.name,
        {
            "description": "Fused GELU / SwiGLU: forward to FP8 E4M3 + transpose + amax, backward "
            "with dbias + FP8 E5M2 cast + transpose, bf16 16384x16384 (gated input 16384x32768); "
            "and GELU bf16 in, bf16 out, forward and backward, against torch's",
            "h200_copy_tbps_baseline": H200_COPY_TBPS,
            "measured_copy_tbps": copy_tbps,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
