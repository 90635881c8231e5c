"""Module keywords of NVIDIA Transformer Engine 2.x's PyTorch API: a program passing them runs
here unchanged, or gets an error naming the module, the keyword, what is supported and what
came."""

import pytest
import torch

import transformer_engine.pytorch as te

CPU = "cpu"


# te.LayerNorm / te.RMSNorm: normalized_shape, NVIDIA's name of our hidden_size

@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
@pytest.mark.parametrize("shape", [16, (16,), [16], torch.Size([16])])
def test_norm_normalized_shape(cls, shape):
    by_new = cls(normalized_shape=shape, eps=1e-6, device=CPU)
    by_old = cls(hidden_size=16, eps=1e-6, device=CPU)
    assert by_new.hidden_size == 16 and by_new.weight.shape == (16,)
    assert by_new.eps == 1e-6
    x = torch.randn(3, 16)
    torch.testing.assert_close(by_new(x), by_old(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norm_nvidia_positional_order(cls):
    """NVIDIA's order: normalized_shape, eps, sequence_parallel, params_dtype,
    zero_centered_gamma, hidden_size."""
    m = cls(16, 1e-3, True, torch.bfloat16, True, device=CPU)
    assert (m.eps, m.sequence_parallel, m.weight.dtype, m.zero_centered_gamma) == (
        1e-3, True, torch.bfloat16, True)
    assert m.weight.sequence_parallel
    assert cls(16, device=CPU, dtype=torch.float16).weight.dtype == torch.float16


@pytest.mark.parametrize("cls, name", [(te.LayerNorm, "te.LayerNorm"), (te.RMSNorm, "te.RMSNorm")])
def test_norm_bad_shapes(cls, name):
    with pytest.raises(ValueError, match=name + r": normalized_shape must be an int or a "
                                              r"1-element tuple/list.*\(4, 4\)"):
        cls(normalized_shape=(4, 4), device=CPU)
    with pytest.raises(ValueError, match=name + r": normalized_shape must be an int or a "
                                              r"1-element.*\[\]"):
        cls(normalized_shape=[], device=CPU)
    with pytest.raises(ValueError, match=name + r": hidden_size must be positive.*2.5"):
        cls(normalized_shape=(2.5,), device=CPU)
    with pytest.raises(ValueError, match=name + r": normalized_shape \(16\) and hidden_size "
                                              r"\(8\).*must agree"):
        cls(normalized_shape=16, hidden_size=8, device=CPU)
    with pytest.raises(TypeError, match=name + r": give normalized_shape"):
        cls(device=CPU)
    with pytest.raises(ValueError, match=name + r": params_dtype .* and dtype .* must agree"):
        cls(16, params_dtype=torch.float32, dtype=torch.bfloat16, device=CPU)


# DotProductAttention.forward: NVIDIA's keyword names and order

def _dpa(**kw):
    kw.setdefault("qkv_format", "bshd")
    kw.setdefault("attn_mask_type", "causal")
    return te.DotProductAttention(2, 16, device=CPU, attention_dropout=0.0, **kw)


def _qkv(grad=False, shape=(2, 8, 2, 16)):
    torch.manual_seed(0)
    return [torch.randn(*shape, requires_grad=grad) for _ in range(3)]


def test_dpa_nvidia_keyword_names():
    m = _dpa()
    q, k, v = _qkv()
    ref = m(q, k, v)
    by_nvidia = m(query_layer=q, key_layer=k, value_layer=v, attention_mask=None,
                  qkv_format="bshd", attn_mask_type="causal", window_size=None,
                  checkpoint_core_attention=False, core_attention_bias_type="no_bias",
                  core_attention_bias=None, alibi_slopes=None, fast_zero_fill=True,
                  inference_params=None, pad_between_seqs=None, fp8_output=False,
                  cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    by_ours = m(query=q, key=k, value=v)
    assert torch.equal(by_nvidia, ref) and torch.equal(by_ours, ref)
    # a mask type of the call changes the result: the keyword is read, not dropped
    assert not torch.equal(m(query_layer=q, key_layer=k, value_layer=v,
                             attn_mask_type="no_mask"), ref)


def test_dpa_nvidia_positional_order():
    """query, key, value, attention_mask, qkv_format, cu_seqlens_q, cu_seqlens_kv,
    cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type."""
    m = _dpa(qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v = _qkv(shape=(10, 2, 16))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    ref = m(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6,
            max_seqlen_kv=6, attn_mask_type="padding_causal")
    out = m(q, k, v, None, "thd", cu, cu, None, None, 6, 6, "padding_causal")
    assert torch.equal(out, ref)
    # the first token of the second sequence sees itself only: its output is its value
    torch.testing.assert_close(out[4].view(2, 16), v[4])


def test_dpa_one_name_per_input():
    m = _dpa()
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="DotProductAttention: query_layer and query name "
                                        "the same input"):
        m(q, k, v, query=q)
    with pytest.raises(TypeError, match="DotProductAttention: forward needs value_layer "
                                        r"\(or value\)"):
        m(query_layer=q, key_layer=k)


def _grads(m, checkpoint_core_attention):
    q, k, v = _qkv(grad=True)
    out = m(q, k, v, checkpoint_core_attention=checkpoint_core_attention)
    (out * torch.arange(out.numel()).view(out.shape).sin()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def test_dpa_checkpoint_core_attention_recomputes(monkeypatch):
    m = _dpa()
    calls = []
    attend = m._attend
    monkeypatch.setattr(m, "_attend", lambda *a: calls.append(1) or attend(*a))
    plain = _grads(m, False)
    assert len(calls) == 1
    recomputed = _grads(m, True)
    assert len(calls) == 3  # once forward, once again in the backward
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # nothing to recompute without autograd
        m(*_qkv(), checkpoint_core_attention=True)
    assert len(calls) == 4


def test_dpa_checkpoint_core_attention_fp8_delayed():
    from transformer_engine.common.recipe import DelayedScaling
    recipe = DelayedScaling(fp8_dpa=True)
    results = []
    for ckpt in (False, True):
        m = _dpa(qkv_format="bshd")
        with te.fp8_autocast(fp8_recipe=recipe):
            results.append(_grads(m, ckpt))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(core_attention_bias_type="post_scale_bias"), ValueError,
     ["core_attention_bias_type='post_scale_bias' needs core_attention_bias"]),
    (dict(core_attention_bias_type="alibi"), ValueError, ["'alibi' needs alibi_slopes"]),
    (dict(core_attention_bias_type="relative"), ValueError,
     ["core_attention_bias_type must be one of", "'relative'"]),
    (dict(core_attention_bias=torch.zeros(1, 2, 8, 8)), ValueError,
     ["core_attention_bias is given", "'no_bias'"]),
    (dict(alibi_slopes=torch.ones(2)), ValueError, ["alibi_slopes is given", "'no_bias'"]),
    # padding between packed sequences is for thd (test_padded_packing.py); this is bshd
    (dict(pad_between_seqs=True), ValueError, ["pad_between_seqs", "qkv_format 'bshd'"]),
    (dict(cu_seqlens_q_padded=torch.tensor([0, 8, 16])), ValueError,
     ["cu_seqlens_q_padded", "(qkv_format 'thd')"]),
    (dict(cu_seqlens_kv_padded=torch.tensor([0, 8, 16])), ValueError,
     ["cu_seqlens_kv_padded", "(qkv_format 'thd')"]),
    (dict(inference_params=object()), NotImplementedError,
     ["inference_params", "te.MultiheadAttention"]),
    (dict(fp8_output=True), NotImplementedError, ["fp8_output=True", "fp8_mha=True"]),
])
def test_dpa_refused_keywords(kwargs, error, words):
    with pytest.raises(error) as info:
        _dpa()(*_qkv(), **kwargs)
    message = str(info.value)
    assert message.startswith("DotProductAttention: ")
    for word in words:
        assert word in message, (word, message)


def test_mha_refusals_name_the_module():
    mha = te.MultiheadAttention(32, 2, attention_dropout=0.0, device=CPU)
    with pytest.raises(ValueError, match=r"te\.MultiheadAttention: alibi_slopes is given"):
        mha(torch.randn(8, 2, 32), alibi_slopes=torch.ones(2))


# LayerNormMLP / TransformerLayer: NVIDIA's activation names

def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


# NVIDIA's definitions; a gated one activates the first half of FC1's output, times the second.
NVIDIA_ACTIVATIONS = {
    "gelu": _gelu_tanh,
    "relu": torch.relu,
    "silu": lambda x: x * torch.sigmoid(x),
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: torch.relu(x) ** 2,
    "geglu": _gelu_tanh,
    "swiglu": lambda x: x * torch.sigmoid(x),
    "reglu": torch.relu,
    "qgeglu": lambda x: x * torch.sigmoid(1.702 * x),
    "sreglu": lambda x: torch.relu(x) ** 2,
    "glu": torch.sigmoid,
}
GATED = ("geglu", "swiglu", "reglu", "qgeglu", "sreglu", "glu")


@pytest.mark.parametrize("act", sorted(NVIDIA_ACTIVATIONS))
def test_mlp_activation_names_compute_nvidias_functions(act):
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(32, 48, activation=act, device=CPU)
    with torch.no_grad():
        mlp.fc1_bias.normal_()
        mlp.fc1_weight.mul_(20.0)  # FC1 outputs of order 1: the functions differ there
    x = torch.randn(6, 32, dtype=torch.float64).float()
    ln = torch.nn.functional.layer_norm(x, (32,), mlp.layer_norm_weight, mlp.layer_norm_bias,
                                        mlp.cfg.eps)
    h = ln @ mlp.fc1_weight.t() + mlp.fc1_bias
    f = NVIDIA_ACTIVATIONS[act]
    if act in GATED:
        assert mlp.fc1_weight.shape[0] == 96
        a, b = h.chunk(2, dim=-1)
        h_act = f(a) * b
    else:
        h_act = f(h)
    expected = h_act @ mlp.fc2_weight.t() + mlp.fc2_bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", sorted(NVIDIA_ACTIVATIONS))
def test_transformer_layer_takes_every_core_activation(act):
    layer = te.TransformerLayer(32, 48, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                activation=act, device=CPU)
    assert layer.layernorm_mlp.activation == act
    x = torch.randn(4, 2, 32, requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("make, name", [
    (lambda: te.LayerNormMLP(32, 48, activation="tanh", device=CPU), "te.LayerNormMLP"),
    (lambda: te.TransformerLayer(32, 48, 2, activation="tanh", device=CPU),
     "te.TransformerLayer"),
])
def test_unknown_activation_is_a_value_error(make, name):
    with pytest.raises(ValueError, match=name + r": activation must be one of .*'tanh'"):
        make()


# MultiheadAttention: qk_norm_type, qk_norm_eps, qk_norm_before_rope

def _rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _ln(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("before_rope", [False, True])
def test_mha_qk_norm_per_head(kind, before_rope):
    """q and k reach attention normalized per head over head_dim with learned weights, before
    or after RoPE; v does not."""
    from transformer_engine.pytorch.rope import apply_rotary_pos_emb
    torch.manual_seed(0)
    eps = 1e-3
    mha = te.MultiheadAttention(32, 2, attention_dropout=0.0, qk_norm_type=kind,
                                qk_norm_eps=eps, qk_norm_before_rope=before_rope, device=CPU)
    assert mha.q_norm.weight.shape == (16,) and mha.k_norm.eps == eps
    with torch.no_grad():  # learned weights that RoPE does not commute with
        for p in (*mha.q_norm.parameters(), *mha.k_norm.parameters()):
            p.normal_()
    seen = {}
    mha.qkv.register_forward_hook(lambda m, a, out: seen.update(projected=out))
    mha.core_attention.register_forward_pre_hook(lambda m, a: seen.update(qkv=a[:3]))
    freqs = te.RotaryPositionEmbedding(16)(6)
    x = torch.randn(6, 2, 32)
    mha(x, rotary_pos_emb=freqs)

    q, k, v = (t.reshape(6, 2, 2, 16) for t in seen["projected"].split(32, dim=-1))

    def norm(t, n):
        return (_rms(t, n.weight, eps) if kind == "RMSNorm"
                else _ln(t, n.weight, n.bias, eps))

    def rope(t):
        return apply_rotary_pos_emb(t, freqs, tensor_format="sbhd")

    if before_rope:
        q, k = rope(norm(q, mha.q_norm)), rope(norm(k, mha.k_norm))
    else:
        q, k = norm(rope(q), mha.q_norm), norm(rope(k), mha.k_norm)
    for want, got in zip((q, k, v), seen["qkv"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mha_qk_norm_through_transformer_layer_and_refusal():
    layer = te.TransformerLayer(32, 48, 2, qk_norm_type="RMSNorm", qk_norm_eps=1e-5,
                                qk_norm_before_rope=True, device=CPU)
    sa = layer.self_attention
    assert (sa.qk_norm_type, sa.qk_norm_eps, sa.qk_norm_before_rope) == ("RMSNorm", 1e-5, True)
    assert isinstance(sa.q_norm, te.RMSNorm)
    with pytest.raises(ValueError, match=r"te\.MultiheadAttention: qk_norm_type must be one "
                                         r"of .*'RMSNorm'.*got 'BatchNorm'"):
        te.MultiheadAttention(32, 2, qk_norm_type="BatchNorm", device=CPU)


def test_norms_accept_sm_margin_and_activation_params_only_for_clamped_swiglu():
    # sm_margin (SMs left for overlapped communication) changes nothing here: same numbers.
    x = torch.randn(4, 32)
    for cls in (te.LayerNorm, te.RMSNorm):
        torch.manual_seed(0)
        plain = cls(32, device="cpu")
        torch.manual_seed(0)
        margin = cls(32, device="cpu", sm_margin=8)
        assert torch.equal(plain(x), margin(x))
        with pytest.raises(ValueError, match=r"sm_margin must be an int >= 0, got -1"):
            cls(32, device="cpu", sm_margin=-1)
    # (clamped_swiglu's own tests: test_clamped_swiglu.py)
    with pytest.raises(ValueError, match=r"te.LayerNormMLP: activation_params apply to "
                                         r"clamped_swiglu only; 'gelu' takes none"):
        te.LayerNormMLP(32, 64, device="cpu", activation_params={"limit": 7.0})


# DotProductAttention's constructor keywords of NVIDIA TE (Megatron-LM's TEDotProductAttention
# passes the tensor-parallel ones)

def _attention_inputs(heads, shape=(2, 8), kv_seq=None, dim=16, grad=False):
    torch.manual_seed(0)
    b, s = shape
    q = torch.randn(b, s, heads, dim, requires_grad=grad)
    k, v = (torch.randn(b, kv_seq or s, heads, dim, requires_grad=grad) for _ in range(2))
    return q, k, v


def test_dpa_tensor_parallel_keywords_attend_this_ranks_heads():
    from te_torch_tests._tp_world import SizedGroup

    local = te.DotProductAttention(2, 16, qkv_format="bshd", device=CPU)
    q, k, v = _attention_inputs(2)
    want = local(q, k, v)
    for kw in (dict(tp_size=2), dict(tp_group=SizedGroup(2)),
               dict(tp_size=2, tp_group=SizedGroup(2), sequence_parallel=True)):
        split = te.DotProductAttention(4, 16, qkv_format="bshd", device=CPU, **kw)
        assert (split.num_attention_heads, split.num_gqa_groups, split.tp_size) == (2, 2, 2)
        assert torch.equal(split(q, k, v), want)
    with pytest.raises(ValueError, match=r"DotProductAttention: num_attention_heads must be "
                                         r"divisible by tp_size=4, got 6"):
        te.DotProductAttention(6, 16, tp_size=4, device=CPU)
    with pytest.raises(ValueError, match=r"tp_size must equal the size of tp_group \(2\), "
                                         r"got 4"):
        te.DotProductAttention(8, 16, tp_size=4, tp_group=SizedGroup(2), device=CPU)


def test_dpa_dropout_draws_from_the_rng_trackers_fork_unless_sequence_parallel():
    forks = []

    class Tracker:
        def fork(self):
            import contextlib

            forks.append(1)
            return contextlib.nullcontext()

    q, k, v = _attention_inputs(2)
    for sequence_parallel, dropout, want in ((False, 0.1, 1), (True, 0.1, 0), (False, 0.0, 0)):
        forks.clear()
        m = te.DotProductAttention(2, 16, attention_dropout=dropout, qkv_format="bshd",
                                   get_rng_state_tracker=Tracker,
                                   sequence_parallel=sequence_parallel, device=CPU)
        m(q, k, v)
        assert len(forks) == want, (sequence_parallel, dropout)
        m.eval()
        m(q, k, v)  # no dropout in evaluation
        assert len(forks) == want


@pytest.mark.parametrize("mask, flag, want", [
    ("causal", True, "causal_bottom_right"), ("padding_causal", True,
                                              "padding_causal_bottom_right"),
    ("causal_bottom_right", False, "causal"), ("causal", None, "causal"),
    ("no_mask", True, "no_mask")])
def test_dpa_bottom_right_diagonal_moves_the_causal_diagonal(mask, flag, want):
    m = te.DotProductAttention(2, 16, attn_mask_type=mask, bottom_right_diagonal=flag,
                               device=CPU)
    assert m.attn_mask_type == want
    if mask == "causal" and flag:  # the same numbers as the bottom-right mask (sq < skv)
        q, k, v = _attention_inputs(2, kv_seq=12)
        ref = te.DotProductAttention(2, 16, qkv_format="bshd",
                                     attn_mask_type="causal_bottom_right", device=CPU)
        m = te.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal",
                                   bottom_right_diagonal=True, device=CPU)
        assert torch.equal(m(q, k, v), ref(q, k, v))


def test_dpa_refusals_and_keyword_only_tail():
    with pytest.raises(ValueError, match=r"softmax_type must be one of .*got 'sink'"):
        te.DotProductAttention(2, 16, softmax_type="sink", device=CPU)
    with pytest.raises(NotImplementedError, match=r"return_max_logit=True is not supported"):
        te.DotProductAttention(2, 16, return_max_logit=True, device=CPU)
    # NVIDIA's releases put different arguments after window_size: keywords only there
    with pytest.raises(TypeError):
        te.DotProductAttention(2, 16, None, 0.0, "bshd", "causal", None, False)
    m = te.DotProductAttention(2, 16, None, 0.0, "bshd", "causal", (-1, 0), name="attn",
                               device=CPU)
    assert (m.qkv_format, m.window_size, m.name) == ("bshd", (-1, 0), "attn")


# A Llama decoder layer as NVIDIA's Llama tutorial builds it: te.TransformerLayer with RMSNorm,
# SwiGLU, grouped-query attention and separate q/k/v weights, loaded from a Hugging Face style
# state dict by parameter name and run with rotary embeddings.

def test_llama_style_decoder_layer_loads_by_name_and_runs():
    import transformer_engine as te_root
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.attention import RotaryPositionEmbedding

    hidden, ffn, heads, kv_heads, seq = 64, 96, 4, 2, 8
    layer = te_root.pytorch.TransformerLayer(
        hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads, bias=False,
        layernorm_epsilon=1e-5, hidden_dropout=0, attention_dropout=0, fuse_qkv_params=False,
        normalization="RMSNorm", activation="swiglu", attn_input_format="bshd",
        num_gqa_groups=kv_heads, device=CPU)
    head_dim = hidden // heads
    torch.manual_seed(0)
    # Our name -> the tensor a checkpoint would give it (gate and up rows stacked into fc1).
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    given = {
        "self_attention.layernorm_qkv.layer_norm_weight": torch.rand(hidden) + 0.5,
        "self_attention.layernorm_qkv.query_weight": torch.randn(hidden, hidden),
        "self_attention.layernorm_qkv.key_weight": torch.randn(kv_heads * head_dim, hidden),
        "self_attention.layernorm_qkv.value_weight": torch.randn(kv_heads * head_dim, hidden),
        "self_attention.proj.weight": torch.randn(hidden, hidden),
        "layernorm_mlp.layer_norm_weight": torch.rand(hidden) + 0.5,
        "layernorm_mlp.fc1_weight": torch.cat([gate, up]),
        "layernorm_mlp.fc2_weight": torch.randn(hidden, ffn),
    }
    state = layer.state_dict()
    for name, value in given.items():
        assert state[name].shape == value.shape, name
        state[name].data[:] = value * 0.05
    params = dict(layer.named_parameters())
    for name, value in given.items():
        torch.testing.assert_close(params[name].detach(), value * 0.05, rtol=0, atol=0)

    rope = RotaryPositionEmbedding(head_dim)(max_seq_len=seq)
    x = torch.randn(2, seq, hidden, requires_grad=True)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    out = layer(x, attention_mask=None, rotary_pos_emb=rope)
    masked = layer(x, attention_mask=causal, self_attn_mask_type="arbitrary",
                   rotary_pos_emb=rope)
    assert out.shape == masked.shape == x.shape
    # True marks a masked-out position: an explicit causal mask is the causal mask type.
    torch.testing.assert_close(masked, out, rtol=1e-5, atol=1e-5)
    (out.sum() + masked.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(params[n].grad).all() for n in given)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        fp8_out = layer(x, attention_mask=None, rotary_pos_emb=rope)
    assert fp8_out.shape == x.shape and torch.isfinite(fp8_out).all()
