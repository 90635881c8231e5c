"""A Transformer MLP block's training step in JAX: Transformer Engine's fused FP8
LayerNormMLP beside the same module without FP8 and flax's bf16 block (nn.LayerNorm,
nn.Dense, the activation, nn.Dense), in one process.

Each contender runs the same jitted step: value_and_grad of a loss that needs the block's
output (its mean square), with respect to the parameters, the FP8 state and the input (as
if a layer below wanted its gradient: every dgrad is kept), then an optax SGD update;
16384 tokens, hidden 4096, ffn 16384, GELU and SwiGLU, bf16 compute, fp32 parameters, with
biases. Per contender and activation it records the median step time, the TFLOP/s of its
six GEMMs, and how many FP8 GEMMs its compiled HLO holds (our te_gemm_ffi calls with FP8
operands, XLA's cuBLAS FP8 custom calls), with the custom-call targets.

    python benchmarks/bench_layernorm_mlp_jax.py          # writes results/layernorm_mlp_jax.json
    python benchmarks/bench_layernorm_mlp_jax.py --smoke  # tiny shapes, prints instead of writing
"""

from __future__ import annotations

import argparse
import json

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import transformer_engine.jax as te
from bench_dense_jax import time_jax
from transformer_engine.common import recipe
from transformer_engine.jax import hlo
from transformer_engine.jax.flax import LayerNormMLP

RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024)
ACTIVATIONS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}


class FlaxMLP(nn.Module):
    """flax's own block: LayerNorm, Dense, activation (gated: on the first half, times the
    second), Dense."""

    intermediate_dim: int
    activations: tuple
    dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        gated = len(self.activations) == 2
        h = nn.Dense(self.intermediate_dim * (2 if gated else 1), dtype=self.dtype)(y)
        if gated:
            a, b = jnp.split(h, 2, axis=-1)
            h = nn.silu(a) * b
        else:
            h = nn.gelu(h)
        return nn.Dense(x.shape[-1], dtype=self.dtype)(h)


def contenders(ffn: int, activations: tuple) -> dict:
    """name -> (flax module, whether it runs inside te.fp8_autocast)."""
    # dtype is the parameters' dtype (NVIDIA's meaning); it computes in the input's bf16.
    ours = LayerNormMLP(intermediate_dim=ffn, activations=activations, use_bias=True,
                        dtype=jnp.float32)
    return {
        "te_layernorm_mlp_fp8": (ours, True),
        "te_layernorm_mlp_bf16": (ours, False),  # our fused kernels and GEMM, no FP8
        "flax_mlp_bf16": (FlaxMLP(ffn, activations), False),
    }


def make_step(model: nn.Module, use_te_fp8: bool, tx):
    def loss_fn(params, other, x):
        with te.fp8_autocast(enabled=use_te_fp8, fp8_recipe=RECIPE):
            out = model.apply({"params": params, **other}, x)
        if isinstance(out, tuple):  # ours returns (out, ln_out), as NVIDIA's module does
            out = out[0]
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))

    def step(params, other, opt_state, x):
        loss, (g_params, g_other, g_x) = grad_fn(params, other, x)
        updates, opt_state = tx.update(g_params, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The gradient of the FP8 state (fp8_metas) is its next value.
        return params, te.update_collections(g_other, other), opt_state, loss, g_x

    return jax.jit(step, donate_argnums=(0, 1, 2))


def bench_step(name, model, use_te_fp8, x, ffn, gated, timing) -> dict:
    tx = optax.sgd(1e-4)
    with te.fp8_autocast(enabled=use_te_fp8, fp8_recipe=RECIPE):
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
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
    flops = 3 * (2 * m * k * ffn * (2 if gated else 1) + 2 * m * ffn * k)
    return {
        "name": name,
        **t,
        "gemm_tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
        "te_fp8_gemms_in_hlo": hlo.count_fp8_gemms(text),
        "cublas_fp8_gemms_in_hlo": hlo.count_cublas_fp8_gemms(text),
        "custom_call_targets": dict(hlo.target_counts(text)),
        "loss_after": float(run()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print, write nothing")
    args = parser.parse_args()
    tokens, hidden, ffn = (64, 128, 256) if args.smoke else (16384, 4096, 16384)
    timing = dict(batch=2, repeats=2, warmup=1) if args.smoke else dict(batch=5, repeats=10,
                                                                         warmup=2)
    x = jax.random.normal(jax.random.PRNGKey(2), (tokens, hidden), jnp.bfloat16)
    steps = []
    for act_name, activations in ACTIVATIONS.items():
        for name, (model, use_te_fp8) in contenders(ffn, activations).items():
            label = f"{name}_{act_name}"
            try:
                row = bench_step(label, model, use_te_fp8, x, ffn, len(activations) == 2, timing)
            except Exception as err:  # one failing contender must not lose the others' results
                print(f"{label:32s} FAILED: {type(err).__name__}: {err}")
                steps.append({"name": label, "error": f"{type(err).__name__}: {err}"[:2000]})
                continue
            print(f"{label:32s} {row['median_ms']:8.3f} ms  {row['gemm_tflops']:7.1f} TFLOP/s  "
                  f"FP8 GEMMs: ours {row['te_fp8_gemms_in_hlo']}, "
                  f"cuBLAS {row['cublas_fp8_gemms_in_hlo']}")
            steps.append(row)
    payload = {
        "config": {"tokens": tokens, "hidden": hidden, "ffn": ffn,
                   "activations": {k: list(v) for k, v in ACTIVATIONS.items()},
                   "dtype": "bfloat16", "param_dtype": "float32", "optimizer": "optax.sgd",
                   "recipe": repr(RECIPE), "jax": jax.__version__, "flax": flax.__version__,
                   "jax_devices": [str(d) for d in jax.devices()]},
        "training_step": steps,
    }
    if args.smoke:
        print(json.dumps(payload, indent=1)[:2000])
        return
    from harness import write_result  # torch-based; imported only for a real run

    write_result("layernorm_mlp_jax", payload)


if __name__ == "__main__":
    main()
