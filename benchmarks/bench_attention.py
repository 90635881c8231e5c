"""Causal bf16 attention, forward + backward, through te.DotProductAttention beside torch's
scaled_dot_product_attention on its cuDNN and flash backends, and fused_attn beside
jax.nn.dot_product_attention(implementation="cudnn"); then our FP8 forward beside our bf16 one,
and the module's FP8 forward + backward (fp8_dpa, casts included) beside its bf16 one.

TFLOP/s count the two batched GEMMs of the forward, 4 * B * Hq * Sq * Skv * D, halved for the
causal mask (only the lower triangle is computed); forward + backward counts 3.5 times the
forward (the backward's five GEMMs are 2.5 forwards).

    python benchmarks/bench_attention.py           # GPU: writes benchmarks/results/attention.json
    python benchmarks/bench_attention.py --smoke   # tiny CPU run of every path; writes nothing
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from harness import time_host

# torch and jax share the GPU in this process: jax must not take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# (batch, heads_q, heads_kv, seqlen, head_dim)
SHAPES = [(4, 32, 32, 4096, 128), (2, 16, 16, 8192, 128), (2, 32, 8, 8192, 128)]
SMOKE_SHAPES = [(1, 4, 2, 64, 16)]


def flops(shape, backward: bool) -> float:
    b, hq, _, s, d = shape
    forward = 4.0 * b * hq * s * s * d / 2  # causal: half the logits
    return forward * (3.5 if backward else 1.0)


def torch_cases(shape, device: str) -> dict:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    b, hq, hk, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hk, hk))
    grad = torch.randn(b, s, hq * d, device=device, dtype=torch.bfloat16)
    attn = te.DotProductAttention(hq, d, num_gqa_groups=hk, qkv_format="bshd",
                                  attn_mask_type="causal")
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    grad_t = grad.view(b, s, hq, d).transpose(1, 2).contiguous()

    def ours(i):
        attn(q, k, v).backward(grad)

    def sdpa(backend):
        from torch.nn.attention import sdpa_kernel

        def run(i):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                               enable_gqa=hq != hk).backward(grad_t)
        return run

    def ours_forward(i):
        with torch.no_grad():
            attn(q, k, v)

    def ours_fp8_forward(i):
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            attn(q, k, v)

    fp8_dpa = recipe.DelayedScaling(fp8_dpa=True)

    def ours_fp8(i):  # the module's FP8 forward and backward (casts and widenings included)
        with te.fp8_autocast(fp8_recipe=fp8_dpa):
            out = attn(q, k, v)
        out.backward(grad)

    cases = {("fwd_bwd", "transformer_engine"): ours,
             ("fwd_bwd", "transformer_engine_fp8"): ours_fp8,
             ("fwd", "transformer_engine_bf16"): ours_forward,
             ("fwd", "transformer_engine_fp8"): ours_fp8_forward,
             ("fwd", "transformer_engine_fp8_operands"): _fp8_operands_forward(q, k, v)}
    if device == "cuda":
        from torch.nn.attention import SDPBackend

        cases[("fwd_bwd", "torch_sdpa_cudnn")] = sdpa(SDPBackend.CUDNN_ATTENTION)
        cases[("fwd_bwd", "torch_sdpa_flash")] = sdpa(SDPBackend.FLASH_ATTENTION)
    info = te.get_attention_backend(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    fp8 = te.get_attention_backend(q.detach(), k.detach(), v.detach(), qkv_format="bshd",
                                   attn_mask_type="causal", fp8=True)
    return cases, {"backend": info.name, "reasons": info.reasons, "fp8_forward_backend": fp8.name,
                   "fp8_forward_reasons": fp8.reasons}


def _fp8_operands_forward(q, k, v):
    """The FP8 forward on operands already in E4M3, o written in E4M3: the attention itself,
    as it runs when the surrounding GEMMs hand FP8 in and take FP8 out (fp8_mha), in inference
    (no softmax statistics), as the module's forward without grad runs it. The module case
    ("transformer_engine_fp8") adds the casts of bf16 q, k, v and the widening of o."""
    from transformer_engine.pytorch import ops

    quant = [ops.quantize_current(t.detach().reshape(-1, t.shape[-1]), "float8_e4m3", True,
                                  False, False, 0.0) for t in (q, k, v)]
    qf, kf, vf = (data.view(t.shape) for (data, *_), t in zip(quant, (q, k, v), strict=True))
    descales = torch.cat([scale_inv for _, _, _, scale_inv, _ in quant])
    s_scales = torch.tensor([448.0, 1 / 448.0], device=q.device)
    o_scale = quant[2][2] * 0.5
    none_i32 = torch.empty(0, dtype=torch.int32, device=q.device)
    none_i64 = torch.empty(0, dtype=torch.int64, device=q.device)
    s, d = q.shape[1], q.shape[-1]
    backend = "cudnn" if q.is_cuda else "auto"

    def run(i):
        ops.attention_forward_fp8(qf, kf, vf, descales, s_scales, none_i32, none_i32, none_i64,
                                  "bshd", "causal", -1, 0, d ** -0.5, 0.0, s, s, backend,
                                  o_scale, torch.uint8, True)

    return run


def jax_cases(shape, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from transformer_engine.jax.attention import fused_attn

    b, hq, hk, s, d = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hk, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hk, d), jnp.bfloat16)

    def step(fn):
        grad = jax.jit(jax.grad(lambda q_, k_, v_: fn(q_, k_, v_).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
        return lambda i: jax.block_until_ready(grad(q, k, v))

    cases = {("fwd_bwd", "transformer_engine_jax"): step(
        lambda q_, k_, v_: fused_attn(q_, k_, v_, attn_mask_type="causal"))}
    if not smoke:
        cases[("fwd_bwd", "jax_dpa_cudnn")] = step(
            lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_, is_causal=True,
                                                            implementation="cudnn"))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="attention")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no JSON")
    parser.add_argument("--no-jax", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows, backends = [], []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        cases, chosen = torch_cases(shape, device)
        backends.append({"shape": list(shape), **chosen})
        if not args.no_jax:
            cases.update(jax_cases(shape, args.smoke))
        # torch's contenders on CUDA in interleaved rounds (the GPU's clock drifts with its
        # power draw; see harness.time_cuda_interleaved), the rest one by one.
        timed = {}
        if device == "cuda":
            from harness import time_cuda_interleaved

            timed = time_cuda_interleaved({key: fn for key, fn in cases.items()
                                           if "jax" not in key[1]},
                                          batch=3, repeats=7, warmup=1)
        for (op, impl), fn in cases.items():
            try:
                t = timed.get((op, impl)) or time_host(fn)
                if "error" in t:
                    raise RuntimeError(t["error"])
            except Exception as e:  # a peer's backend may not take the shape: record why
                rows.append({"op": op, "impl": impl, "shape": list(shape), "error": str(e)[:300]})
                print(f"{impl:26s} {op:8s} {shape}: error {str(e)[:120]}")
                continue
            tflops = flops(shape, op == "fwd_bwd") / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"op": op, "impl": impl, "shape": list(shape), "mask": "causal",
                         "dtype": "bfloat16" if "fp8" not in impl else "float8_e4m3", **t,
                         "tflops": tflops})
            print(f"{impl:26s} {op:8s} {shape}: {t['median_ms']:.3f} ms {tflops:.1f} TFLOP/s")
    if args.smoke:
        return
    from harness import write_result

    write_result(args.name, {
        "description": "causal attention, bf16 fwd+bwd, ours vs torch SDPA (cuDNN, flash) and "
                       "jax.nn.dot_product_attention (cuDNN); FP8 forward vs bf16 forward; "
                       "the module's FP8 fwd+bwd (fp8_dpa) vs its bf16 fwd+bwd. "
                       "shape = (batch, heads_q, heads_kv, seqlen, head_dim)",
        "sdpa_cudnn_baseline_fwd_bwd_tflops_b4_h32_s4096": 465,
        "backends": backends,
        "results": rows,
    })


if __name__ == "__main__":
    main()
