"""te.TransformerLayer against a plain PyTorch layer built from nn modules (nn.LayerNorm /
nn.RMSNorm, nn.Linear, an explicit masked softmax, RoPE from its formula) in float64, with the
weights copied from ours: every block arrangement, mask type, GQA, RoPE, fp32 and bf16, FP8
under each recipe, gradients, activation recompute, torch.compile, the parameter names of
NVIDIA TE's layer and the errors."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

# Small sizes for the CPU: 2 x 16 tokens, head dim 16.
B, S, HIDDEN, FFN, HEADS = 2, 16, 64, 128, 4

# fp32 layer against float64: each output element passes through about eight reductions of at
# most 128 terms (GEMMs, norms, softmax), each off by ~K * 2^-24 ~ 1e-5 of its magnitude, and
# RoPE's angles are fp32 (position * frequency, 2^-24 relative): 1e-4 covers them with room,
# while a wrong mask entry, head order or residual moves outputs by O(0.1).
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 layer (bf16 parameters, input and every intermediate) against float64 from the same
# bf16 values: each of ~12 roundings adds up to 2^-9 of a value of order 1-3, and the
# residual stream carries them all: 3e-2 (measured worst 2.2e-2, at an output near 4).
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
# FP8 (fp32 activations, E4M3 GEMM operands) against float64: the RMS of what the blocks add
# to the residual stream, relative to its own RMS. One E4M3 rounding (3 mantissa bits) errs by
# up to 2^-4 of a value, about 2.5% RMS; the GEMMs average independent roundings over their
# K-term sums, so the measured figure is 1.3-1.6% for every recipe. 0.05 leaves 3x that; the
# same layer without FP8 is within 1e-6, so a floor of 1e-3 shows the FP8 path ran.
FP8_REL_RMSE = (1e-3, 0.05)


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


_ACTS = {"gelu": _gelu, "relu": torch.relu, "silu": F.silu,
         "qgelu": lambda x: x * torch.sigmoid(1.702 * x), "srelu": lambda x: torch.relu(x) ** 2,
         "sigmoid": torch.sigmoid}
_GATED = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu", "qgeglu": "qgelu",
          "sreglu": "srelu", "glu": "sigmoid"}


def _rope(x, positions, interleaved=False, base=10000.0):
    """x [b, s, h, d] (float64) rotated at positions [b, s]: pairs (i, i + d/2), or (2i,
    2i + 1) interleaved, at angle position * base^(-2i/d)."""
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[..., None, None].double() * freq  # [b, s, 1, d/2]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
    r1 = x1 * torch.cos(angle) - x2 * torch.sin(angle)
    r2 = x2 * torch.cos(angle) + x1 * torch.sin(angle)
    if interleaved:
        return torch.stack((r1, r2), dim=-1).flatten(-2)
    return torch.cat((r1, r2), dim=-1)


def _attention(q, k, v, allowed):
    """q [b, sq, h, d], k and v [b, skv, g, d], allowed [b or 1, 1, sq, skv] bool."""
    h, g = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // g, dim=2), v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key give 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _allowed(mask_type, sq, skv, q_len=None, kv_len=None, arbitrary=None):
    """Which keys each query may see: [b or 1, 1, sq, skv]."""
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    allowed = torch.ones(1, 1, sq, skv, dtype=torch.bool)
    if "causal" in mask_type:
        allowed = allowed & (j <= i)
    if mask_type.startswith("padding"):
        valid_q = torch.arange(sq)[None, :] < q_len[:, None]
        valid_kv = torch.arange(skv)[None, :] < kv_len[:, None]
        allowed = allowed & (valid_q[:, None, :, None] & valid_kv[:, None, None, :])
    if mask_type == "arbitrary":
        allowed = ~arbitrary
    return allowed


class RefAttention(nn.Module):
    def __init__(self, groups, head_dim, norm: Optional[nn.Module], bias: bool):
        super().__init__()
        self.groups, self.head_dim, self.norm = groups, head_dim, norm
        self.q = nn.Linear(HIDDEN, HEADS * head_dim, bias=bias)
        self.k = nn.Linear(HIDDEN, groups * head_dim, bias=bias)
        self.v = nn.Linear(HIDDEN, groups * head_dim, bias=bias)
        self.o = nn.Linear(HEADS * head_dim, HIDDEN, bias=bias)

    qk_norm = None  # (kind, eps, before_rope, q weight, k weight, q bias, k bias)

    def _norm_qk(self, t, which):
        kind, eps, _, *params = self.qk_norm
        if kind == "L2Normalization":
            return t / torch.sqrt(t.square().sum(-1, keepdim=True) + eps)
        w, b = params[which], params[2 + which]
        if kind == "RMSNorm":
            return F.rms_norm(t, (t.shape[-1],), w, eps)
        return F.layer_norm(t, (t.shape[-1],), w, b, eps)

    def forward(self, x, memory, allowed, positions=None, interleaved=False):
        """x, memory [b, s, hidden]; returns (output, the norm's output)."""
        ln = self.norm(x) if self.norm is not None else x
        mem = ln if memory is None else memory
        b, sq, skv = x.shape[0], x.shape[1], mem.shape[1]
        q = self.q(ln).view(b, sq, HEADS, self.head_dim)
        k = self.k(mem).view(b, skv, self.groups, self.head_dim)
        v = self.v(mem).view(b, skv, self.groups, self.head_dim)
        before = self.qk_norm is not None and self.qk_norm[2]
        if before:
            q, k = self._norm_qk(q, 0), self._norm_qk(k, 1)
        if positions is not None:
            q, k = _rope(q, positions, interleaved), _rope(k, positions, interleaved)
        if self.qk_norm is not None and not before:
            q, k = self._norm_qk(q, 0), self._norm_qk(k, 1)
        o = _attention(q, k, v, allowed).reshape(b, sq, -1)
        return self.o(o), ln


class RefLayer(nn.Module):
    """The layer as NVIDIA TE defines it, from nn modules (float64, batch first)."""

    def __init__(self, layer: te.TransformerLayer, normalization="LayerNorm",
                 activation="gelu", eps=1e-5, bias=True, groups=HEADS, head_dim=HIDDEN // HEADS,
                 ffn=FFN):
        super().__init__()
        self.layers = (layer,)  # a tuple: not a submodule, so .double() leaves it alone
        self.activation = activation

        def norm():
            if normalization == "LayerNorm":
                return nn.LayerNorm(HIDDEN, eps=eps, dtype=torch.float64)
            return nn.RMSNorm(HIDDEN, eps=eps, dtype=torch.float64)

        pre = not layer.output_layernorm
        self.attn = RefAttention(groups, head_dim, norm() if pre else None, bias)
        if layer.layer_type == "decoder":
            self.cross = RefAttention(groups, head_dim, norm(), bias)
        self.mlp_norm = norm()
        gated = activation in _GATED
        self.fc1 = nn.Linear(HIDDEN, ffn * (2 if gated else 1), bias=bias)
        self.fc2 = nn.Linear(ffn, HIDDEN, bias=bias)
        self.final_norm = norm() if layer.output_layernorm else None
        self.double()
        self._copy_weights(groups, head_dim)

    def _copy_weights(self, groups, head_dim):
        layer = self.layers[0]

        def put(dst: nn.Module, weight, bias):
            with torch.no_grad():
                dst.weight.copy_(weight.detach().double())
                if bias is not None:
                    dst.bias.copy_(bias.detach().double())

        def norm_of(dst, src, weight="layer_norm_weight", bias="layer_norm_bias"):
            w = getattr(src, weight).detach().double()
            if layer.layernorm_mlp.cfg.zero_centered_gamma:
                w = w + 1.0
            b = getattr(src, bias, None)
            with torch.no_grad():
                dst.weight.copy_(w)
                if b is not None:
                    dst.bias.copy_(b.detach().double())

        sa = layer.self_attention
        first = sa.layernorm_qkv if sa.input_layernorm else sa.qkv
        if sa.input_layernorm:
            norm_of(self.attn.norm, first)
        q, k, v, bq, bk, bv = _qkv_weights(sa, first, groups, head_dim)
        put(self.attn.q, q, bq)
        put(self.attn.k, k, bk)
        put(self.attn.v, v, bv)
        put(self.attn.o, sa.proj.weight, sa.proj.bias)
        if sa.qk_norm_type is not None:
            norms = [getattr(sa, n, None) for n in ("q_norm", "k_norm")]
            weights = [None if m is None else m.weight.detach().double() for m in norms]
            biases = [None if m is None else getattr(m, "bias", None) for m in norms]
            biases = [None if b is None else b.detach().double() for b in biases]
            self.attn.qk_norm = (sa.qk_norm_type, sa.qk_norm_eps, sa.qk_norm_before_rope,
                                 *weights, *biases)
        if layer.layer_type == "decoder":
            ia = layer.inter_attention
            norm_of(self.cross.norm, ia.layernorm_query)
            lq, kv = ia.layernorm_query, ia.key_value
            if ia.fuse_qkv_params:
                put(self.cross.q, lq.weight, lq.bias)
                (k, v), (bk, bv) = (_kv_rows(t, ia.qkv_weight_interleaved, groups, head_dim)
                                    for t in (kv.weight, kv.bias))
                put(self.cross.k, k, bk)
                put(self.cross.v, v, bv)
            else:
                put(self.cross.q, lq.query_weight, getattr(lq, "query_bias", None))
                put(self.cross.k, kv.key_weight, getattr(kv, "key_bias", None))
                put(self.cross.v, kv.value_weight, getattr(kv, "value_bias", None))
            put(self.cross.o, ia.proj.weight, ia.proj.bias)
        mlp = layer.layernorm_mlp
        norm_of(self.mlp_norm, mlp)
        put(self.fc1, mlp.fc1_weight, mlp.fc1_bias)
        put(self.fc2, mlp.fc2_weight, mlp.fc2_bias)
        if self.final_norm is not None:
            norm_of(self.final_norm, layer.layernorm, "weight", "bias")

    def forward(self, x, allowed, memory=None, cross_allowed=None, positions=None,
                interleaved=False):
        layer = self.layers[0]
        post = layer.apply_residual_connection_post_layernorm
        a, ln = self.attn(x, None, allowed, positions, interleaved)
        if layer.parallel_attention_mlp:
            return x + a + self._mlp(x)[0]
        h = (ln if post and not layer.output_layernorm else x) + a
        if layer.layer_type == "decoder":
            c, ln = self.cross(h, memory, cross_allowed)
            h = (ln if post else h) + c
        m, ln = self._mlp(h)
        out = (ln if post else h) + m
        return self.final_norm(out) if self.final_norm is not None else out

    def _mlp(self, x):
        ln = self.mlp_norm(x)
        h = self.fc1(ln)
        if self.activation in _GATED:
            a, b = h.chunk(2, dim=-1)
            h = _ACTS[_GATED[self.activation]](a) * b
        else:
            h = _ACTS[self.activation](h)
        return self.fc2(h), ln


def _kv_rows(t, interleaved, groups, head_dim):
    """The key and value rows of a fused key/value weight or bias: per group [k_g, v_g] when
    interleaved, else [k | v]."""
    if t is None:
        return None, None
    if not interleaved:
        return t.chunk(2)
    t = t.reshape(groups, 2, head_dim, *t.shape[1:])
    return t[:, 0].reshape(-1, *t.shape[3:]), t[:, 1].reshape(-1, *t.shape[3:])


def _qkv_weights(mha, first, groups, head_dim):
    """The query, key and value weights (and biases) of a self-attention block, from separate
    parameters or from the fused weight in either row order (NVIDIA TE's layouts)."""
    if not mha.fuse_qkv_params:
        return (first.query_weight, first.key_weight, first.value_weight,
                getattr(first, "query_bias", None), getattr(first, "key_bias", None),
                getattr(first, "value_bias", None))
    hpg = HEADS // groups

    def split(t):
        if t is None:
            return None, None, None
        rest = t.shape[1:]
        if mha.qkv_weight_interleaved:  # per group: its query heads, its key, its value
            t = t.reshape(groups, hpg + 2, head_dim, *rest)
            return (t[:, :hpg].reshape(-1, *rest), t[:, hpg].reshape(-1, *rest),
                    t[:, hpg + 1].reshape(-1, *rest))
        return t.split([HEADS * head_dim, groups * head_dim, groups * head_dim])

    (q, k, v), (bq, bk, bv) = split(first.weight), split(first.bias)
    return q, k, v, bq, bk, bv


def _layer(**kw):
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    kw.setdefault("attn_input_format", "bshd")
    kw.setdefault("device", "cpu")
    layer = te.TransformerLayer(HIDDEN, kw.pop("ffn", FFN), HEADS, **kw)
    with torch.no_grad():  # non-trivial norm parameters and biases
        for name, p in layer.named_parameters():
            if "layer_norm" in name or name.startswith("layernorm.") or "_norm." in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return layer


def _data(dtype=torch.float32, s=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, s, HIDDEN, generator=g).to(dtype)


def _fmt(t, fmt):
    return t if fmt == "bshd" else t.transpose(0, 1).contiguous()


def _compare(layer, ref, x, tol, fmt="bshd", allowed=None, **kw):
    allowed = allowed if allowed is not None else _allowed("causal", S, S)
    pos = torch.arange(x.shape[1]).expand(B, -1) if kw.get("rotary_pos_emb") is not None \
        else None
    memory = kw.pop("memory", None)
    cross_allowed = kw.pop("cross_allowed", None)
    got = layer(_fmt(x, fmt), encoder_output=None if memory is None else _fmt(memory, fmt), **kw)
    want = ref(x.double(), allowed, None if memory is None else memory.double(), cross_allowed,
               pos, interleaved=layer.self_attention.rotary_pos_interleaved)
    torch.testing.assert_close(_fmt(got, fmt).double(), want, **tol)
    return got


# ------------------------------------------------------------------ high precision


CONFIGS = {
    "prenorm_gqa_rope": dict(num_gqa_groups=2),
    "sbhd": dict(attn_input_format="sbhd"),
    "post_layernorm_residual": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "output_layernorm_post_residual": dict(output_layernorm=True,
                                           apply_residual_connection_post_layernorm=True),
    "parallel_attention_mlp": dict(parallel_attention_mlp=True),
    "rmsnorm_swiglu_mqa": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=1),
    "zero_centered_gamma_srelu": dict(zero_centered_gamma=True, activation="srelu"),
    "fused_interleaved_qkv": dict(fuse_qkv_params=True, num_gqa_groups=2),
    "fused_concatenated_qkv": dict(fuse_qkv_params=True, qkv_weight_interleaved=False,
                                   num_gqa_groups=2),
    "no_bias_geglu": dict(bias=False, activation="geglu"),
    "kv_channels_qgelu": dict(kv_channels=8, activation="qgelu"),
    "rope_interleaved_reglu": dict(rotary_pos_interleaved=True, activation="reglu"),
    "relu_silu_eps": dict(activation="relu", layernorm_epsilon=1e-3),
    "qk_rmsnorm": dict(qk_norm_type="RMSNorm", num_gqa_groups=2),
    "qk_layernorm_before_rope": dict(qk_norm_type="LayerNorm", qk_norm_before_rope=True),
    "qk_l2": dict(qk_norm_type="L2Normalization", qk_norm_eps=1e-3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_layer_matches_reference(name):
    kw = dict(CONFIGS[name])
    fmt = kw.get("attn_input_format", "bshd")
    layer = _layer(**kw)
    groups = kw.get("num_gqa_groups", HEADS)
    head_dim = kw.get("kv_channels", HIDDEN // HEADS)
    ref = RefLayer(layer, kw.get("normalization", "LayerNorm"), kw.get("activation", "gelu"),
                   kw.get("layernorm_epsilon", 1e-5), kw.get("bias", True), groups, head_dim)
    rope = te.RotaryPositionEmbedding(head_dim, interleaved=layer.self_attention
                                      .rotary_pos_interleaved)(S)
    _compare(layer, ref, _data(), FP32_TOL, fmt, rotary_pos_emb=rope)


MASKS = ["causal", "padding", "no_mask", "arbitrary", "padding_causal"]


@pytest.mark.parametrize("mask", MASKS)
def test_each_self_attention_mask(mask):
    layer = _layer(self_attn_mask_type=mask, num_gqa_groups=2)
    ref = RefLayer(layer, groups=2)
    lengths = torch.tensor([S, 11])
    pad = torch.arange(S)[None, :] >= lengths[:, None]                 # True = padded
    arbitrary = torch.rand(B, 1, S, S) < 0.3
    arbitrary[..., 0] = False  # every query sees key 0
    mask_arg = {"padding": pad[:, None, None, :], "padding_causal": pad[:, None, None, :],
                "arbitrary": arbitrary}.get(mask)
    allowed = _allowed(mask, S, S, lengths, lengths, arbitrary)
    got = layer(_data(), attention_mask=mask_arg)
    want = ref(_data().double(), allowed)
    if mask.startswith("padding"):  # padded query rows are not compared (NVIDIA: undefined)
        keep = ~pad
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got.double(), want, **FP32_TOL)


def test_packed_thd_input_matches_the_padded_batch():
    """Sequences packed back to back (thd, cu_seqlens) give the padded bshd layer's outputs
    on their tokens (that layer is checked against the reference above); RoPE restarts at
    each sequence."""
    padded = _layer(self_attn_mask_type="padding_causal", num_gqa_groups=2)
    packed = _layer(self_attn_mask_type="padding_causal", num_gqa_groups=2,
                    attn_input_format="thd")
    packed.load_state_dict(padded.state_dict())
    lengths, x = [S, 11], _data()
    pad = (torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None])[:, None, None, :]
    rope = te.RotaryPositionEmbedding(HIDDEN // HEADS)(S)
    want = padded(x, attention_mask=pad, rotary_pos_emb=rope)
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    got = packed(torch.cat([x[0], x[1, :lengths[1]]]), cu_seqlens_q=cu, cu_seqlens_kv=cu,
                 max_seqlen_q=S, max_seqlen_kv=S, rotary_pos_emb=rope)
    torch.testing.assert_close(got, torch.cat([want[0], want[1, :lengths[1]]]), **FP32_TOL)


def test_forward_mask_type_overrides_the_constructor():
    layer = _layer(self_attn_mask_type="causal")
    ref = RefLayer(layer)
    got = layer(_data(), self_attn_mask_type="no_mask")
    torch.testing.assert_close(got.double(), ref(_data().double(), _allowed("no_mask", S, S)),
                               **FP32_TOL)


@pytest.mark.parametrize("fuse", [False, True])
def test_decoder_cross_attention_with_padding(fuse):
    layer = _layer(layer_type="decoder", enc_dec_attn_mask_type="padding", num_gqa_groups=2,
                   fuse_qkv_params=fuse, apply_residual_connection_post_layernorm=fuse)
    ref = RefLayer(layer, groups=2)
    s_enc = 12
    memory = _data(s=s_enc, seed=3)
    q_len, kv_len = torch.tensor([S, S]), torch.tensor([s_enc, 7])
    q_pad = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    kv_pad = (torch.arange(s_enc)[None, :] >= kv_len[:, None])[:, None, None, :]
    cross = _allowed("padding", S, s_enc, q_len, kv_len)
    _compare(layer, ref, _data(), FP32_TOL, memory=memory, cross_allowed=cross,
             enc_dec_attn_mask=(q_pad, kv_pad))


def test_bf16_layer_matches_reference(device):
    layer = _layer(params_dtype=torch.bfloat16, num_gqa_groups=2, activation="swiglu",
                   normalization="RMSNorm", device=device)
    ref = RefLayer(layer, "RMSNorm", "swiglu", groups=2)
    rope = te.RotaryPositionEmbedding(HIDDEN // HEADS)(S).to(device)
    x = _data(torch.bfloat16)
    got = layer(x.to(device), rotary_pos_emb=rope)
    assert got.dtype == torch.bfloat16
    want = ref(x.double(), _allowed("causal", S, S), positions=torch.arange(S).expand(B, -1))
    torch.testing.assert_close(got.double().cpu(), want, **BF16_TOL)


def test_gradients_match_reference():
    layer = _layer(num_gqa_groups=2)
    ref = RefLayer(layer, groups=2)
    rope = te.RotaryPositionEmbedding(HIDDEN // HEADS)(S)
    x = _data().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    g = torch.randn(B, S, HIDDEN)
    (layer(x, rotary_pos_emb=rope) * g).sum().backward()
    pos = torch.arange(S).expand(B, -1)
    (ref(x64, _allowed("causal", S, S), positions=pos) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32_TOL)
    sa, mlp = layer.self_attention, layer.layernorm_mlp
    pairs = {"query_weight": (sa.layernorm_qkv.query_weight, ref.attn.q.weight),
             "value_bias": (sa.layernorm_qkv.value_bias, ref.attn.v.bias),
             "qkv layer_norm_weight": (sa.layernorm_qkv.layer_norm_weight, ref.attn.norm.weight),
             "proj bias": (sa.proj.bias, ref.attn.o.bias),
             "fc1_weight": (mlp.fc1_weight, ref.fc1.weight),
             "fc2_bias": (mlp.fc2_bias, ref.fc2.bias)}
    for name, (ours, theirs) in pairs.items():
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **FP32_TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_checkpoint_core_attention_gives_the_same_gradients():
    layer = _layer()
    x = _data().requires_grad_()
    grads = []
    for recompute in (False, True):
        x.grad = None
        layer.zero_grad()
        layer(x, checkpoint_core_attention=recompute).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Inside a checkpoint of the whole layer the inner one is redundant and skipped.
    x.grad = None
    te.checkpoint(layer, x, checkpoint_core_attention=True).square().sum().backward()
    torch.testing.assert_close(x.grad, grads[0][0], atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_drop_path_drops_whole_samples_in_training_only(fmt):
    """Stochastic depth: in training each sample's block output is either dropped or scaled
    by 1 / (1 - rate); outside training the residual addition is plain."""
    layer = _layer(drop_path_rate=0.5, attn_input_format=fmt)
    batch_dim = 0 if fmt == "bshd" else 1
    h, r = torch.randn(8, 8, HIDDEN), torch.randn(8, 8, HIDDEN)
    delta = layer._residual(h, r) - r
    kept = [torch.allclose(d, 2.0 * hb, atol=1e-5) for d, hb in zip(delta.unbind(batch_dim),
                                                      h.unbind(batch_dim), strict=True)]
    dropped = [not d.any() for d in delta.unbind(batch_dim)]
    assert all(k != d for k, d in zip(kept, dropped, strict=True)) and any(kept) and any(dropped)
    layer.eval()
    assert torch.equal(layer._residual(h, r), r + h)
    x = _data() if fmt == "bshd" else _data().transpose(0, 1)
    assert torch.equal(layer(x), _layer_like(layer, fmt)(x))


def test_drop_path_skips_the_cross_attention():
    """A decoder's cross-attention output joins the residual stream whole (NVIDIA TE drops
    only the self-attention's and the MLP's): the MLP's input is exactly the cross-attention's
    input plus its output, while drop_path still acts on the other blocks."""
    layer = _layer(layer_type="decoder", drop_path_rate=0.5)
    seen = {}
    layer.inter_attention.register_forward_hook(
        lambda m, args, out: seen.update(cross_in=args[0], cross_out=out))
    layer.layernorm_mlp.register_forward_pre_hook(
        lambda m, args: seen.update(mlp_in=args[0]))
    x = torch.randn(8, S, HIDDEN)
    memory = _data(s=12, seed=3).repeat(4, 1, 1)
    with torch.no_grad():
        out = layer(x, encoder_output=memory)
        assert torch.equal(seen["mlp_in"], seen["cross_in"] + seen["cross_out"])
        layer.eval()
        assert not torch.equal(out, layer(x, encoder_output=memory))


def _layer_like(layer, fmt):
    """The same weights without any dropout (what eval mode must compute)."""
    twin = _layer(attn_input_format=fmt)
    twin.load_state_dict(layer.state_dict())
    return twin


# ------------------------------------------------------------------ FP8


FP8_RECIPES = {
    "delayed": recipe.DelayedScaling(),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
    "delayed_fp8_mha": recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True),
}


@pytest.mark.parametrize("name", list(FP8_RECIPES))
def test_fp8_layer_is_close_to_reference(device, name):
    _check_fp8(device, name, rope=True)


def test_fp8_mha_splits_interleaved_fused_qkv_in_fp8(device):
    """Without RoPE the QKV GEMM writes FP8, split by key/value group in FP8 bytes."""
    _check_fp8(device, "delayed_fp8_mha", rope=False, fuse_qkv_params=True)


def _check_fp8(device, name, rope, **kw):
    layer = _layer(num_gqa_groups=2, device=device, **kw)
    ref = RefLayer(layer, groups=2)
    x = _data()
    freqs = te.RotaryPositionEmbedding(HIDDEN // HEADS)(S).to(device) if rope else None
    for _ in range(2):  # delayed scaling: the second step quantizes with the first's amaxes
        with te.fp8_autocast(fp8_recipe=FP8_RECIPES[name]):
            got = layer(x.to(device), rotary_pos_emb=freqs)
    pos = torch.arange(S).expand(B, -1) if rope else None
    want = ref(x.double(), _allowed("causal", S, S), positions=pos)
    added, added_ref = got.double().cpu() - x.double(), want - x.double()
    rel = (added - added_ref).square().mean().sqrt() / added_ref.square().mean().sqrt()
    low, high = FP8_REL_RMSE
    assert low < rel < high, f"{name}: relative RMS error {rel:.3g}"


def test_fp8_layer_trains_without_extra_casts():
    """Under fp8_mha the QKV GEMM hands attention FP8 bytes (no RoPE), attention hands the
    output projection FP8, and the backward reaches every parameter."""
    layer = _layer(params_dtype=torch.bfloat16)
    seen = {}
    layer.self_attention.proj.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("proj_input", type(args[0]).__name__))
    x = _data(torch.bfloat16).requires_grad_()
    with te.fp8_autocast(fp8_recipe=FP8_RECIPES["delayed_fp8_mha"]):
        y = layer(x)
    y.float().square().mean().backward()
    assert seen["proj_input"] == "Float8Tensor"
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


# ------------------------------------------------------------------ compile, names, errors


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_forward_traces_in_one_graph(fp8):
    torch._dynamo.reset()
    layer = _layer(num_gqa_groups=2, params_dtype=torch.bfloat16 if fp8 else None)
    x = _data(torch.bfloat16 if fp8 else torch.float32)
    rope = te.RotaryPositionEmbedding(HIDDEN // HEADS)(S)
    r = recipe.Float8CurrentScaling()

    def step(t):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
            return layer(t, rotary_pos_emb=rope)

    # aot_eager traces forward and backward like inductor (a graph break raises) without
    # compiling C++, which the 2-core CPU cannot afford here.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), step(x), atol=0, rtol=0)


def test_parameter_names_are_nvidia_te_names():
    layer = te.TransformerLayer(64, 128, 4, layer_type="decoder", device="cpu")
    names = set(dict(layer.named_parameters()))
    # The state dict has exactly these (each once) and the FP8 state of the te modules.
    assert {k for k in layer.state_dict() if not k.endswith("_extra_state")} == names
    qkv = "self_attention.layernorm_qkv."
    want = {qkv + n for n in ("layer_norm_weight", "layer_norm_bias", "query_weight",
                              "query_bias", "key_weight", "key_bias", "value_weight",
                              "value_bias")}
    want |= {"self_attention.proj.weight", "self_attention.proj.bias"}
    lq, kv = "inter_attention.layernorm_query.", "inter_attention.key_value."
    want |= {lq + n for n in ("layer_norm_weight", "layer_norm_bias", "query_weight",
                              "query_bias")}
    want |= {kv + n for n in ("key_weight", "key_bias", "value_weight", "value_bias")}
    want |= {"inter_attention.proj.weight", "inter_attention.proj.bias"}
    want |= {"layernorm_mlp." + n for n in ("layer_norm_weight", "layer_norm_bias",
                                           "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")}
    assert names == want
    fused = te.TransformerLayer(64, 128, 4, fuse_qkv_params=True, output_layernorm=True,
                                device="cpu")
    assert {"self_attention.qkv.weight", "layernorm.weight", "layernorm.bias"} <= set(
        dict(fused.named_parameters()))


def test_sequence_parallel_without_tensor_parallelism_is_a_no_op():
    """NVIDIA TE ignores sequence_parallel=True on one rank; so does this layer."""
    layer = _layer(sequence_parallel=True)
    twin = _layer()
    twin.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(_data()), twin(_data()), atol=0, rtol=0)


def test_default_initialization_is_nvidia_te_s():
    layer = te.TransformerLayer(256, 512, 4, device="cpu")
    w = layer.layernorm_mlp.fc1_weight
    assert abs(w.std().item() - 0.023) < 0.002 and abs(w.mean().item()) < 0.002
    assert not layer.self_attention.proj.bias.any() and not layer.layernorm_mlp.fc2_bias.any()


@pytest.mark.parametrize("kw, error, words", [
    (dict(layer_type="both"), ValueError, "layer_type"),
    (dict(attn_input_format="hbsd"), ValueError, "attn_input_format"),
    (dict(attn_input_format="thd", drop_path_rate=0.1), ValueError, "drop_path_rate"),
    (dict(ub_tp_comm_overlap=True), NotImplementedError, "userbuffers"),
    (dict(parallel_attention_mlp=True, output_layernorm=True), ValueError,
     "parallel_attention_mlp"),
    (dict(hidden_dropout=1.0), ValueError, "hidden_dropout"),
    (dict(normalization="BatchNorm"), ValueError, "normalization"),
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(qk_norm_type="BatchNorm"), ValueError, "qk_norm_type"),
    (dict(softmax_type="sigmoid"), ValueError, "softmax_type"),
    (dict(num_gqa_groups=3), ValueError, "num_gqa_groups"),
])
def test_bad_constructor_arguments_are_refused(kw, error, words):
    with pytest.raises(error, match=words):
        te.TransformerLayer(64, 128, 4, device="cpu", **kw)


def test_bad_forward_arguments_are_refused():
    layer = _layer(layer_type="decoder")
    with pytest.raises(ValueError, match="encoder_output"):
        layer(_data())
    with pytest.raises(ValueError, match="'alibi' needs alibi_slopes"):
        _layer()(_data(), core_attention_bias_type="alibi")
    with pytest.raises(ValueError, match="hidden_size"):
        _layer()(torch.randn(B, S, HIDDEN + 1))
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        _layer().set_context_parallel_group(None, [0], None, "ring")
