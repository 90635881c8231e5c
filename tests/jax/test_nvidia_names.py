"""NVIDIA's JAX import paths and names: each path imports, the attention enums are our option
strings and give the layers' outputs bit for bit, the sharding guard nests and restores and
the modules refuse the parallelism they do not implement, FP8 availability agrees with the
PyTorch package's, and ``activation`` reads NVIDIA's [..., A, K] layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import ops
from transformer_engine.jax.attention import (
    LAYOUTS,
    MASKS,
    AttnBiasType,
    AttnMaskType,
    QKVFormat,
    QKVLayout,
    SequenceDescriptor,
    fused_attn,
)
from transformer_engine.jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    TransformerLayer,
)
from transformer_engine.jax.layernorm_mlp import activation as last_axis_activation

CPU = jax.default_backend() == "cpu"


def test_import_paths():
    from transformer_engine.jax.activation import activation
    from transformer_engine.jax.cpp_extensions.misc import (
        get_cudnn_version,
        get_device_compute_capability,
    )
    from transformer_engine.jax.quantize import (
        ScalingMode,
        is_fp8_available,
        is_scaling_mode_supported,
    )
    from transformer_engine.jax.sharding import (
        MeshResource,
        global_mesh_resource,
        global_shard_guard,
    )

    assert callable(activation) and callable(global_shard_guard) and callable(is_fp8_available)
    assert callable(is_scaling_mode_supported) and len(ScalingMode) >= 4
    assert MeshResource is te.MeshResource and global_mesh_resource() == MeshResource()
    assert te.get_cudnn_version is get_cudnn_version
    assert te.get_device_compute_capability is get_device_compute_capability
    assert te.sharding.global_shard_guard is global_shard_guard
    assert te.quantize.ScalingMode is ScalingMode


def test_cpp_extensions_names_only_the_device_queries():
    with pytest.raises(AttributeError, match="act_lu.*transformer_engine.jax.ops"):
        te.cpp_extensions.act_lu  # noqa: B018


@pytest.mark.skipif(not CPU, reason="the CPU answers")
def test_device_queries_on_the_cpu():
    assert te.get_device_compute_capability() == 0
    assert te.get_device_compute_capability(gpu_id=3) == 0
    assert te.get_cudnn_version() == (0, 0, 0)


# ---- attention enums ------------------------------------------------------------------------

def test_attention_enums_are_our_option_strings():
    assert {m.value for m in AttnMaskType} == set(MASKS)
    assert {f.value for f in QKVFormat} == set(LAYOUTS)
    separate = [lay for lay in QKVLayout if lay.is_separate()]
    assert separate == [QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD]
    assert [lay.value for lay in separate] == ["bshd", "thd"]
    for lay in QKVLayout:
        assert (lay.value in LAYOUTS) == lay.is_separate()
        assert lay.is_separate() + lay.is_kvpacked() + lay.is_qkvpacked() == 1
        assert lay.get_qkv_format() == (QKVFormat.THD if lay.is_thd() else QKVFormat.BSHD)
    assert AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK.is_padding()
    assert AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK.is_causal()
    assert AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK.is_bottom_right()
    assert not AttnMaskType.PADDING_MASK.is_causal() and not AttnMaskType.NO_MASK.is_padding()
    assert [b.value for b in AttnBiasType] == ["no_bias", "pre_scale_bias", "post_scale_bias"]


def _qkv(b=2, s=6, h=2, d=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(k, (b, s, h, d), jnp.float32) for k in keys]


def _padding_mask(b=2, s=6, lengths=(6, 4)):
    valid = np.arange(s)[None, :] < np.asarray(lengths)[:, None]
    keep = valid[:, None, :, None] & valid[:, None, None, :]
    return jnp.asarray(~keep)


@pytest.mark.parametrize("mask_type", list(AttnMaskType), ids=lambda m: m.name)
def test_dot_product_attention_with_enums_equals_strings(mask_type):
    q, k, v = _qkv()
    mask = _padding_mask()
    by_enum = DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type=mask_type,
                                  qkv_layout=QKVLayout.BSHD_BSHD_BSHD)
    by_string = DotProductAttention(head_dim=8, num_attention_heads=2,
                                    attn_mask_type=mask_type.value, qkv_layout="bshd")
    out_enum = by_enum.apply({}, q, k, v, mask)
    out_string = by_string.apply({}, q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(out_enum), np.asarray(out_string))
    # and the enum is not a no-op: another mask gives another output
    other = "causal" if mask_type.value == "no_mask" else "no_mask"
    out_other = DotProductAttention(head_dim=8, num_attention_heads=2,
                                    attn_mask_type=other).apply({}, q, k, v, mask)
    assert not np.array_equal(np.asarray(out_enum), np.asarray(out_other))


def test_fused_attn_takes_enums_and_refuses_packed_layouts():
    q, k, v = _qkv()
    a = fused_attn(q, k, v, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
                   attn_mask_type=AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK)
    b = fused_attn(q, k, v, qkv_layout="bshd", attn_mask_type="causal_bottom_right")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="qkv_layout must be one of"):
        fused_attn(q, k, v, qkv_layout=QKVLayout.BSHD_BS2HD)


def test_multi_head_attention_with_enums_equals_strings():
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 2, 16), jnp.float32)  # [s, b, hidden]
    bias = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 5, 5), jnp.float32)

    def run(mask_type, bias_type):
        mha = MultiHeadAttention(head_dim=8, num_attention_heads=2, attn_mask_type=mask_type,
                                 attn_bias_type=bias_type, scale_attn_logits=True)
        variables = mha.init(jax.random.PRNGKey(0), x, x, bias=bias, deterministic=True)
        return mha.apply(variables, x, x, bias=bias, deterministic=True)

    by_enum = run(AttnMaskType.CAUSAL_MASK, AttnBiasType.PRE_SCALE_BIAS)
    by_string = run("causal", "pre_scale_bias")
    np.testing.assert_array_equal(np.asarray(by_enum[0]), np.asarray(by_string[0]))
    post = run("causal", AttnBiasType.POST_SCALE_BIAS)  # (the scale is not 1: a change)
    assert not np.array_equal(np.asarray(by_enum[0]), np.asarray(post[0]))


def test_sequence_descriptor_gives_the_cu_seqlens():
    q, k, v = _qkv()
    desc = SequenceDescriptor.from_seqlens((jnp.array([6, 4]), jnp.array([5, 3])))
    cu_q, cu_kv = desc.cu_seqlens()
    np.testing.assert_array_equal(np.asarray(cu_q), [0, 6, 10])
    np.testing.assert_array_equal(np.asarray(cu_kv), [0, 5, 8])
    same = SequenceDescriptor.from_seqlens(jnp.array([6, 4]))
    np.testing.assert_array_equal(np.asarray(same.kv_seqlens), [6, 4])

    @jax.jit
    def attend(desc, q, k, v):  # the descriptor is a pytree: it crosses jit
        cu_q, cu_kv = desc.cu_seqlens()
        return fused_attn(q, k, v, attn_mask_type=AttnMaskType.PADDING_MASK,
                          cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)

    expected = fused_attn(q, k, v, attn_mask_type="padding", cu_seqlens_q=jnp.array([0, 6, 10]),
                          cu_seqlens_kv=jnp.array([0, 5, 8]))
    np.testing.assert_array_equal(np.asarray(attend(desc, q, k, v)), np.asarray(expected))
    with pytest.raises(ValueError, match="pair"):
        SequenceDescriptor.from_seqlens((jnp.array([1]),) * 3)


# ---- sharding -------------------------------------------------------------------------------

def test_shard_guard_nests_and_restores():
    from transformer_engine.jax.sharding import (
        MeshResource,
        global_mesh_resource,
        global_shard_guard,
    )

    assert global_mesh_resource() == MeshResource(None, None, None, None, None)
    outer = MeshResource(dp_resource="data")
    inner = MeshResource(dp_resource="batch", pp_resource="stage")
    with global_shard_guard(outer):
        assert global_mesh_resource() is outer
        with global_shard_guard(inner):
            assert global_mesh_resource() is inner
            with global_shard_guard(None):
                assert global_mesh_resource() == MeshResource()
            assert global_mesh_resource() is inner
        assert global_mesh_resource() is outer
        with pytest.raises(RuntimeError, match="boom"), global_shard_guard(inner):
            raise RuntimeError("boom")
        assert global_mesh_resource() is outer
    assert global_mesh_resource() == MeshResource()
    with pytest.raises(TypeError, match="MeshResource"), global_shard_guard({"dp": "data"}):
        pass
    with pytest.raises(dataclasses_frozen_error()):
        outer.dp_resource = "other"


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_shard_guard_keeps_the_recipe_and_autocast_sees_it():
    from transformer_engine.jax.sharding import (
        MeshResource,
        global_mesh_resource,
        global_shard_guard,
    )

    r = recipe.Float8CurrentScaling()
    with te.autocast(enabled=True, recipe=r):
        with global_shard_guard(MeshResource(dp_resource="data")):
            assert te.get_fp8_recipe() is r
            assert te.get_mesh_resource().dp_resource == "data"
        assert te.get_mesh_resource() == MeshResource()
    with global_shard_guard(MeshResource(dp_resource="data")):
        assert not te.is_fp8_enabled()
    with te.autocast(mesh_resource=MeshResource(pp_resource="stage")):
        assert global_mesh_resource().pp_resource == "stage"


def _modules():
    x3 = jnp.ones((2, 4, 16), jnp.float32)
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    return [
        (DenseGeneral(features=8), (x3,)),
        (LayerNorm(), (x3,)),
        (LayerNormDenseGeneral(features=8), (x3,)),
        (LayerNormMLP(intermediate_dim=32), (x3,)),
        (DotProductAttention(head_dim=8, num_attention_heads=2), (q, q, q)),
        (MultiHeadAttention(head_dim=8, num_attention_heads=2), (x3, x3)),
        (TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2,
                          hidden_dropout=0.0, attention_dropout=0.0), (x3,)),
    ]


def test_modules_accept_every_parallelism_axis_unchanged_without_a_mesh():
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    for module, args in _modules():
        variables = module.init(jax.random.PRNGKey(0), *args)
        rngs = {"dropout": jax.random.PRNGKey(1)}
        expected = module.apply(variables, *args, rngs=rngs)
        with global_shard_guard(MeshResource(dp_resource="data", pp_resource="stage",
                                             cp_resource="context", tpsp_resource="model")):
            got = module.apply(variables, *args, rngs=rngs)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- quantize ---------------------------------------------------------------------------------

def test_scaling_modes_map_to_the_core_and_recipes():
    from transformer_engine.jax.quantize import ScalingMode

    assert ScalingMode.NO_SCALING.core_mode is None and ScalingMode.NO_SCALING.recipe is None
    assert ScalingMode.DELAYED_TENSOR_SCALING.core_mode is ops.ScalingMode.TENSOR
    assert ScalingMode.CURRENT_TENSOR_SCALING.core_mode is ops.ScalingMode.TENSOR
    assert ScalingMode.MXFP8_1D_SCALING.core_mode is ops.ScalingMode.MXFP8
    assert ScalingMode.BLOCK_1X128_SCALING.core_mode is ops.ScalingMode.BLOCK_1X128
    assert ScalingMode.BLOCK_128X128_SCALING.core_mode is ops.ScalingMode.BLOCK_128X128
    assert ScalingMode.DELAYED_TENSOR_SCALING.recipe.delayed()
    assert ScalingMode.CURRENT_TENSOR_SCALING.recipe.float8_current_scaling()
    assert ScalingMode.BLOCK_1X128_SCALING.recipe.float8_block_scaling()
    assert ScalingMode.MXFP8_1D_SCALING.recipe.mxfp8()
    assert ScalingMode.DELAYED_TENSOR_SCALING.is_tensor_scaling()
    assert not ScalingMode.MXFP8_1D_SCALING.is_tensor_scaling()
    assert ScalingMode.MXFP8_1D_SCALING.is_1d_block_scaling()
    # every core mode has a name
    assert {m.core_mode for m in ScalingMode} - {None} == set(ops.ScalingMode)


@pytest.mark.skipif(not CPU, reason="the CPU answers")
def test_is_fp8_available_agrees_with_the_pytorch_package():
    te_torch = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.jax.quantize import ScalingMode, is_fp8_available

    theirs = te_torch.is_fp8_available()
    ok, reason = is_fp8_available()
    assert ok is theirs is True
    assert "CPU" in reason
    assert is_fp8_available(ScalingMode.CURRENT_TENSOR_SCALING)[0] is True
    assert is_fp8_available(gpu_id=0) == (ok, reason)


def test_scaling_mode_support_matches_what_the_modules_run():
    from transformer_engine.jax.quantize import ScalingMode, is_scaling_mode_supported

    x = jnp.ones((16, 32), jnp.float32)
    layer = DenseGeneral(features=16)
    for mode in ScalingMode:
        ok, reason = is_scaling_mode_supported(mode)
        assert isinstance(ok, bool) and isinstance(reason, str) and reason
        if mode.recipe is None:
            assert ok is (mode is ScalingMode.NO_SCALING), mode
            continue
        if not ok:
            assert mode is ScalingMode.MXFP8_1D_SCALING or not CPU, (mode, reason)
            with pytest.raises(NotImplementedError):
                with te.autocast(enabled=True, recipe=mode.recipe):
                    layer.init(jax.random.PRNGKey(0), x)
            continue
        with te.autocast(enabled=True, recipe=mode.recipe):
            variables = layer.init(jax.random.PRNGKey(0), x)
            out = layer.apply(variables, x, mutable=[te.NVTE_FP8_COLLECTION_NAME])[0]
        assert out.shape == (16, 16)
    assert "Blackwell" in is_scaling_mode_supported(ScalingMode.MXFP8_1D_SCALING)[1]
    assert "NVFP4" in is_scaling_mode_supported("nvfp4_1d_scaling")[1]
    with pytest.raises(TypeError, match="ScalingMode"):
        is_scaling_mode_supported("per_tensor")


def test_fp8_collection_name_is_where_the_state_lives():
    assert te.NVTE_FP8_COLLECTION_NAME == te.FP8_COLLECTION
    x = jnp.ones((16, 32), jnp.float32)
    with te.autocast(enabled=True, recipe=recipe.DelayedScaling()):
        variables = DenseGeneral(features=16).init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params", te.NVTE_FP8_COLLECTION_NAME}


# ---- activation -------------------------------------------------------------------------------

@pytest.mark.parametrize("act", [("gelu",), ("relu",), ("silu",), ("quick_gelu",),
                                 ("squared_relu",), ("gelu", "linear"), ("silu", "linear"),
                                 ("relu", "linear")])
def test_activation_reads_nvidias_layout(act):
    from transformer_engine.jax.activation import activation

    n = len(act)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4, n, 8), jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(1), (3, 4, 8), jnp.float32)
    y, vjp = jax.vjp(lambda x: activation(x, activation_type=act), x)
    assert y.shape == (3, 4, 8) and y.dtype == x.dtype
    # ours on the last axis [a, b]: the same numbers, so the same kernels
    flat = x.reshape(3, 4, n * 8)
    y_ref, vjp_ref = jax.vjp(lambda f: last_axis_activation(f, act), flat)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    dx, dflat = vjp(dy)[0], vjp_ref(dy)[0]
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dflat.reshape(x.shape)))
    if n == 2:  # x[..., 0, :] is activated and multiplies x[..., 1, :]
        single = last_axis_activation(x[..., 0, :], act[:1])
        np.testing.assert_allclose(np.asarray(y), np.asarray(single * x[..., 1, :]),
                                   rtol=1e-6, atol=1e-6)


def test_activation_errors():
    from transformer_engine.jax.activation import activation

    x = jnp.ones((4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"\[\.\.\., 1, K\]"):
        activation(x, ("gelu",))
    with pytest.raises(ValueError, match="unsupported activation_type"):
        activation(x, ("tanh", "linear"))
    with pytest.raises(NotImplementedError, match="quantizer"):
        activation(x, ("gelu", "linear"), quantizer=object())
    assert activation(jnp.ones((4, 1, 8)), "relu").shape == (4, 8)
