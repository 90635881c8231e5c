"""One rank of the tensor-parallel norm-block tests (test_tensor_parallel_ln.py):
``python _tp_rank_ln.py RANK WORLD PORT``. Every rank builds the column-parallel
te.LayerNormLinear and the te.LayerNormMLP with set_parallel_mode=True next to the
single-process modules from the same seed, runs forward and backward on the same data, and
checks its shards against the single-process module. Failures are printed and the exit status
is 1.

A standalone script, as _tp_rank.py (pytest imports test files under names another process
could not import).
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_world import case, exact, rms_close, within

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
H, N, FFN = 64, 128, 128  # hidden, LayerNormLinear's out, MLP's ffn: every shard a multiple of 16
LEAD = (3, 16)
T = 48  # tokens: the product of LEAD
U = 2.0**-24  # fp32's unit roundoff; the GEMMs accumulate in fp32
EPS = {torch.float32: U, torch.bfloat16: 2.0**-8}

RECIPES = {
    "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}

# The configurations: (kind, constructor keywords). The second of each returns the norm's
# output (whose gradient must join the summed ones once) and uses RMSNorm; the MLP's a gated
# activation (FC1's two halves split pairwise) and return_bias.
CONFIGS = {
    "lnl": ("lnl", {}),
    "lnl-rms": ("lnl", dict(normalization="RMSNorm", return_layernorm_output=True)),
    "mlp": ("mlp", {}),
    "mlp-swiglu": ("mlp", dict(activation="swiglu", normalization="RMSNorm",
                               return_layernorm_output=True, return_bias=True)),
}

def shard(t, dim=-1, halves=1):
    """This rank's slice of ``t`` along ``dim`` (of each of ``halves`` equal blocks)."""
    blocks = t.chunk(halves, dim)
    size = blocks[0].shape[dim] // WORLD
    return torch.cat([b.narrow(dim, RANK * size, size) for b in blocks], dim)


def modules(config, dtype=torch.float32, seed=0, **extra):
    """(single-process module, this rank's parallel module) from the same generator draws;
    the norm's parameters set to the same random values in both (not 1 and 0, so that their
    gradients and the input's depend on them)."""
    kind, kwargs = CONFIGS[config]
    kwargs = dict(kwargs, params_dtype=dtype, device="cpu", **extra)
    if kind == "lnl":
        def make(**tp):
            return te.LayerNormLinear(H, N, **kwargs, **tp)
        tp = dict(tp_group=GROUP, tp_size=WORLD, parallel_mode="column")
    else:
        def make(**tp):
            return te.LayerNormMLP(H, FFN, **kwargs, **tp)
        tp = dict(tp_group=GROUP, tp_size=WORLD, set_parallel_mode=True)
    torch.manual_seed(seed)
    full = make()
    torch.manual_seed(seed)
    par = make(**tp)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, base in (("layer_norm_weight", 1.0), ("layer_norm_bias", 0.0)):
            if getattr(full, name) is not None:
                value = base + 0.5 * torch.randn(H, generator=gen)
                getattr(full, name).copy_(value)
                getattr(par, name).copy_(value)
    return full, par


def split_of(config, name):
    """How a parameter of the parallel module relates to the single-process one's: (dim,
    halves) of its slice, or None when it is whole."""
    kind, kwargs = CONFIGS[config]
    if name.startswith("layer_norm") or name == "fc2_bias":
        return None
    if name == "fc2_weight":
        return 1, 1
    return 0, 2 if kwargs.get("activation") == "swiglu" and name.startswith("fc1") else 1


def data(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)  # the same on every rank
    x = torch.randn(*LEAD, H, generator=gen).to(dtype)
    g = torch.randn(*LEAD, N, generator=gen).to(dtype)  # the MLP's gradient: the first H
    g_ln = torch.randn(*LEAD, H, generator=gen).to(dtype)
    return x, g, g_ln


def run(config, module, x, g, g_ln, recipe_=None, group=None):
    """Forward and backward; returns {quantity: value} with the parameters' gradients."""
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=recipe_ is not None, fp8_recipe=recipe_, fp8_group=group):
        out = module(x)
    out = out if isinstance(out, tuple) else (out,)
    y = out[0]
    loss = (y * g[..., :y.shape[-1]]).sum()
    got = {"output": y.detach()}
    if CONFIGS[config][1].get("return_layernorm_output"):
        loss = loss + (out[-1] * g_ln).sum()
        got["ln_out"] = out[-1].detach()
    loss.backward()
    got["dgrad"] = x.grad
    for name, p in module.named_parameters():
        got[name] = p.grad
    return got


def reference(config, full, x, g, g_ln):
    """Float64 magnitudes (sums of |terms|) of every quantity, and the norm's statistics, for
    the bounds. g is the full output gradient."""
    kind, kwargs = CONFIGS[config]
    rms = kwargs.get("normalization") == "RMSNorm"
    x64 = x.double().reshape(T, H)
    gamma = full.layer_norm_weight.detach().double()
    beta = None if full.layer_norm_bias is None else full.layer_norm_bias.detach().double()
    if rms:
        rs = ((x64 * x64).mean(-1, keepdim=True) + 1e-5).rsqrt()
        xhat = x64 * rs
    else:
        xc = x64 - x64.mean(-1, keepdim=True)
        rs = ((xc * xc).mean(-1, keepdim=True) + 1e-5).rsqrt()
        xhat = xc * rs
    ln = xhat * gamma + (0 if beta is None else beta)
    mag = {"ln_out": ln.abs()}

    def w(name):
        return getattr(full, name).detach().double()

    def b(name):
        p = getattr(full, name)
        return 0 if p is None else p.detach().double().abs()

    if kind == "lnl":
        g64 = g[..., :N].double().reshape(T, N)
        mag["output"] = ln.abs() @ w("weight").abs().t() + b("bias")
        mag["weight"] = g64.abs().t() @ ln.abs()
        mag["bias"] = g64.abs().sum(0)
        d_ln = g64.abs() @ w("weight").abs()
        terms = N  # the reassociated sum: the GEMM's dgrad over the output features
    else:
        g64 = g[..., :H].double().reshape(T, H)
        h = (ln @ w("fc1_weight").t() + (0 if full.fc1_bias is None else
                                          full.fc1_bias.detach().double())).requires_grad_()
        gated = kwargs.get("activation") == "swiglu"
        if gated:
            ha, hb = h.chunk(2, -1)
            a = F.silu(ha) * hb
        else:
            a = F.gelu(h, approximate="tanh")
        # d_h: the gradient that reaches FC1's output (the same arithmetic on both sides)
        (dh,) = torch.autograd.grad((a @ w("fc2_weight").t() * g64).sum(), h,
                                    retain_graph=True)
        # Each feature of act(h) depends on one feature of h (of each half when gated): the
        # gradient of the sum holds those partial derivatives.
        (slope,) = torch.autograd.grad(a.sum(), h)
        a = a.detach()
        # FP8: FC1's output within E_FWD of its magnitude, carried through the activation to
        # first order (the slope's absolute value, both halves' terms summed when gated).
        err_h = E_FWD * (ln.abs() @ w("fc1_weight").abs().t() + b("fc1_bias"))
        err_a = slope.abs() * err_h
        err_a = sum(err_a.chunk(2, -1)) if gated else err_a
        mag["output"] = a.abs() @ w("fc2_weight").abs().t() + b("fc2_bias")
        mag["output fp8"] = (E_FWD * mag["output"] + err_a @ w("fc2_weight").abs().t())
        mag["fc2_weight"] = g64.abs().t() @ a.abs()
        mag["fc2_weight fp8"] = E_BWD * mag["fc2_weight"] + g64.abs().t() @ err_a
        mag["fc2_bias"] = g64.abs().sum(0)
        mag["fc1_weight"] = dh.abs().t() @ ln.abs()
        mag["fc1_bias"] = dh.abs().sum(0)
        d_ln = dh.abs() @ w("fc1_weight").abs()
        terms = h.shape[-1]
    if kwargs.get("return_layernorm_output"):
        d_ln = d_ln + g_ln.double().reshape(T, H).abs()
    mag["d_ln"] = d_ln
    # The norm's backward is linear in the gradient v of its output: dx = rs * (gamma v -
    # mean(gamma v) - xhat mean(gamma v xhat)) (RMSNorm without the middle term), dgamma =
    # sum over tokens of v xhat, dbeta = sum of v. Their magnitudes: the same with |.|.
    gv = gamma.abs() * d_ln
    mag["dgrad"] = (rs * (gv + gv.mean(-1, keepdim=True) + xhat.abs() *
                          (gv * xhat.abs()).mean(-1, keepdim=True))).reshape(*LEAD, H)
    mag["layer_norm_weight"] = (d_ln * xhat.abs()).sum(0)
    mag["layer_norm_bias"] = d_ln.sum(0)
    mag["ln_out"] = mag["ln_out"].reshape(*LEAD, H)
    for q in ("output", "output fp8"):
        if q in mag:
            mag[q] = mag[q].reshape(*LEAD, -1)
    return mag, terms


NORM_BACKWARD = ("dgrad", "layer_norm_weight", "layer_norm_bias")


def compare(config, dtype, recipe_=None, group=None, steps=1):
    """Both modules' results: [(quantity, parallel, single-process's slice, magnitude)] and
    the number of terms of the sum that the ranks split."""
    full, par = modules(config, dtype)
    kind = CONFIGS[config][0]
    # Initialization: the slices of the single-process module's values, exactly.
    for name, p in par.named_parameters():
        split = split_of(config, name)
        want = getattr(full, name).detach()
        exact(p.detach(), want if split is None else shard(want, *split), f"{config} init {name}")
    x, g, g_ln = data(dtype)
    g_par = shard(g[..., :N]) if kind == "lnl" else g
    for _ in range(steps):
        for p in (*full.parameters(), *par.parameters()):
            p.grad = None
        want = run(config, full, x, g, g_ln, recipe_, group)
        got = run(config, par, x, g_par, g_ln, recipe_, group)
    mag, terms = reference(config, full, x, g, g_ln)
    pairs = []
    for q, value in got.items():
        w, m, m8 = want[q], mag.get(q), mag.get(f"{q} fp8")
        split = (-1, 1) if (q == "output" and kind == "lnl") else \
            (split_of(config, q) if q in dict(full.named_parameters()) else None)
        if split is not None:
            w = None if w is None else shard(w, *split)
            m = shard(m, *split)
            m8 = None if m8 is None else shard(m8, *split)
        if value is None or w is None:
            assert value is None and w is None, f"{config} {q}: a gradient on one side only"
            continue
        pairs.append((q, value, w, m, m8))
    return full, par, pairs, terms


def check_high_precision(config, dtype):
    _, _, pairs, terms = compare(config, dtype)
    kind = CONFIGS[config][0]
    eps = EPS[dtype]
    for q, got, want, mag, _ in pairs:
        what = f"{config} {dtype} {q}"
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
        # What the ranks sum where one process sums in one GEMM: the norm's backward input
        # (the output gradient's GEMM over the split features), and the MLP's output (FC2's
        # GEMM over them). Everything else is the same arithmetic on the same values.
        if q in NORM_BACKWARD:
            # The two sums of `terms` products, each within terms * U * sum|terms| of the
            # exact one; WORLD + 2 roundings of the partial and summed results (eps each);
            # both sides' norm backwards, whose sums over H features and T tokens err by at
            # most (H + T) * U relative, twice, with slack for the few other operations.
            rel = 2 * terms * U + (WORLD + 2) * eps + 2 * (H + T + 8) * U
        elif kind == "mlp" and q == "output":
            rel = 2 * FFN * U + (WORLD + 2) * eps
        elif dtype == torch.float32:
            exact(got, want, what)
            continue
        else:  # bf16: one rounding each, and the sums' partials (see _tp_rank.py)
            rel = 2 * U + (WORLD + 2) * eps
        within(got, want, rel * mag, what)


# FP8 against FP8 (see _tp_rank.py): both sides quantize with their own scales, so each is
# within the FP8 rounding of the exact product: a relative 2^-4 per E4M3 operand, 2^-3 per
# E5M2 one (the gradients under HYBRID), e = 2 (e_a + e_b + e_a e_b) for the difference.
E_FWD = 2 * (2.0**-4 + 2.0**-4 + 2.0**-8)
E_BWD = 2 * (2.0**-3 + 2.0**-4 + 2.0**-7)
# Root-mean-square limits: what a missing or doubled sum, a wrong slice or a bias added per
# rank exceeds by far. The MLP's pass two quantized GEMMs (and the activation between them).
FP8_RMS = {"lnl": 0.1, "mlp": 0.2}


def check_fp8(config, name, group=None, steps=1):
    full, par, pairs, _ = compare(config, torch.float32, RECIPES[name], group, steps)
    kind = CONFIGS[config][0]
    for q, got, want, mag, mag8 in pairs:
        what = f"{config} {name} {q} (step {steps})"
        slack = 1e-3 * mag.max() + 1e-6 * mag  # values below the formats' normal range
        if kind == "lnl":
            # One GEMM per quantity: the elementwise bound of te.Linear's tests; the norm's
            # backward is linear, so its input's bound passes through it as the magnitudes do.
            rel = {"output": E_FWD, "weight": E_BWD, "bias": 0.0, "ln_out": 0.0}.get(q, E_BWD)
            within(got, want, rel * mag + slack, what)
        elif mag8 is not None:  # the MLP's output and FC2's weight gradient (see reference)
            within(got, want, 1.25 * mag8 + slack, what)  # 1.25: the second-order terms
        elif q in ("fc2_bias", "ln_out"):
            within(got, want, 2 * T * U * mag + slack, what)
        # (FC1's and the norm's gradients: FP8 roundings of four operands compound through
        # the activation's derivative; the rms check bounds them.)
        rms_close(got, want, 1e-5 if q in ("bias", "fc2_bias", "ln_out") else FP8_RMS[kind],
                  what)
    return par


def check_scales_shared(config, group):
    """Delayed scaling with fp8_group=tp_group: every rank ends each step with the same amax
    histories and scales; without the group the weight slices' amaxes give different forward
    scales (so the check can fail)."""
    for steps in (1, 2):
        par = check_fp8(config, "delayed", group, steps)
        same = _tp_world.fp8_state_same_on_ranks(par, WORLD, GROUP)
        if group is not None:
            assert all(same), f"{config} fp8_group, step {steps}: ranks differ: {same}"
        else:
            assert not same[1], f"{config} without fp8_group: forward scales equal on all ranks"


def check_options(config):
    """is_first_microbatch: the kept FP8 weights give the same output; a deep copy shares the
    group and computes the same; without grad, no collective of the backward is set up."""
    _, par = modules(config)
    x, _, _ = data(torch.float32)
    with te.fp8_autocast(fp8_recipe=RECIPES["current"]):
        ys = [par(x, is_first_microbatch=first) for first in (None, True, False)]
    ys = [y[0] if isinstance(y, tuple) else y for y in ys]
    for first, y in zip((True, False), ys[1:], strict=True):
        assert torch.equal(y, ys[0]), f"{config} is_first_microbatch={first}"
    twin = copy.deepcopy(par)
    assert twin.tp_group is GROUP and twin.layer_norm_weight is not par.layer_norm_weight
    with torch.no_grad():
        a, b = twin(x), par(x)
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    exact(a, b, f"{config} deepcopy output")
    assert "tp_size=" in repr(par), repr(par)


def check_partition_marks():
    """Megatron's attributes mark the split parameters only: the norm is whole on every rank
    (marked split, its gradient would count once per rank in a gradient norm)."""
    _, par = modules("lnl")
    marked = {n for n, p in par.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert marked == {"weight", "bias"}, marked
    assert par.weight.partition_dim == 0 and par.use_bias and par.eps == 1e-5


def check_bad_input():
    import pytest  # only its raises()

    _, par = modules("lnl")
    with pytest.raises(ValueError, match=f"input must have {H} features"):
        par(torch.randn(2, H // WORLD))  # a slice where the full input is expected
    with pytest.raises(ValueError, match=rf"ffn_hidden_size must be divisible by "
                                         rf"tp_size={WORLD}"):
        te.LayerNormMLP(H, FFN + 1, tp_group=GROUP, tp_size=WORLD, set_parallel_mode=True,
                        device="cpu")


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    quick = WORLD > 2  # larger worlds: fp32, and delayed scaling with the group for two
    for config in CONFIGS:
        case(check_high_precision, config, torch.float32)
        if not quick:
            case(check_high_precision, config, torch.bfloat16)
            for name in ("current", "block"):
                case(check_fp8, config, name)
            case(check_options, config)
        if not quick or config in ("lnl-rms", "mlp-swiglu"):
            case(check_scales_shared, config, GROUP)
    if not quick:
        case(check_scales_shared, "mlp", None)
        case(check_scales_shared, "lnl", None)
    case(check_bad_input)
    case(check_partition_marks)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
