"""One rank of the tensor-parallel tests (test_tensor_parallel.py): ``python _tp_rank.py RANK
WORLD PORT``. Every rank builds the column- and row-parallel te.Linear and the single-process
te.Linear from the same seed, runs forward and backward on the same data, and checks its
shards against the single-process layer. Failures are printed and the exit status is 1.

A standalone script (pytest imports test files under names another process could not
import); it needs only torch and transformer_engine.
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, exact, rms_close, within

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
K, N = 64, 128  # in and out features: every shard (K/4, N/4 included) a multiple of 16
LEAD = (3, 16)  # leading dimensions of the input
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}

RECIPES = {
    "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}

def layers(mode, dtype=torch.float32, seed=0):
    """(single-process layer, this rank's parallel layer): the same draws of the generator."""
    torch.manual_seed(seed)
    full = te.Linear(K, N, params_dtype=dtype, device="cpu")
    torch.manual_seed(seed)
    par = te.Linear(K, N, params_dtype=dtype, device="cpu", tp_group=GROUP, tp_size=WORLD,
                    parallel_mode=mode)
    return full, par


def data(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)  # the same on every rank
    x = torch.randn(*LEAD, K, generator=gen).to(dtype)
    g = torch.randn(*LEAD, N, generator=gen).to(dtype)
    return x, g


def shard(t, mode, dim=-1):
    """This rank's slice of ``t`` along ``dim`` (rows of the output for column, of the input
    for row)."""
    size = t.shape[dim] // WORLD
    return t.narrow(dim, RANK * size, size)


def run(layer, x, g, recipe_=None, group=None):
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=recipe_ is not None, fp8_recipe=recipe_, fp8_group=group):
        y = layer(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def compare(mode, dtype, recipe_=None, group=None, steps=1):
    """Forward and backward of both layers; returns the quantities of both, per rank's view:
    (name, parallel, single-process, magnitude for bounds)."""
    full, par = layers(mode, dtype)
    # Initialization: the slice of the single-process layer's values, exactly.
    w_slice = shard(full.weight, mode, 0 if mode == "column" else 1)
    exact(par.weight.detach(), w_slice.detach(), f"{mode} init weight")
    b_full = shard(full.bias, mode, 0) if mode == "column" else full.bias
    exact(par.bias.detach(), b_full.detach(), f"{mode} init bias")
    x, g = data(dtype)
    for _ in range(steps):
        for p in (*full.parameters(), *par.parameters()):
            p.grad = None
        y, dx = run(full, x, g, recipe_, group)
        if mode == "column":
            yp, dxp = run(par, x, shard(g, mode), recipe_, group)
        else:
            yp, dxp = run(par, shard(x, mode), g, recipe_, group)
    # Magnitudes (sum of |terms| of each result), in float64 over the [tokens, features] views.
    ax, ag = x.double().abs().flatten(0, -2), g.double().abs().flatten(0, -2)
    aw, ab = full.weight.detach().double().abs(), full.bias.detach().double().abs()
    mag = {"output": ax @ aw.t() + ab, "dgrad": ag @ aw, "wgrad": ag.t() @ ax,
           "bias grad": ag.sum(0)}
    mag["output"], mag["dgrad"] = mag["output"].view(y.shape), mag["dgrad"].view(dx.shape)
    # What this rank holds of each single-process result: its slice along the split dimension.
    col = mode == "column"
    want = {"output": shard(y, mode) if col else y,
            "dgrad": dx if col else shard(dx, mode),
            "wgrad": shard(full.weight.grad, mode, 0 if col else 1),
            "bias grad": shard(full.bias.grad, mode, 0) if col else full.bias.grad}
    mag = {"output": shard(mag["output"], mode) if col else mag["output"],
           "dgrad": mag["dgrad"] if col else shard(mag["dgrad"], mode),
           "wgrad": shard(mag["wgrad"], mode, 0 if col else 1),
           "bias grad": shard(mag["bias grad"], mode, 0) if col else mag["bias grad"]}
    got = {"output": yp, "dgrad": dxp, "wgrad": par.weight.grad, "bias grad": par.bias.grad}
    pairs = [(q, got[q], want[q], mag[q]) for q in got]
    return full, par, pairs


# Quantities a parallel layer sums over the ranks (all-reduce) where the single-process
# layer sums in one GEMM: the same terms in another order, so not bit-exact. Each sum of m
# products, in any order, errs by at most ~m * eps * sum|terms| (the standard bound for
# recursive summation; the magnitude bounds sum|terms|); twice that for both results, and the
# all-reduce adds tp_size roundings of at most eps * sum|terms| each. Everything else is the
# same arithmetic on the same values and must be bit-exact in fp32.
REASSOCIATED = {"column": {"dgrad": N}, "row": {"output": K}}


def check_high_precision(mode, dtype):
    _, _, pairs = compare(mode, dtype)
    eps = EPS[dtype]
    for name, got, want, mag in pairs:
        what = f"{mode} {dtype} {name}"
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
        terms = REASSOCIATED[mode].get(name)
        if dtype == torch.float32 and terms is None:
            exact(got, want, what)
            continue
        # bf16: the products accumulate in fp32 (terms * 2^-24) and each result, partial
        # sums included, is rounded to bf16 once (eps each, WORLD + 1 of them).
        m = terms or 1
        rel = 2 * m * 2.0**-24 + (WORLD + 2) * eps
        within(got, want, rel * mag, what)


# FP8 against FP8: both layers quantize with their own scales (a slice's amax is not the full
# tensor's), so each is within the FP8 rounding of the exact product: per operand a relative
# 2^-4 (E4M3, 3 mantissa bits) or 2^-3 (E5M2, 2 bits; the gradient under HYBRID), so the
# difference of the two is within 2 * (e_a + e_b + e_a e_b) of the magnitude, plus values
# below the format's normal range (absolute, covered by the 1e-3 of the largest magnitude).
# The rms check catches what that elementwise bound is too loose for: its limits are twice
# the rms of one operand's rounding error (2^-4 / sqrt(3) ~ 3.6%, E5M2 7.2%).
FP8_REL = {"output": (2.0**-4, 2.0**-4), "dgrad": (2.0**-3, 2.0**-4),
           "wgrad": (2.0**-3, 2.0**-4), "bias grad": (0.0, 0.0)}
FP8_RMS = {"output": 0.10, "dgrad": 0.2, "wgrad": 0.2, "bias grad": 1e-5}


def check_fp8(mode, name, group=None, steps=1):
    full, par, pairs = compare(mode, torch.float32, RECIPES[name], group, steps)
    for q, got, want, mag in pairs:
        what = f"{mode} {name} {q} (step {steps})"
        ea, eb = FP8_REL[q]
        bound = 2 * (ea + eb + ea * eb) * mag + 1e-3 * mag.max() + 1e-6 * mag
        within(got, want, bound, what)
        rms_close(got, want, FP8_RMS[q], what)
    return par


def check_scales_shared(mode, group):
    """Delayed scaling under fp8_autocast(fp8_group=tp_group): after each step every rank
    holds the same amax histories and scales; without the group the slices' different amaxes
    give different scales (so the check can fail)."""
    for steps in (1, 2):
        par = check_fp8(mode, "delayed", group, steps)
        same = _tp_world.fp8_state_same_on_ranks(par, WORLD, GROUP)
        if group is not None:
            assert all(same), f"{mode} fp8_group, step {steps}: ranks differ: {same}"
        else:
            # The weight slices' amaxes differ (and, for row, the input slices').
            assert not same[1], f"{mode} without fp8_group: forward scales equal on all ranks"


def check_options(mode):
    """return_bias: the output without the bias (a row layer's summed over the ranks) and the
    bias this rank adds; is_first_microbatch: the kept FP8 weight gives the same output."""
    full, _ = layers(mode)
    torch.manual_seed(0)
    par = te.Linear(K, N, device="cpu", tp_group=GROUP, tp_size=WORLD, parallel_mode=mode,
                    return_bias=True)
    x, _ = data(torch.float32)
    xp = x if mode == "column" else shard(x, mode)
    out, bias = par(xp)
    want_bias = shard(full.bias, mode, 0) if mode == "column" else full.bias
    assert bias is par.bias and torch.equal(bias, want_bias), f"{mode} return_bias: bias"
    y = full(x)
    want = shard(y, mode) if mode == "column" else y
    torch.testing.assert_close(out + bias, want, rtol=1e-5, atol=1e-5)
    with te.fp8_autocast(fp8_recipe=RECIPES["current"]):
        ys = [par(xp, is_first_microbatch=first)[0] for first in (None, True, False)]
    for first, y in zip((True, False), ys[1:], strict=True):
        assert torch.equal(y, ys[0]), f"{mode} is_first_microbatch={first}"
    # A deep copy shares the group (communicators cannot be copied) and computes the same.
    twin = copy.deepcopy(par)
    assert twin.tp_group is GROUP and twin.weight is not par.weight, f"{mode} deepcopy"
    exact(twin(xp)[0], par(xp)[0], f"{mode} deepcopy output")


SPLIT = {"q": 64, "k": 32, "v": 32}  # parameters_split: out_features' named row blocks


def check_parameters_split(mode):
    """parameters_split: a column layer splits each named block over the ranks (this rank's
    rows of q, of k and of v); a row layer keeps the blocks and splits the input features."""
    torch.manual_seed(0)
    full = te.Linear(K, N, device="cpu", parameters_split=SPLIT)
    torch.manual_seed(0)
    par = te.Linear(K, N, device="cpu", parameters_split=SPLIT, tp_group=GROUP, tp_size=WORLD,
                    parallel_mode=mode)
    col = mode == "column"
    x, g = data(torch.float32)
    y = full(x)
    for name in SPLIT:
        for kind in ("weight", "bias"):
            got, want = getattr(par, f"{name}_{kind}"), getattr(full, f"{name}_{kind}")
            want = shard(want, mode, 0) if col else (want if kind == "bias" else
                                                      shard(want, mode, 1))
            exact(got.detach(), want.detach(), f"{mode} split init {name}_{kind}")
    if col:
        blocks = y.split(list(SPLIT.values()), dim=-1)
        want = torch.cat([shard(b, mode) for b in blocks], dim=-1)
        yp = par(x)
        exact(yp, want, f"{mode} split output")
        g_local = torch.cat([shard(b, mode) for b in g.split(list(SPLIT.values()), -1)], -1)
        (yp * g_local).sum().backward()
        (y * g).sum().backward()
        for name in SPLIT:
            exact(getattr(par, f"{name}_weight").grad,
                  shard(getattr(full, f"{name}_weight").grad, mode, 0),
                  f"{mode} split wgrad {name}")
    else:
        mag = x.double().abs() @ torch.cat([full.q_weight, full.k_weight, full.v_weight]
                                           ).detach().double().abs().t()
        within(par(shard(x, mode)), y, 4 * K * 2.0**-24 * (mag + 1), f"{mode} split output")


def check_bad_arguments():
    import pytest  # only its raises()

    with pytest.raises(ValueError, match=rf"te.Linear: tp_size must equal the size of "
                                         rf"tp_group \({WORLD}\), got {WORLD + 1}"):
        te.Linear(K, N, tp_group=GROUP, tp_size=WORLD + 1, parallel_mode="row", device="cpu")
    with pytest.raises(ValueError, match=rf"in_features must be divisible by tp_size={WORLD}"):
        te.Linear(K + 1, N, tp_group=GROUP, tp_size=WORLD, parallel_mode="row", device="cpu")
    _, par = layers("row")
    with pytest.raises(ValueError, match=rf"input must have {K // WORLD} \(in_features / "
                                         rf"tp_size = {K} / {WORLD}\)"):
        par(torch.randn(2, K))  # the full input where the slice is expected


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    quick = WORLD > 2  # larger worlds: high precision and delayed scaling only
    for mode in ("column", "row"):
        case(check_high_precision, mode, torch.float32)
        if not quick:
            case(check_high_precision, mode, torch.bfloat16)
            for name in ("current", "block"):
                case(check_fp8, mode, name)
            case(check_scales_shared, mode, None)
        case(check_scales_shared, mode, GROUP)
        case(check_options, mode)
        case(check_parameters_split, mode)
    case(check_bad_arguments)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
