"""One table of tolerances for the JAX tests, by what is compared.

* ``float32``: our GEMM and XLA's dot both accumulate in fp32, only in a different order:
  a few ulps of the largest partial sums at K <= 256.
* ``float16`` / ``bfloat16``: both round the fp32 result to the output dtype once; a
  different accumulation order can move it by one ulp (2^-11 / 2^-8 relative), so we allow
  two ulps of the output's magnitude.
* ``norm_float32``: LayerNorm / RMSNorm (values and gradients) against flax's layers in fp32.
  Both compute the row statistics in fp32 but in a different order (the core sums in 128
  fixed lanes, flax takes the variance as E[x^2] - E[x]^2), and rsigma's rounding carries into
  every output: measured at most 3e-7 of max(1, |expected|) for N <= 1024 and inputs of mean
  0.5 and std 2; 1e-5 leaves a 30x margin (the CUDA kernels are bit-identical to the CPU
  path). In bf16 / fp16 the core rounds y and dx from fp32 once (half an ulp, measured 1.6e-3
  < 2^-9 for bf16), which the ``bfloat16`` / ``float16`` entries cover.
* ``rope_float32``: rotary position embedding against the pure-jnp formula in fp32 from the
  same angles. Each side takes cos and sin within about an fp32 ulp (the core's own sincos,
  XLA's cos and sin), then two products and a sum, each rounded once: at most 4 * 2^-24 of
  |x_i cos| + |x_k sin| <= 2 max|x| apart per side; 2^-20 of max(1, max|expected|) holds both
  sides' errors with room. In bf16 / fp16 both round the fp32 result once, which the
  ``bfloat16`` / ``float16`` entries (two ulps) cover.
* ``fp8_exact``: an FP8 GEMM against the fp64 product of the same FP8 values (the numpy
  model): exact products, fp32 accumulation, so again only the order differs.
* ``fp8_cuda_vs_cpu``: the same FP8 values on both, but Hopper's FP8 tensor cores accumulate
  with about 14 significant bits before partial sums reach fp32: the core's GEMM tests bound
  the error by 2^-9 of sum |a b| (2^-10.5 measured on the H200). For the random operands
  here (K <= 256) sum |a b| stays within about 3x the largest |output|, so 1e-2 of the
  largest output holds it with room. ``fp8_exact`` becomes this when the tests run on a GPU
  (jax's default backend).
* ``fp8_step_cuda_vs_cpu``: a whole FP8 training step, compared by the relative RMS error
  ||actual - expected|| / ||expected|| of each gradient: the forward outputs differ by the
  fast accumulation above, so some elements land on the other side of an FP8 rounding
  boundary (a step of 2^-3 relative in E4M3, 2^-2 in E5M2) before the next GEMM. The
  largest single element can move by several percent (up to 6% was seen on the H200 for a
  LayerNormMLP step, where a flip of the activation's E4M3 and then of the gradient's E5M2
  compound), but such flips are a small fraction of the elements, so the RMS error stays
  a few percent: measured at most 3.7% on the H200 (a SwiGLU LayerNormMLP step under
  current scaling, where the gradient crosses E4M3 and then E5M2 roundings); 6% leaves a
  margin, and a wrong kernel gives O(1).
* ``amax_cuda_vs_cpu``: an amax of a tensor that a GEMM made (the gradient before the
  first GEMM of an MLP), against the fp64 product: the tensor cores' accumulation above,
  measured 1.1e-5 relative on the H200; 1e-3 keeps a wide margin and still fails on a wrong
  element.
* ``bfloat16_layer``: a whole bf16 Transformer layer against the fp32 reference computed
  from the same bf16 inputs and parameters, by the largest error relative to the largest
  output: the layer rounds to bf16 at about eight points in series (normed input, q/k/v,
  attention weights and output, projection, MLP hidden and activation, residual sums), each
  by at most half an ulp (2^-9 relative), so 8 * 2^-9 = 2^-6 bounds it; measured 0.6%.
* ``fp8_vs_fp32``: an FP8 layer against the fp32 layer; relative to the largest output,
  E4M3 rounds each input by up to 2^-4, E5M2 (gradients) by 2^-3, and the errors average
  over K; 10% / 20% of the largest value bounds them with a wide margin at these sizes.
"""

from __future__ import annotations

import jax
import numpy as np

TOLERANCES = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "norm_float32": dict(rtol=1e-5, atol=1e-5),
    "rope_float32": dict(rtol=2.0**-20, atol=2.0**-20),
    "float16": dict(rtol=2 * 2.0**-11, atol=2 * 2.0**-11),
    "bfloat16": dict(rtol=2 * 2.0**-8, atol=2 * 2.0**-8),
    "fp8_exact": dict(rtol=1e-5, atol=1e-5),
    "fp8_cuda_vs_cpu": dict(rtol=1e-2, atol=1e-2),
    "fp8_step_cuda_vs_cpu": 0.06,
    "amax_cuda_vs_cpu": 1e-3,
    "fp8_forward_vs_fp32": 0.10,
    "fp8_backward_vs_fp32": 0.20,
    "bfloat16_layer": 2.0**-6,
}


def assert_close(actual, expected, kind: str) -> None:
    """Elementwise closeness, scaled by the largest |expected| for the atol part."""
    if kind == "fp8_exact" and jax.default_backend() == "gpu":
        kind = "fp8_cuda_vs_cpu"
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    tol = TOLERANCES[kind]
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol["rtol"], atol=tol["atol"] * scale)


def assert_relative_max_error(actual, expected, kind: str) -> None:
    """max|actual - expected| / max|expected| below the table's bound."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    err = float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))
    assert err < TOLERANCES[kind], f"relative max error {err:.4f} >= {TOLERANCES[kind]} ({kind})"


def assert_relative_rms_error(actual, expected, kind: str) -> None:
    """||actual - expected|| / ||expected|| below the table's bound."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    norm = float(np.linalg.norm(expected))
    diff = float(np.linalg.norm(actual - expected))
    err = diff / norm if norm > 0 else diff
    assert err < TOLERANCES[kind], f"relative RMS error {err:.4f} >= {TOLERANCES[kind]} ({kind})"
