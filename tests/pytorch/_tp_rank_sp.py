"""One rank of the sequence-parallel tests (test_parallel_worlds.py): ``python
_tp_rank_sp.py RANK WORLD PORT``. Every rank builds te.Linear (column and row),
te.LayerNormLinear and te.LayerNormMLP with ``sequence_parallel=True`` and the same modules
unsplit from the same seed, feeds its shard of the sequence (the first dimension of an sbhd
tensor) and checks what it holds against the unsplit module: its output shard, its input
gradient shard, its parameter gradients; gradients of parameters applied to a sequence shard
(marked ``sequence_parallel``) only once summed over the ranks, as their caller sums them.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H, F = 32, 2, 64, 128  # sequence, batch, hidden, ffn / out features
CURRENT = recipe.Float8CurrentScaling()


def build(kind, mode=None, split=False, seed=0):
    torch.manual_seed(seed)
    kw = dict(device="cpu")
    if split:
        kw.update(tp_group=GROUP, tp_size=WORLD, sequence_parallel=True)
    if kind == "Linear":
        if split:
            kw["parallel_mode"] = mode
        return te.Linear(H, F, **kw)
    if kind == "LayerNormLinear":
        if split:
            kw["parallel_mode"] = "column"
        return te.LayerNormLinear(H, F, **kw)
    if split:
        kw["set_parallel_mode"] = True
    return te.LayerNormMLP(H, F, **kw)


def seq(t):
    """This rank's shard of the sequence (dimension 0)."""
    n = t.shape[0] // WORLD
    return t[RANK * n:(RANK + 1) * n]


def feat(t, dim=-1):
    n = t.shape[dim] // WORLD
    return t.narrow(dim, RANK * n, n)


def summed(t):
    t = t.contiguous().clone()
    dist.all_reduce(t, group=GROUP)
    return t


def step(module, x, g, r):
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = module(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def check(kind, mode=None, r=None):
    full, par = build(kind, mode), build(kind, mode, split=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, H, generator=gen)
    y_shape = (S, B, H if kind == "LayerNormMLP" else F)
    g = torch.randn(*y_shape, generator=gen)
    y, dx = step(full, x, g, r)
    row = mode == "row"
    # A row-parallel layer takes its input features over the whole sequence and gives its
    # sequence shard of the output; a column-parallel one the reverse; the MLP (column then
    # row) takes and gives sequence shards.
    x_local = feat(x) if row else seq(x)
    if row or kind == "LayerNormMLP":
        y_local_want, g_local = seq(y), seq(g)
    else:
        y_local_want, g_local = feat(y), feat(g)
    yp, dxp = step(par, x_local, g_local, r)
    dx_want = feat(dx) if row else seq(dx)
    rel = 1e-5 if r is None else 0.12
    what = f"{kind} {mode or ''} {'fp8' if r else 'fp32'}"
    assert yp.shape == y_local_want.shape, (what, yp.shape, y_local_want.shape)
    rms_close(yp, y_local_want, rel, f"{what} output")
    assert dxp.shape == dx_want.shape, (what, dxp.shape, dx_want.shape)
    rms_close(dxp, dx_want, rel * 2, f"{what} input gradient")
    for (name, p), q in zip(par.named_parameters(), full.parameters(), strict=True):
        got = summed(p.grad) if getattr(p, "sequence_parallel", False) else p.grad
        want = q.grad
        if got.shape != want.shape:  # this rank's slice of a split parameter
            dim = 1 if name == "fc2_weight" or (row and name == "weight") else 0
            want = feat(want, dim)
        rms_close(got, want, rel * 2, f"{what} {name}.grad")
    marked = {n for n, p in par.named_parameters() if getattr(p, "sequence_parallel", False)}
    expected = {"Linear": {"row": {"bias"}, "column": set()}.get(mode),
                "LayerNormLinear": {"layer_norm_weight", "layer_norm_bias"},
                "LayerNormMLP": {"layer_norm_weight", "layer_norm_bias", "fc2_bias"}}[kind]
    assert marked == expected, (what, marked)


def check_indivisible_sequence():
    import pytest  # only its raises()

    par = build("Linear", "row", split=True)
    with pytest.raises(ValueError, match=rf"te.Linear: sequence parallelism splits the first "
                                         rf"dimension over the {WORLD} ranks"):
        par(torch.randn(S + 1, B, H // WORLD))


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for r in (None, CURRENT):
        case(check, "Linear", "column", r)
        case(check, "Linear", "row", r)
        case(check, "LayerNormLinear", None, r)
        case(check, "LayerNormMLP", None, r)
    case(check_indivisible_sequence)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
