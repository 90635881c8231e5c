"""The CUDA handlers of the activations and the FP8 norm forward against the CPU handlers
(bit for bit: the core promises identical bits on both), and a LayerNormMLP FP8 training
step on the GPU against the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import TOLERANCES, assert_relative_rms_error

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


def _bits(a):
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same_bits(gpu, cpu):
    leaves_gpu, leaves_cpu = jax.tree.leaves(gpu), jax.tree.leaves(cpu)
    assert len(leaves_gpu) == len(leaves_cpu)
    for i, (a, b) in enumerate(zip(leaves_gpu, leaves_cpu, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"leaf {i}"
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"leaf {i}")


def _inputs(shape, seed=0, scale=3.0):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), shape) * scale, np.float32)


# Clamped SwiGLU is the one activation with parameters: it comes as their tuple (not the
# defaults, so that they reach the kernels).
_ACTS = [ops.ClampedSwiGLU(2.0, 1.5, 0.5) if a == ops.Activation.CLAMPED_SWIGLU else a
         for a in ops.Activation]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", _ACTS, ids=lambda a: ops.kind_of(a).name.lower())
def test_activation_forward_and_backward_are_bit_exact(act, dtype):
    # Awkward sizes: rows not a multiple of the kernels' tiles, K not of 128.
    n = 200
    k = 2 * n if ops.is_gated(act) else n
    x = _inputs((300, k)).astype(dtype)
    dy = _inputs((300, n), seed=1, scale=1.0).astype(dtype)
    scale = np.array([2.0], np.float32)

    def f(x, dy, scale):
        y, amax = ops.activation_forward(x, act, compute_amax=True)
        q = ops.activation_forward_fp8(x, act, scale, jnp.float8_e4m3fn)
        dx, dbias, dx_amax = ops.activation_backward(dy, x, act, dbias_dtype=jnp.float32,
                                                     compute_amax=True)
        g, g_dbias = ops.activation_backward_fp8(dy, x, act, scale, jnp.float8_e5m2,
                                                 dbias_dtype=dtype)
        return y, amax, q, dx, dbias, dx_amax, g, g_dbias

    gpu, cpu = _both(f, x, dy, scale)
    _assert_same_bits(gpu, cpu)


@pytest.mark.parametrize("norm_type", [ops.NormType.LAYERNORM, ops.NormType.RMSNORM],
                         ids=["layernorm", "rmsnorm"])
def test_norm_fp8_forward_is_bit_exact(norm_type):
    x = _inputs((300, 768)).astype(jnp.bfloat16)
    gamma = 1 + 0.1 * _inputs((768,), seed=1, scale=1.0)
    beta = 0.1 * _inputs((768,), seed=2, scale=1.0)
    b = beta if norm_type == ops.NormType.LAYERNORM else None

    def f(x, gamma, beta):
        return ops.norm_forward_fp8(x, gamma, beta, jnp.array([4.0]), jnp.float8_e4m3fn,
                                    norm_type=norm_type, write_output=True)

    gpu, cpu = _both(f, x, gamma, b)
    _assert_same_bits(gpu, cpu)


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear")], ids="-".join)
@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(amax_history_len=4),
                                        recipe.Float8CurrentScaling(),
                                        recipe.Float8BlockScaling()],
                         ids=["delayed", "current", "block"])
def test_layernorm_mlp_fp8_training_step_matches_the_cpu(fp8_recipe, activations):
    from transformer_engine.jax.flax import LayerNormMLP

    x = _inputs((2, 128, 256), scale=1.0).astype(jnp.bfloat16)
    # fp32 parameters (dtype's default); it computes in x's bf16
    mlp = LayerNormMLP(intermediate_dim=512, activations=activations, use_bias=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)

    def step(variables, x):
        params, other = variables["params"], {k: v for k, v in variables.items() if k != "params"}

        def loss(p, o, x):
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out, _ = mlp.apply({"params": p, **o}, x)
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, other, x)

    (l_gpu, g_gpu), (l_cpu, g_cpu) = _both(step, variables, x)
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=TOLERANCES["fp8_step_cuda_vs_cpu"])
    for a, b in zip(jax.tree.leaves(g_gpu), jax.tree.leaves(g_cpu), strict=True):
        assert_relative_rms_error(a, b, "fp8_step_cuda_vs_cpu")
    lowered = jax.jit(step).lower(*jax.device_put((variables, x), jax.devices("gpu")[0]))
    assert hlo.count_fp8_gemms(lowered.compile().as_text()) == 6


def test_layernorm_dense_fp8_operands_match_the_cpu():
    x = _inputs((256, 512), scale=1.0).astype(jnp.bfloat16)
    gamma, beta = 1 + 0.1 * _inputs((512,), seed=1, scale=1.0), _inputs((512,), seed=2, scale=0.1)
    kernel = _inputs((512, 256), seed=3, scale=0.05)
    fp8_recipe = recipe.DelayedScaling()
    state = te.new_fp8_state(fp8_recipe)
    state["x"]["scale"] = jnp.array([16.0])

    def f(x, gamma, beta, kernel, state):
        qset = te.make_quantizer_set(fp8_recipe, state)
        return te.layernorm_dense_fp8_operands(x, gamma, beta, kernel, quantizer_set=qset)

    gpu, cpu = _both(f, x, gamma, beta, kernel, state)
    _assert_same_bits(gpu, cpu)
