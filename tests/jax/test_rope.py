"""transformer_engine.jax.rope: the fused rotary position embedding (custom calls forward and
backward) against a pure-jnp formula written pair by pair, values and gradients, under jit and
vmap; the angles of rotary_freqs against float64; the argument checks; and on a GPU the CUDA
handlers against the CPU ones bit for bit (rope.h)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import assert_close

import transformer_engine.jax as te
from transformer_engine.jax.rope import apply_rotary_pos_emb, rotary_freqs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KIND = {"float32": "rope_float32", "bfloat16": "bfloat16", "float16": "float16"}


def reference(x, freqs, tensor_format, interleaved, start_positions=None):
    """The rotation in fp32 by gathers of the pair's features: y_i = x_i cos a_i - x_k sin a_i
    for the first feature of a pair, x_i cos a_i + x_k sin a_i for the second."""
    xs = x.astype(jnp.float32)
    if tensor_format == "sbhd":
        xs = jnp.swapaxes(xs, 0, 1)
    batch, seq, _, dim = xs.shape
    rot = freqs.shape[-1]
    start = jnp.zeros(batch, jnp.int32) if start_positions is None else start_positions
    angles = freqs[start[:, None] + jnp.arange(seq)[None, :]][:, :, None, :]  # [b, s, 1, R]
    j = np.arange(rot)
    if interleaved:
        partner, first = j ^ 1, j % 2 == 0
    else:
        partner, first = np.where(j < rot // 2, j + rot // 2, j - rot // 2), j < rot // 2
    sign = jnp.where(first, -1.0, 1.0).astype(jnp.float32)
    xr = xs[..., :rot]
    y = xr * jnp.cos(angles) + (sign * xr[..., partner]) * jnp.sin(angles)
    y = jnp.concatenate((y, xs[..., rot:]), axis=-1)
    if tensor_format == "sbhd":
        y = jnp.swapaxes(y, 0, 1)
    return y.astype(x.dtype)


def _case(tensor_format, dtype, head_dim, rot_dim, interleaved, with_start, seed=0):
    shape = (3, 7, 2, head_dim) if tensor_format == "bshd" else (7, 3, 2, head_dim)
    kx, kg = jax.random.split(jax.random.PRNGKey(seed))
    x = (jax.random.normal(kx, shape) * 2).astype(DTYPES[dtype])
    g = jax.random.normal(kg, shape).astype(DTYPES[dtype])
    freqs = rotary_freqs(16, rot_dim, base=500.0, interleaved=interleaved)
    start = jnp.array([4, 0, 9], jnp.int32) if with_start else None
    return x, g, freqs, start


@pytest.mark.parametrize("with_start", [False, True], ids=["", "start"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rot_dim", [(16, 16), (20, 12)], ids=["full", "partial"])
@pytest.mark.parametrize("tensor_format", ["bshd", "sbhd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_values_and_gradients_match_jnp(dtype, tensor_format, head_dim, rot_dim, interleaved,
                                        with_start):
    x, g, freqs, start = _case(tensor_format, dtype, head_dim, rot_dim, interleaved, with_start)

    def fused(x):
        return apply_rotary_pos_emb(x, freqs, tensor_format, interleaved, start)

    def ref(x):
        return reference(x, freqs, tensor_format, interleaved, start)

    y, vjp = jax.vjp(jax.jit(fused), x)
    y_ref, vjp_ref = jax.vjp(ref, x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y_ref, KIND[dtype])
    (dx,), (dx_ref,) = vjp(g), vjp_ref(g)
    assert dx.dtype == x.dtype
    assert_close(dx, dx_ref, KIND[dtype])
    # The features beyond rot_dim pass through untouched.
    np.testing.assert_array_equal(np.asarray(y[..., rot_dim:]), np.asarray(x[..., rot_dim:]))


def test_backward_is_the_inverse_rotation():
    """With the usual angle layout the backward rotates by minus the angle: it undoes the
    forward up to fp32 rounding. Each pass errs by at most 4 * 2^-24 of |x_i cos| + |x_k sin|
    <= 2 max|x|: 16 * 2^-24 max|x| = 2^-20 max|x| for both, doubled for room."""
    x, _, freqs, start = _case("bshd", "float32", 16, 16, False, True)
    _, vjp = jax.vjp(lambda x: apply_rotary_pos_emb(x, freqs, "bshd", False, start), x)
    y = apply_rotary_pos_emb(x, freqs, "bshd", False, start)
    (back,) = vjp(y)
    bound = 2 * 2.0**-20 * float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=0, atol=bound)


def test_freqs_and_start_positions_are_constants_for_autodiff():
    x, _, freqs, start = _case("bshd", "float32", 16, 8, True, True)
    grad = jax.grad(lambda f: apply_rotary_pos_emb(x, f, "bshd", True, start).sum())(freqs)
    assert grad.shape == freqs.shape and not np.any(np.asarray(grad))


def test_vmap_over_a_leading_axis():
    x, _, freqs, _ = _case("bshd", "float32", 16, 16, False, False)
    stacked = jnp.stack((x, 2 * x))
    y = jax.vmap(lambda v: apply_rotary_pos_emb(v, freqs))(stacked)
    assert_close(y[1], reference(2 * x, freqs, "bshd", False), "rope_float32")


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_freqs_match_float64(interleaved):
    got = np.asarray(rotary_freqs(40, 24, base=10000.0, interleaved=interleaved), np.float64)
    # The exponent 2i / rot_dim is the fp32 value the formula defines; the rest in float64.
    exponent = (np.arange(0, 24, 2, dtype=np.float32) / np.float32(24)).astype(np.float64)
    half = np.arange(40, dtype=np.float64)[:, None] * 10000.0 ** -exponent[None, :]
    want = np.repeat(half, 2, axis=1) if interleaved else np.concatenate((half, half), axis=1)
    # fp32 pow, reciprocal and product: a few ulps (2^-20 relative leaves room).
    np.testing.assert_allclose(got, want, rtol=2.0**-20, atol=0)
    assert rotary_freqs(4, 8).dtype == jnp.float32


def test_exported_from_the_package():
    assert te.apply_rotary_pos_emb is apply_rotary_pos_emb and te.rotary_freqs is rotary_freqs


def test_bad_arguments_are_refused():
    x = jnp.zeros((2, 4, 2, 8))
    f = rotary_freqs(6, 8)
    with pytest.raises(ValueError, match="apply_rotary_pos_emb: tensor_format"):
        apply_rotary_pos_emb(x, f, "thd")
    with pytest.raises(ValueError, match="x must have rank 4"):
        apply_rotary_pos_emb(x[0], f)
    with pytest.raises(TypeError, match="freqs must be float32"):
        apply_rotary_pos_emb(x, f.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="rot_dim.*at most x's head dimension 4"):
        apply_rotary_pos_emb(x[..., :4], f)
    with pytest.raises(ValueError, match="at least the sequence length 4 rows, got 3"):
        apply_rotary_pos_emb(x, f[:3])
    with pytest.raises(ValueError, match="start_positions must be an integer vector \\[2\\]"):
        apply_rotary_pos_emb(x, f, start_positions=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="rotary_freqs: rot_dim must be even"):
        rotary_freqs(4, 7)


def test_cpu_refuses_positions_past_freqs():
    """The core checks start_positions against the rows of freqs on the CPU (rope.h)."""
    x = jnp.zeros((2, 4, 2, 8))
    with pytest.raises(Exception, match="rope_forward: freqs.data must have a row for every "
                                        "position used, up to 7"):
        jax.block_until_ready(apply_rotary_pos_emb(x, rotary_freqs(6, 8), "bshd", False,
                                                   jnp.array([0, 4], jnp.int32)))


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32), (20, 12)],
                         ids=["vector", "vector-partial", "scalar"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_matches_cpu_bit_for_bit(dtype, head_dim, rot_dim, interleaved):
    """The CUDA kernel (its 128-bit path for head_dim 64, its scalar path for 20) writes the
    CPU path's bits, forward and backward."""
    x, g, freqs, start = _case("sbhd", dtype, head_dim, rot_dim, interleaved, True)

    def f(x, g, freqs, start):
        y, vjp = jax.vjp(lambda v: apply_rotary_pos_emb(v, freqs, "sbhd", interleaved, start), x)
        return y, vjp(g)[0]

    results = []
    for platform in ("gpu", "cpu"):
        args = jax.device_put((x, g, freqs, start), jax.devices(platform)[0])
        results.append([np.asarray(a) for a in jax.jit(f)(*args)])
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a.view(np.uint16 if a.itemsize == 2 else np.uint32),
                                      b.view(np.uint16 if b.itemsize == 2 else np.uint32))
