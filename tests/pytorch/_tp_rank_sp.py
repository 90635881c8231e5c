"""One rank of the sequence-parallel tests (test_parallel_worlds.py): ``python
_tp_rank_sp.py RANK WORLD PORT``. Every rank builds te.Linear (column and row),
te.LayerNormLinear (LayerNorm, RMSNorm) and te.LayerNormMLP with ``sequence_parallel=True``
and the same modules unsplit from the same seed, feeds its shard of the sequence (the first
dimension of an sbhd tensor) and checks what it holds against the unsplit module on the whole
sequence: its output shard, its input gradient shard, its parameter gradients (gradients of
parameters applied to a sequence shard, marked ``sequence_parallel``, once summed over the
ranks, as their caller sums them) and, under delayed scaling, its FP8 state; in fp32, under
DelayedScaling (with ``fp8_group``) and Float8CurrentScaling.

It also watches the collectives and the norm: under the per-tensor FP8 recipes the forward's
all-gathers move uint8, one byte per element (half of what bf16 moves), and those bytes are
the whole tensor's quantization; the norm kernel sees this rank's rows only. A gather in the
wrong rank order or a reduce-scatter that does not sum must fail the checks.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import DEVICE, case, exact, generator, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import distributed as te_distributed
from transformer_engine.pytorch import ops

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H, F = 32, 2, 64, 128  # sequence, batch, hidden, ffn / out features
# (a history of one step: the second step's scales come from the second step alone)
DELAYED = recipe.DelayedScaling(amax_history_len=1)
CURRENT = recipe.Float8CurrentScaling()
RECIPES = {"fp32": None, "delayed": DELAYED, "current": CURRENT}
FP8_STATE = ("amax_history_fwd", "scale_fwd", "scale_inv_fwd", "amax_history_bwd", "scale_bwd",
             "scale_inv_bwd")


def build(kind, mode=None, split=False, seed=0, **extra):
    torch.manual_seed(seed)
    kw = dict(device=DEVICE, **extra)
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


@contextmanager
def watched(gathers: list, norm_rows: list):
    """Records what torch.distributed.all_gather_into_tensor moves ((dtype, bytes of the
    gathered tensor, the tensor)) and how many rows each norm kernel call sees."""
    saved = dist.all_gather_into_tensor, ops.norm_forward, ops.norm_forward_fp8

    def gather(out, inp, *args, **kwargs):
        work = saved[0](out, inp, *args, **kwargs)
        gathers.append((out.dtype, out.numel() * out.element_size(), out.clone()))
        return work

    def norm(x, *args, **kwargs):
        norm_rows.append(x.shape[0])
        return saved[1](x, *args, **kwargs)

    def norm_fp8(x, *args, **kwargs):
        norm_rows.append(x.shape[0])
        return saved[2](x, *args, **kwargs)

    dist.all_gather_into_tensor, ops.norm_forward, ops.norm_forward_fp8 = gather, norm, norm_fp8
    try:
        yield
    finally:
        dist.all_gather_into_tensor, ops.norm_forward, ops.norm_forward_fp8 = saved


def step(module, x, g, r, group=None, g_ln=None, watch=None):
    """One forward and backward; (output, input gradient, the norm's output or None)."""
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r, fp8_group=group):
        if watch is None:
            out = module(x)
        else:
            with watched(*watch):
                out = module(x)
    y, ln = out if isinstance(out, tuple) else (out, None)
    loss = (y * g).sum() + (0 if ln is None else (ln * g_ln).sum())
    loss.backward()
    return y.detach(), x.grad, None if ln is None else ln.detach()


def check(kind, mode=None, name="fp32", norm="LayerNorm", ln_out=False, gathered=False):
    """``gathered``: the norm's output returned over the whole sequence
    (return_layernorm_output_gathered); each rank's loss takes 1/WORLD of its gradient, so that
    the gather's backward, which sums the ranks' gradients, gives the unsplit one."""
    r = RECIPES[name]
    extra = {} if kind == "Linear" else {"normalization": norm}
    if ln_out:
        extra["return_layernorm_output"] = True
        extra["return_layernorm_output_gathered"] = gathered
    full, par = build(kind, mode, **extra), build(kind, mode, split=True, **extra)
    gen = generator(1)
    x = torch.randn(S, B, H, generator=gen)
    y_shape = (S, B, H if kind == "LayerNormMLP" else F)
    g = torch.randn(*y_shape, generator=gen)
    g_ln = torch.randn(S, B, H, generator=gen) if ln_out else None
    row = mode == "row"
    # A row-parallel layer takes its input features over the whole sequence and gives its
    # sequence shard of the output; a column-parallel one the reverse; the MLP (column then
    # row) takes and gives sequence shards.
    x_local = feat(x) if row else seq(x)
    if row or kind == "LayerNormMLP":
        g_local = seq(g)
    else:
        g_local = feat(g)
    g_ln_local = None if g_ln is None else g_ln / WORLD if gathered else seq(g_ln)
    what = f"{kind} {mode or norm} {name}{' ln_out' if ln_out else ''}" + \
        (" gathered" if gathered else "")
    gathers, norm_rows = [], []
    # Delayed scaling: a first step (scaled from the tensors' own amaxes), then a step with
    # the scales the first one left, which must be the same on the split ranks and unsplit.
    for i in range(2 if name == "delayed" else 1):
        y, dx, ln = step(full, x, g, r, g_ln=g_ln)
        watch = (gathers, norm_rows) if i == 0 else None
        yp, dxp, lnp = step(par, x_local, g_local, r, GROUP, g_ln_local, watch)
        if name == "delayed":
            check_fp8_state(par, full, i, f"{what} step {i}")
    y_want = seq(y) if row or kind == "LayerNormMLP" else feat(y)
    if name == "delayed" and mode != "row" and kind != "LayerNormMLP":
        # the same FP8 bytes and scales in the second step, the same GEMM: the same bits
        exact(yp, y_want, f"{what} output")
    dx_want = feat(dx) if row else seq(dx)
    rel = 1e-5 if r is None else 0.12
    assert yp.shape == y_want.shape, (what, yp.shape, y_want.shape)
    rms_close(yp, y_want, rel, f"{what} output")
    assert dxp.shape == dx_want.shape, (what, dxp.shape, dx_want.shape)
    rms_close(dxp, dx_want, rel * 2, f"{what} input gradient")
    if ln_out:  # this rank's shard of the norm's output, or all of it
        exact(lnp, ln if gathered else seq(ln), f"{what} norm output")
    for (pname, p), q in zip(par.named_parameters(), full.parameters(), strict=True):
        got = summed(p.grad) if getattr(p, "sequence_parallel", False) else p.grad
        want = q.grad
        if got.shape != want.shape:  # this rank's slice of a split parameter
            dim = 1 if pname == "fc2_weight" or (row and pname == "weight") else 0
            want = feat(want, dim)
        rms_close(got, want, rel * 2, f"{what} {pname}.grad")
    if WORLD == 1:  # one rank: the modules run unsplit (no mark, no gather), as NVIDIA's
        assert not gathers, what
        return
    marked = {n for n, p in par.named_parameters() if getattr(p, "sequence_parallel", False)}
    norms = {"layer_norm_weight", "layer_norm_bias"} if norm == "LayerNorm" else \
        {"layer_norm_weight"}
    expected = {"Linear": {"row": {"bias"}, "column": set()}.get(mode),
                "LayerNormLinear": norms, "LayerNormMLP": norms | {"fc2_bias"}}[kind]
    assert marked == expected, (what, marked)
    check_traffic(kind, mode, name, x, gathers, norm_rows, what)


def check_fp8_state(par, full, i, what):
    """Delayed scaling's state on the split ranks as unsplit. In the first step only the
    forward's column of the gathered input: the weights of a split layer take their
    first-step scales from their slices, so what FC1's output feeds (the MLP's FC2 input and
    FC1's gradient) may differ then; from the second step on, every column."""
    for buf in FP8_STATE[:3] if i == 0 else FP8_STATE:
        got, want = getattr(par, buf), getattr(full, buf)
        if i == 0:
            got, want = got[..., 0], want[..., 0]
        exact(got, want, f"{what} {buf}")


def check_traffic(kind, mode, name, x, gathers, norm_rows, what):
    """The forward's all-gather (none for a row-parallel layer) moved the whole input (or
    norm output) in FP8 under the FP8 recipes, fp32 otherwise; the norm saw this rank's rows
    only. A norm output returned gathered adds one all-gather of it in its dtype (fp32)."""
    if mode == "row":
        assert not gathers, (what, [(d, n) for d, n, _ in gathers])
        return
    if what.endswith(" gathered"):
        assert [(d, n) for d, n, _ in gathers[1:]] == [(torch.float32, S * B * H * 4)], what
        gathers = gathers[:1]
    assert len(gathers) == 1, (what, [(d, n) for d, n, _ in gathers])
    dtype, nbytes, data = gathers[0]
    fp8 = name != "fp32"
    assert dtype == (torch.uint8 if fp8 else torch.float32), (what, dtype)
    assert nbytes == S * B * H * (1 if fp8 else 4), (what, nbytes)
    if kind != "Linear":
        assert norm_rows and max(norm_rows) == S * B // WORLD, (what, norm_rows)
    if name == "current":  # the bytes of the whole tensor quantized with its own amax
        whole = x.reshape(-1, H)
        if kind != "Linear":
            ones = torch.ones(H)
            whole, _, _ = ops.norm_forward(whole, ones, torch.zeros(H) if "RMS" not in what
                                           else None, "rmsnorm" if "RMS" in what
                                           else "layernorm", 1e-5, False)
        want = te.Float8Tensor.quantize(whole)._data
        exact(data.reshape(-1, H), want, f"{what} gathered FP8 bytes")


def check_fp8_moves_half_of_bf16():
    """te.LayerNormLinear on a bf16 input: the FP8 gather moves half the bytes of the bf16
    one."""
    moved = {}
    for name, r in (("bf16", None), ("fp8", CURRENT)):
        par = build("LayerNormLinear", split=True, params_dtype=torch.bfloat16)
        gathers, rows = [], []
        x = torch.randn(S // WORLD, B, H, dtype=torch.bfloat16)
        step(par, x, torch.ones(S, B, F // WORLD, dtype=torch.bfloat16), r,
             watch=(gathers, rows))
        assert len(gathers) == 1, gathers
        moved[name] = gathers[0][:2]
    assert moved["bf16"] == (torch.bfloat16, S * B * H * 2), moved
    assert moved["fp8"] == (torch.uint8, S * B * H), moved


def check_delayed_without_group_gathers_high_precision():
    """Delayed scaling without an fp8_group: the ranks' scales may differ, so the gather
    moves the input's dtype."""
    par = build("LayerNormLinear", split=True)
    gathers = []
    step(par, torch.randn(S // WORLD, B, H), torch.ones(S, B, F // WORLD), DELAYED,
         watch=(gathers, []))
    assert [d for d, _, _ in gathers] == [torch.float32], gathers


@contextmanager
def broken(piece):
    """te's gather in the wrong rank order, or its reduce-scatter taking this rank's share of
    its own gradient without the sum."""
    saved = te_distributed.gather_first_dim, te_distributed.reduce_scatter_first_dim
    if piece == "gather order":
        def gather(t, group):
            out = saved[0](t, group)
            return torch.cat(list(reversed(out.chunk(WORLD))))

        te_distributed.gather_first_dim = gather
    else:
        def scatter(t, group, op):
            return t.chunk(WORLD)[RANK].contiguous()

        te_distributed.reduce_scatter_first_dim = scatter
    try:
        yield
    finally:
        te_distributed.gather_first_dim, te_distributed.reduce_scatter_first_dim = saved


def check_broken_pieces_fail():
    for piece in ("gather order", "no reduce in the reduce-scatter"):
        for kind, name in (("LayerNormLinear", "current"), ("Linear", "delayed")):
            with broken(piece):
                try:
                    check(kind, "column", name)
                except AssertionError:
                    continue
            raise AssertionError(f"{kind} {name} passed its checks with a broken {piece}")


def check_indivisible_sequence():
    import pytest  # only its raises()

    par = build("Linear", "row", split=True)
    with pytest.raises(ValueError, match=rf"te.Linear: sequence parallelism splits the first "
                                         rf"dimension over the {WORLD} ranks"):
        par(torch.randn(S + 1, B, H // WORLD))


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for name in RECIPES:
        case(check, "Linear", "column", name)
        case(check, "Linear", "row", name)
        case(check, "LayerNormLinear", None, name, "LayerNorm")
        case(check, "LayerNormLinear", None, name, "RMSNorm")
        case(check, "LayerNormMLP", None, name, "LayerNorm")
        case(check, "LayerNormLinear", None, name, "LayerNorm", True)
    case(check, "LayerNormMLP", None, "current", "RMSNorm", True)
    case(check, "LayerNormLinear", None, "fp32", "LayerNorm", True, True)
    case(check, "LayerNormLinear", None, "delayed", "LayerNorm", True, True)
    case(check, "LayerNormMLP", None, "current", "RMSNorm", True, True)
    if WORLD > 1:  # (what the gathers move, and a sequence that does not divide)
        case(check_fp8_moves_half_of_bf16)
        case(check_delayed_without_group_gathers_high_precision)
        case(check_broken_pieces_fail)
        case(check_indivisible_sequence)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
