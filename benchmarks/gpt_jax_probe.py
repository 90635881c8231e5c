"""Where the JAX GPT demo's bf16 run departs on the GPU: its first steps under variants.

The demo's JAX bf16 run (examples/train_gpt.py --framework jax --device cuda) jumped at steps
3 and 5 where its FP8 run did not (gpt_demo_jax_h100.json); the PyTorch demo does neither.
The two JAX runs share weights and batches; in bf16, every GEMM is the core's (ops.gemm, through
the XLA FFI), where the PyTorch bf16 blocks use torch's matmul. This runs the demo's model, data
and schedule for ``--steps`` steps per variant and records each step's loss and global gradient
norm:

  - ``bf16``: the demo's bf16 run as it is;
  - ``bf16_xla_gemm``: the same, with every high-precision ops.gemm replaced by XLA's matmul
    (fp32 accumulation, the same output dtype): the core's GEMM out of the picture;
  - ``fp8_delayed``: the demo's FP8 run;
  - ``fp32``: the model in fp32 (parameters and compute) through the core.

Before the runs, the first step's gradients of ``bf16`` and ``bf16_xla_gemm`` (same weights and
batch) are compared leaf by leaf (relative L2 difference), and ops.gemm is checked against
XLA's matmul at the model's GEMM shapes in every transpose form the modules use. JSON goes to
``results/<name>.json``, written after each part so a cut-off run keeps what it finished.

    python benchmarks/gpt_jax_probe.py                       # GPU: the demo's GPU size
    python benchmarks/gpt_jax_probe.py --smoke               # CPU: tiny, two steps
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt  # noqa: E402  (examples/, for the demo's sizes)
from gpt import data, loop, model_jax  # noqa: E402

import transformer_engine.jax as te  # noqa: E402
from transformer_engine.jax import ops  # noqa: E402

RESULTS = Path(os.environ.get("TE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
_CORE_GEMM = ops.gemm


def xla_gemm(a, b, *, a_scale_inv=None, b_scale_inv=None, transpose_a=False, transpose_b=False,
             bias=None, out_dtype=None, compute_amax=False, **kwargs):
    """ops.gemm by XLA's matmul for high-precision operands (FP8 ones stay the core's)."""
    if a_scale_inv is not None or b_scale_inv is not None or compute_amax:
        return _CORE_GEMM(a, b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv,
                          transpose_a=transpose_a, transpose_b=transpose_b, bias=bias,
                          out_dtype=out_dtype, compute_amax=compute_amax, **kwargs)
    lhs = a.T if transpose_a else a
    rhs = b.T if transpose_b else b
    d = jnp.matmul(lhs, rhs, preferred_element_type=jnp.float32)
    if bias is not None:
        d = d + bias.astype(jnp.float32)
    return d.astype(out_dtype if out_dtype is not None else a.dtype)


class ProbeRunner(model_jax.Runner):
    """The demo's runner whose step also returns the global norm of the gradients (before
    clipping) and the gradients themselves when asked."""

    def _train_step(self, params, others, opt_state, batch, lr):
        with self._autocast():
            loss, (grads, other_grads) = jax.value_and_grad(self._loss, argnums=(0, 1))(
                params, others, batch)
        norm = optax.global_norm(grads)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        others = te.update_collections(other_grads, others) if others else others
        return (loss, norm), params, others, opt_state

    def step(self, batch, lr):
        (loss, norm), self.params, self.others, self.opt_state = self._step(
            self.params, self.others, self.opt_state, jnp.asarray(batch), jnp.float32(lr))
        return loss, norm

    def grads(self, batch):
        def f(params, others):
            with self._autocast():
                return jax.grad(self._loss)(params, others, jnp.asarray(batch))
        return jax.jit(f)(self.params, self.others)


def leaf_differences(a, b) -> list[dict]:
    """Per leaf of two gradient trees: relative L2 difference and both norms, largest first."""
    rows = []
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a),
                                 jax.tree_util.tree_leaves_with_path(b), strict=True):
        x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
        ny = float(np.linalg.norm(y32))
        rows.append({"leaf": jax.tree_util.keystr(path),
                     "rel_diff": float(np.linalg.norm(x32 - y32)) / max(ny, 1e-30),
                     "norm": float(np.linalg.norm(x32)), "norm_ref": ny,
                     "finite": bool(np.isfinite(x32).all())})
    return sorted(rows, key=lambda r: -r["rel_diff"])


def gemm_checks(size, dtype) -> list[dict]:
    """ops.gemm against XLA's matmul (fp32 accumulation) at the model's GEMM shapes, in the
    forms the modules call: forward x @ W, dgrad dy @ W^T, wgrad x^T @ dy. Relative error is
    max |d - ref| / max |ref|; bf16 rounding of the output alone gives about 2^-9."""
    tokens = size.batch * size.seq
    rows = []
    key = jax.random.PRNGKey(1)
    for k, n in ((size.hidden, 3 * size.hidden), (size.hidden, size.hidden),
                 (size.hidden, size.ffn), (size.ffn, size.hidden)):
        key, k1, k2, k3 = jax.random.split(key, 4)
        x = jax.random.normal(k1, (tokens, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(k2, (k, n), jnp.float32) * 0.02).astype(dtype)
        dy = jax.random.normal(k3, (tokens, n), jnp.float32).astype(dtype)
        for form, args, kw in (("forward", (x, w), {}),
                               ("dgrad", (dy, w), {"transpose_b": True}),
                               ("wgrad", (x, dy), {"transpose_a": True})):
            got = jax.jit(lambda a, b, kw=kw: _CORE_GEMM(a, b, **kw))(*args)
            ref = jax.jit(lambda a, b, kw=kw: xla_gemm(a, b, **kw).astype(jnp.float32))(*args)
            got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
            rows.append({"form": form, "k": k, "n": n, "tokens": tokens,
                         "rel_err": float(np.abs(got32 - ref32).max() / np.abs(ref32).max()),
                         "finite": bool(np.isfinite(got32).all())})
            # Twice: a plan reused from the cache must give the same bits.
            again = np.asarray(jax.jit(lambda a, b, kw=kw: _CORE_GEMM(a, b, **kw))(*args),
                               np.float32)
            rows[-1]["repeat_bitwise"] = bool(np.array_equal(again, got32))
    return rows


def run_variant(name, built, fp8_recipe, batches, size, total_steps) -> dict:
    runner = ProbeRunner(built, fp8_recipe, "cuda" if jax.default_backend() == "gpu" else "cpu")
    warmup = max(1, total_steps // 10)
    losses, norms = [], []
    t0 = time.perf_counter()
    for step, batch in enumerate(batches, start=1):
        loss, norm = runner.step(batch, loop.learning_rate(step, total_steps, size.lr, warmup))
        losses.append(float(loss))
        norms.append(float(norm))
    return {"variant": name, "losses": losses, "grad_norms": norms,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int)
    p.add_argument("--smoke", action="store_true", help="the demo's quick size on the CPU")
    p.add_argument("--name", default="gpt_jax_probe")
    p.add_argument("--variants", nargs="*",
                   default=["bf16", "bf16_xla_gemm", "fp8_delayed", "fp32"])
    args = p.parse_args()
    size = train_gpt.SIZES["quick" if args.smoke else "cuda"]
    if args.layers:
        size = dataclasses.replace(size, layers=args.layers)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    corpus = data.load_corpus(size.corpus_bytes)
    batches = data.train_batches(corpus, size.steps, size.batch, size.seq, 0)[:args.steps]
    built = model_jax.build(size, device, 0)  # bf16 on the GPU, fp32 on the CPU
    out = {"benchmark": args.name,
           "environment": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           "device": model_jax.device_name(device), **model_jax.versions()},
           "description": __doc__.split("\n\n")[1].replace("\n", " "),
           "config": {**dataclasses.asdict(size), "probe_steps": args.steps}}
    path = RESULTS / f"{args.name}.json"

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))

    dtype = jnp.bfloat16 if device == "cuda" else jnp.float32
    out["gemm_checks"] = gemm_checks(size, dtype)
    save()
    first = batches[0]
    core = ProbeRunner(built, None, device).grads(first)
    ops.gemm = xla_gemm
    try:
        xla = ProbeRunner(built, None, device).grads(first)
    finally:
        ops.gemm = _CORE_GEMM
    out["first_grads_core_vs_xla_gemm"] = leaf_differences(core, xla)
    save()
    out["runs"] = []
    for name in args.variants:
        recipe = model_jax.RECIPES["delayed"]() if name.startswith("fp8") else None
        run_built = built
        if name == "fp32":
            model = model_jax.GPT(size, jnp.float32)
            variables = jax.tree_util.tree_map(
                lambda v: v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating)
                else v, built["variables"])
            run_built = {"model": model, "variables": variables}
        if name == "bf16_xla_gemm":
            ops.gemm = xla_gemm
        try:
            out["runs"].append(run_variant(name, run_built, recipe, batches, size, size.steps))
        finally:
            ops.gemm = _CORE_GEMM
        print(name, [round(v, 3) for v in out["runs"][-1]["losses"]],
              [round(v, 2) for v in out["runs"][-1]["grad_norms"]], flush=True)
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
