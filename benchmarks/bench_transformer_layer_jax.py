"""One Transformer layer's training step in JAX: Transformer Engine's Flax TransformerLayer
in FP8 (DelayedScaling, Float8CurrentScaling) and bf16 beside the same layer from flax's
modules (nn.LayerNorm, nn.Dense, jax.nn.dot_product_attention on cuDNN, nn.Dropout), in one
process.

The getting-started layer: sequence 2048, batch 8, hidden 4096, ffn 16384, 32 heads, bf16
parameters and compute, LayerNorm, GELU (tanh form), biases, causal self-attention,
[batch, seq, hidden] inputs. Hidden dropout 0.1 in every contender; attention dropout 0 in
every contender, because jax.nn.dot_product_attention has none. Each contender runs the same
jitted step: value_and_grad of the mean square of the layer's output with respect to the
parameters, the FP8 state and the input, then an optax SGD update, the dropout key split
inside the step. Steps are timed in batches ended by block_until_ready, the contenders
interleaved in rounds; TFLOP/s count three times the forward's GEMMs and causal attention.
The FP8 target is printed beside the figures, never asserted.

    python benchmarks/bench_transformer_layer_jax.py          # writes transformer_layer_jax.json
    python benchmarks/bench_transformer_layer_jax.py --smoke  # tiny CPU shapes, writes nothing

``--model`` times the model stack of PyTorch's bench_model.py instead (4 layers, 8192 tokens
as batch 4 x sequence 2048, hidden 1024 / 2048 / 4096 with hidden / 128 heads and a 4 x hidden
MLP, no dropout: the same blocks and step as above, stacked) and writes model_jax.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo, quantizer

SHAPE = (2048, 8, 4096, 16384, 32)  # seqlen, batch, hidden, ffn, heads
SMOKE_SHAPE = (32, 2, 64, 128, 4)
HIDDEN_DROPOUT = 0.1
ATTENTION_DROPOUT = 0.0  # jax.nn.dot_product_attention has no dropout: 0 for all alike
RECIPES = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}
BASELINE = "flax_layer_bf16"
# The first-step probe's contender (--first-step-probe): FP8 delayed scaling traced without
# the first-step rule (quantizer.first_step_rule), to show what the rule's launches cost a
# step; past the first step it computes the same bits as the delayed contender.
NO_FIRST_STEP_RULE = "te_transformer_layer_fp8_delayed_no_first_step_rule"
TARGET_FP8_VS_FLAX = 1.5


# The model stack (--model): bench_model.py's shapes.
MODEL_LAYERS, MODEL_SEQ, MODEL_BATCH, MODEL_HEAD_DIM = 4, 2048, 4, 128
MODEL_HIDDENS = (1024, 2048, 4096)
SMOKE_MODEL = dict(layers=2, seq=32, batch=2, hiddens=(64,), head_dim=16)


class Stack(nn.Module):
    """``layers`` copies of a layer (each with its own parameters), applied in turn."""

    make: object  # () -> nn.Module
    layers: int

    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        for i in range(self.layers):
            x = self.make(name=f"layer_{i}")(x, deterministic=deterministic)
        return x


class FlaxLayer(nn.Module):
    """The layer from flax's modules: pre-LayerNorm causal self-attention (fused QKV Dense,
    jax.nn.dot_product_attention, output Dense), hidden dropout, residual; pre-LayerNorm MLP
    (Dense, tanh GELU, Dense), hidden dropout, residual. Inputs [batch, seq, hidden]."""

    ffn: int
    heads: int
    implementation: str | None
    dtype: object = jnp.bfloat16
    dropout_rate: float = HIDDEN_DROPOUT

    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        b, s, hidden = x.shape
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        dropout = nn.Dropout(self.dropout_rate, deterministic=deterministic)
        qkv = nn.Dense(3 * hidden, **kw)(nn.LayerNorm(epsilon=1e-6, **kw)(x))
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * self.heads, hidden // self.heads), 3, axis=2)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.implementation)
        x = x + dropout(nn.Dense(hidden, **kw)(o.reshape(b, s, hidden)))
        h = nn.gelu(nn.Dense(self.ffn, **kw)(nn.LayerNorm(epsilon=1e-6, **kw)(x)))
        return x + dropout(nn.Dense(hidden, **kw)(h))


def contenders(shape, implementation, layers: int = 0, dropout: float = HIDDEN_DROPOUT,
               first_step_probe: bool = False) -> dict:
    """name -> (flax module, the recipe it runs under, or None); ``layers`` > 0: a stack of
    that many layers of each kind; ``first_step_probe``: NO_FIRST_STEP_RULE too."""
    from transformer_engine.jax.flax import TransformerLayer

    _, _, hidden, ffn, heads = shape

    def ours(name=None):
        return TransformerLayer(hidden_size=hidden, mlp_hidden_size=ffn,
                                num_attention_heads=heads, layernorm_type="layernorm",
                                mlp_activations=("gelu",), use_bias=True,
                                hidden_dropout=dropout, attention_dropout=ATTENTION_DROPOUT,
                                intermediate_dropout=0.0, self_attn_mask_type="causal",
                                transpose_batch_sequence=False,
                                enable_relative_embedding=False, dtype=jnp.bfloat16, name=name)

    def flax_layer(name=None):
        return FlaxLayer(ffn, heads, implementation, dropout_rate=dropout, name=name)

    def build(make):
        return Stack(make, layers) if layers else make()

    out = {f"te_transformer_layer_fp8_{name}": (build(ours), r) for name, r in RECIPES.items()}
    if first_step_probe:
        out[NO_FIRST_STEP_RULE] = (build(ours), RECIPES["delayed"])
    out["te_transformer_layer_bf16"] = (build(ours), None)
    out[BASELINE] = (build(flax_layer), None)
    return out


def make_step(model: nn.Module, fp8_recipe, tx, first_step_rule: bool = True):
    def loss_fn(params, other, x, key):
        quantizer.first_step_rule = first_step_rule  # (read while this function is traced)
        try:
            with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                out = model.apply({"params": params, **other}, x, deterministic=False,
                                  rngs={"dropout": key})
        finally:
            quantizer.first_step_rule = True
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))

    def step(params, other, opt_state, key, x):
        key, use = jax.random.split(key)
        loss, (g_params, g_other, g_x) = grad_fn(params, other, x, use)
        updates, opt_state = tx.update(g_params, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The gradient of the FP8 state (fp8_metas) is its next value.
        return params, te.update_collections(g_other, other), opt_state, key, loss, g_x

    return jax.jit(step, donate_argnums=(0, 1, 2))


def prepare(name, model, fp8_recipe, x) -> tuple:
    """Initializes and compiles one contender: returns run() (one step, returning its loss)
    and what its compiled HLO says about it."""
    tx = optax.sgd(1e-4)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
        variables = jax.jit(lambda k, d: model.init({"params": k, "dropout": d}, x,
                                                    deterministic=False))(keys[0], keys[1])
    other, params = flax.core.pop(variables, "params")
    step = make_step(model, fp8_recipe, tx, first_step_rule=name != NO_FIRST_STEP_RULE)
    state = [params, other, tx.init(params), keys[2]]
    start = time.perf_counter()
    text = step.lower(*state, x).compile().as_text()
    info = {"name": name, "compile_s": time.perf_counter() - start,
            "te_fp8_gemms_in_hlo": hlo.count_fp8_gemms(text),
            "cublas_fp8_gemms_in_hlo": hlo.count_cublas_fp8_gemms(text),
            "custom_call_targets": dict(hlo.target_counts(text))}

    def run():
        out = step(*state, x)
        state[:] = out[:4]
        return out[4]

    return run, info


def time_interleaved(runs: dict, *, batch: int, repeats: int, warmup: int) -> dict:
    """Milliseconds per step of every ``runs[name]()``: batches of steps ended by
    block_until_ready (dispatch overlaps device work, as in a training loop), one batch of
    each contender per round in an order that rotates, so the device's clock drift over the
    run falls on all alike; medians over the rounds."""
    for run in runs.values():
        for _ in range(warmup * batch):
            out = run()
        jax.block_until_ready(out)
    names = list(runs)
    per_step = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(batch):
                out = runs[name]()
            jax.block_until_ready(out)
            per_step[name].append((time.perf_counter() - start) * 1e3 / batch)
    return {name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                   "batches": repeats, "calls_per_batch": batch}
            for name, v in per_step.items()}


def model_flops(shape) -> float:
    """Three times the forward's FLOPs: its GEMMs and its two attention GEMMs (causal)."""
    s, b, hidden, ffn, _ = shape
    gemms = 2.0 * s * b * hidden * (3 * hidden + hidden + 2 * ffn)
    return 3 * (gemms + 4.0 * b * s * s * hidden / 2)


def run_contenders(shape, implementation, timing, layers: int = 0,
                   dropout: float = HIDDEN_DROPOUT, first_step_probe: bool = False) -> dict:
    """name -> row: compile info, step times, TFLOP/s (per layer count) and the speedup over
    the flax bf16 contender."""
    s, b, hidden, _, _ = shape
    x = jax.random.normal(jax.random.PRNGKey(2), (b, s, hidden), jnp.bfloat16)
    runs, rows = {}, {}
    for name, (model, fp8_recipe) in contenders(shape, implementation, layers, dropout,
                                                 first_step_probe).items():
        try:
            runs[name], rows[name] = prepare(name, model, fp8_recipe, x)
            runs[name]()  # one step outside the timing: a contender that fails, fails here
        except Exception as err:  # one failing contender must not lose the others' results
            print(f"{name:36s} FAILED: {type(err).__name__}: {err}")
            rows[name] = {"name": name, "error": f"{type(err).__name__}: {err}"[:2000]}
            runs.pop(name, None)
    for name, t in time_interleaved(runs, **timing).items():
        rows[name].update(t, shape_sbhfn=list(shape), layers=max(layers, 1),
                          tflops=max(layers, 1) * model_flops(shape) / (t["median_ms"] * 1e-3)
                          / 1e12, loss_after=float(runs[name]()))
    base = rows.get(BASELINE, {}).get("median_ms")
    for row in rows.values():
        if "median_ms" in row and base is not None:
            row["speedup_vs_flax_bf16"] = base / row["median_ms"]
    return rows


def main_model(smoke: bool, name: str = "model_jax", first_step_probe: bool = False) -> None:
    """The model stack (--model): every hidden size, all contenders, ``name``.json, rewritten
    after each hidden size (a run cut short keeps the sizes it finished)."""
    size = SMOKE_MODEL if smoke else dict(layers=MODEL_LAYERS, seq=MODEL_SEQ,
                                          batch=MODEL_BATCH, hiddens=MODEL_HIDDENS,
                                          head_dim=MODEL_HEAD_DIM)
    timing = dict(batch=2, repeats=2, warmup=1) if smoke else dict(batch=5, repeats=10,
                                                                    warmup=2)
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    rows = []
    for hidden in size["hiddens"]:
        shape = (size["seq"], size["batch"], hidden, 4 * hidden, hidden // size["head_dim"])
        for contender, row in run_contenders(shape, implementation, timing, size["layers"],
                                             dropout=0.0,
                                             first_step_probe=first_step_probe).items():
            rows.append({**row, "hidden": hidden})
            if "median_ms" in row:
                print(f"hidden {hidden:5d} {contender:36s} {row['median_ms']:9.3f} ms  "
                      f"{row.get('speedup_vs_flax_bf16', float('nan')):.2f}x flax bf16")
        payload = {
            "description": "jitted training step of a stack of layers (bench_model.py's "
                           "stack: value_and_grad of the output's mean square over params, "
                           "fp8_metas and input; SGD): our Flax TransformerLayer in FP8 and "
                           "bf16 beside flax's layer, no dropout; speedup_vs_flax_bf16 = flax "
                           "ms / ms",
            "config": {**size, "layout": "bshd", "dtype": "bfloat16", "mask": "causal",
                       "recipes": {k: repr(v) for k, v in RECIPES.items()},
                       "attention_implementation_of_flax_layer": implementation,
                       "jax": jax.__version__, "flax": flax.__version__,
                       "jax_devices": [str(d) for d in jax.devices()]},
            "training_step": rows,
        }
        if smoke:
            continue
        from harness import write_result  # torch-based; imported only for a real run

        write_result(name, payload)
    if smoke:
        print(json.dumps(payload, indent=1)[:2000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print, write nothing")
    parser.add_argument("--model", action="store_true",
                        help="the model stack of bench_model.py instead (model_jax.json)")
    parser.add_argument("--name", default="model_jax", help="--model's result file name")
    parser.add_argument("--first-step-probe", action="store_true",
                        help="--model: also time FP8 delayed scaling traced without the "
                             "first-step rule (" + NO_FIRST_STEP_RULE + ")")
    args = parser.parse_args()
    if args.model:
        main_model(args.smoke, args.name, args.first_step_probe)
        return
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    timing = dict(batch=2, repeats=2, warmup=1) if args.smoke else dict(batch=5, repeats=10,
                                                                         warmup=2)
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    rows = run_contenders(shape, implementation, timing)
    for name, row in rows.items():
        if "median_ms" not in row:
            continue
        note = ""
        if name.startswith("te_transformer_layer_fp8") and "speedup_vs_flax_bf16" in row:
            met = row["speedup_vs_flax_bf16"] >= TARGET_FP8_VS_FLAX
            note = (f"  {row['speedup_vs_flax_bf16']:.2f}x flax bf16 (target >= "
                    f"{TARGET_FP8_VS_FLAX}x: {'met' if met else 'NOT met'})")
        print(f"{name:36s} {row['median_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s  FP8 "
              f"GEMMs: ours {row['te_fp8_gemms_in_hlo']}, cuBLAS "
              f"{row['cublas_fp8_gemms_in_hlo']}  compile {row['compile_s']:.0f} s{note}")
    payload = {
        "description": "one Transformer layer's jitted training step (value_and_grad of the "
                       "output's mean square over params, fp8_metas and input; SGD): the Flax "
                       "TransformerLayer in FP8 and bf16 beside flax's layer with "
                       "jax.nn.dot_product_attention; shape_sbhfn = (seqlen, batch, hidden, "
                       "ffn, heads); tflops = 3 x the forward's GEMM and causal attention "
                       "FLOPs; speedup_vs_flax_bf16 = flax ms / ms",
        "config": {"shape_sbhfn": list(shape), "layout": "bshd", "dtype": "bfloat16",
                   "param_dtype": "bfloat16", "hidden_dropout": HIDDEN_DROPOUT,
                   "attention_dropout": ATTENTION_DROPOUT, "intermediate_dropout": 0.0,
                   "activation": "gelu (tanh)", "mask": "causal", "optimizer": "optax.sgd",
                   "attention_implementation_of_flax_layer": implementation,
                   "recipes": {k: repr(v) for k, v in RECIPES.items()},
                   "target_fp8_vs_flax_bf16": TARGET_FP8_VS_FLAX, "jax": jax.__version__,
                   "flax": flax.__version__, "jax_devices": [str(d) for d in jax.devices()]},
        "training_step": list(rows.values()),
    }
    if args.smoke:
        print(json.dumps(payload, indent=1)[:2000])
        return
    from harness import write_result  # torch-based; imported only for a real run

    write_result("transformer_layer_jax", payload)


if __name__ == "__main__":
    main()
