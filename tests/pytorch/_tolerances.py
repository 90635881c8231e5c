"""The one table of tolerances of the PyTorch tests, with the reason for each entry.

GEMM results are compared with a reference computed in float64 from the very FP8 (or
high-precision) operands the layer used, so the only differences are rounding in the GEMM:
fp32 accumulation of K products and the final rounding to the output dtype. Both are bounded
relative to ``sum_k |a_k| |b_k|`` (the "magnitude" of each output element), which is what the
tolerance multiplies; a bound relative to the result itself would fail on cancellation.
"""

from __future__ import annotations

import torch

# Relative to sum_k |a_k||b_k|, for K <= 256:
#   fp32: a sequential fp32 sum errs by at most (K - 1) * 2^-24 of the magnitude (1.5e-5 for
#         K = 256); 2e-5 adds the roundings of the scale_inv products.
#   bf16: the result is rounded once to 8 significant bits: 2^-9 of |result| <= magnitude,
#         plus the fp32 accumulation: 2^-8 covers both with room.
#   fp16: 11 significant bits: 2^-11 of the result, doubled for the accumulation.
GEMM_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
# On CUDA, FP8 operands go through Hopper's FP8 tensor cores, whose MMA keeps only about 14
# significant bits before partial sums reach fp32: the core's GEMM tests measured up to
# 2^-10.5 of sum |a||b| on the H200; 2^-9 more (as they allow) leaves three times the room.
FP8_TENSOR_CORE_RTOL = 2.0**-9

# A compiled step against the eager one: the same FP8 ops run in both, but inductor may
# reorder the high-precision reductions around them (the bias gradient, the loss), so sums
# differ by a few fp32 ulps; the loss itself is compared with this relative tolerance.
COMPILE_RTOL = 1e-5


def assert_gemm_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor,
                      dtype: torch.dtype, what: str) -> None:
    """|got - want| <= rtol * magnitude elementwise (all float64 on the CPU), rtol being
    GEMM_RTOL[dtype], plus FP8_TENSOR_CORE_RTOL when ``got`` was computed on CUDA."""
    rtol = GEMM_RTOL[dtype] + (FP8_TENSOR_CORE_RTOL if got.is_cuda else 0.0)
    got64 = got.detach().double().cpu()
    want64, mag = want.double().cpu(), magnitude.double().cpu()
    assert got64.shape == want64.shape, (what, got64.shape, want64.shape)
    err = (got64 - want64).abs()
    bound = rtol * mag + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the {dtype} tolerance"


# LayerNorm / RMSNorm (te.LayerNorm, te.RMSNorm) against torch's norms in float64 from the
# same input, weight and bias values. The core computes in fp32 and sums a row in 128 lanes of
# at most ceil(N / 1024) * 8 sequential terms, then 7 pairwise levels: for N <= 1024 a row sum
# errs by at most ~15 * 2^-24 of sum |terms|; mean, variance, rsqrt and the products add a few
# ulps each, so xhat = (x - mu) * rsigma is off by < 50 * 2^-24 ~ 3e-6 of (|xhat| + 1) (the
# "+ 1" is the mean's error times rsigma, mean|x| * rsigma being O(1) for the test data).
# Each error is bounded relative to a magnitude computed beside the reference:
#   forward        y:  (|xhat| + 1) * |g| + |beta|
#   grad_input     dx: rsigma * (|dy g| + mean|dy g| + (|xhat| + 1) * mean|dy g xhat|)
#   grad_gamma:        sum over rows of |dy| (|xhat| + 1)
#   grad_beta:         sum over rows of |dy|
#   (the column sums take 32 + M / 32 sequential terms, in groups of 32 rows: a few ulps for
#   the M <= 64 rows of the tests)
# fp32: 5e-6 (~84 ulps) is above that estimate; the measured worst is ~3 ulps. bf16: every
# output is rounded once to 8 significant bits, up to half an ulp = 2^-8 of a value bounded by
# its magnitude (measured: 0.92 of that), plus the fp32 errors; 2^-7 covers both twice (the
# reference starts from the same bf16 values, so the inputs themselves add nothing).
NORM_RTOL = {torch.float32: 5e-6, torch.bfloat16: 2.0**-7}


def assert_within(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, rtol: float,
                  what: str) -> None:
    """|got - want| <= rtol * magnitude elementwise, in float64 on the CPU."""
    got64 = got.detach().double().cpu()
    want64, mag = want.detach().double().cpu(), magnitude.detach().double().cpu()
    assert got64.shape == want64.shape, (what, got64.shape, want64.shape)
    err = (got64 - want64).abs()
    worst = (err / (rtol * mag + 1e-30)).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the tolerance {rtol:.3g}"


# FP8 blocks against an unfused float64 reference (te.LayerNormLinear, te.LayerNormMLP): the
# error of every quantized operand is bounded elementwise and carried through the block.
# Quantization rounds to nearest even and saturates (quantize.h): a value whose scaled
# magnitude is normal is off by at most half an ulp, 2^-4 of it for E4M3 (3 mantissa bits) and
# 2^-3 for E5M2 (2 bits); a subnormal one by half the smallest subnormal (2^-10 resp. 2^-17)
# over the scale. Every scale in these tests is at least fp8_max / (4 amax): current scaling
# takes fp8_max / amax (a power of two at most halves it), a block's amax is at most the
# tensor's, delayed scaling with margin 1 takes (fp8_max / amax') / 2 from the previous step's
# amax' of nearly the same tensor (which margin 1 also keeps from saturating).
FP8_EPS = {"float8_e4m3": 2.0**-4, "float8_e5m2": 2.0**-3}
_FP8_TINY = {"float8_e4m3": 2.0**-10 / 448.0, "float8_e5m2": 2.0**-17 / 57344.0}
# sup |act'| of gelu (tanh form, 1.129), silu and qgelu (1.100), relu (1); srelu's is 2|x|.
ACT_LIPSCHITZ = 1.13
# The activations evaluate within a few fp32 ulp (activation.h): 2^-20 of the value.
ACT_RTOL = 2.0**-20


def fp8_error(v: torch.Tensor, err: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """Bound on |q - v| elementwise, where q is the FP8 rounding of a v' within err of v."""
    size = v.abs() + err
    return err + FP8_EPS[fp8_dtype] * size + 4.0 * size.max() * _FP8_TINY[fp8_dtype]


def gemm_error(a, ea, b, eb, bias, dtype: torch.dtype) -> torch.Tensor:
    """Bound on the error of ``a' @ b'^T + bias`` for operands within ea, eb of a, b (float64),
    plus the GEMM's own rounding (GEMM_RTOL of the magnitude)."""
    a, b = a.abs(), b.abs()
    mag = (a + ea) @ (b + eb).t() + (0.0 if bias is None else bias.abs())
    return ea @ b.t() + a @ eb.t() + ea @ eb.t() + GEMM_RTOL[dtype] * mag


def act_error(h: torch.Tensor, eh: torch.Tensor, act: str, gated_base) -> torch.Tensor:
    """Bound on |act(h') - act(h)| for h' within eh of h; ``gated_base`` is the activation of a
    gated one (its input is [a, b]) or None."""
    def lipschitz(x, e, name):
        return 2.0 * (x.abs() + e) if name == "srelu" else ACT_LIPSCHITZ

    if gated_base is None:
        return lipschitz(h, eh, act) * eh + ACT_RTOL * (h.abs() + eh) * lipschitz(h, eh, act)
    (a, b), (ea, eb) = h.chunk(2, dim=-1), eh.chunk(2, dim=-1)
    fa = lipschitz(a, ea, gated_base) * (a.abs() + ea)  # |f(a)| <= L |a| for these f
    return lipschitz(a, ea, gated_base) * ea * (b.abs() + eb) + fa * eb \
        + ACT_RTOL * fa * (b.abs() + eb)


def assert_bounded(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - want| <= bound elementwise (float64 on the CPU)."""
    err = (got.detach().double().cpu() - want.detach().double().cpu()).abs()
    worst = (err / (bound.double().cpu() + 1e-30)).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3g}x its bound"
# Attention outputs and gradients against a float64 reference, (atol, rtol): fp32 on the CPU
# sums at most 129 products of O(1) values per element, ~n * 2^-24 of the magnitude, so
# 2e-5 / 1e-4 leaves ample room while any wrong mask entry moves results by O(1 / seqlen);
# bf16 (CUDA) is the bound, 1.5e-2: inputs carry 2^-9 relative error, kernels
# accumulate in fp32. Gradients get twice these (one more GEMM of rounded operands).
ATTENTION_TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1.5e-2, 1.5e-2)}
# FP8 attention against bf16: E4M3 keeps 3 mantissa bits (2^-4 relative per element), which
# averages down over the keys: within 0.5 absolute / 0.05 relative, and an RMSE below 0.11 of
# the output's range.
ATTENTION_FP8_TOL = (0.5, 0.05)
# cuDNN's FP8 backward writes the gradients in the recipe's backward format, widened after:
# under HYBRID that is E5M2, whose 2 mantissa bits move a value by up to 2^-3 of itself, on top
# of what ATTENTION_FP8_TOL covers (the CPU and the CUDA math path write high precision). On
# the H100 the E4M3 tolerance alone left dv at 0.88-1.02x of it over four steps, with and
# without the first-step rule (gpu_checks.md).
E5M2_GRAD_RTOL = 2.0**-3
ATTENTION_FP8_RMSE_OF_RANGE = 0.11

# Rotary position embedding (te.apply_rotary_pos_emb) against a float64 reference from the same
# fp32 angles, relative to the magnitude |x_i cos a_i| + |x_k sin a_i| of each output (k the
# partner feature; for gradients the same with the gradient's values). cos and sin are within
# an fp32 ulp of exact (the core's: half an ulp plus 1e-16; torch's: about one ulp), and the
# two products and the sum each round once in fp32: at most 4 * 2^-24 of the magnitude, so
# 2^-21 leaves twice that. bf16 / fp16 outputs round once more, by half an ulp of the result
# (2^-9 / 2^-12 of |y| <= the magnitude); 2^-8 / 2^-11 is twice that, the fp32 part included.
# Two paths that each meet these (fused and unfused) differ by at most twice as much.
ROPE_RTOL = {torch.float32: 2.0**-21, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# te.RotaryPositionEmbedding's angles against float64 arithmetic on the same fp32 exponents
# k / rot_dim: torch's fp32 pow (about an ulp, 2^-23 of the value), the reciprocal, the
# position's interpolation and the product (half an ulp each) add up to 2.5 * 2^-23 ~ 2^-21.7
# relative; 2^-20 leaves three times that.
ROPE_FREQS_RTOL = 2.0**-20

# te.parallel_cross_entropy against torch's F.cross_entropy in float64 from the same logit
# values (_reference.cross_entropy64), relative to magnitudes: a token's loss to
# |lse| + max|x| + 1 (+ the z-loss), a gradient element to its terms before they cancel,
# (p + eps / V + [target]) |d loss|. The loss and the gradient are computed in float32 for
# float32 and half logits: the sum of V <= 128 exponentials errs by at most V 2^-24 of itself,
# the log, the exp and the differences by an ulp or two each; 2^-17 covers that with room
# (measured: about 2^-22). The gradient of half logits is rounded once more, by half an ulp
# of the result, 2^-9 (bf16) / 2^-12 (fp16) of it: 2^-8 / 2^-11 is twice that. fp16 rounds
# results below 2^-14 to subnormals 2^-24 apart, hence the absolute half-spacing 2^-25.
# float64 logits are computed in float64: 2^-40 leaves room for V 2^-53.
CROSS_ENTROPY_RTOL = {torch.float64: 2.0**-40, torch.float32: 2.0**-17,
                      torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
CROSS_ENTROPY_ATOL = {torch.float16: 2.0**-25}
