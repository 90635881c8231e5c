"""Why the JAX GPT demo's FP8 loss parted from bf16 after its first update, on the CPU.

Flax's random initializers drawn directly in bf16 take only 128 distinct values. FP8's
per-tensor scale maps that lattice onto FP8's rounding boundaries in step, so a small update
(Adam's first step moves each weight by about the learning rate) flips many weights' FP8 values
at once, each by a whole FP8 step: FP8 then sees the update larger than it is. Drawn in float32
and rounded to bf16 (what torch's ``normal_`` does for a bf16 tensor, and what the Flax modules
now do), the weights are spread and FP8 sees the update as bf16 does.

Two measurements, each with kernels drawn both ways:
  - one DenseGeneral (bf16 kernel, N(0, 0.023^2)): the change of a linear loss when the kernel
    moves by 1e-5 against its gradient's sign, in FP8 (delayed scaling, scales from the
    kernel's own amax) over the exact change (float32 math on the same bf16 kernels);
  - the demo's GPT at its GPU width (hidden 2048, 16 heads, FFN 8192) cut to 2 layers and
    2 x 128 tokens, bf16 parameters: FP8 and bf16 runs from the same weights, the loss of the
    second step (after one update) and their gap.

    python benchmarks/fp8_init_lattice_probe.py --json out.json          # about 2 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt  # noqa: E402  (examples/)
from gpt import data  # noqa: E402
from gpt import model_jax as mj  # noqa: E402

import transformer_engine.jax as te  # noqa: E402
import transformer_engine.jax.flax as te_flax  # noqa: E402

STD = 0.023
_FLAX_NORMAL = nn.initializers.normal


def _drawn_in_bf16(std: float):
    """flax's initializers.normal drawn in bf16 whatever dtype the module asks for."""
    def init(key, shape, dtype=jnp.float32):
        return _FLAX_NORMAL(std)(key, shape, jnp.bfloat16).astype(dtype)
    return init


def dense_ratio(draw, k: int = 2048, m: int = 256) -> dict:
    recipe = mj.RECIPES["delayed"]()
    x = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32)
    layer = te_flax.DenseGeneral(k, use_bias=False, dtype=jnp.bfloat16, kernel_init=draw(STD))
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        variables = layer.init(jax.random.PRNGKey(3), x)
    metas, params = flax.core.pop(variables, "params")

    def loss(p, fp8):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            y = layer.apply({"params": p, **(metas if fp8 else {})}, x)
        return float(jnp.sum(c * y.astype(jnp.float32)))

    w0 = params["kernel"]
    g = x.astype(jnp.float32).T @ c
    w1 = (w0.astype(jnp.float32) - 1e-5 * jnp.sign(g)).astype(jnp.bfloat16)
    exact = float(jnp.sum(c * (x.astype(jnp.float32) @ (w1 - w0).astype(jnp.float32))))
    fp8 = loss({"kernel": w1}, True) - loss({"kernel": w0}, True)
    return {"distinct_kernel_values": int(np.unique(np.asarray(w0, np.float32)).size),
            "weights_changed": float(jnp.mean(w1 != w0)), "exact_change": exact,
            "fp8_change": fp8, "fp8_over_exact": fp8 / exact}


def gpt_gap(draw) -> dict:
    size = replace(train_gpt.SIZES["cuda"], layers=2, seq=128, batch=2, steps=2,
                   corpus_bytes=1 << 20)
    batches = data.train_batches(data.load_corpus(size.corpus_bytes), 2, size.batch, size.seq, 0)
    nn.initializers.normal = draw  # (the demo's kernel initializers)
    try:
        model = mj.GPT(size, jnp.bfloat16)
        with te.fp8_autocast(enabled=True, fp8_recipe=mj.RECIPES["delayed"]()):
            variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, size.seq), jnp.int32))
    finally:
        nn.initializers.normal = _FLAX_NORMAL
    built = {"model": model, "variables": variables}
    out = {}
    for name, recipe in (("bf16", None), ("fp8", mj.RECIPES["delayed"]())):
        runner = mj.Runner(built, recipe, "cpu")
        handles = [runner.step(b, 1e-5) for b in batches]
        out[f"{name}_losses"] = [float(v) for v in runner.read(handles)[:, 0]]
    out["second_step_gap"] = out["fp8_losses"][1] / out["bf16_losses"][1] - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    jax.config.update("jax_default_device", jax.devices("cpu")[0])
    rows = []
    for how, draw in (("drawn in bf16 (flax's initializers)", _drawn_in_bf16),
                      ("drawn in float32, rounded to bf16", mj._normal)):
        row = {"kernels": how, "dense": dense_ratio(draw), "gpt": gpt_gap(draw)}
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "fp8_init_lattice_probe",
            "environment": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "device": "cpu", "python": platform.python_version(),
                "jax": jax.__version__, "flax": flax.__version__,
                "transformer_engine": te.__version__},
            "description": __doc__.split("\n\n")[1].replace("\n", " "),
            "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
