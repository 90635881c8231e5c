"""Train a small MLP of te.Linear layers in FP8 and in high precision, and compare the losses.

A fixed random "teacher" MLP maps random inputs to targets; a "student" MLP built from
te.Linear learns to imitate it from data made on the fly. The student is trained twice from
the same initial weights on the same batches: once under te.fp8_autocast (the chosen recipe),
once in plain high precision. FP8 should leave the loss curve where high precision puts it.

    python examples/train_mlp_fp8.py                     # CPU: FP8 emulated by the core
    python examples/train_mlp_fp8.py --device cuda       # real FP8 GEMMs (sm_89+)
    python examples/train_mlp_fp8.py --recipe block --steps 300
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from progress import Progress  # examples/progress.py, beside this file

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID,
                                             amax_history_len=16),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
# (in, hidden, out, batch): small enough for the CPU path (an fp32 loop), and a GPU size.
SIZES = {"cpu": (64, 128, 32, 128), "cuda": (1024, 4096, 1024, 8192)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, help="hidden width (default by device)")
    p.add_argument("--batch", type=int, help="samples per step (default by device)")
    return p.parse_args(argv)


def make_teacher(d_in: int, d_hidden: int, d_out: int, device) -> torch.nn.Module:
    teacher = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.Tanh(),
                                  torch.nn.Linear(d_hidden, d_out)).to(device)
    return teacher.requires_grad_(False)


def make_student(d_in: int, d_hidden: int, d_out: int, device, dtype) -> torch.nn.Module:
    def linear(i, o):
        return te.Linear(i, o, device=device, params_dtype=dtype)

    return torch.nn.Sequential(linear(d_in, d_hidden), torch.nn.GELU(),
                               linear(d_hidden, d_hidden), torch.nn.GELU(),
                               linear(d_hidden, d_out))


def train(student, teacher, fp8_recipe, args, sizes, device, dtype, label) -> dict:
    d_in, _, _, batch = sizes
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    data = torch.Generator(device=device).manual_seed(args.seed + 1)  # same batches each run
    progress = Progress(label, args.steps)
    losses = []
    for step in range(1, args.steps + 1):
        x = torch.randn(batch, d_in, device=device, generator=data).to(dtype)
        target = teacher(x.float()).to(dtype)
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = student(x)
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 10 == 0 or step == args.steps:
            progress.update(step, losses[-1].item(), step * batch)
    seconds = progress.close()
    tail = torch.stack(losses[-10:]).mean().item()
    return {"final_loss": tail, "first_loss": losses[0].item(), "seconds": seconds,
            "samples_per_s": args.steps * batch / seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    d_in, d_hidden, d_out, batch = SIZES[device.type]
    sizes = (d_in, args.hidden or d_hidden, d_out, args.batch or batch)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ok, reason = te.is_fp8_available(return_reason=True)
    print(f"FP8 available: {ok} ({reason})")
    if not ok:
        return 1
    torch.manual_seed(args.seed)
    teacher = make_teacher(sizes[0], sizes[1], sizes[2], device)
    student = make_student(sizes[0], sizes[1], sizes[2], device, dtype)
    print(f"student MLP {sizes[0]} -> {sizes[1]} -> {sizes[1]} -> {sizes[2]} ({dtype}), "
          f"batch {sizes[3]}, {args.steps} steps, Adam lr {args.lr}, on {device}")
    fp8_recipe = RECIPES[args.recipe]()
    runs = {}
    for label, r in ((f"FP8 {args.recipe}", fp8_recipe), ("high precision", None)):
        runs[label] = train(copy.deepcopy(student), teacher, r, args, sizes, device, dtype,
                            label)
    fp8, hp = runs[f"FP8 {args.recipe}"], runs["high precision"]
    print(f"\n{'run':>16} {'first loss':>11} {'final loss':>11} {'samples/s':>10}")
    for label, run in runs.items():
        print(f"{label:>16} {run['first_loss']:11.5f} {run['final_loss']:11.5f} "
              f"{run['samples_per_s']:10.0f}")
    gap = (fp8["final_loss"] - hp["final_loss"]) / hp["final_loss"]
    print(f"\nFP8 ({type(fp8_recipe).__name__}) final loss is {gap:+.2%} from high precision; "
          f"the loss fell {hp['first_loss'] / hp['final_loss']:.1f}x in high precision and "
          f"{fp8['first_loss'] / fp8['final_loss']:.1f}x in FP8.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
