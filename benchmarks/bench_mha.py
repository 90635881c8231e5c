"""The attention block, te.MultiheadAttention (QKV projection, causal attention, output
projection), forward + backward and forward alone: bf16; FP8 GEMMs with bf16 attention; FP8
attention too (fp8_dpa: q, k, v cast to FP8 and o widened inside attention); FP8 between the
steps (fp8_mha: the QKV GEMM writes FP8, the projection reads FP8 o); all under DelayedScaling,
beside the same block from torch ops in bf16 (nn.Linear, SDPA on cuDNN, nn.Linear).

    python benchmarks/bench_mha.py           # GPU: writes benchmarks/results/mha.json
    python benchmarks/bench_mha.py --smoke   # tiny CPU run of every path; writes nothing
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from harness import time_host

# (batch, heads_q, heads_kv, seqlen, head_dim): the attention benchmark's shapes; hidden =
# heads_q * head_dim.
SHAPES = [(4, 32, 32, 4096, 128), (2, 16, 16, 8192, 128), (2, 32, 8, 8192, 128)]
SMOKE_SHAPES = [(2, 4, 2, 32, 16)]


class TorchBlock(torch.nn.Module):
    """The same block from torch ops: one QKV linear, SDPA, the output linear."""

    def __init__(self, hidden: int, hq: int, hk: int, d: int, device, dtype):
        super().__init__()
        self.hq, self.hk, self.d = hq, hk, d
        self.qkv = torch.nn.Linear(hidden, (hq + 2 * hk) * d, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(hq * d, hidden, device=device, dtype=dtype)

    def forward(self, x):  # x [s, b, hidden]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).split([self.hq * self.d, self.hk * self.d, self.hk * self.d], -1)
        q, k, v = (t.reshape(s, b, -1, self.d).permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hq != self.hk)
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, self.hq * self.d))


def cases(shape, device: str) -> dict:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    b, hq, hk, s, d = shape
    hidden = hq * d
    dtype = torch.bfloat16
    x = torch.randn(s, b, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(s, b, hidden, device=device, dtype=dtype)
    mha = te.MultiheadAttention(hidden, hq, num_gqa_groups=hk, attention_dropout=0.0,
                                params_dtype=dtype, device=device)
    block = TorchBlock(hidden, hq, hk, d, device, dtype)
    recipes = {"bf16": None, "fp8_gemms": recipe.DelayedScaling(),
               "fp8_dpa": recipe.DelayedScaling(fp8_dpa=True),
               "fp8_mha": recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)}

    def step(r):
        def run(i):
            with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
                y = mha(x)
            y.backward(grad)
        return run

    def forward(r):
        def run(i):
            with torch.no_grad(), te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
                mha(x)
        return run

    def torch_step(i):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if device == "cuda"
                         else SDPBackend.MATH):
            block(x).backward(grad)

    out = {}
    for name, r in recipes.items():
        out[("fwd_bwd", f"te.MultiheadAttention {name}")] = step(r)
        out[("fwd", f"te.MultiheadAttention {name}")] = forward(r)
    out[("fwd_bwd", "torch block bf16 (nn.Linear, SDPA cuDNN)")] = torch_step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="mha")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no JSON")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        medians = {}
        fns = cases(shape, device)
        if device == "cuda":  # in interleaved rounds: see harness.time_cuda_interleaved
            from harness import time_cuda_interleaved

            timed = time_cuda_interleaved(fns, batch=3, repeats=7, warmup=2)
        else:
            timed = {key: time_host(fn, repeats=3) for key, fn in fns.items()}
        for (op, impl), t in timed.items():
            medians[(op, impl)] = t["median_ms"]
            rows.append({"op": op, "impl": impl, "shape": list(shape), "mask": "causal", **t})
            print(f"{impl:44s} {op:8s} {shape}: {t['median_ms']:.3f} ms")
        for op in ("fwd_bwd", "fwd"):
            bf16 = medians[(op, "te.MultiheadAttention bf16")]
            for name in ("fp8_gemms", "fp8_dpa", "fp8_mha"):
                speedup = bf16 / medians[(op, f"te.MultiheadAttention {name}")]
                rows.append({"op": f"{op}_speedup_vs_bf16", "impl": name, "shape": list(shape),
                             "speedup": speedup})
                print(f"  {op} {name} vs bf16: {speedup:.2f}x")
    if args.smoke:
        return
    from harness import write_result

    write_result(args.name, {
        "description": "te.MultiheadAttention (QKV linear, causal attention, output linear; "
                       "sbhd, hidden = heads_q * head_dim) forward + backward and forward: bf16 "
                       "vs DelayedScaling (FP8 GEMMs), + fp8_dpa, + fp8_mha; and the same block "
                       "from torch ops in bf16. shape = (batch, heads_q, heads_kv, seqlen, "
                       "head_dim)",
        "results": rows,
    })


if __name__ == "__main__":
    main()
