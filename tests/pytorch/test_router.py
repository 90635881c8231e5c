"""transformer_engine.pytorch.router (NVIDIA TE's MoE router functions, as Megatron-LM calls
them): probabilities, routing maps and gradients against a float64 reference written here from
NVIDIA's documented semantics (softmax before or after the top k, sigmoid and sqrtsoftplus
normalised over the chosen experts, grouped top-k, the scaling factor, an expert bias that only
steers the choice), the aux-loss scores and the aux loss; the packed bitmap, the dense index
buffer, torch.compile and the argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from te_torch_tests._tolerances import assert_within

from transformer_engine.pytorch.router import (
    RoutingMapFormat,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

T, E = 48, 32
# Relative to each value's magnitude (the sum of the absolute values of the terms it is made
# of). float32: the router computes in float32; every value is a product or quotient of a few
# exp / sigmoid / softplus / sqrt results (within 2 ulp each) and of sums of at most 48 terms
# (within 47 ulp of the sum of their absolute values), and exp's argument x - max carries
# |x - max| <= 16 ulp for these logits: under 80 ulp in all, and 2^-17 is 128 ulp (measured:
# 0.1 of it). bfloat16 outputs (probabilities, gradients, the loss) round once more, by half an
# ulp of the result, up to 2^-8 of it (8 significant bits; measured: 0.98 of that): 2^-7
# covers both twice. The inputs (logits, gradients) are the same values in both.
RTOL = {torch.float32: 2.0**-17, torch.bfloat16: 2.0**-7}
# Rows whose choice of experts (or of groups) is closer than this to a tie are drawn again, so
# float32 and float64 choose the same experts: the scores carry errors near 2^-20.
MARGIN = 1e-4


def _activation(x, score_function):
    return torch.sigmoid(x) if score_function == "sigmoid" else \
        torch.log1p(torch.exp(x)).sqrt()


def _activation_grad_magnitude(x, score_function):
    """|d activation / dx| as its terms add up: the router (as NVIDIA's and torch's sigmoid
    backward) computes sigmoid' as a * (1 - a) from the float32 a, whose error 1 - a cancels
    into; sqrtsoftplus' = sigmoid(x) / (2 a) cancels nothing."""
    a = _activation(x, score_function)
    return a * (1 + a) if score_function == "sigmoid" else torch.sigmoid(x) / (2 * a)


def _top(scores, k):
    """(chosen, margin): the k highest of each row, and how far the k-th is above the next."""
    ranked = scores.sort(dim=-1, descending=True).values
    kth = ranked[:, k - 1:k]
    nxt = ranked[:, k] if k < scores.shape[1] else torch.full_like(kth[:, 0], float("-inf"))
    return scores >= kth, kth[:, 0] - nxt


def topk_reference(x, topk, pre, num_groups, group_topk, scaling, score_function, bias):
    """float64 (probs, chosen, margin) from float64 logits ``x``, differentiable in ``x``."""
    if score_function == "softmax":
        select = torch.softmax(x, -1) if pre else x
    else:
        select = _activation(x, score_function) + (0 if bias is None else bias.double())
    select = select.detach()
    margin = torch.full_like(select[:, 0], float("inf"))
    if group_topk:
        per_group = select.view(len(x), num_groups, -1).sort(dim=-1, descending=True).values
        group_score = per_group[..., :topk // group_topk].sum(-1)
        allowed, margin = _top(group_score, group_topk)
        select = select.masked_fill(~allowed.repeat_interleave(E // num_groups, 1), -np.inf)
    chosen, expert_margin = _top(select, topk)
    margin = torch.minimum(margin, expert_margin)
    if score_function == "softmax" and pre:
        probs = torch.softmax(x, -1) * chosen
    elif score_function == "softmax":
        probs = torch.softmax(x.masked_fill(~chosen, -np.inf), -1)
    else:
        probs = _activation(x, score_function) * chosen
        if topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return probs * (1.0 if scaling is None else scaling), chosen, margin


def topk_grad_magnitude(x, g, chosen, topk, pre, scaling, score_function):
    """The sum of the absolute values of the terms of each element of d probs / d x . g."""
    g = g.abs() * chosen * (1.0 if scaling is None else scaling)
    if score_function == "softmax":
        p = torch.softmax(x if pre else x.masked_fill(~chosen, -np.inf), -1)
        return p * (g + (g * p).sum(-1, keepdim=True))
    a = _activation(x, score_function) * chosen
    if topk > 1:
        total = a.sum(-1, keepdim=True)
        g = g / total + (g * a).sum(-1, keepdim=True) / total**2
    return g * _activation_grad_magnitude(x, score_function) * chosen


def draw(dtype, margin_of, seed, rows=T):
    """Logits [rows, E] in ``dtype`` (randn * 2), the rows whose margin is below MARGIN drawn
    again."""
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, E, generator=gen, dtype=torch.float64)).to(dtype)
    for _ in range(50):
        bad = margin_of(x.double()) < MARGIN
        if not bad.any():
            return x
        x[bad] = (2 * torch.randn(int(bad.sum()), E, generator=gen, dtype=torch.float64)).to(dtype)
    raise AssertionError("could not draw logits without near ties")


def bias_values():
    # Comparable to the sigmoid's spread, so the bias changes which experts are chosen.
    gen = torch.Generator().manual_seed(7)
    return torch.linspace(-0.4, 0.4, E)[torch.randperm(E, generator=gen)]


GROUPINGS = [(None, None, 1), (None, None, 5), (8, 4, 8), (4, 2, 6)]  # num_groups, group_topk, k
SOFTMAX_CASES = [("softmax", pre, False) for pre in (False, True)]
BIASED_CASES = [(sf, False, bias) for sf in ("sigmoid", "sqrtsoftplus") for bias in (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score_function,pre,with_bias", SOFTMAX_CASES + BIASED_CASES)
@pytest.mark.parametrize("num_groups,group_topk,topk", GROUPINGS)
@pytest.mark.parametrize("scaling", [None, 1.5])
def test_topk_matches_reference(dtype, score_function, pre, with_bias, num_groups, group_topk,
                                topk, scaling):
    bias = bias_values() if with_bias else None
    args = (topk, pre, num_groups, group_topk, scaling, score_function, bias)
    x = draw(dtype, lambda x64: topk_reference(x64, *args)[2], seed=topk).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    want, chosen, _ = topk_reference(x64, *args)

    probs, routing_map = fused_topk_with_score_function(
        logits=x, topk=topk, use_pre_softmax=pre, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling, score_function=score_function, expert_bias=bias)
    assert probs.dtype == dtype and routing_map.dtype == torch.bool
    assert torch.equal(routing_map, chosen)
    assert_within(probs, want, want.abs(), RTOL[dtype], "probs")

    g = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(dtype)
    (dx,) = torch.autograd.grad(probs, x, g)
    (dx64,) = torch.autograd.grad(want, x64, g.double())
    mag = topk_grad_magnitude(x64.detach(), g.double(), chosen, topk, pre, scaling,
                              score_function)
    assert dx.dtype == dtype
    assert_within(dx, dx64, mag, RTOL[dtype], "grad")


def test_bias_steers_the_choice_and_gets_no_gradient():
    x = draw(torch.float32, lambda x64: torch.full((T,), 1.0), seed=1).requires_grad_()
    bias = bias_values().requires_grad_()
    plain = fused_topk_with_score_function(x, 4, False, None, None, None, "sigmoid", None)[1]
    probs, biased = fused_topk_with_score_function(x, 4, False, None, None, None, "sigmoid", bias)
    assert not torch.equal(plain, biased)
    probs.sum().backward()
    assert bias.grad is None and x.grad is not None


def test_leading_dimensions_are_tokens():
    x = draw(torch.float32, lambda x64: topk_reference(
        x64, 3, False, None, None, None, "sigmoid", None)[2], seed=4, rows=6)
    flat = fused_topk_with_score_function(x, 3, False, None, None, None, "sigmoid", None)
    nested = fused_topk_with_score_function(x.view(2, 3, E), 3, False, None, None, None,
                                            "sigmoid", None)
    for a, b in zip(flat, nested, strict=True):
        assert b.shape == (2, 3, E) and torch.equal(a, b.reshape(6, E))


def test_sqrtsoftplus_gradient_is_finite_where_softplus_underflows():
    # softplus(-200) is 0 in float32: d sqrt(softplus) = sigmoid / (2 sqrt(softplus)) would be
    # 0 / 0 there; the true value, exp(-100) / 2, is 0 in float32.
    x = torch.randn(4, E, generator=torch.Generator().manual_seed(11))
    x[:, :3] = -200.0
    x.requires_grad_()
    probs, _ = fused_topk_with_score_function(x, E, False, None, None, None, "sqrtsoftplus",
                                              None)
    _, scores = fused_compute_score_for_moe_aux_loss(x, 2, "sqrtsoftplus")
    for out in (probs, scores):
        (dx,) = torch.autograd.grad(out, x, torch.randn(4, E))
        assert dx.isfinite().all() and (dx[:, :3] == 0).all()


def packed(byte_map: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(byte_map.numpy(), axis=-1, bitorder="little"))


@pytest.mark.parametrize("fmt", ["bitmap_u8", RoutingMapFormat.BITMAP_U8, 1], ids=str)
def test_bitmap_is_the_packed_bytemap(fmt):
    x = torch.randn(T, 20, generator=torch.Generator().manual_seed(5))  # 20: a partial byte
    probs, byte_map = fused_topk_with_score_function(x, 6, False, None, None, 2.0,
                                                     "sqrtsoftplus", None)
    probs_b, bit_map = fused_topk_with_score_function(x, 6, False, None, None, 2.0,
                                                      "sqrtsoftplus", None, fmt)
    assert bit_map.dtype == torch.uint8 and bit_map.shape == (T, 3)
    assert torch.equal(bit_map, packed(byte_map)) and torch.equal(probs, probs_b)
    byte_map, scores = fused_compute_score_for_moe_aux_loss(x, 6, "softmax")
    bit_map, scores_b = fused_compute_score_for_moe_aux_loss(x, 6, "softmax", fmt)
    assert torch.equal(bit_map, packed(byte_map)) and torch.equal(scores, scores_b)


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32, torch.int64], ids=str)
def test_topk_indices_buffer_gets_the_chosen_experts(index_dtype):
    bias = bias_values()
    x = draw(torch.bfloat16, lambda x64: topk_reference(
        x64, 4, False, None, None, None, "sigmoid", bias)[2], seed=6).requires_grad_()
    probs, routing_map = fused_topk_with_score_function(x, 4, False, None, None, None,
                                                        "sigmoid", bias)
    buffer = torch.full((T, 4), -1, dtype=index_dtype)
    probs_i, out = fused_topk_with_score_function(x, 4, False, None, None, None, "sigmoid",
                                                  bias, topk_indices=buffer)
    assert out is buffer and torch.equal(probs, probs_i)
    rebuilt = torch.zeros(T, E, dtype=torch.bool).scatter(1, buffer.long(), True)
    assert torch.equal(rebuilt, routing_map)
    biased = (torch.sigmoid(x.detach().float()) + bias).gather(1, buffer.long())
    assert (biased[:, :-1] >= biased[:, 1:]).all()  # highest score first
    g = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(torch.autograd.grad(probs, x, g)[0],
                       torch.autograd.grad(probs_i, x, g)[0])


def scores_reference(x, topk, score_function):
    if score_function == "softmax":
        scores = torch.softmax(x, -1)
    else:
        a = _activation(x, score_function)
        scores = a / (a.sum(-1, keepdim=True) + 1e-20)
    return scores, *_top(scores.detach(), topk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("topk", [1, 4])
def test_aux_loss_scores_match_reference(dtype, score_function, topk):
    x = draw(dtype, lambda x64: scores_reference(x64, topk, score_function)[2],
             seed=8).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    want, chosen, _ = scores_reference(x64, topk, score_function)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(
        logits=x, topk=topk, score_function=score_function)
    assert scores.dtype == torch.float32 and torch.equal(routing_map, chosen)
    assert_within(scores, want, want, RTOL[torch.float32], "scores")

    g = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    (dx,) = torch.autograd.grad(scores, x, g)
    (dx64,) = torch.autograd.grad(want, x64, g.double())
    s, gabs = want.detach(), g.double().abs()
    if score_function == "softmax":
        mag = s * (gabs + (gabs * s).sum(-1, keepdim=True))
    else:
        x0 = x64.detach()
        a = _activation(x0, score_function)
        total = a.sum(-1, keepdim=True)
        mag = (gabs / total + (gabs * a).sum(-1, keepdim=True) / total**2) \
            * _activation_grad_magnitude(x0, score_function)
    assert dx.dtype == dtype
    assert_within(dx, dx64, mag, RTOL[dtype], "grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.float32], ids=str)
@pytest.mark.parametrize("total_as_tensor", [False, True])
def test_aux_loss_matches_reference(dtype, count_dtype, total_as_tensor):
    gen = torch.Generator().manual_seed(9)
    probs = torch.rand(T, E, generator=gen).to(dtype).requires_grad_()
    counts = torch.randint(0, 40, (E,), generator=gen).to(count_dtype)
    total, num_experts, topk, coeff = 3 * T, 64, 6, 0.01
    loss = fused_moe_aux_loss(probs=probs, tokens_per_expert=counts,
                              total_num_tokens=torch.tensor(total) if total_as_tensor else total,
                              num_experts=num_experts, topk=topk, coeff=coeff)
    constant = num_experts * coeff / (topk * total * total)
    p64 = probs.detach().double()
    want = (p64.sum(0) * counts.double()).sum() * constant
    assert loss.dtype == dtype and loss.shape == ()
    assert_within(loss, want, want, RTOL[dtype], "loss")
    (grad,) = torch.autograd.grad(loss, probs, torch.tensor(2.0, dtype=dtype))
    want_grad = (2.0 * constant * counts.double()).expand(T, E)
    assert grad.dtype == dtype
    assert_within(grad, want_grad, want_grad, RTOL[dtype], "grad")


def test_traces_under_torch_compile():
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(10)).requires_grad_()
    bias = bias_values()

    def route(x):
        probs, bits = fused_topk_with_score_function(x, 8, False, 8, 4, 2.0, "sqrtsoftplus",
                                                     bias, "bitmap_u8")
        routing_map, scores = fused_compute_score_for_moe_aux_loss(x, 8, "sigmoid")
        loss = fused_moe_aux_loss(scores, routing_map.sum(0), T, E, 8, 0.1)
        return probs, bits, loss

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")  # a graph break raises
    got, want = compiled(x), route(x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(got[0].sum() + got[2], x)[0],
                       torch.autograd.grad(want[0].sum() + want[2], x)[0])


def test_bad_arguments_say_what_is_wrong():
    x = torch.randn(4, 8)
    topk_fn = fused_topk_with_score_function
    bad = [
        (topk_fn, (x.double(), 2, False, None, None, None, "softmax", None), ValueError,
         r"logits must be float32, bfloat16 or float16 .* got torch.float64"),
        (topk_fn, (x.long(), 2, False, None, None, None, "softmax", None), TypeError,
         r"logits must be a floating-point tensor, got torch.int64"),
        (topk_fn, (x, 9, False, None, None, None, "softmax", None), ValueError,
         r"topk must be an int in \[1, num_experts=8\], got 9"),
        (topk_fn, (x, 2, False, None, None, None, "relu", None), ValueError,
         r"score_function must be one of \('softmax', 'sigmoid', 'sqrtsoftplus'\), got 'relu'"),
        (topk_fn, (x, 2, False, None, None, None, "softmax", torch.zeros(8)), ValueError,
         r"expert_bias must be None with score_function 'softmax'"),
        (topk_fn, (x, 2, False, None, None, None, "sigmoid", torch.zeros(7)), ValueError,
         r"expert_bias must be a floating-point tensor \[8\] on cpu, got torch.float32 \[7\]"),
        (topk_fn, (x, 3, False, 4, 2, None, "sigmoid", None), ValueError,
         r"num_groups and group_topk must be .* got num_groups=4, group_topk=2"),
        (topk_fn, (x, 2, False, None, None, None, "sigmoid", None, "bitmap"), ValueError,
         r"routing_map_format must be 'bytemap', 'bitmap_u8', .* got 'bitmap'"),
        (topk_fn, (x, 2, False, None, None, None, "sigmoid", None, 0,
                   torch.zeros(4, 2, dtype=torch.uint8)), ValueError,
         r"topk_indices must be an int16, int32 or int64 tensor \[4, 2\] on cpu, "
         r"got torch.uint8 \[4, 2\]"),
        (topk_fn, (x, 2, False, None, None, None, "sigmoid", torch.zeros(8), 0, None,
                   torch.zeros(8, 4, dtype=torch.int32)), NotImplementedError,
         r"Quantile Balancing \(qb_histogram, qb_bin_bounds, qb_histogram_mode\) is not "
         r"supported"),
        (fused_compute_score_for_moe_aux_loss, (x.double(), 2, "sigmoid"), ValueError,
         r"logits must be float32, bfloat16 or float16 .* got torch.float64"),
        (fused_compute_score_for_moe_aux_loss, (x, 0, "sigmoid"), ValueError,
         r"topk must be an int in \[1, num_experts=8\], got 0"),
        (fused_moe_aux_loss, (x, torch.ones(7), 4, 8, 2, 0.1), ValueError,
         r"tokens_per_expert must be a real tensor \[8\] on cpu, got torch.float32 \[7\]"),
        (fused_moe_aux_loss, (x, torch.ones(8), 0, 8, 2, 0.1), ValueError,
         r"total_num_tokens must be a positive int or a one-element tensor, got 0"),
        (fused_moe_aux_loss, (x[0], torch.ones(8), 4, 8, 2, 0.1), ValueError,
         r"probs must be \[\.\.\., num_experts\] .* got shape \[8\]"),
    ]
    for fn, args, error, message in bad:
        with pytest.raises(error, match=f"^{fn.__name__}: {message}"):
            fn(*args)
