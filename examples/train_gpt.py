"""Train a small byte-level GPT of TransformerLayer in FP8 and in high precision, and compare.

The model reads bytes (a 256-token vocabulary) and learns to continue Python code: the corpus
is the standard library's own source, which every machine with Python has. It is trained twice
from the same initial weights on the same batches: under FP8 autocast (the chosen recipe) and
in high precision (bf16 on a GPU, fp32 on the CPU). The demo prints both runs' losses,
validation losses, throughput and peak memory, plots the loss curves, and samples a few lines
from each model through the KV cache. FP8 should leave the loss curve where high precision
puts it, and on a GPU run faster.

    python examples/train_gpt.py                          # CPU: FP8 emulated by the core
    python examples/train_gpt.py --device cuda            # real FP8 GEMMs (sm_89+)
    python examples/train_gpt.py --recipe current --steps 500 --json gpt.json
    python examples/train_gpt.py --framework jax          # the same in JAX/Flax
    python examples/train_gpt.py --quick                  # a few seconds: the CI smoke run
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import asdict, dataclass, replace

from gpt import data, loop, report  # examples/gpt/, beside this file


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    steps: int
    lr: float
    corpus_bytes: int  # read from the stdlib (a minimal one holds ~10 MiB); 1/20 held out
    valid_batches: int
    new_tokens: int  # sampled per prompt after training
    normalization: str = "LayerNorm"
    activation: str = "gelu"


# Per device. The CPU size takes about two minutes on two cores (FP8 emulated by the core);
# the GPU size is large enough (16k tokens a step, hidden 2048) that FP8 GEMMs outrun bf16.
# Its peak learning rate is 3e-4: at 6e-4 the first steps of Adam (nearly sign-like) threw the
# held-out loss up at this width in both frameworks (benchmarks/gpt_first_steps_probe.py), and
# the JAX demo's FP8 and bf16 runs ended 3.5% and 7.3% apart on two GPUs; at 3e-4 both
# frameworks train smoothly and end within 0.6% of each other (gpt_demo_*_h100.json).
SIZES = {
    "cpu": Size(layers=2, hidden=128, heads=4, ffn=512, seq=64, batch=16, steps=150, lr=3e-3,
                corpus_bytes=4 << 20, valid_batches=8, new_tokens=48),
    "cuda": Size(layers=8, hidden=2048, heads=16, ffn=8192, seq=2048, batch=8, steps=300,
                 lr=3e-4, corpus_bytes=8 << 20, valid_batches=8, new_tokens=128),
    # --quick, for CI: tiny, yet enough steps that the loss clearly falls.
    "quick": Size(layers=2, hidden=64, heads=2, ffn=256, seq=64, batch=8, steps=50, lr=3e-3,
                  corpus_bytes=1 << 20, valid_batches=2, new_tokens=16),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda when the framework sees a GPU, else cpu")
    p.add_argument("--recipe", choices=("delayed", "current", "block"), default="delayed")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (CI)")
    p.add_argument("--steps", type=int, help="training steps (default by size)")
    p.add_argument("--lr", type=float, help="peak learning rate (default by size)")
    p.add_argument("--layers", type=int, help="TransformerLayers (default by size)")
    p.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    p.add_argument("--activation", choices=("gelu", "swiglu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.8, help="sampling; 0 is greedy")
    p.add_argument("--plot", default="gpt_loss.png", help="loss-curve PNG ('' for none)")
    p.add_argument("--json", help="write the results (numbers, config, versions) here")
    args = p.parse_args(argv)
    for name in ("steps", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def pick_size(args, device: str) -> Size:
    size = SIZES["quick" if args.quick else device]
    overrides = {k: getattr(args, k) for k in ("steps", "lr", "layers", "normalization",
                                                "activation") if getattr(args, k) is not None}
    return replace(size, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Only the chosen framework is imported: either one alone is enough.
    backend = importlib.import_module(f"gpt.model_{args.framework}")
    device = args.device or backend.default_device()
    size = pick_size(args, device)
    ok, reason = backend.check_fp8()
    print(f"FP8 available: {ok} ({reason})")
    if not ok:
        return 1
    corpus = data.load_corpus(size.corpus_bytes)
    batches = data.train_batches(corpus, size.steps, size.batch, size.seq, args.seed)
    valid = data.valid_batches(corpus, size.valid_batches, size.batch, size.seq, args.seed)
    prompts = data.prompts(corpus)
    high = "bf16" if device == "cuda" else "fp32"
    print(f"corpus: {corpus.describe()}")
    print(f"GPT ({args.framework}): {size.layers} x TransformerLayer(hidden {size.hidden}, ffn "
          f"{size.ffn}, {size.heads} heads, {size.normalization}, {size.activation}, RoPE), "
          f"seq {size.seq}, batch {size.batch} ({size.seq * size.batch} tokens/step), "
          f"{size.steps} steps, AdamW peak lr {size.lr}, on {device} "
          f"({backend.device_name(device)})")
    initial = backend.build(size, device, args.seed)
    fp8_recipe = backend.RECIPES[args.recipe]()
    warmup = max(1, size.steps // 10)
    runs = {}
    for key, label, run_recipe in (("fp8", f"FP8 {args.recipe}", fp8_recipe),
                                   ("high_precision", high, None)):
        runner = backend.Runner(initial, run_recipe, device)
        runs[key] = loop.run(label, runner, batches, valid, size.lr, warmup, prompts,
                             size.new_tokens, args.temperature, args.seed)
        del runner  # frees the run's weights and optimizer state before the next run
    report.print_table(runs)
    report.print_comparison(runs["fp8"], runs["high_precision"], type(fp8_recipe).__name__,
                            emulated=device == "cpu")
    report.print_samples(runs, prompts)
    title = (f"byte-level GPT, {size.layers} layers x {size.hidden} ({args.framework}, "
             f"{device}): FP8 {args.recipe} vs {high}")
    if args.plot:
        report.plot(runs, args.plot, title)
    if args.json:
        config = {**asdict(size), "framework": args.framework, "recipe": repr(fp8_recipe),
                  "high_precision": high, "seed": args.seed, "warmup": warmup,
                  "temperature": args.temperature, "corpus": corpus.describe(),
                  "corpus_sha256": corpus.sha256}
        report.write_json(args.json, runs, config, backend.device_name(device),
                          backend.versions())
    return 0


if __name__ == "__main__":
    sys.exit(main())
