"""The GPT demo's first training steps in both frameworks, on the CPU, at the GPU model's size.

On the GPU the JAX demo's loss jumped in its first steps (``gpt_jax_probe_h100.json``), in bf16,
fp32 and FP8 alike, and its FP8 and bf16 final losses ended 3.5% apart. This asks whether the
jumps belong to the JAX model or to the training setup: it builds examples/train_gpt.py's GPU-size
model (8 layers, hidden 2048, FFN 8192, 16 heads) in fp32 on the CPU, in PyTorch and in JAX, and
runs the demo's own runner (AdamW, gradient clipping at 1.0, the demo's learning-rate ramp) for a
few steps on the demo's batches, shortened to ``--batch`` x ``--seq`` tokens so that a step takes
seconds. Per framework it records the initial gradient norm, each step's loss (on that step's
batch, before its update) and the mean loss of two held-out batches after each step: batches this
small differ in difficulty, so only the held-out loss tells a worse model from a harder
batch. With ``--json`` it writes them.

    python benchmarks/gpt_first_steps_probe.py --steps 5 --json out.json     # a few minutes
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt  # noqa: E402  (examples/)
from gpt import data, loop  # noqa: E402  (examples/gpt)


def _size(args):
    hidden = args.hidden
    return replace(train_gpt.SIZES["cuda"], layers=args.layers, hidden=hidden, heads=hidden // 128,
                   ffn=4 * hidden, seq=args.seq, batch=args.batch, corpus_bytes=2 << 20)


def _train(runner, batches, held_out, lrs) -> dict:
    """The demo runner's steps: each step's loss (before its update) and the held-out loss
    before the first step and after each."""
    losses, held = [], [runner.evaluate(held_out)]
    for b, lr in zip(batches, lrs, strict=True):
        losses.append(float(runner.step(b, lr)))
        held.append(runner.evaluate(held_out))
    return {"losses": losses, "held_out_losses": held}


def _torch_run(size, batches, held_out, lrs) -> dict:
    import torch

    model_torch = importlib.import_module("gpt.model_torch")
    torch.manual_seed(0)
    model = model_torch.GPT(size, torch.device("cpu"), torch.float32)
    runner = model_torch.Runner(model, None, "cpu")
    loss = runner._loss(runner._tensor(batches[0]))
    loss.backward()
    norm = float(torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in runner.model.parameters() if p.grad is not None])))
    runner.opt.zero_grad(set_to_none=True)
    return {"first_grad_norm": norm, **_train(runner, batches, held_out, lrs),
            "versions": model_torch.versions()}


def _jax_run(size, batches, held_out, lrs) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    model_jax = importlib.import_module("gpt.model_jax")
    built = model_jax.build(size, "cpu", 0)
    runner = model_jax.Runner(built, None, "cpu")
    grads = jax.grad(runner._loss)(runner.params, runner.others, jnp.asarray(batches[0]))
    norm = float(optax.global_norm(grads))
    return {"first_grad_norm": norm, **_train(runner, batches, held_out, lrs),
            "versions": model_jax.versions()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--frameworks", nargs="+", default=["torch", "jax"])
    p.add_argument("--warmup", type=int, default=30, help="warm-up steps of the schedule")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    size = _size(args)
    corpus = data.load_corpus(size.corpus_bytes)
    batches = data.train_batches(corpus, args.steps, size.batch, size.seq, 0)
    held_out = data.valid_batches(corpus, 2, size.batch, size.seq, 0)
    # The demo's schedule: 300 steps, warm-up 30 (or --warmup), the GPU size's peak rate.
    lrs = [loop.learning_rate(i + 1, 300, size.lr, args.warmup) for i in range(args.steps)]
    runs = {}
    for fw in args.frameworks:
        start = time.perf_counter()
        runs[fw] = (_torch_run if fw == "torch" else _jax_run)(size, batches, held_out, lrs)
        runs[fw]["seconds"] = time.perf_counter() - start
        print(f"{fw:6s} first grad norm {runs[fw]['first_grad_norm']:.3f}  losses "
              + " ".join(f"{v:.3f}" for v in runs[fw]["losses"]) + "  held out "
              + " ".join(f"{v:.3f}" for v in runs[fw]["held_out_losses"]), flush=True)
    if args.json:
        out = {"benchmark": "gpt_first_steps_probe",
               "environment": {"device": f"cpu ({platform.machine()})",
                               "python": platform.python_version(),
                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
               "description": __doc__.split("\n\n")[1].replace("\n", " "),
               "config": {"layers": size.layers, "hidden": size.hidden, "heads": size.heads,
                          "ffn": size.ffn, "seq": size.seq, "batch": size.batch,
                          "dtype": "float32", "peak_lr": size.lr, "warmup": args.warmup,
                          "learning_rates": lrs},
               "runs": runs}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
