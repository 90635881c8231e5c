"""What one more tensor in or out of a custom op costs a torch.compile'd training step.

A compiled graph of four autograd nodes, each one forward and one backward custom op made as
the layer node's ops are (ops._backend.custom_op: one kernel for every device, and a fake),
doing almost nothing (a clone of a 4-element tensor; each extra result is a 4-element
allocation of its own). Two knobs, each against its baseline of
one, in the same process:

  - results: the forward op returns `n` more tensors, which the node saves for its backward
    and its backward op takes as a list (the layer op returns 29 tensors);
  - inputs: the node takes `n` more tensors (no gradient), passed to both ops as a list and
    saved for the backward (the layer op takes 32 forward, 55 backward).

Each figure is the smallest of `rounds` medians of a step (forward, backward of a sum),
host time: the tensors are tiny, so the step is the compiled region's own work.

    python benchmarks/compiled_call_cost_probe.py [--device cpu] [--counts 1 28]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness import environment, write_result
from transformer_engine.pytorch.ops._backend import custom_op

NODES = 4


def _backward_op(name: str):
    """A node's backward op: the gradient (cloned) from it and a list of tensors it only
    takes."""
    @custom_op(name, schema="(Tensor g, Tensor[] ts) -> Tensor")
    def backward(g, ts):
        return g.clone()

    backward.register_fake(lambda g, ts: torch.empty_like(g))
    return backward


def _node_with_results(n: int, device: str):
    schema = "(Tensor x) -> (" + ", ".join(["Tensor"] * (n + 1)) + ")"

    @custom_op(f"call_cost_probe::results_forward_{n}", schema=schema)
    def forward(x):
        return (x.clone(), *(x.new_empty(4) for _ in range(n)))

    forward.register_fake(lambda x: (torch.empty_like(x), *(x.new_empty(4) for _ in range(n))))

    backward = _backward_op(f"call_cost_probe::results_backward_{n}")

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out, *made = forward.op(x)
            ctx.save_for_backward(*made)
            return out

        @staticmethod
        def backward(ctx, g):
            return backward.op(g, list(ctx.saved_tensors))

    return lambda x, extra: Node.apply(x)


def _node_with_inputs(n: int, device: str):
    @custom_op(f"call_cost_probe::inputs_forward_{n}", schema="(Tensor x, Tensor[] ts) -> Tensor")
    def forward(x, ts):
        return x.clone()

    forward.register_fake(lambda x, ts: torch.empty_like(x))

    backward = _backward_op(f"call_cost_probe::inputs_backward_{n}")

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ts):
            ctx.save_for_backward(*ts)
            return forward.op(x, list(ts))

        @staticmethod
        def backward(ctx, g):
            return (backward.op(g, list(ctx.saved_tensors)), *(None,) * len(ctx.saved_tensors))

    return lambda x, extra: Node.apply(x, *extra)


def _step_us(make, n: int, device: str, steps: int, rounds: int) -> float:
    node = make(n, device)
    extras = [[torch.randn(4, device=device) for _ in range(n)] for _ in range(NODES)]

    def model(x):
        for extra in extras:
            x = node(x, extra)
        return x

    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, device=device, requires_grad=True)

    def step():
        compiled(x).sum().backward()

    for _ in range(5):
        step()
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times) * 1e6)
    return min(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 28])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--name", default="compiled_call_cost")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = []
    for knob, make in (("results", _node_with_results), ("inputs", _node_with_inputs)):
        for n in args.counts:
            us = _step_us(make, n, args.device, args.steps, args.rounds)
            results.append({"knob": knob, "extra_tensors_per_node": n, "nodes": NODES,
                            "step_us": round(us, 1)})
            print(f"{knob:8s} {n:3d} more per node, {NODES} nodes: {us:8.1f} us a step")
        base, most = results[-len(args.counts)], results[-1]
        per = (most["step_us"] - base["step_us"]) / (NODES * (most["extra_tensors_per_node"]
                                                              - base["extra_tensors_per_node"]))
        results.append({"knob": knob, "us_per_tensor_per_node": round(per, 2)})
        print(f"{knob:8s} about {per:.2f} us a step per tensor and node")
    write_result(args.name, {
        "environment": environment(),
        "description": ("host time of a compiled step (forward and backward) of a graph of "
                        f"{NODES} autograd nodes, each a forward and a backward custom op "
                        "(ops._backend.custom_op) doing a 4-element clone, with more tensors "
                        "returned by the forward op and saved (results) or more tensors "
                        "taken by both ops and saved (inputs); step_us: the smallest of the "
                        "rounds' medians"),
        "config": {"device": args.device, "steps": args.steps, "rounds": args.rounds},
        "results": results,
    })


if __name__ == "__main__":
    main()
