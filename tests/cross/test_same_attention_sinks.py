"""Attention sinks through PyTorch's ``te.DotProductAttention`` and Flax's
``DotProductAttention``: the same sink logits, q, k and v give the same outputs and gradients
(the sink's included). Each framework computes in its own ops (torch matmuls and softmax,
jnp einsums), in fp32, so they agree to the rounding of those sums."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

import transformer_engine.jax.flax as te_flax  # noqa: E402
import transformer_engine.pytorch as te_torch  # noqa: E402

B, S, HEADS, GROUPS, DIM = 2, 9, 4, 2, 16
SINK = np.array([0.7, -0.3, 1.5, -2.0], np.float32)
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_same_outputs_and_gradients(softmax_type):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, HEADS, DIM)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, GROUPS, DIM)).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((B, S, HEADS, DIM)).astype(np.float32)
    learnable = softmax_type == "learnable"

    m = te_torch.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd",
                                     softmax_type=softmax_type, device="cpu")
    if learnable:
        with torch.no_grad():
            m.softmax_offset.copy_(torch.from_numpy(SINK))
    tq, tk, tv = (torch.from_numpy(t).requires_grad_() for t in (q, k, v))
    out = m(tq, tk, tv)
    out.backward(torch.from_numpy(dy).reshape(out.shape))

    f = te_flax.DotProductAttention(head_dim=DIM, num_attention_heads=HEADS,
                                    num_gqa_groups=GROUPS, softmax_type=softmax_type)
    sink = jnp.asarray(SINK if learnable else np.zeros(HEADS, np.float32))

    def run(q, k, v, sink):
        return f.apply({"params": {"softmax_offset": sink}} if learnable else {}, q, k, v)

    y, vjp = jax.vjp(run, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sink)
    grads = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(out.detach().numpy().reshape(y.shape), np.asarray(y), **TOL)
    for name, t, g in zip(("dq", "dk", "dv"), (tq, tk, tv), grads[:3], strict=True):
        np.testing.assert_allclose(t.grad.numpy(), np.asarray(g), **TOL, err_msg=name)
    if learnable:
        np.testing.assert_allclose(m.softmax_offset.grad.numpy(), np.asarray(grads[3]), **TOL)
