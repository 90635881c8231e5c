"""Where the host time of a te.TransformerLayer FP8 step goes, call by call.

One layer (hidden 1024, 8 heads of 128, ffn 4096, bshd [4, 2048], causal, bf16 parameters,
DelayedScaling) runs whole steps through its one-node path (layer_block_nodes.Layer). Each
step starts on an idle GPU, so the host is never held back by a full launch queue. The calls
the node makes are wrapped with wall-clock timers: their own host time per step, and what is
left of the node's forward and backward around them (its Python). Then single calls timed
alone (median of many, the GPU synchronized between them): a te_eager operator that does
nothing, an allocation, a tiny kernel launch, the core's attention call with its arguments
made beforehand, and the same call through ops.attention_forward.

    python benchmarks/host_split_probe.py [--out FILE] [--hidden 1024] [--steps 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

import transformer_engine.pytorch as te
from harness import environment
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import layer_block_nodes as nodes
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops import attention as attention_ops

_SPENT: dict = collections.defaultdict(float)
_CALLS: dict = collections.defaultdict(int)


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _SPENT[name] += time.perf_counter() - t0
            _CALLS[name] += 1
    # (a custom op's eager shortcut, which _compiled.call takes, is timed under the same name)
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        wrapper.__wrapped__ = _timed(name, inner)
    return wrapper


def _wrap(owner, attr: str, name: str) -> None:
    setattr(owner, attr, _timed(name, getattr(owner, attr)))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_us(fn, device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync(device)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs=2, default=(4, 2048))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--unfused", action="store_true",
                        help="the node's attention half as separate operator calls "
                             "(layer_block_nodes.fused_attention_block off)")
    args = parser.parse_args()
    nodes.fused_attention_block = not args.unfused
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, (b, s) = args.hidden, args.tokens
    heads = h // 128 if h >= 128 else 2
    layer = te.TransformerLayer(h, 4 * h, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", attn_input_format="bshd",
                                params_dtype=torch.bfloat16, device=device)
    x = torch.randn(b, s, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    recipe = DelayedScaling()
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        with te.fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
        out.float().square().mean().backward()

    for _ in range(5):
        step()
    _sync(device)

    # What torch's profiler records of a step (its own overhead included: counts, not times,
    # are what to read here): operators, allocations, the CUDA runtime's calls.
    from torch.profiler import ProfilerActivity, profile
    profiled_steps = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled_steps):
            _sync(device)
            step()
    _sync(device)
    recorded = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:40]
    profiled = [{"name": e.key, "calls_per_step": e.count / profiled_steps,
                 "self_us_per_step": round(e.self_cpu_time_total / profiled_steps, 1)}
                for e in recorded]
    # The node's calls, by the names it reaches them through.
    blocks = nodes.compiled_blocks
    for owner, attr, name in (
            (blocks, "_linear_forward", "fwd: QKV block operator"),
            (blocks, "_mlp_forward", "fwd: MLP block operator"),
            (nodes.fast_linear, "_forward", "fwd: projection operator"),
            (nodes, "_attend", "fwd: attention (_attend)"),
            (nodes, "_fp8_layer_fused", "fwd: the whole layer, one operator"),
            (ops, "attention_forward", "fwd: attention: ops.attention_forward"),
            (nodes, "_residual", "fwd: residual adds"),
            (nodes, "_projection_attention_backward", "bwd: projection + attention, one operator"),
            (blocks, "layernorm_mlp_block_backward", "bwd: MLP block operator"),
            (blocks, "layernorm_linear_block_backward", "bwd: QKV block operator"),
            (nodes, "linear_backward", "bwd: projection (linear_backward)"),
            (nodes, "_attend_backward", "bwd: attention (_attend_backward)"),
            (ops, "attention_backward_packed", "bwd: attention: ops.attention_backward_packed"),
            (nodes, "release", "bwd: release"),
            (nodes, "split_grads", "bwd: split_grads")):
        _wrap(owner, attr, name)
    fwd, bwd = nodes.Layer.forward, nodes.Layer.backward
    nodes.Layer.forward = staticmethod(_timed("node forward (whole)", fwd))
    nodes.Layer.backward = staticmethod(_timed("node backward (whole)", bwd))
    step_times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - t0)
    _sync(device)
    n = args.steps
    per_step = {k: round(v / n * 1e6, 1) for k, v in sorted(_SPENT.items())}
    calls = {k: v / n for k, v in sorted(_CALLS.items())}
    fwd_parts = sum(v for k, v in per_step.items() if k.startswith("fwd: ") and ": ops." not in k
                    and k != "fwd: attention: ops.attention_forward")
    bwd_parts = sum(v for k, v in per_step.items() if k.startswith("bwd: ") and ": ops." not in k)

    # Single calls, timed alone.
    alone = {}
    if hasattr(torch.ops, "te_eager"):
        nothing = torch.ops.te_eager.delayed_scaling_update.default
        alone["te_eager operator doing nothing"] = _median_us(
            lambda: nothing([], [], [], 0, 0, 0, 0), device, 500)
    alone["torch.empty 1 MiB"] = _median_us(
        lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device), device, 500)
    tiny = torch.zeros(4, device=device)
    alone["tiny kernel (add_)"] = _median_us(lambda: tiny.add_(1.0), device, 500)
    residual = torch.randn(b * s, h, device=device, dtype=torch.bfloat16)
    alone["residual add [M, H]"] = _median_us(lambda: residual + residual, device, 200)
    # attention at the layer's shape, q, k, v packed in one [M, 3H] output as the node has them
    qkv = torch.randn(b, s, 3 * h, device=device, dtype=torch.bfloat16)
    q, k, v = (qkv.view(b, s, 3, heads, h // heads)[:, :, i] for i in range(3))
    empty32 = torch.empty(0, dtype=torch.int32, device=device)
    empty64 = torch.empty(0, dtype=torch.int64, device=device)
    scale = (h // heads) ** -0.5
    call = (q, k, v, empty32, empty32, empty64, "bshd", "causal", -1, 0, scale, 0.0, s, s, "auto")
    alone["ops.attention_forward (packed)"] = _median_us(
        lambda: ops.attention_forward(*call), device, 100)
    o, lse = ops.attention_forward(*call)
    d_o = torch.randn_like(o)
    bcall = (qkv, q, k, v, o, d_o, lse, empty64, "bshd", "causal", -1, 0, scale, 0.0,
             False, "auto")
    alone["ops.attention_backward_packed"] = _median_us(
        lambda: ops.attention_backward_packed(*bcall), device, 100)
    if device.type == "cuda":
        c = attention_ops.core()
        strides = attention_ops.qkv_strides("bshd", "causal", q, k, v)
        cfg = attention_ops.config("bshd", "causal", -1, 0, scale, 0.0, s, s, False,
                                   "auto", False, strides)
        ws = attention_ops._workspace_for(cfg, ("probe",), q, k, v, "bfloat16", "bfloat16",
                                          empty32, s, s, False)
        raws = [attention_ops.raw_view(t) for t in (q, k, v)]
        o_raw, lse_raw, ws_raw = attention_ops.raw(o), attention_ops.raw(lse), attention_ops.raw(ws)
        stream = attention_ops.stream_of(q)
        alone["core attention_forward, arguments made"] = _median_us(
            lambda: c.attention_forward(cfg, *raws, o_raw, lse_raw, workspace=ws_raw,
                                        stream=stream), device, 100)
        alone["building the config"] = _median_us(
            lambda: attention_ops.config("bshd", "causal", -1, 0, scale, 0.0, s, s, False, "auto",
                                         False, strides), device, 200)

    result = {
        "benchmark": "host_split_probe",
        "environment": environment() if device.type == "cuda" else {"device": "cpu"},
        "description": __doc__.split("\n\n")[0],
        "config": {"hidden": h, "heads": heads, "shape_bsh": [b, s, h], "steps": n,
                   "recipe": "DelayedScaling", "device": device.type,
                   "fused_attention_block": nodes.fused_attention_block},
        "step_host_us_median": round(statistics.median(step_times) * 1e6, 1),
        "per_step_us": per_step,
        "calls_per_step": calls,
        "node_forward_python_us": round(per_step.get("node forward (whole)", 0) - fwd_parts, 1),
        "node_backward_python_us": round(per_step.get("node backward (whole)", 0) - bwd_parts, 1),
        "alone_us": {k: round(v, 1) for k, v in alone.items()},
        "profiled": profiled,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
