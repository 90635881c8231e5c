"""One Transformer layer's training step (forward + backward), side by side on one GPU.

The getting-started layer: sequence 2048, batch 8, hidden 4096, ffn 16384, 32 heads, sbhd,
bf16 parameters, LayerNorm, GELU (tanh form), causal self-attention, hidden and attention
dropout 0.1 in every contender; then a small layer (hidden 1024, 16 heads, ffn 4096, batch 4)
whose step is short enough that host time shows. Contenders:
  - the layer from torch's modules in bf16 (nn.LayerNorm, nn.Linear, SDPA on its cuDNN
    backend, nn.Dropout), under torch.compile and eager (SDPA on flash where torch does not
    route this dropout to cuDNN; the row names the backend);
  - te.TransformerLayer in bf16;
  - te.TransformerLayer under fp8_autocast: DelayedScaling (FP8 GEMMs), DelayedScaling with
    fp8_dpa and fp8_mha (FP8 attention, FP8 between the attention block's steps), and
    Float8CurrentScaling. The FP8 attention row runs without attention dropout and is
    compared with the compiled torch layer without it (SDPA on cuDNN): the core does not
    launch cuDNN's FP8 attention with dropout on sm_90, whose kernel faults there.
Each step drops the parameter gradients first (as optimizer.zero_grad does), runs the layer
and calls y.backward(grad). Step times are medians of CUDA-event timed batches, all
contenders interleaved in rounds; peak memory comes from a separate pass per contender:
max_memory_allocated over two steps above what was allocated before them, plus the
parameters. TFLOP/s count the model FLOPs: three times the forward's GEMMs and attention
(causal: half the logits). Targets are printed beside the figures, never asserted.

    python benchmarks/bench_transformer_layer.py          # writes results/transformer_layer.json
    python benchmarks/bench_transformer_layer.py --smoke  # tiny CPU run of every path, no file
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from harness import time_host
from transformer_engine.common import recipe

# (seqlen, batch, hidden, ffn, heads): NVIDIA's getting-started layer (at batch 8), then a
# small layer whose short step lets host time show.
SHAPES = [(2048, 8, 4096, 16384, 32), (2048, 4, 1024, 4096, 16)]
SMOKE_SHAPES = [(32, 2, 64, 128, 4)]
# The getting-started guide's defaults (those of te.TransformerLayer), for every contender.
HIDDEN_DROPOUT = 0.1
ATTENTION_DROPOUT = 0.1
TORCH_COMPILED = "torch layer bf16 torch.compile (nn.Linear, nn.LayerNorm, SDPA)"
TORCH_EAGER = "torch layer bf16 eager (nn.Linear, nn.LayerNorm, SDPA)"
OURS_BF16 = "te.TransformerLayer bf16"
OURS_FP8 = "te.TransformerLayer DelayedScaling (FP8 GEMMs)"
# FP8 attention without attention dropout, beside the compiled torch layer without it: on
# sm_90 the core does not launch cuDNN's FP8 attention with dropout (its kernel faults), so
# with dropout the FP8 attention row would time the core's slow math path instead.
OURS_FP8_ATTN = ("te.TransformerLayer DelayedScaling fp8_dpa + fp8_mha (FP8 attention), "
                 "attention dropout 0")
TORCH_COMPILED_NO_ATTN_DROPOUT = TORCH_COMPILED + ", attention dropout 0"
OURS_CURRENT = "te.TransformerLayer Float8CurrentScaling"
# Targets of the issue, printed next to the figures.
TARGETS = {"fp8_vs_torch_compiled": 1.55, "fp8_attention_vs_torch_compiled": 1.7,
           "fp8_peak_memory_vs_bf16": 0.8}


class TorchLayer(torch.nn.Module):
    """te.TransformerLayer's default layer from torch's modules: pre-LayerNorm self-attention
    (fused QKV linear, causal SDPA with attention dropout, output linear), hidden dropout,
    residual; pre-LayerNorm MLP (linear, tanh GELU, linear), hidden dropout, residual."""

    def __init__(self, hidden: int, ffn: int, heads: int, device, dtype,
                 attention_dropout: float = ATTENTION_DROPOUT):
        super().__init__()
        self.attention_dropout = attention_dropout
        kw = dict(device=device, dtype=dtype)
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-5, **kw)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-5, **kw)
        self.fc1 = torch.nn.Linear(hidden, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, hidden, **kw)
        self.dropout = torch.nn.Dropout(HIDDEN_DROPOUT)

    def forward(self, x):  # x [s, b, hidden]
        s, b, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        dropout = self.attention_dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        x = x + self.dropout(self.proj(o.permute(2, 0, 1, 3).reshape(s, b, hidden)))
        h = F.gelu(self.fc1(self.ln2(x)), approximate="tanh")
        return x + self.dropout(self.fc2(h))


def model_flops(shape) -> float:
    """Three times the forward's FLOPs: its GEMMs and its two attention GEMMs (causal)."""
    s, b, hidden, ffn, heads = shape
    gemms = 2.0 * s * b * hidden * (3 * hidden + hidden + 2 * ffn)
    attention = 4.0 * b * s * s * hidden / 2
    return 3 * (gemms + attention)


class Contender:
    """One training step of ``module`` on ``x`` under ``fp8_recipe`` (None: no autocast)."""

    def __init__(self, module, x, grad, fp8_recipe=None, sdpa_backends=None, forward=None):
        self.module, self.x, self.grad = module, x, grad
        self.fp8_recipe, self.sdpa_backends = fp8_recipe, sdpa_backends
        self.forward = module if forward is None else forward
        self.params = list(module.parameters())

    def clear(self) -> None:
        for p in self.params:
            p.grad = None
        self.x.grad = None

    def __call__(self, i: int) -> None:
        self.clear()
        if self.sdpa_backends is not None:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(self.sdpa_backends):
                y = self.forward(self.x)
        else:
            with te.fp8_autocast(enabled=self.fp8_recipe is not None,
                                 fp8_recipe=self.fp8_recipe):
                y = self.forward(self.x)
        y.backward(self.grad)

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def sdpa_backends(device: str, heads: int, head_dim: int) -> list:
    """SDPA's cuDNN backend where it takes this layer's attention (causal, dropout), else
    flash: torch routes no dropout to cuDNN that is not a multiple of 1/16 (0.1 is not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cpu":
        return [SDPBackend.MATH]
    q = torch.randn(1, heads, 256, head_dim, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    for backends in ([SDPBackend.CUDNN_ATTENTION], [SDPBackend.FLASH_ATTENTION]):
        try:
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(q, q, q, is_causal=True,
                                               dropout_p=ATTENTION_DROPOUT).sum().backward()
            return backends
        except RuntimeError as err:
            print(f"SDPA {backends[0].name} cannot run this layer's attention: "
                  f"{str(err)[:200]}")
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _cudnn_backend() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION]


def contenders(shape, device: str, smoke: bool) -> dict:
    s, b, hidden, ffn, heads = shape
    dtype = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(s, b, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(s, b, hidden, device=device, dtype=dtype)
    backends = sdpa_backends(device, heads, hidden // heads)
    torch_layer = TorchLayer(hidden, ffn, heads, device, dtype)
    # The smoke run traces the compiled path with dynamo and AOT autograd but leaves
    # inductor's code generation out (minutes on a small CPU).
    compiled = torch.compile(torch_layer, dynamic=False,
                             backend="aot_eager" if smoke else "inductor")
    torch_layer_no_drop = TorchLayer(hidden, ffn, heads, device, dtype, attention_dropout=0.0)
    compiled_no_drop = torch.compile(torch_layer_no_drop, dynamic=False,
                                     backend="aot_eager" if smoke else "inductor")
    out = {TORCH_COMPILED: Contender(torch_layer, x, grad, sdpa_backends=backends,
                                     forward=compiled),
           TORCH_EAGER: Contender(torch_layer, x, grad, sdpa_backends=backends),
           TORCH_COMPILED_NO_ATTN_DROPOUT: Contender(
               torch_layer_no_drop, x, grad, forward=compiled_no_drop,
               sdpa_backends=backends if device == "cpu" else _cudnn_backend())}
    recipes = {OURS_BF16: None, OURS_FP8: recipe.DelayedScaling(),
               OURS_FP8_ATTN: recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True),
               OURS_CURRENT: recipe.Float8CurrentScaling()}
    for name, r in recipes.items():
        # One layer per recipe: each keeps its own FP8 state, as a model trained with it would.
        layer = te.TransformerLayer(hidden, ffn, heads, hidden_dropout=HIDDEN_DROPOUT,
                                    attention_dropout=0.0 if name == OURS_FP8_ATTN
                                    else ATTENTION_DROPOUT,
                                    self_attn_mask_type="causal", attn_input_format="sbhd",
                                    params_dtype=dtype, device=device)
        out[name] = Contender(layer, x, grad, fp8_recipe=r)
    return out


def probe_parser(doc: str, name: str, steps: int, top: int) -> argparse.ArgumentParser:
    """The arguments that the GPU probes of this layer share (kernel_profile.py,
    gap_probe.py): steps, top, --only (repeatable) and the result's name."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--top", type=int, default=top)
    parser.add_argument("--only", action="append", default=[],
                        help="contenders whose name holds this text (repeatable; all if none)")
    parser.add_argument("--name", default=name)
    return parser


def probed_contenders(only: list[str]):
    """(name, step) of the getting-started shape's contenders on CUDA whose name holds one of
    ``only`` (all when empty), for the probes."""
    for name, step in contenders(SHAPES[0], "cuda", False).items():
        if not only or any(o in name for o in only):
            yield name, step


def probe(steps: dict) -> tuple[dict, dict]:
    """Runs each contender's first step (torch.compile compiles here, once per contender):
    returns those that ran, with the seconds their first step took, and the errors of those
    that did not (a path this device or build cannot run loses only its own row)."""
    ok, errors = {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        try:
            step(0)
            if torch.cuda.is_available() and step.x.is_cuda:
                torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 (recorded in the result, never hidden)
            errors[name] = f"{type(err).__name__}: {err}"[:2000]
            print(f"{name:70s} FAILED: {errors[name][:300]}")
            continue
        ok[name] = step
        step.first_step_s = time.perf_counter() - start
    return ok, errors


def peak_memory(step: Contender, steps: int = 2) -> dict:
    """The step's peak memory above what was allocated before it (gradients dropped), and
    that plus the parameters: the peak of a process that held this layer alone."""
    step.clear()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base
    step.clear()
    mib = 1 << 20
    return {"peak_step_mib": above / mib, "param_mib": step.param_bytes() / mib,
            "peak_mib": (above + step.param_bytes()) / mib}


def bench_shape(shape, smoke: bool, skip: list[str]) -> list[dict]:
    device = "cpu" if smoke else "cuda"
    steps = {name: step for name, step in contenders(shape, device, smoke).items()
             if not any(text in name for text in skip)}
    steps, errors = probe(steps)
    rows = [{"op": "transformer_layer_fwd_bwd", "impl": name, "shape_sbhfn": list(shape),
             "error": err} for name, err in errors.items()]
    if smoke:
        timed = {name: time_host(step, repeats=2) for name, step in steps.items()}
    else:
        from harness import time_cuda_interleaved

        timed = time_cuda_interleaved(steps, batch=5, repeats=10, warmup=2)
    flops = model_flops(shape)
    results = {}
    for name, t in timed.items():
        row = {"op": "transformer_layer_fwd_bwd", "impl": name, "shape_sbhfn": list(shape), **t}
        if "median_ms" in t:
            row["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
            row["first_step_s"] = steps[name].first_step_s
            if steps[name].sdpa_backends is not None:
                row["sdpa_backend"] = steps[name].sdpa_backends[0].name
            if not smoke:
                row.update(peak_memory(steps[name]))
            results[name] = row
        rows.append(row)
        mem = f"  peak {row['peak_mib']:9.1f} MiB" if "peak_mib" in row else ""
        ms = f"{t['median_ms']:9.3f} ms" if "median_ms" in t else t.get("error", "")[:80]
        print(f"{name:70s} {shape}: {ms}{mem}")
    return rows + speedups(results, shape)


def speedups(results: dict, shape) -> list[dict]:
    """The issue's ratios, each printed beside its target."""
    def ratio(num, den, key):
        if num in results and den in results and key in results[num]:
            return results[den][key] / results[num][key]
        return None

    rows = []
    checks = [("speedup_vs_torch_compiled", OURS_FP8, TORCH_COMPILED, "median_ms",
               "fp8_vs_torch_compiled"),
              ("speedup_vs_torch_compiled", OURS_FP8_ATTN, TORCH_COMPILED_NO_ATTN_DROPOUT,
               "median_ms", "fp8_attention_vs_torch_compiled"),
              ("speedup_vs_torch_compiled", OURS_CURRENT, TORCH_COMPILED, "median_ms", None),
              ("speedup_vs_torch_compiled", OURS_BF16, TORCH_COMPILED, "median_ms", None),
              ("speedup_vs_torch_compiled", TORCH_EAGER, TORCH_COMPILED, "median_ms", None),
              ("speedup_vs_te_bf16", OURS_FP8, OURS_BF16, "median_ms", None)]
    for op, impl, base, key, target in checks:
        value = ratio(impl, base, key)
        if value is None:
            continue
        row = {"op": op, "impl": impl, "shape_sbhfn": list(shape), "speedup": value}
        note = ""
        if target is not None:
            row["target"] = TARGETS[target]
            met = value >= row["target"]
            note = f"  (target >= {row['target']}x: {'met' if met else 'NOT met'})"
        rows.append(row)
        print(f"  {impl} vs {base}: {value:.2f}x{note}")
    for impl in (OURS_FP8, OURS_FP8_ATTN, OURS_CURRENT):
        value = ratio(OURS_BF16, impl, "peak_mib")
        if value is None:
            continue
        row = {"op": "peak_memory_vs_te_bf16", "impl": impl, "shape_sbhfn": list(shape),
               "memory_ratio": value,
               "step_memory_ratio": results[impl]["peak_step_mib"] /
               results[OURS_BF16]["peak_step_mib"]}
        note = ""
        if impl == OURS_FP8:
            row["target"] = TARGETS["fp8_peak_memory_vs_bf16"]
            met = value <= row["target"]
            note = f"  (target <= {row['target']}x: {'met' if met else 'NOT met'})"
        rows.append(row)
        print(f"  {impl} peak memory / bf16's: {value:.2f}x "
              f"(step alone {row['step_memory_ratio']:.2f}x){note}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU, every path, write nothing")
    parser.add_argument("--name", default="transformer_layer")
    parser.add_argument("--main-shape-only", action="store_true",
                        help="the getting-started shape alone (the first of SHAPES)")
    parser.add_argument("--skip", action="append", default=[],
                        help="leave out the contenders whose name holds this text (repeatable)")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    shapes = SMOKE_SHAPES if args.smoke else SHAPES[:1] if args.main_shape_only else SHAPES
    for shape in shapes:
        rows += bench_shape(shape, args.smoke, args.skip)
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.smoke:
        return
    from harness import write_result

    write_result(args.name, {
        "description": "one Transformer layer's training step (zero_grad, forward, "
                       "y.backward(grad)), sbhd, bf16 parameters, causal: the layer from "
                       "torch modules (compiled and eager) beside te.TransformerLayer in bf16 "
                       "and FP8; shape_sbhfn = (seqlen, batch, hidden, ffn, heads); tflops = "
                       "3 x the forward's GEMM and causal attention FLOPs; peak_mib = "
                       "parameters + the step's peak above its resting state; speedup = "
                       "baseline ms / ms; memory_ratio = peak_mib / te bf16's",
        "config": {"shapes_sbhfn": [list(s) for s in shapes], "dtype": "bfloat16",
                   "hidden_dropout": HIDDEN_DROPOUT, "attention_dropout": ATTENTION_DROPOUT,
                   "activation": "gelu (tanh)", "normalization": "LayerNorm",
                   "mask": "causal", "format": "sbhd", "targets": TARGETS,
                   "skipped": args.skip},
        "results": rows,
    })


if __name__ == "__main__":
    main()
