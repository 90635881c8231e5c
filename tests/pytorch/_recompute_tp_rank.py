"""One rank of the tests of te.checkpoint(distribute_saved_activations=True)
(test_activation_recompute_tp.py): ``python _recompute_tp_rank.py RANK WORLD PORT``.

Every rank runs the same blocks on the same input with and without the checkpoint and checks
that the outputs, the input's gradient and the parameters' gradients are the same bits, and
that what the checkpoint keeps of the input is this rank's 1/tp of it. Failures are printed and
the exit status is 1. A standalone script, as _tp_rank.py.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, exact

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
H, FFN = 32, 64
LEAD = (4, 6)

RECIPES = {
    "none": None,
    "delayed": recipe.DelayedScaling(amax_history_len=3),
    "current": recipe.Float8CurrentScaling(),
}


def blocks(kind: str, group) -> torch.nn.Module:
    """The checkpointed block, the same on every rank of ``group`` (seed 0)."""
    torch.manual_seed(0)
    if kind == "layers":
        return _tp_world.layer_stack(H)
    return torch.nn.Sequential(
        te.LayerNormMLP(H, FFN, tp_group=group, tp_size=group.size(), set_parallel_mode=True,
                        device="cpu"),
        torch.nn.Dropout(0.25),  # the recompute must draw the same mask
        te.LayerNormLinear(H, H, device="cpu"))


def steps(model, x, r, group, checkpointed: bool, n: int = 2) -> list:
    """Per training step: output, input gradient, parameter gradients, FP8 buffers."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(n):
        inp = x.clone().requires_grad_()
        torch.manual_seed(100 + step)  # dropout's mask, the same on every rank
        with te.fp8_autocast(enabled=r is not None, fp8_recipe=r, fp8_group=group):
            if checkpointed:
                y = te.checkpoint(model, inp, distribute_saved_activations=True,
                                  tp_group=group)
            else:
                y = model(inp)
        y.square().mean().backward()  # after the autocast exit, as in training
        record.append((y.detach(), inp.grad, [p.grad.clone() for p in model.parameters()],
                       [b.clone() for b in model.buffers()]))
        opt.step()
        opt.zero_grad()
    return record


def check_same_as_without_recompute(kind: str, recipe_name: str, groups) -> None:
    group, index = groups
    model = blocks(kind, group)
    # the input differs between groups (the ranks of one group hold the same one), so a
    # gather over the wrong ranks would show
    x = torch.randn(*LEAD, H, generator=torch.Generator().manual_seed(1 + index))
    r = RECIPES[recipe_name]
    plain = steps(copy.deepcopy(model), x, r, group, False)
    recomputed = steps(model, x, r, group, True)
    for step, (a, b) in enumerate(zip(plain, recomputed, strict=True)):
        exact(b[0], a[0], f"output, step {step}")
        exact(b[1], a[1], f"input gradient, step {step}")
        for i, (ga, gb) in enumerate(zip(a[2], b[2], strict=True)):
            exact(gb, ga, f"parameter {i} gradient, step {step}")
        for i, (ba, bb) in enumerate(zip(a[3], b[3], strict=True)):
            exact(bb, ba, f"buffer {i}, step {step}")


def check_awkward_sizes(shape, requires_grad: bool) -> None:
    """An element count that tp does not divide (the slices are padded), or smaller than tp
    (some ranks keep padding only); an input with and without a gradient."""
    torch.manual_seed(0)
    layer = te.Linear(shape[-1], 5, device="cpu")
    twin = copy.deepcopy(layer)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    got = []
    for checkpointed, module in ((False, twin), (True, layer)):
        inp = x.clone().requires_grad_(requires_grad)
        if checkpointed:
            y = te.checkpoint(module, inp, distribute_saved_activations=True, tp_group=GROUP)
        else:
            y = module(inp)
        y.square().sum().backward()
        got.append((y.detach(), inp.grad, module.weight.grad, module.bias.grad))
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = got
    exact(y1, y0, "output")
    exact(dw1, dw0, "weight gradient")
    exact(db1, db0, "bias gradient")
    if requires_grad:
        exact(dx1, dx0, "input gradient")
    else:
        assert dx0 is None and dx1 is None


def what_is_kept(model, x0, **keywords) -> tuple:
    """(whether te.checkpoint(model, x) keeps ``x`` itself alive after its forward, where
    nothing else holds it (a block's input made by the layer before); the element counts of
    the tensors it hands torch's checkpoint to keep)."""
    real = torch.utils.checkpoint.checkpoint
    handed = []

    def spy(function, *args, **kwargs):
        handed.extend(a.numel() for a in args if isinstance(a, torch.Tensor))
        return real(function, *args, **kwargs)

    x = x0 * 1.0
    ref = weakref.ref(x)
    torch.utils.checkpoint.checkpoint = spy
    try:
        y = te.checkpoint(model, x, **keywords)
    finally:
        torch.utils.checkpoint.checkpoint = real
    del x
    gc.collect()
    alive = ref() is not None
    y.sum().backward()  # the graph still works
    return alive, handed


def check_keeps_a_slice() -> None:
    model = blocks("mlp", GROUP)
    x0 = torch.randn(*LEAD, H, requires_grad=True, generator=torch.Generator().manual_seed(3))
    model(x0).sum().backward()  # whatever the modules make on their first call
    alive, handed = what_is_kept(model, x0)
    assert alive and handed == [x0.numel()], (alive, handed)
    alive, handed = what_is_kept(model, x0, distribute_saved_activations=True, tp_group=GROUP)
    assert not alive and handed == [-(-x0.numel() // WORLD)], (alive, handed)


def tp_groups():
    """(this rank's tensor-parallel group, its index): one group of all ranks, and, in a
    world of 4, two groups of 2 (every rank creates every group)."""
    pairs = [dist.new_group(list(r)) for r in ((0, 1), (2, 3))] if WORLD == 4 else None
    return [(GROUP, 0)] + ([(pairs[RANK // 2], RANK // 2)] if pairs else [])


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for groups in tp_groups():
        case(check_same_as_without_recompute, "mlp", "none", groups)
    case(check_same_as_without_recompute, "layers", "none", (GROUP, 0))
    for name in ("delayed", "current"):
        case(check_same_as_without_recompute, "mlp", name, (GROUP, 0))
    case(check_awkward_sizes, (3, 33), True)  # 99 elements
    case(check_awkward_sizes, (1, 1), False)  # fewer elements than ranks
    case(check_keeps_a_slice)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
