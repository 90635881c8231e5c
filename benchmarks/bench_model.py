"""Whole-model speed (issue 20): a training step of a stack of 4 blocks, ours beside torch.

The model: 4 blocks on input [batch 4, seq 2048, hidden] (8192 tokens, bshd layout), bf16
parameters, heads of 128 channels, ffn = 4 x hidden, hidden 1024, 2048 and 4096. Stacks:
  - te_mha_mlp: per block x = x + te.MultiheadAttention(x) (input LayerNorm, causal, no
    dropout), then x = x + te.LayerNormMLP(x) (GELU, tanh form);
  - te_layer: 4 te.TransformerLayer (no dropout, causal), each step one autograd node (FP8
    or bf16) where the layer takes it (layer_block.py); te_layer_modules: the same layers
    through their modules' path (layer_block.enabled = False), for the comparison;
  - torch: the same blocks from torch's modules in bf16 (nn.LayerNorm, nn.Linear,
    F.scaled_dot_product_attention(is_causal=True), tanh GELU MLP), the peer of both stacks.
Ours run under three recipes, fp8_delayed (DelayedScaling), fp8_current
(Float8CurrentScaling) and bf16 (no fp8_autocast); torch runs in bf16. Executions:
  - eager;
  - compile: torch.compile(model) (inductor, default mode); the fp8_autocast stays outside the
    compiled forward, as a user writes it;
  - reduce_overhead: torch.compile(model, mode="reduce-overhead") (inductor's CUDA graphs);
  - cuda_graph (ours only): the whole step (autocast, forward, backward) captured once with
    torch.cuda.graph after warm-up steps on a side stream, on a static input; replays timed;
  - graphed_modules (ours only): each module of the stack graphed on its own (forward and
    backward) by te.make_graphed_callables, the step issued eagerly around the replays.
A step drops the gradients (as optimizer.zero_grad does), runs the forward and the backward of
loss = out.float().square().mean(). Each case builds a fresh model, and a case that fails
records its error and the run goes on.

Per case: median_ms, the step time from CUDA events (benchmarks/harness.py: time_cuda);
host_issue_ms, the wall time from the start of a step to the return of its backward, each
step issued on an idle GPU (median), the host's cost of one step when its launch queue does
not fill; host_back_to_back_ms, the wall time of issuing `steps` steps back to back before
synchronizing, per step: the host cost where the GPU is faster than the host, else close to
median_ms. A second part times one fwd + bwd of single modules at a tiny shape (hidden 256,
2 heads, 16 tokens, batch 1) on the host, synchronized at the end: the per-module overhead,
as a ratio to nn.Linear(256, 256)'s (the FP8 ones also with LayerNormLinear's and
LayerNormMLP's whole-block path off, compiled_blocks.enabled = False, the layer with
attention's q, k, v copied rather than read in place, attention_fn.packed_enabled = False,
and the layer through its modules' path, layer_block.enabled = False, for the comparison).

    python benchmarks/bench_model.py                       # all cases; results/model.json
    python benchmarks/bench_model.py --hidden 4096 --variants 'torch/*' 'te_*/fp8_delayed/*'
    python benchmarks/bench_model.py --list                 # the case names --variants matches
    python benchmarks/bench_model.py --device cpu --tiny --no-compile   # smoke run, no claims
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import harness
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import attention_fn, compiled_blocks, layer_block

HIDDENS = (1024, 2048, 4096)
BATCH, SEQ, HEAD_DIM, BLOCKS = 4, 2048, 128, 4
# The CPU smoke shape: every path runs, nothing about speed is claimed.
TINY = {"hidden": 256, "heads": 2, "seq": 32, "batch": 2, "steps": 2, "module_iters": 5}
# The per-module host probe: GPU work of a few microseconds, so host cost is what shows.
MODULE_HIDDEN, MODULE_HEADS, MODULE_TOKENS = 256, 2, 16

STACKS = ("te_mha_mlp", "te_layer", "te_layer_modules", "torch")
RECIPES = {"fp8_delayed": recipe.DelayedScaling, "fp8_current": recipe.Float8CurrentScaling,
           "bf16": None}
EXECUTIONS = ("eager", "compile", "reduce_overhead", "cuda_graph", "graphed_modules")
CUDA_ONLY = ("reduce_overhead", "cuda_graph", "graphed_modules")
COMPILED = ("compile", "reduce_overhead")
# The cases the ratios read: a run short of time measures these first, for every
# hidden size, and the others after them.
CORE = {"torch/bf16/compile", "torch/bf16/reduce_overhead",
        *(f"{s}/fp8_delayed/{e}" for s in ("te_mha_mlp", "te_layer")
          for e in ("eager", "compile", "cuda_graph", "graphed_modules"))}
# (ratio name, our execution, torch's execution): our median_ms / torch's (below 1: ours is
# faster).
RATIOS = (("eager_over_torch_compiled", "eager", "compile"),
          ("compiled_over_torch_compiled", "compile", "compile"),
          ("graphed_over_torch_reduce_overhead", "cuda_graph", "reduce_overhead"))


class TeBlocks(torch.nn.Module):
    """te.MultiheadAttention then te.LayerNormMLP per block, each with its residual add."""

    def __init__(self, hidden: int, heads: int, blocks: int, device):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device=device)
        self.attention = torch.nn.ModuleList(
            te.MultiheadAttention(hidden, heads, input_layernorm=True, attention_dropout=0.0,
                                  attn_mask_type="causal", qkv_format="bshd", **kw)
            for _ in range(blocks))
        self.mlp = torch.nn.ModuleList(te.LayerNormMLP(hidden, 4 * hidden, **kw)
                                       for _ in range(blocks))

    def forward(self, x):
        for attention, mlp in zip(self.attention, self.mlp, strict=True):
            x = x + attention(x)
            x = x + mlp(x)
        return x


def te_layers(hidden: int, heads: int, blocks: int, device) -> torch.nn.Module:
    return torch.nn.Sequential(*(
        te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0, attention_dropout=0.0,
                            self_attn_mask_type="causal", attn_input_format="bshd",
                            params_dtype=torch.bfloat16, device=device)
        for _ in range(blocks)))


class TorchBlock(torch.nn.Module):
    """One block from torch's modules: pre-LayerNorm causal self-attention (fused QKV linear,
    SDPA, output linear) and pre-LayerNorm MLP (linear, tanh GELU, linear), with residuals."""

    def __init__(self, hidden: int, heads: int, device):
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden, **kw)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.ln2 = torch.nn.LayerNorm(hidden, **kw)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x):  # x [b, s, hidden]
        b, s, hidden = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, hidden // self.heads)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # [b, heads, s, head_dim]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def build(stack: str, hidden: int, heads: int, device) -> torch.nn.Module:
    torch.manual_seed(0)
    if stack == "te_mha_mlp":
        return TeBlocks(hidden, heads, BLOCKS, device)
    if stack in ("te_layer", "te_layer_modules"):
        return te_layers(hidden, heads, BLOCKS, device)
    return torch.nn.Sequential(*(TorchBlock(hidden, heads, device) for _ in range(BLOCKS)))


def make_step(model, forward, x, fp8_recipe, mark_cudagraph_step: bool = False):
    """One training step: drop the gradients, forward (in fp8_autocast when there is a
    recipe), backward of a scalar loss. Takes and ignores the harness's call index."""
    params = list(model.parameters())

    def step(_: int = 0) -> None:
        for p in params:
            p.grad = None
        x.grad = None
        if mark_cudagraph_step:  # a new iteration for inductor's CUDA graph trees
            torch.compiler.cudagraph_mark_step_begin()
        autocast = (te.fp8_autocast(fp8_recipe=fp8_recipe) if fp8_recipe is not None
                    else contextlib.nullcontext())
        with autocast:
            out = forward(x)
        out.float().square().mean().backward()
    return step


def capture(step, warmup: int = 3):
    """Captures one whole step in a CUDA graph, as torch's docs show (warm-up on a side
    stream, gradients None before capture), and returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # drops the gradients first, so the graph allocates (and keeps) its own
    return lambda _=0: graph.replay()


def graph_modules(model, x, fp8_recipe) -> None:
    """te.make_graphed_callables over the stack's modules, each graphed on its own (forward
    and backward), after one eager step so that delayed scaling starts from real scales."""
    modules = (tuple(model) if isinstance(model, torch.nn.Sequential) else
               tuple(m for pair in zip(model.attention, model.mlp, strict=True) for m in pair))
    make_step(model, model, x, fp8_recipe)()
    model.zero_grad(set_to_none=True)
    sample = tuple((torch.randn_like(x).requires_grad_(),) for _ in modules)
    te.make_graphed_callables(modules, sample, fp8_enabled=fp8_recipe is not None,
                              fp8_recipe=fp8_recipe)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_times(step, device: str, steps: int) -> dict:
    """Host issue time of a step (see the module docstring), in milliseconds."""
    one = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        one.append((time.perf_counter() - start) * 1e3)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    back_to_back = (time.perf_counter() - start) * 1e3 / steps
    _sync(device)
    return {"host_issue_ms": statistics.median(one), "host_back_to_back_ms": back_to_back}


def compile_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def run_case(stack, recipe_name, execution, shape, device, steps, backend) -> dict:
    """Builds a fresh model, runs its first step (compiles or captures here) and times it."""
    batch, seq, hidden, heads = shape
    torch._dynamo.reset()  # no compiled code or recompile count carried over from a case
    layer_block.enabled = stack != "te_layer_modules"  # (the layer's step as one node or not)
    model = build(stack, hidden, heads, device)
    x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    fp8_recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] is not None else None
    forward = model
    if execution == "compile":
        forward = torch.compile(model, dynamic=False, backend=backend)
    elif execution == "reduce_overhead":
        forward = torch.compile(model, dynamic=False, mode="reduce-overhead")
    step = make_step(model, forward, x, fp8_recipe, execution == "reduce_overhead")
    before = compile_counts()
    start = time.perf_counter()
    if execution == "cuda_graph":
        step = capture(step)
    elif execution == "graphed_modules":
        graph_modules(model, x, fp8_recipe)
    step()
    _sync(device)
    first_step_s = time.perf_counter() - start
    # What compilation made of the step: graph breaks split it, and a skipped CUDA graph
    # leaves reduce_overhead timing plain compiled code (inductor only logs why).
    compiled = ({k: v - before[k] for k, v in compile_counts().items()}
                if execution in COMPILED else {})
    if device == "cuda":
        timed = harness.time_cuda(step, batch=2, repeats=steps, warmup=1)
    else:
        timed = harness.time_host(step, repeats=steps)
    return {**timed, "first_step_s": first_step_s, **compiled, **host_times(step, device, steps)}


def _error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]


def _cleanup(device: str) -> None:
    """After a case, and above all after a failed one: drain the GPU, drop compiled code,
    CUDA graph pools and the model."""
    with contextlib.suppress(Exception):
        _sync(device)
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def case_names() -> list[str]:
    names = []
    for stack in STACKS:
        for recipe_name in (("bf16",) if stack == "torch" else RECIPES):
            for execution in EXECUTIONS:
                if not (stack == "torch" and execution in ("cuda_graph", "graphed_modules")):
                    names.append(f"{stack}/{recipe_name}/{execution}")
    return names


def selected(patterns: list[str] | None) -> list[str]:
    names = case_names()
    if not patterns:
        return names
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]


def why_skipped(name: str, args, started: float) -> str | None:
    execution = name.split("/")[2]
    if args.device != "cuda" and execution in CUDA_ONLY:
        return "needs CUDA"
    if args.no_compile and execution in COMPILED:
        return "--no-compile"
    if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
        return f"time budget of {args.budget_s:g} s spent"
    return None


def bench_models(args, shapes: list[tuple], started: float, rows: list[dict]) -> list[dict]:
    """Runs the selected cases, appending each one's row to ``rows`` as it ends (an
    interrupted run keeps the cases done)."""
    names = selected(args.variants)
    # Ratio cases first, for every hidden size; the stable sort keeps the order otherwise.
    todo = sorted(((shape, n) for shape in shapes for n in names), key=lambda c: c[1] not in CORE)
    for shape, name in todo:
        stack, recipe_name, execution = name.split("/")
        row = {"op": f"step_{execution}", "impl": f"{stack} {recipe_name}", "case": name,
               "stack": stack, "recipe": recipe_name, "execution": execution,
               "hidden": shape[2], "shape_bsh": list(shape[:3]), "heads": shape[3]}
        skip = why_skipped(name, args, started)
        if skip is not None:
            rows.append({**row, "skipped": skip})
            print(f"{name:36s} hidden {shape[2]:5d}: skipped ({skip})")
            continue
        try:
            if args.isolate:
                row.update(run_isolated(name, shape, args))
            else:
                row.update(run_case(stack, recipe_name, execution, shape, args.device,
                                    args.steps, args.compile_backend))
            print(f"{name:36s} hidden {shape[2]:5d}: {row['median_ms']:9.3f} ms, host "
                  f"{row['host_issue_ms']:8.3f} ms/step, first step {row['first_step_s']:.1f} s")
        except Exception as err:  # noqa: BLE001 (recorded in the result, the run goes on)
            row["error"] = _error(err)
            print(f"{name:36s} hidden {shape[2]:5d}: FAILED {row['error']}")
        _cleanup(args.device)
        rows.append(row)
    return rows


def run_isolated(name: str, shape: tuple, args) -> dict:
    """run_case in a fresh Python process of this script (--isolate): in one long process the
    cases measured late run slower than the same cases in a fresh one (host-bound steps:
    results/model_layer_block_h100_b7a82ed.json against
    model_layer_block_1024_separate_h100.json), so a comparison across cases is fair only
    where each starts alike."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--device", args.device, "--variants", name,
               "--module-iters", "0", "--name", "case", "--steps", str(args.steps),
               "--compile-backend", args.compile_backend]
        cmd += ["--tiny"] if args.tiny else ["--hidden", str(shape[2])]
        done = subprocess.run(cmd, env={**os.environ, "TE_BENCH_RESULTS": tmp},
                              capture_output=True, text=True, check=False)
        path = Path(tmp) / "case.json"
        if not path.exists():
            raise RuntimeError(f"the case's process wrote no result (exit {done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1:] or ''}")
        (row,) = json.loads(path.read_text())["results"]
    if "error" in row:
        raise RuntimeError(row["error"])
    return {k: v for k, v in row.items() if k not in ("op", "impl", "case", "stack", "recipe",
                                                     "execution", "hidden", "shape_bsh",
                                                     "heads")}


def ratios(rows: list[dict]) -> list[dict]:
    """Our median_ms over torch's, per hidden size, stack, recipe and ratio of RATIOS."""
    ms = {(r["hidden"], r["case"]): r["median_ms"] for r in rows if "median_ms" in r}
    out = []
    for hidden in sorted({r["hidden"] for r in rows}):
        for stack in ("te_mha_mlp", "te_layer", "te_layer_modules"):
            for recipe_name in RECIPES:
                for ratio, ours, peer in RATIOS:
                    a = ms.get((hidden, f"{stack}/{recipe_name}/{ours}"))
                    b = ms.get((hidden, f"torch/bf16/{peer}"))
                    if a is not None and b is not None:
                        out.append({"hidden": hidden, "stack": stack, "recipe": recipe_name,
                                    "ratio": ratio, "value": a / b})
    for r in out:
        print(f"  hidden {r['hidden']:5d} {r['stack']:10s} {r['recipe']:11s} "
              f"{r['ratio']:34s} {r['value']:.3f}")
    return out


def module_host_times(device: str, iters: int) -> list[dict]:
    """Host milliseconds of one fwd + bwd of single modules at a tiny shape, synchronized at
    the end of each, median over ``iters``; and each over nn.Linear(256, 256)'s."""
    h, bf16 = MODULE_HIDDEN, torch.bfloat16
    x = torch.randn(1, MODULE_TOKENS, h, device=device, dtype=bf16, requires_grad=True)
    grad = torch.randn_like(x)
    torch.manual_seed(0)
    kw = dict(params_dtype=bf16, device=device)
    pair = TeBlocks(h, MODULE_HEADS, 1, device)
    layer = te.TransformerLayer(h, 4 * h, MODULE_HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", attn_input_format="bshd", **kw)
    linear = torch.nn.Linear(h, h, device=device, dtype=bf16)
    # (torch's own block of the same layers: what a block of plain torch modules costs on
    # this host, the yardstick for the TE blocks beside nn.Linear's)
    torch_block = TorchBlock(h, MODULE_HEADS, device)
    # (blocks: whether LayerNormLinear and LayerNormMLP run as whole blocks, compiled_blocks.py;
    # off, their step operators with the Python steps around them, for the comparison)
    # (packed: whether attention reads q, k, v in place from the QKV output, attention_fn.py)
    # (node: whether te.TransformerLayer's step is one autograd node, layer_block.py, which
    # stands on the whole blocks and packed attention: off where either is)
    cases = {"te.MultiheadAttention + te.LayerNormMLP fp8_delayed":
                 (pair, "fp8_delayed", True, True, True),
             "te.MultiheadAttention + te.LayerNormMLP fp8_delayed, whole blocks off":
                 (pair, "fp8_delayed", False, True, True),
             "te.MultiheadAttention + te.LayerNormMLP bf16": (pair, "bf16", True, True, True),
             "te.TransformerLayer fp8_delayed": (layer, "fp8_delayed", True, True, True),
             "te.TransformerLayer fp8_current": (layer, "fp8_current", True, True, True),
             "te.TransformerLayer fp8_delayed, layer node off":
                 (layer, "fp8_delayed", True, True, False),
             "te.TransformerLayer fp8_delayed, whole blocks off":
                 (layer, "fp8_delayed", False, True, True),
             "te.TransformerLayer fp8_delayed, packed attention off":
                 (layer, "fp8_delayed", True, False, True),
             "te.TransformerLayer bf16": (layer, "bf16", True, True, True),
             "te.TransformerLayer bf16, layer node off": (layer, "bf16", True, True, False),
             "torch block (nn.LayerNorm, nn.Linear, SDPA) bf16":
                 (torch_block, "bf16", True, True, True),
             "nn.Linear(256, 256) bf16": (linear, "bf16", True, True, True)}
    rows = []
    for name, (module, recipe_name, blocks, packed, node) in cases.items():
        compiled_blocks.enabled = blocks
        attention_fn.packed_enabled = packed
        layer_block.enabled = node
        fp8_recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] is not None else None
        params = list(module.parameters())

        def step(module=module, fp8_recipe=fp8_recipe, params=params):
            for p in params:
                p.grad = None
            x.grad = None
            autocast = (te.fp8_autocast(fp8_recipe=fp8_recipe) if fp8_recipe is not None
                        else contextlib.nullcontext())
            with autocast:
                y = module(x)
            y.backward(grad)
            _sync(device)

        row = {"module": name, "recipe": recipe_name, "shape_bsh": [1, MODULE_TOKENS, h],
               "iters": iters}
        try:
            for _ in range(max(3, iters // 10)):
                step()
            per = []
            for _ in range(iters):
                start = time.perf_counter()
                step()
                per.append((time.perf_counter() - start) * 1e3)
            row["host_ms"] = statistics.median(per)
        except Exception as err:  # noqa: BLE001 (recorded in the result)
            row["error"] = _error(err)
            _cleanup(device)
        rows.append(row)
    compiled_blocks.enabled = True
    attention_fn.packed_enabled = True
    layer_block.enabled = True
    base = rows[-1].get("host_ms")
    for row in rows:
        if base and "host_ms" in row:
            row["ratio_to_nn_linear"] = row["host_ms"] / base
        print(f"{row['module']:56s} {row.get('host_ms', float('nan')):8.3f} ms  "
              f"x{row.get('ratio_to_nn_linear', float('nan')):.2f}  {row.get('error', '')}")
    return rows


def write(name: str, payload: dict, device: str) -> Path:
    """harness.write_result on a GPU; on the CPU (whose environment has no CUDA device to name)
    the same file, in the same directory, with the CPU named instead."""
    if device == "cuda":
        return harness.write_result(name, payload)
    import transformer_engine.common as te_common

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "transformer_engine": te_common.__version__,
           "python": platform.python_version(), "git_commit": harness._git_commit()}
    out_dir = Path(os.environ.get("TE_BENCH_RESULTS", harness.RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "environment": env, **payload}, indent=2)
                    + "\n")
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help=f"tiny shapes and steps ({TINY}); the CPU smoke run")
    parser.add_argument("--hidden", type=int, nargs="+", choices=HIDDENS,
                        help="hidden sizes to run (default: all)")
    parser.add_argument("--variants", nargs="+", metavar="PATTERN",
                        help="cases to run: shell patterns over stack/recipe/execution names "
                             "(see --list), e.g. 'torch/*' 'te_*/fp8_delayed/*'")
    parser.add_argument("--steps", type=int, help="timed batches per case (default 10)")
    parser.add_argument("--budget-s", type=float,
                        help="wall seconds after which the remaining cases are recorded as "
                             "skipped (a case that started runs to its end)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile cases (slow on a small CPU)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="backend of the default-mode compile cases")
    parser.add_argument("--module-iters", type=int,
                        help="iterations of the per-module host probe (default 200; 0 skips)")
    parser.add_argument("--name", default="model", help="the result file's name")
    parser.add_argument("--isolate", action="store_true",
                        help="each case in a fresh process of its own (see run_isolated)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(case_names()))
        return None
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --tiny")
    if args.tiny:
        shapes = [(TINY["batch"], TINY["seq"], TINY["hidden"], TINY["heads"])]
    else:
        shapes = [(BATCH, SEQ, h, h // HEAD_DIM) for h in args.hidden or HIDDENS]
    args.steps = args.steps or (TINY["steps"] if args.tiny else 10)
    if args.module_iters is None:
        args.module_iters = TINY["module_iters"] if args.tiny else 200
    started = time.perf_counter()
    rows, module_rows, interrupted = [], [], False
    try:
        bench_models(args, shapes, started, rows)
        if args.module_iters:
            module_rows = module_host_times(args.device, args.module_iters)
    except KeyboardInterrupt:  # SIGINT (timeout -s INT): keep the cases that ended
        interrupted = True
        print("interrupted: writing the cases that ended")
    timing = "cuda_events" if args.device == "cuda" else "cpu_wall_clock (smoke run, no claims)"
    return write(args.name, {
        "description": "training step (zero_grad, forward, backward of "
                       "out.float().square().mean()) of 4 blocks, bshd, bf16 parameters, "
                       "causal: te_mha_mlp = te.MultiheadAttention + te.LayerNormMLP with "
                       "residuals, te_layer = te.TransformerLayer (its step one autograd node "
                       "where it takes it), te_layer_modules = te.TransformerLayer through its "
                       "modules' path, torch = the same blocks "
                       "from torch modules (SDPA); executions eager, compile (inductor), "
                       "reduce_overhead, cuda_graph (whole step captured, replays timed), "
                       "graphed_modules (te.make_graphed_callables per module). "
                       "median_ms: step time from CUDA events; host_issue_ms: wall time from a "
                       "step's start to its backward's return, issued on an idle GPU, "
                       "median; host_back_to_back_ms: wall time of issuing `steps` steps back "
                       "to back, per step, before synchronizing; first_step_s: the first "
                       "step (compilation, capture); graphs, graph_breaks, cudagraph_skips "
                       "(compiled cases): what dynamo and inductor made of the first step, "
                       "a cudagraph skip meaning reduce_overhead ran without CUDA graphs. "
                       "ratios: our median_ms / torch's (below 1: ours faster). module_host: "
                       "host ms of one fwd + bwd of a module at [1, 16, 256], synchronized, "
                       "median, and its ratio to nn.Linear's",
        "config": {"shapes_bsh_heads": [list(s) for s in shapes], "blocks": BLOCKS,
                   "ffn": "4 x hidden", "dtype": "bfloat16", "timing": timing,
                   "steps": args.steps, "variants": args.variants, "budget_s": args.budget_s,
                   "compile_backend": args.compile_backend, "no_compile": args.no_compile,
                   "wall_s": time.perf_counter() - started, "interrupted": interrupted,
                   "isolate": args.isolate},
        "results": rows,
        "ratios": ratios(rows),
        "module_host": module_rows,
    }, args.device)


if __name__ == "__main__":
    main()
