"""A dense layer's training step in JAX: Transformer Engine's FP8 DenseGeneral beside flax's
bf16 nn.Dense and flax's two FP8 dot_general ops, in one process.

Each contender runs the same jitted step: value_and_grad of a loss that needs the layer's
output (the mean square of it), with respect to the parameters, the FP8 state and the input
(as if a layer below wanted its gradient: dgrad is kept), then an optax SGD update; 16384
tokens, 8192 -> 8192, bf16 compute, fp32 parameters, no bias. Per contender it records the
median step time, the TFLOP/s of its three GEMMs, and how many FP8 GEMMs its compiled HLO
holds (our te_gemm_ffi calls with FP8 operands, XLA's cuBLAS FP8 custom calls). It also times
our FP8 GEMM custom call alone at that shape, and checks that the seed example's compiled
step holds our FP8 GEMM.

    python benchmarks/bench_dense_jax.py              # writes benchmarks/results/dense_jax.json
    python benchmarks/bench_dense_jax.py --check-seed # only the seed example's HLO check
    python benchmarks/bench_dense_jax.py --smoke      # tiny shapes, prints instead of writing
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import time
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo, ops
from transformer_engine.jax.flax import DenseGeneral

SEED_EXAMPLE = Path(__file__).resolve().parents[1] / "jax" / "examples" / "jax_dense_fp8.py"
RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024)


def time_jax(fn, *, batch: int = 5, repeats: int = 10, warmup: int = 2) -> dict:
    """Milliseconds per call of ``fn()``: batches of calls, each batch ended by
    block_until_ready, so dispatch overlaps device work as in a training loop; medians."""
    for _ in range(warmup * batch):
        out = fn()
    jax.block_until_ready(out)
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) * 1e3 / batch)
    return {"median_ms": statistics.median(per_call), "min_ms": min(per_call),
            "max_ms": max(per_call), "batches": repeats, "calls_per_batch": batch}


def contenders(features: int) -> dict:
    """name -> (flax module, whether it runs inside te.fp8_autocast)."""
    common = dict(features=features, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    # Ours: dtype is the parameters' dtype (NVIDIA's meaning); it computes in the input's
    # bf16, as flax's Dense does with dtype=bfloat16.
    ours = DenseGeneral(features=features, use_bias=False, dtype=jnp.float32)
    return {
        "te_dense_general_fp8": (ours, True),
        "te_dense_general_bf16": (ours, False),  # our GEMM, no FP8
        "flax_dense_bf16": (nn.Dense(**common), False),
        "flax_dense_fp8_qdq": (nn.Dense(**common, dot_general_cls=fp8_ops.Fp8DotGeneralOp), False),
        "flax_dense_fp8_direct": (nn.Dense(**common, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
                                  False),
    }


def make_step(model: nn.Module, use_te_fp8: bool, tx):
    def loss_fn(params, other, x):
        with te.fp8_autocast(enabled=use_te_fp8, fp8_recipe=RECIPE):
            out = model.apply({"params": params, **other}, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))

    def step(params, other, opt_state, x):
        loss, (g_params, g_other, g_x) = grad_fn(params, other, x)
        updates, opt_state = tx.update(g_params, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The gradient of the FP8 state is its next value (ours: fp8_metas; flax's fp8_ops:
        # the _overwrite_with_gradient collection).
        return params, te.update_collections(g_other, other), opt_state, loss, g_x

    return jax.jit(step, donate_argnums=(0, 1, 2))


def bench_step(name, model, use_te_fp8, x, timing) -> dict:
    tx = optax.sgd(1e-4)
    with te.fp8_autocast(enabled=use_te_fp8, fp8_recipe=RECIPE):
        variables = model.init(jax.random.PRNGKey(0), x)
    other, params = flax.core.pop(variables, "params")
    opt_state = tx.init(params)
    step = make_step(model, use_te_fp8, tx)
    text = step.lower(params, other, opt_state, x).compile().as_text()
    state = [params, other, opt_state]

    def run():
        out = step(*state, x)
        state[:] = out[:3]
        return out[3]

    t = time_jax(run, **timing)
    m, k = x.shape
    n = jax.tree.leaves(params)[0].shape[-1]
    flops = 3 * 2 * m * n * k
    return {
        "name": name,
        **t,
        "gemm_tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
        "te_fp8_gemms_in_hlo": hlo.count_fp8_gemms(text),
        "cublas_fp8_gemms_in_hlo": hlo.count_cublas_fp8_gemms(text),
        "custom_call_targets": dict(hlo.target_counts(text)),
        "loss_after": float(run()),
    }


def bench_gemm_alone(m, k, n, timing) -> list[dict]:
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.bfloat16)  # [N, K]: the forward GEMM's B operand
    one = jnp.ones((1,), jnp.float32)
    qx = ops.quantize(x, one, jnp.float8_e4m3fn)
    qw = ops.quantize(w, one, jnp.float8_e4m3fn)
    fp8 = jax.jit(lambda a, b, sa, sb: ops.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb,
                                                transpose_b=True, out_dtype=jnp.bfloat16))
    bf16 = jax.jit(lambda a, b: ops.gemm(a, b, transpose_b=True))
    xla_bf16 = jax.jit(lambda a, b: a @ b.T)
    rows = []
    cases = (("te_gemm_fp8_e4m3", fp8, (qx.data, qw.data, qx.scale_inv, qw.scale_inv)),
             ("te_gemm_bf16", bf16, (x, w)), ("xla_dot_bf16", xla_bf16, (x, w)))
    for name, fn, args in cases:
        t = time_jax(lambda fn=fn, args=args: fn(*args), **timing)
        rows.append({"name": name, "shape_mnk": [m, n, k], **t,
                     "tflops": 2 * m * n * k / (t["median_ms"] * 1e-3) / 1e12})
    return rows


def check_seed_example() -> dict:
    """Runs the seed example as written, then compiles its fwd_bwd_fn under jit (inside its
    fp8_autocast) and reports whether our FP8 GEMM custom call is in the HLO."""
    ns = runpy.run_path(str(SEED_EXAMPLE), run_name="seed_example")
    with te.fp8_autocast(enabled=True, fp8_recipe=ns["fp8_recipe"]):
        text = jax.jit(ns["fwd_bwd_fn"]).lower(ns["params"], ns["other_variables"],
                                               ns["inp"]).compile().as_text()
    result = {"te_fp8_gemms_in_hlo": hlo.count_fp8_gemms(text),
              "custom_call_targets": dict(hlo.target_counts(text))}
    found = "YES" if result["te_fp8_gemms_in_hlo"] else "NO"
    print(f"seed example: compiled HLO holds {result['te_fp8_gemms_in_hlo']} FP8 GEMM custom "
          f"call(s) of ours (te_gemm_ffi with FP8 operands): {found}; "
          f"targets {result['custom_call_targets']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check-seed", action="store_true",
                        help="only the seed example's HLO check")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print, write nothing")
    args = parser.parse_args()
    seed = check_seed_example()
    if args.check_seed:
        return
    tokens, hidden = (64, 128) if args.smoke else (16384, 8192)
    timing = dict(batch=5, repeats=10, warmup=2)
    if args.smoke:
        timing = dict(batch=2, repeats=2, warmup=1)
    x = jax.random.normal(jax.random.PRNGKey(2), (tokens, hidden), jnp.bfloat16)
    steps = []
    for name, (model, use_te_fp8) in contenders(hidden).items():
        try:
            row = bench_step(name, model, use_te_fp8, x, timing)
        except Exception as err:  # one failing contender must not lose the others' results
            print(f"{name:24s} FAILED: {type(err).__name__}: {err}")
            steps.append({"name": name, "error": f"{type(err).__name__}: {err}"[:2000]})
            continue
        print(f"{name:24s} {row['median_ms']:8.3f} ms  {row['gemm_tflops']:7.1f} TFLOP/s  "
              f"FP8 GEMMs: ours {row['te_fp8_gemms_in_hlo']}, "
              f"cuBLAS {row['cublas_fp8_gemms_in_hlo']}")
        steps.append(row)
    gemms = bench_gemm_alone(tokens, hidden, hidden, timing)
    for row in gemms:
        print(f"{row['name']:24s} {row['median_ms']:8.3f} ms  {row['tflops']:7.1f} TFLOP/s")
    payload = {
        "config": {"tokens": tokens, "in_features": hidden, "out_features": hidden,
                   "dtype": "bfloat16", "param_dtype": "float32", "optimizer": "optax.sgd",
                   "recipe": repr(RECIPE), "jax": jax.__version__, "flax": flax.__version__,
                   "jax_devices": [str(d) for d in jax.devices()]},
        "training_step": steps,
        "gemm_alone": gemms,
        "seed_example": seed,
    }
    if args.smoke:
        print(json.dumps(payload, indent=1)[:2000])
        return
    from harness import write_result  # torch-based; imported only for a real run

    write_result("dense_jax", payload)


if __name__ == "__main__":
    main()
