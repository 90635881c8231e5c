"""Where the memory of one Transformer layer's training step goes, bf16 against FP8.

The layer is the getting-started one: ``te.MultiheadAttention(input_layernorm=True)`` and
``te.LayerNormMLP`` with residuals, sbhd, bf16 parameters, forward + backward of a fixed output
gradient. For bf16 and for each FP8 recipe (DelayedScaling, Float8CurrentScaling, and
DelayedScaling with fp8_dpa and fp8_mha) it measures, per component (the QKV projection with its
norm, attention, the output projection, the MLP):

* saved: the bytes the forward leaves for the backward: every tensor autograd saves, seen
  through ``torch.autograd.graph.saved_tensors_hooks``, counted once per storage (views of one
  buffer share it) and at the size of the whole storage; parameters are left out (both steps
  save the same ones, and they exist anyway).
* held: the bytes the modules keep between steps besides parameters and gradients: FP8
  weight copies, cached transposes, the delayed-scaling buffers, the GEMM workspace.
* peak: the largest amount of memory the step allocated beyond what existed before it
  (gradients included: they are set to None before each step), in the forward and in the
  backward. On the CPU, from the allocator's own events (``torch.profiler`` with
  ``profile_memory``), so every allocation counts, those inside the ops too; on CUDA
  (``--device cuda``), ``torch.cuda.max_memory_allocated``. ``--live`` lists what is alive
  at the forward's and at the backward's peak by the op and the block (or backward node)
  that made it, from a dispatch mode
  that sees each op's outputs and a finalizer on each new storage (``LiveBytes``).

The estimate of a whole step's peak is parameters + held + the step's peak. At the
getting-started shape (seq 2048, batch 8, hidden 4096, ffn 16384, 32 heads of 128) the FP8
emulation of the CPU would take hours; the default is that shape scaled down with the same
ratios of ffn to hidden and tokens to hidden (hidden 512, ffn 2048, 4 heads of 128, seq 256,
batch 8). ``--extrapolate`` runs half the batch too and splits saved bytes and the peak into
a part per token and a fixed part (weights); both grow with the hidden size (per-token bytes
as hidden, weight bytes as its square, heads as hidden / 128), which gives the figures at
full size. Held bytes stay as measured (a CUDA run adds the GEMM workspace).

    python benchmarks/memory_probe.py                  # CPU, the scaled-down shape
    python benchmarks/memory_probe.py --extrapolate    # and the estimate at full size
    python benchmarks/memory_probe.py --device cuda --seq 2048 --batch 8 --hidden 4096 \
        --ffn 16384 --heads 32                         # GPU, measured

A probe, not a benchmark: it writes no result file and times nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import weakref
from collections import defaultdict
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COMPONENTS = ("qkv", "attention", "proj", "mlp", "other")
# te submodule -> component of the table.
_NAMES = {"layernorm_qkv": "qkv", "core_attention": "attention", "proj": "proj",
          "mlp": "mlp"}


def recipes() -> dict:
    from transformer_engine.common import recipe

    return {"bf16": None, "delayed": recipe.DelayedScaling(),
            "current": recipe.Float8CurrentScaling(),
            "delayed_mha": recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)}


class Layer(torch.nn.Module):
    """x + attention(x), then + mlp(...): the pre-norm layer of the getting-started guide."""

    def __init__(self, hidden: int, ffn: int, heads: int, device, dtype=torch.bfloat16):
        super().__init__()
        import transformer_engine.pytorch as te

        # One QKV weight (fuse_qkv_params): three would be concatenated at every forward,
        # and bf16 would save that copy for its backward.
        self.mha = te.MultiheadAttention(hidden, heads, attention_dropout=0.0,
                                         input_layernorm=True, qkv_format="sbhd",
                                         fuse_qkv_params=True, params_dtype=dtype,
                                         device=device)
        self.mlp = te.LayerNormMLP(hidden, ffn, params_dtype=dtype, device=device)

    def forward(self, x, is_first_microbatch=None):
        h = x + self.mha(x, is_first_microbatch=is_first_microbatch)
        return h + self.mlp(h, is_first_microbatch=is_first_microbatch)


# ------------------------------------------------------------ which component runs


class _Where:
    """The component whose forward is running (module hooks keep a stack)."""

    def __init__(self, layer: Layer):
        self.stack: list[str] = []
        self.handles = []
        for name, module in layer.named_modules():
            part = _NAMES.get(name.rsplit(".", 1)[-1])
            if part is not None:
                self.handles.append(module.register_forward_pre_hook(self._push(part)))
                self.handles.append(module.register_forward_hook(self._pop))

    def _push(self, part):
        def hook(module, args):
            self.stack.append(part)
        return hook

    def _pop(self, module, args, out):
        self.stack.pop()

    @property
    def now(self) -> str:
        return self.stack[-1] if self.stack else "other"

    def remove(self):
        for h in self.handles:
            h.remove()


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind t: its own, or a Float8Tensor's parts (data, transpose, scales)."""
    from transformer_engine.pytorch import Float8Tensor

    if isinstance(t, Float8Tensor):
        parts = (t._data, t._scale_inv, t._transpose, t._transpose_scale_inv)
        return [s for p in parts if p is not None for s in _storages(p)]
    return [t.untyped_storage()]


def _key(s: torch.UntypedStorage) -> tuple:
    return (s.device.type, s.data_ptr(), s.nbytes())


# ------------------------------------------------------------ the three figures


def _step(layer: Layer, x, grad, recipe, is_first_microbatch=None):
    import transformer_engine.pytorch as te

    for p in layer.parameters():
        p.grad = None
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = layer(x, is_first_microbatch)
    y.backward(grad)


def saved_bytes(layer: Layer, x, grad, recipe) -> dict:
    """Bytes saved for the backward per component, and per dtype ("fp8" for uint8 and torch's
    float8 dtypes): {"by_part": {part: bytes}, "by_dtype": {dtype: bytes}, "tensors": [...]}."""
    import transformer_engine.pytorch as te

    params = {_key(s) for p in layer.parameters() for s in _storages(p)}
    seen: set = set()
    where = _Where(layer)
    by_part: dict = defaultdict(int)
    by_dtype: dict = defaultdict(int)
    tensors = []

    def pack(t):
        for s in _storages(t):
            k = _key(s)
            if k in params or k in seen or s.nbytes() == 0:
                continue
            seen.add(k)
            dtype = "fp8" if t.dtype in (torch.uint8, torch.float8_e4m3fn,
                                         torch.float8_e5m2) else str(t.dtype).split(".")[-1]
            if isinstance(t, te.Float8Tensor):
                dtype = "fp8"
            by_part[where.now] += s.nbytes()
            by_dtype[dtype] += s.nbytes()
            tensors.append((where.now, dtype, tuple(t.shape), s.nbytes()))
        return t

    for p in layer.parameters():
        p.grad = None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = layer(x)
    finally:
        where.remove()
    y.backward(grad)
    return {"by_part": dict(by_part), "by_dtype": dict(by_dtype), "tensors": tensors}


def _walk(obj, depth: int = 0):
    """Tensors reachable from obj through dicts, lists, tuples (NamedTuples too)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v, depth + 1)


def held_bytes(layer: Layer) -> dict:
    """Bytes the modules keep between steps outside parameters and their gradients, by kind:
    "scaling" (delayed-scaling buffers), "weight_cache" (FP8 weight copies: the microbatch
    cache, a Float8Tensor parameter's cached transpose), "workspace" (the process's GEMM
    workspaces), "other" (any other tensor a module holds in its attributes)."""
    from transformer_engine.pytorch import Float8Tensor
    from transformer_engine.pytorch.ops import _backend

    # A Float8Tensor parameter's data and scale are the parameter; its transpose is a cache.
    skip = {_key(s) for p in layer.parameters()
            for s in ((p._data.untyped_storage(), p._scale_inv.untyped_storage())
                      if isinstance(p, Float8Tensor) else (p.untyped_storage(),))}
    skip |= {_key(s) for p in layer.parameters() if p.grad is not None
             for s in _storages(p.grad)}
    held: dict = defaultdict(int)
    seen: set = set()

    def add(kind, t):
        for s in _storages(t):
            k = _key(s)
            if k in seen or k in skip or s.nbytes() == 0:
                continue
            seen.add(k)
            held[kind] += s.nbytes()

    for p in layer.parameters():
        if isinstance(p, Float8Tensor) and p._transpose is not None:
            add("weight_cache", p._transpose)
    for module in layer.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                add("scaling" if name.startswith(("amax", "scale")) else "other", buf)
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            kind = "weight_cache" if "cache" in name else "other"
            for t in _walk(value):
                add(kind, t)
    for ws, _ in _backend._workspaces.values():
        add("workspace", ws)
    return dict(held)


def _cpu_peaks(layer: Layer, x, grad, recipe) -> dict:
    """The step's peak of allocated bytes over what existed before it, in the forward and in
    the backward, from the CPU allocator's events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import transformer_engine.pytorch as te

    for p in layer.parameters():
        p.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("probe::forward"):
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = layer(x)
        with record_function("probe::backward"):
            y.backward(grad)
            del y
    events = prof.profiler.kineto_results.events()
    spans = {e.name(): (e.start_ns(), e.end_ns()) for e in events
             if e.name().startswith("probe::")}
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, out = 0, {"forward": 0, "backward": 0, "end_of_forward": 0}
    fwd_end = spans["probe::forward"][1]
    for t, nbytes in mem:
        live += nbytes
        phase = "forward" if t <= fwd_end else "backward"
        out[phase] = max(out[phase], live)
        if t <= fwd_end:
            out["end_of_forward"] = live
    out["peak"] = max(out["forward"], out["backward"])
    return out


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensors the ops of a step create (a dispatch mode sees every op's
    outputs; a weakref finalizer on each new storage sees it freed) and the live set at the
    peak by creator: (component or backward node, op, dtype) -> bytes. Storages that existed
    before (``known``: parameters, inputs) are not counted, nor allocations an op makes and
    frees inside itself (the allocator events of ``_cpu_peaks`` count those)."""

    def __init__(self, where: _Where, known: set):
        super().__init__()
        self.where, self.known = where, known
        self.live: dict = {}
        self.bytes = 0
        # phase ("forward" / "backward", set by the caller) -> (peak, live set at it)
        self.phase = "forward"
        self.peaks: dict = {}

    def _freed(self, key):
        _, nbytes = self.live.pop(key)
        self.bytes -= nbytes

    def _creator(self) -> str:
        node = torch._C._current_autograd_node()
        return node.name() if node is not None else self.where.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for s in _storages(t):
                key = _key(s)
                if s.nbytes() == 0 or key in self.live or key in self.known:
                    continue
                tag = (self._creator(), str(func).rsplit(".", 1)[0].split(".")[-1],
                       str(t.dtype).split(".")[-1])
                self.live[key] = (tag, s.nbytes())
                self.bytes += s.nbytes()
                weakref.finalize(s, self._freed, key)
        if self.bytes > self.peaks.get(self.phase, (0,))[0]:
            snapshot: dict = defaultdict(int)
            for tag, nbytes in self.live.values():
                snapshot[tag] += nbytes
            self.peaks[self.phase] = (self.bytes, dict(snapshot))
        return out


def live_at_peak(layer: Layer, x, grad, recipe) -> dict:
    """Per phase ("forward", "backward"): (its peak bytes, the live set at that peak by
    creator) of one step, from LiveBytes."""
    import transformer_engine.pytorch as te

    for p in layer.parameters():
        p.grad = None
    gc.collect()
    known = {_key(s) for t in (*layer.parameters(), *layer.buffers(), x, grad)
             for s in _storages(t)}
    where = _Where(layer)
    mode = LiveBytes(where, known)
    try:
        with mode:
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = layer(x)
            mode.phase = "backward"
            y.backward(grad)
            del y
    finally:
        where.remove()
    return mode.peaks


def _cuda_peaks(layer: Layer, x, grad, recipe) -> dict:
    import transformer_engine.pytorch as te

    for p in layer.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = layer(x)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    end_of_forward = torch.cuda.memory_allocated() - base
    y.backward(grad)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"forward": fwd_peak, "backward": peak, "end_of_forward": end_of_forward,
            "peak": peak, "absolute_peak": torch.cuda.max_memory_allocated()}


def measure(name: str, recipe, shape: dict, device: str, with_live: bool = False,
            seed: int = 0) -> dict:
    torch.manual_seed(seed)
    s, b, h = shape["seq"], shape["batch"], shape["hidden"]
    layer = Layer(h, shape["ffn"], shape["heads"], device)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(s, b, h, dtype=torch.bfloat16, device=device)
    for _ in range(2):  # warm-up: FP8 state, workspaces, the compiled path's steady entry
        _step(layer, x, grad, recipe)
    saved = saved_bytes(layer, x, grad, recipe)
    held = held_bytes(layer)
    peaks = (_cuda_peaks if device == "cuda" else _cpu_peaks)(layer, x, grad, recipe)
    params = sum(s.nbytes() for p in layer.parameters() for s in _storages(p))
    total_saved = sum(saved["by_part"].values())
    total_held = sum(held.values())
    live = live_at_peak(layer, x, grad, recipe) if with_live else {}
    return {"recipe": name, "saved": saved, "live": live, "held": held, "peaks": peaks,
            "params": params, "total_saved": total_saved, "total_held": total_held,
            "estimate": params + total_held + peaks["peak"]}


# ------------------------------------------------------------ report


def _mb(n: float) -> str:
    return f"{n / 2**20:9.2f}"


def print_table(results: list[dict], title: str) -> None:
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    print(f"\n{title} (MiB; ratio to bf16 in brackets)")
    head = ["recipe", *(f"saved:{p}" for p in COMPONENTS), "saved", "held", "fwd peak",
            "bwd peak", "estimate"]
    print(" | ".join(f"{h:>14}" for h in head))
    for r in results:
        row = [r["recipe"]] + [_mb(r["saved"]["by_part"].get(p, 0)) for p in COMPONENTS]
        for key, value in (("total_saved", r["total_saved"]), ("total_held", r["total_held"]),
                           ("fwd", r["peaks"]["forward"]), ("bwd", r["peaks"]["backward"]),
                           ("estimate", r["estimate"])):
            ratio = ""
            if base is not None and r is not base:
                ref = {"total_saved": base["total_saved"], "total_held": base["total_held"],
                       "fwd": base["peaks"]["forward"], "bwd": base["peaks"]["backward"],
                       "estimate": base["estimate"]}[key]
                ratio = f" [{value / ref:.2f}]" if ref else ""
            row.append(_mb(value) + ratio)
        print(" | ".join(f"{c:>14}" for c in row))
    for r in results:
        by_dtype = sorted(r["saved"]["by_dtype"].items())
        dtypes = ", ".join(f"{k} {_mb(v).strip()}" for k, v in by_dtype)
        held = ", ".join(f"{k} {_mb(v).strip()}" for k, v in sorted(r["held"].items()))
        print(f"  {r['recipe']:>12}: saved by dtype: {dtypes}; held: {held}; "
              f"params {_mb(r['params']).strip()}")


def print_live(result: dict) -> None:
    for phase, (peak, at_peak) in result["live"].items():
        print(f"\nlive at the {phase} peak of {result['recipe']} ({_mb(peak).strip()} MiB; "
              "by creator):")
        for tag, nbytes in sorted(at_peak.items(), key=lambda kv: -kv[1]):
            if nbytes >= 1024:
                print(f"  {' '.join(f'{t:>12}' for t in tag)} {nbytes / 1024:10.1f} KiB")


def print_tensors(result: dict) -> None:
    print(f"\nsaved tensors of {result['recipe']} (component, dtype, shape, KiB):")
    for part, dtype, shape, nbytes in result["saved"]["tensors"]:
        print(f"  {part:>10} {dtype:>9} {str(list(shape)):>22} {nbytes / 1024:10.1f}")


def extrapolate(small: dict, large: dict, batch: tuple, shape: dict, full: dict) -> dict:
    """Figures at the full shape from two batch sizes at the probe's shape: saved bytes and
    the step's peak are each a + c * batch, a (weights, their gradients and FP8 copies)
    growing as hidden^2, c (per token) as hidden * tokens; parameters grow as hidden^2; held
    bytes (scaling state, workspaces) do not grow."""
    hs = full["hidden"] / shape["hidden"]
    tokens = (full["seq"] * full["batch"]) / shape["seq"]

    def fit(key):
        y0, y1 = key(small), key(large)
        c = (y1 - y0) / (batch[1] - batch[0])
        return (y0 - c * batch[0]) * hs * hs + c * tokens * hs

    out = {"saved": fit(lambda r: r["total_saved"]), "held": large["total_held"],
           "peak": fit(lambda r: r["peaks"]["peak"]), "params": large["params"] * hs * hs}
    out["estimate"] = out["params"] + out["held"] + out["peak"]
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--recipes", default="bf16,delayed,current,delayed_mha")
    ap.add_argument("--tensors", action="store_true", help="list every saved tensor")
    ap.add_argument("--live", action="store_true", help="the live set at the peak")
    ap.add_argument("--extrapolate", action="store_true",
                    help="also run batch / 2 and estimate the getting-started shape")
    ap.add_argument("--block-order", default="full", choices=("full", "own"),
                    help="the MLP backward's order: that of the getting-started shape "
                         "(full, default: the scaled-down run models it) or this shape's own")
    args = ap.parse_args(argv)
    shape = dict(seq=args.seq, batch=args.batch, hidden=args.hidden, ffn=args.ffn,
                 heads=args.heads)
    if args.block_order == "full":
        # The MLP backward picks its order by the size of FC1's output (LEAN_BYTES): the
        # scaled-down run takes the one the getting-started shape (2048 x 8 x 16384 bf16,
        # 512 MiB) takes.
        from transformer_engine.pytorch import layernorm_mlp_fn

        layernorm_mlp_fn.LEAN_BYTES = 0 if 2048 * 8 * 16384 * 2 >= layernorm_mlp_fn.LEAN_BYTES \
            else 2**62
    chosen = {k: v for k, v in recipes().items() if k in args.recipes.split(",")}
    results = [measure(name, r, shape, args.device, args.live) for name, r in chosen.items()]
    print_table(results, f"one layer, {shape}, {args.device}")
    if args.tensors:
        for r in results:
            print_tensors(r)
    if args.live:
        for r in results:
            print_live(r)
    if args.extrapolate:
        half = dict(shape, batch=args.batch // 2)
        smaller = [measure(name, r, half, args.device) for name, r in chosen.items()]
        full = dict(seq=2048, batch=8, hidden=4096, ffn=16384, heads=32)
        print(f"\nextrapolated to {full} (GB = 1e9 bytes):")
        est = {}
        for lo, hi in zip(smaller, results, strict=True):
            est[hi["recipe"]] = e = extrapolate(lo, hi, (half["batch"], args.batch), shape,
                                                full)
            print(f"  {hi['recipe']:>12}: saved {e['saved'] / 1e9:6.2f}  held "
                  f"{e['held'] / 1e9:6.2f}  step peak {e['peak'] / 1e9:6.2f}  params "
                  f"{e['params'] / 1e9:5.2f}  estimate {e['estimate'] / 1e9:6.2f}")
        if "bf16" in est:
            for name, e in est.items():
                if name != "bf16":
                    print(f"  {name}: estimate / bf16 = "
                          f"{e['estimate'] / est['bf16']['estimate']:.2f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
