"""q, k and v read in place from one projection output (attention_fn.packed_qkv): the core's
strided operands (attention.h's row_stride / head_stride) against the dense path.

On the CPU both paths run the same reference arithmetic in the same order, so outputs and
gradients must be bit-identical. On CUDA each backend (cuDNN, the CUDA math path) runs strided
and dense operands beside each other: the forward is the same kernel on other addresses, and
the backward's dq sums may be ordered differently, so gradients compare within ATTENTION_TOL.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._autograd_graph import node_names
from te_torch_tests._tolerances import ATTENTION_TOL

import transformer_engine.pytorch as te
from transformer_engine.common import core
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.attention_fn import _FusedAttention, fused_attention, packed_qkv
from transformer_engine.pytorch.module._heads import split_heads

E32 = torch.empty(0, dtype=torch.int32)
E64 = torch.empty(0, dtype=torch.int64)


def _projection(layout, seq, batch, heads, groups, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (seq, batch) if layout == "sbhd" else (batch, seq)
    x = torch.randn(*lead, (heads + 2 * groups) * dim, generator=g)
    return x.to(dtype=dtype, device=device).requires_grad_(True)


def _run(x, heads, groups, dim, interleaved, params, dense: bool, grad):
    """o and d(x) of attention over the heads of x (as MultiheadAttention splits them)."""
    q, k, v = split_heads(x * 1.0, groups, (heads // groups, 1, 1), dim, interleaved)
    rng = E64 if params[5] == 0.0 else torch.tensor([7, 11], dtype=torch.int64, device=x.device)
    cu = E32.to(x.device)
    if dense:
        o = _FusedAttention.apply(q, k, v, cu, cu, rng, params, False)
    else:
        assert packed_qkv(q, k, v, params) is not None
        o = fused_attention(q, k, v, cu, cu, rng, params)
    (dx,) = torch.autograd.grad(o, x, grad)
    return o, dx


def _params(layout, mask="causal", dim=16, dropout=0.0, backend="auto"):
    return (layout, mask, -1, 0 if "causal" in mask else -1, dim ** -0.5, dropout, 0, 0, backend)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("groups", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_packed_equals_dense_on_cpu(layout, interleaved, groups, dropout):
    heads, dim = 4, 16
    x = _projection(layout, 12, 3, heads, groups, dim, torch.float32, "cpu")
    params = _params(layout, dropout=dropout)
    grad = torch.randn(*x.shape[:2], heads, dim, generator=torch.Generator().manual_seed(1))
    o, dx = _run(x, heads, groups, dim, interleaved, params, False, grad)
    o_ref, dx_ref = _run(x, heads, groups, dim, interleaved, params, True, grad)
    assert torch.equal(o, o_ref)
    assert torch.equal(dx, dx_ref)


def test_which_views_are_packed():
    heads, dim = 4, 16
    params = _params("sbhd")
    x = _projection("sbhd", 8, 2, heads, 4, dim, torch.float32, "cpu")
    assert packed_qkv(*split_heads(x * 1.0, 4, (1, 1, 1), dim, True), params) is not None
    # interleaved groups of two query heads: split_heads copies q, so nothing is packed
    x2 = _projection("sbhd", 8, 2, heads, 2, dim, torch.float32, "cpu")
    assert packed_qkv(*split_heads(x2 * 1.0, 2, (2, 1, 1), dim, True), params) is None
    # ... but the concatenated order keeps them views
    assert packed_qkv(*split_heads(x2 * 1.0, 2, (2, 1, 1), dim, False), params) is not None
    q, k, v = split_heads(x * 1.0, 4, (1, 1, 1), dim, True)
    # padding masks and separate tensors take the dense path
    assert packed_qkv(q, k, v, _params("sbhd", mask="padding_causal")) is None
    assert packed_qkv(q.contiguous(), k, v, params) is None
    # views that leave part of the buffer out (only q and k of it) are not a tiling
    assert packed_qkv(q, k, k, params) is None


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("groups,dim", [(4, 16), (1, 16), (2, 64), (4, 4)])
@pytest.mark.parametrize("mask", ["causal", "padding_causal"])
def test_strides_of_views_are_the_tensors_strides(layout, interleaved, groups, dim, mask):
    """A traced step gives the core q, k, v's strides from their views alone
    (qkv_strides_of): the strides qkv_strides reads off the tensors, None included."""
    heads = 4
    x = _projection(layout, 8, 2, heads, groups, dim, torch.bfloat16, "cpu")
    q, k, v = split_heads(x.detach().clone(), groups, (heads // groups, 1, 1), dim, interleaved)
    start = q._base.storage_offset() if q._base is not None else 0
    views = tuple((tuple(t.shape), tuple(t.stride()), t.storage_offset() - start)
                  for t in (q, k, v))
    want = ops.attention.qkv_strides(layout, mask, q, k, v)
    assert ops.attention.qkv_strides_of(layout, mask, views, 2) == want
    if want:  # (a view starting off a 16-byte boundary is not read in place)
        shifted = tuple((sh, st, off + 1) for sh, st, off in views)
        assert ops.attention.qkv_strides_of(layout, mask, shifted, 2) is None


def test_multihead_attention_reads_qkv_in_place():
    mha = te.MultiheadAttention(64, 4, attention_dropout=0.0, attn_mask_type="causal",
                                params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 2, 64, requires_grad=True)
    out = mha(x)
    assert "_FusedAttentionPackedBackward" in node_names(out)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("layout,interleaved,groups", [("bshd", False, None),
                                                        ("sbhd", True, None),
                                                        ("bshd", True, 1)])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_compiled_multihead_attention_reads_qkv_in_place(layout, interleaved, groups, in_place,
                                                         monkeypatch):
    """A traced step cannot look at the views' storage: with multihead_attention's
    traced_in_place te.MultiheadAttention gives the attention the views it made, so the
    compiled step reads q, k, v in place and writes their gradients into one buffer (no
    copies of them, no concatenation) and matches eager (the default). Off, the traced step
    takes the dense attention."""
    import copy

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from transformer_engine.pytorch.module import multihead_attention

    monkeypatch.setattr(multihead_attention, "traced_in_place", in_place)
    code = []

    def keep(gm, example_inputs):
        code.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = te.MultiheadAttention(64, 2, input_layernorm=True, attention_dropout=0.0,
                                qkv_format=layout, num_gqa_groups=groups,
                                qkv_weight_interleaved=interleaved, params_dtype=torch.float32)
    eager = copy.deepcopy(mha)
    compiled = torch.compile(mha, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True)
    x = torch.randn(16, 2, 64) if layout == "sbhd" else torch.randn(2, 16, 64)
    for model in (compiled, eager):
        model(x).square().mean().backward()
    for (name, a), b in zip(mha.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    graphs = "\n".join(code)
    assert ("attention_backward_packed" in graphs) == in_place
    assert ("attention_backward.default" in graphs) == (not in_place)
    if in_place:
        assert ".clone(" not in graphs


def test_packed_backward_refuses_views_of_another_tensor():
    """The gradients are written where q, k, v sit in qkv: tensors outside it are refused."""
    x = _projection("bshd", 8, 2, 2, 2, 16, torch.float32, "cpu").detach()
    q, k, v = split_heads(x, 2, (1, 1, 1), 16, False)
    o, lse = ops.attention_forward(q, k, v, E32, E32, E64, *_params("bshd"))
    with pytest.raises(ValueError, match="views of the contiguous qkv"):
        ops.attention_backward_packed(x.clone(), q, k, v, o, torch.ones_like(o), lse, E64,
                                      "bshd", "causal", -1, 0, 0.25, 0.0, False, "auto")


def test_core_rejects_bad_strides():
    raw = ops._backend.raw
    q, o, lse = torch.zeros(4, 1, 2, 16), torch.zeros(4, 1, 2, 16), torch.zeros(4, 2, 1)
    overlapping = ops.attention.config("bshd", "causal", -1, 0, 0.25, 0.0, 0, 0,
                                       strides=[16, 8, 32, 16, 32, 16])
    with pytest.raises(ValueError, match=r"head_stride >= head_dim \(16\)"):
        core().attention_forward(overlapping, raw(q), raw(q), raw(q), raw(o), raw(lse))
    q3, o3, lse3 = q[:, 0].contiguous(), o[:, 0].contiguous(), torch.zeros(1, 2, 4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    thd = ops.attention.config("thd", "padding", -1, -1, 0.25, 0.0, 4, 4,
                               strides=[96, 32, 96, 32, 96, 32])
    with pytest.raises(Exception, match="strided q, k and v .* take the bshd and sbhd layouts"):
        core().attention_forward(thd, raw(q3), raw(q3), raw(q3), raw(o3), raw(lse3),
                                 cu_seqlens_q=raw(cu), cu_seqlens_kv=raw(cu))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cudnn", "cuda_math"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("groups", [4, 1], ids=["mha", "mqa"])
def test_packed_matches_dense_on_cuda(backend, layout, interleaved, groups):
    if not torch.cuda.is_available() or not core().built_with_cuda():
        pytest.skip("needs a CUDA GPU and a CUDA build of the core")
    heads, dim = 4, 64
    x = _projection(layout, 256, 2, heads, groups, dim, torch.bfloat16, "cuda")
    params = _params(layout, dim=dim, backend=backend)
    grad = torch.randn(*x.shape[:2], heads, dim, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator("cuda").manual_seed(1))
    o, dx = _run(x, heads, groups, dim, interleaved, params, False, grad)
    o_ref, dx_ref = _run(x, heads, groups, dim, interleaved, params, True, grad)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    torch.testing.assert_close(o.float(), o_ref.float(), atol=0, rtol=0)
    torch.testing.assert_close(dx.float(), dx_ref.float(), atol=atol, rtol=rtol)
