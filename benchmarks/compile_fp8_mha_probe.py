"""Why torch.compile(fullgraph=True) of te.MultiheadAttention under fp8_mha stops in Dynamo.

On the GPU machine's torch (2.11) Dynamo raised an AssertionError in
``overwrite_tensor_vt_proxy`` while tracing ``Fp8LinearFunction.apply`` under fp8_mha (the
test ``test_mha_fp8_mha_compiles_without_graph_breaks[cuda]``); the same test passes on the
CPU, under torch 2.13 and 2.11 alike, and with the CUDA test's sizes. This probe wraps that
Dynamo function to print, for the autograd function being traced, every graph output whose
tracked variable and the traced call's output disagree (a tensor tracked, something else
returned), then compiles the block's forward in a mode:

    default      torch.compile(fullgraph=True), as the test
    static       dynamic=False and no automatic dynamic shapes (a recompile with symbolic
                 sizes is one suspect: the outputs then carry SymInts)
    eager_first  one eager step before compiling (the first-step rule's branch is another)

    python benchmarks/compile_fp8_mha_probe.py [default|static|eager_first] [--all]

``--all`` prints every output pair, not only the disagreeing ones. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import traceback

import torch
import torch._dynamo.variables.higher_order_ops as hoo

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

_ORIGINAL = hoo.overwrite_tensor_vt_proxy
SHOW_ALL = False


def _traced_outputs(graph_output_vts, flat_variable):
    """overwrite_tensor_vt_proxy, printing the pairs it compares first."""
    tracked = list(graph_output_vts)
    items = flat_variable.items
    for i, (vt, out) in enumerate(zip(tracked, items, strict=False)):  # (Dynamo zips so)
        expects_tensor = isinstance(vt, (hoo.variables.SymNodeVariable,
                                         hoo.variables.TensorVariable))
        ok = not expects_tensor or out.is_tensor() or isinstance(out, hoo.SymNodeVariable)
        if not ok or SHOW_ALL:
            try:
                what = out.as_python_constant() if out.is_python_constant() else type(out).__name__
            except Exception as e:  # noqa: BLE001 (a probe: print whatever it is)
                what = repr(e)
            print(f"[probe] output {i}: tracked {type(vt).__name__} "
                  f"{getattr(vt, 'proxy', None)}, returned {type(out).__name__} {what}"
                  f"{'' if ok else '  <-- disagrees'}", flush=True)
    print(f"[probe] {len(tracked)} tracked outputs, {len(items)} returned", flush=True)
    return _ORIGINAL(graph_output_vts, flat_variable)


def main() -> None:
    global SHOW_ALL
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="default",
                    choices=("default", "static", "eager_first"))
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    SHOW_ALL = args.all
    hoo.overwrite_tensor_vt_proxy = _traced_outputs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "static":
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.assume_static_by_default = True
    mha = te.MultiheadAttention(1024, 8, num_gqa_groups=4, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, device=device,
                                fuse_qkv_params=True, qkv_weight_interleaved=False)
    x = torch.randn(256, 2, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)

    def forward(module, x):
        with te.fp8_autocast(fp8_recipe=r):
            return module(x)

    if args.mode == "eager_first":
        forward(mha, x).float().sum().backward()
    compiled = torch.compile(forward, fullgraph=True,
                             dynamic=False if args.mode == "static" else None)
    print(f"[probe] torch {torch.__version__} on {device}, mode {args.mode}", flush=True)
    for step in range(2):
        try:
            compiled(mha, x).float().sum().backward()
            print(f"[probe] step {step}: compiled and ran", flush=True)
        except Exception as e:  # noqa: BLE001 (a probe: report and stop)
            print(f"[probe] step {step}: {type(e).__name__}: {str(e)[:3000]}", flush=True)
            traceback.print_exc(limit=-12)
            break


if __name__ == "__main__":
    main()
