"""What torch.compile's default mode adds to the host time of an FP8 layer stack's step.

A stack of te.TransformerLayers (DelayedScaling, bshd, causal, bf16 parameters) runs the same
step eager and under torch.compile (fp8_autocast outside the compiled stack, as bench_model
does). In both, the layer node's own forward and backward (layer_block_nodes.Layer) make the
same core calls: eager mode calls the node straight away; a compiled graph calls
layer_block_op's custom ops, whose implementation is the node. Per step this times, with
wall clocks and the device synchronized only at the ends of each measured batch:

  - forward and backward (the loss's backward included) as the caller sees them;
  - the time inside the node's forward and backward (both modes);
  - compiled: the time inside the ops' implementations around the node (their glue), and
    inside Inductor's compiled graphs (forward and backward together) around the ops (the
    graph's own code and each op's trip through the dispatcher into its Python kernel).

The difference between the modes outside the node is what the compiled region adds: its
guards, AOTAutograd's runtime wrappers, the graph's own calls and checks, and each op's trip
through the dispatcher. Rounds alternate between the modes; each figure is the minimum over
rounds of the round's median step.

    python benchmarks/compiled_overhead_probe.py                     # CUDA when present
    python benchmarks/compiled_overhead_probe.py --device cpu --hidden 64 --layers 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import transformer_engine.pytorch as te
from harness import environment, write_result
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import layer_block_nodes, layer_block_op

_SPENT = {"node_forward": 0.0, "node_backward": 0.0, "op_forward": 0.0, "op_backward": 0.0,
          "graphs": 0.0}


def _timed(name: str, fn):
    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _SPENT[name] += time.perf_counter() - t0
    return wrapper


def _instrument() -> None:
    """Timers around the node (which both modes call) and around the ops' implementations."""
    layer = layer_block_nodes.Layer
    layer.forward = staticmethod(_timed("node_forward", layer.forward))
    layer.backward = staticmethod(_timed("node_backward", layer.backward))
    layer_block_op._forward = _timed("op_forward", layer_block_op._forward)
    layer_block_op._backward = _timed("op_backward", layer_block_op._backward)
    # (Inductor's compiled graphs, forward and backward: what their own code adds around the
    # ops is graphs less op_*)
    from torch._inductor import output_code

    graph = output_code.CompiledFxGraph
    graph.__call__ = _timed("graphs", graph.__call__)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _stack(hidden: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    heads = max(2, hidden // 128)
    return torch.nn.Sequential(*[
        te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0,
                            attention_dropout=0.0, self_attn_mask_type="causal",
                            attn_input_format="bshd", params_dtype=torch.bfloat16,
                            device=device) for _ in range(layers)])


def _runner(mode: str, hidden: int, layers: int, tokens: tuple, device: str):
    """A function running `steps` steps of one mode, returning per-step medians (us)."""
    model = _stack(hidden, layers, device)
    forward = torch.compile(model) if mode == "compile" else model
    x = torch.randn(*tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    recipe = DelayedScaling()
    params = list(model.parameters())

    def one() -> tuple[float, float]:
        for p in params:
            p.grad = None
        x.grad = None
        t0 = time.perf_counter()
        with te.fp8_autocast(fp8_recipe=recipe):
            out = forward(x)
        t1 = time.perf_counter()
        out.float().square().mean().backward()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(6):  # (past the first steps and their compiles)
        one()
    _sync(device)

    def run(steps: int) -> dict:
        for k in _SPENT:
            _SPENT[k] = 0.0
        fwd, bwd = [], []
        for _ in range(steps):
            f, b = one()
            fwd.append(f)
            bwd.append(b)
        _sync(device)
        per_step = {k: v / steps * 1e6 for k, v in _SPENT.items()}
        return {"forward_us": statistics.median(fwd) * 1e6,
                "backward_us": statistics.median(bwd) * 1e6, **{f"{k}_us": v
                                                               for k, v in per_step.items()}}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, nargs=2, default=[1, 16],
                        metavar=("BATCH", "SEQ"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--name", default="compiled_overhead")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    _instrument()
    results = []
    for layers in args.layers:
        runs = {m: _runner(m, args.hidden, layers, tuple(args.tokens), args.device)
                for m in ("eager", "compile")}
        rounds = {m: [] for m in runs}
        for _ in range(args.rounds):
            for mode, run in runs.items():
                rounds[mode].append(run(args.steps))
        for mode, rs in rounds.items():
            best = min(rs, key=lambda r: r["forward_us"] + r["backward_us"])
            row = {"mode": mode, "layers": layers, "hidden": args.hidden,
                   "shape_bsh": [*args.tokens, args.hidden], **{k: round(v, 1)
                                                               for k, v in best.items()}}
            if mode == "eager":  # (no op and no graph in eager mode)
                for k in ("op_forward_us", "op_backward_us", "graphs_us"):
                    row.pop(k)
            results.append(row)
            print(f"{mode:8s} layers {layers}: forward {row['forward_us']:8.1f} us "
                  f"(node {row['node_forward_us']:8.1f}), backward {row['backward_us']:8.1f} "
                  f"us (node {row['node_backward_us']:8.1f})")
    write_result(args.name, {
        "benchmark": args.name,
        "environment": environment(),
        "description": ("host time per step of an FP8 (DelayedScaling) te.TransformerLayer "
                        "stack, eager and torch.compile default mode: forward_us and "
                        "backward_us as the caller sees them (the loss's backward included), "
                        "node_*: inside layer_block_nodes.Layer's forward/backward, op_*: "
                        "inside layer_block_op's op implementations, graphs_us: inside "
                        "Inductor's compiled graphs, forward and backward (compiled only); each "
                        "row the round (of `rounds`, modes alternating) with the smallest "
                        "median step"),
        "config": {"device": args.device, "steps": args.steps, "rounds": args.rounds,
                   "recipe": "DelayedScaling", "on_cuda": layer_block_op.on_cuda,
                   "timing": "wall clock, synchronized at the ends of each batch"},
        "results": results,
    })


if __name__ == "__main__":
    main()
