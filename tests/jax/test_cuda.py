"""The CUDA handlers against the CPU handlers, op by op and for a whole FP8 training step.

Every test here runs the same jitted function with its inputs on the GPU and on the CPU (one
process, both platforms registered) and compares: bit for bit where the core promises it
(quantization, the delayed update), within the FP8 GEMM tolerance otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import (
    TOLERANCES,
    assert_close,
    assert_relative_rms_error,
)

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo, ops

pytestmark = pytest.mark.cuda


def _both(fn, *args):
    """fn jitted on the GPU and on the CPU, results as numpy trees."""
    results = []
    for platform in ("gpu", "cpu"):
        device = jax.devices(platform)[0]
        out = jax.jit(fn)(*jax.device_put(args, device))
        results.append(jax.tree.map(np.asarray, out))
    return results


def _inputs(shape, seed=0, scale=4.0):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape) * scale, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", [ops.ScalingMode.TENSOR, ops.ScalingMode.BLOCK_1X128,
                                  ops.ScalingMode.BLOCK_128X128])
def test_quantize_is_bit_exact(dtype, mode):
    x = _inputs((256, 384)).astype(dtype)
    scale = None if mode != ops.ScalingMode.TENSOR else np.array([3.0], np.float32)

    def f(x, scale):
        return ops.quantize(x, scale, jnp.float8_e4m3fn, scaling_mode=mode, rowwise=True,
                            columnwise=True, compute_amax=mode == ops.ScalingMode.TENSOR)

    gpu, cpu = _both(f, x, scale)
    for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                      b.view(np.uint8) if b.dtype.itemsize == 1 else b)


def test_amax_scale_and_delayed_update_are_bit_exact():
    x = _inputs((64, 96))
    histories = [np.abs(_inputs((16,), seed=1)), np.zeros(16, np.float32)]
    scales = [np.ones(1, np.float32), np.full(1, 2.0, np.float32)]

    def f(x, histories, scales):
        amax = ops.compute_amax(x)
        s = ops.scale_from_amax(amax, jnp.float8_e5m2, force_pow2_scales=True)
        return amax, s, ops.delayed_scaling_update(histories, scales, jnp.float8_e4m3fn, margin=1)

    gpu, cpu = _both(f, x, histories, scales)
    for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False)])
def test_high_precision_gemm_with_bias(dtype, transpose_a, transpose_b):
    a = _inputs((128, 64), scale=1.0).astype(dtype)
    b = _inputs((64, 96) if not transpose_b else (96, 64), seed=1, scale=1.0).astype(dtype)
    if transpose_a:
        a = _inputs((64, 128), scale=1.0).astype(dtype)
    bias = _inputs((96,), seed=2, scale=1.0).astype(dtype)

    def f(a, b, bias):
        return ops.gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias)

    gpu, cpu = _both(f, a, b, bias)
    assert_close(gpu, cpu, dtype)


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(amax_history_len=4),
                                        recipe.Float8CurrentScaling(),
                                        recipe.Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_training_step_matches_the_cpu(fp8_recipe, dtype):
    from transformer_engine.jax.flax import DenseGeneral

    x = _inputs((2, 128, 256), scale=1.0).astype(dtype)
    layer = DenseGeneral(features=256)  # fp32 parameters; computes in x's dtype
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(0), x)

    def step(variables, x):
        params, other = variables["params"], {k: v for k, v in variables.items() if k != "params"}

        def loss(p, o, x):
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = layer.apply({"params": p, **o}, x)
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, other, x)

    (l_gpu, g_gpu), (l_cpu, g_cpu) = _both(step, variables, x)
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=TOLERANCES["fp8_step_cuda_vs_cpu"])
    for a, b in zip(jax.tree.leaves(g_gpu), jax.tree.leaves(g_cpu), strict=True):
        assert_relative_rms_error(a, b, "fp8_step_cuda_vs_cpu")
    text = jax.jit(step).lower(*jax.device_put((variables, x), jax.devices("gpu")[0]))
    assert hlo.count_fp8_gemms(text.compile().as_text()) == 3


def test_errors_of_the_core_come_back_from_the_cuda_handler():
    q = ops.quantize(jnp.ones((8, 16)), jnp.ones((1,)), jnp.float8_e4m3fn)
    qb = ops.quantize(jnp.ones((16, 16)), jnp.ones((1,)), jnp.float8_e4m3fn)
    gpu = jax.devices("gpu")[0]
    q, qb = jax.device_put((q, qb), gpu)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(ops.gemm(q.data, qb.data, a_scale_inv=q.scale_inv,
                                       b_scale_inv=qb.scale_inv, transpose_b=True,
                                       out_dtype=jnp.float32))


def test_grouped_dense_step_matches_the_cpu():
    """grouped_dense's forward and three gradients (cuBLASLt per group on the GPU, the sizes
    copied to the host) against the CPU: fp32 sums over at most 64 terms in another order."""
    from transformer_engine.jax.dense import grouped_dense

    x, kernel = _inputs((96, 64), seed=2), _inputs((3, 64, 32), seed=3, scale=0.1)
    bias = _inputs((3, 32), seed=4)
    sizes = np.array([40, 0, 50], np.int32)

    def f(x, kernel, bias, sizes):
        return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(grouped_dense(
            a[0], a[1], sizes, bias=a[2]))), argnums=(0, 1, 2))(x, kernel, bias)

    gpu, cpu = _both(f, x, kernel, bias, sizes)
    for a, b in zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_fp8_grouped_dense_step_matches_the_cpu():
    """FP8 grouped_dense (current scaling), forward and gradients: the quantizations are
    bit-exact across devices, but the GEMMs sum in another order, and a gradient that differs
    in its last bits can round to another FP8 value: the whole step's FP8 tolerance."""
    from transformer_engine.jax.dense import grouped_dense

    x, kernel = _inputs((96, 64), seed=5), _inputs((3, 64, 32), seed=6, scale=0.1)
    bias = _inputs((3, 32), seed=7)
    sizes = np.array([48, 0, 32], np.int32)
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())

    def f(x, kernel, bias, sizes):
        return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(grouped_dense(
            a[0], a[1], sizes, bias=a[2], quantizer_set=qset))), argnums=(0, 1, 2))(
                x, kernel, bias)

    gpu, cpu = _both(f, x, kernel, bias, sizes)
    for a, b in zip(jax.tree.leaves(gpu)[1:], jax.tree.leaves(cpu)[1:], strict=True):
        assert_relative_rms_error(a, b, "fp8_step_cuda_vs_cpu")
