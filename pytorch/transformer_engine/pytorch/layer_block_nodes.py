"""The nodes of layer_block.py: a TransformerLayer's (or a MultiheadAttention's) step as one
autograd node, and what they share.

Under per-tensor FP8 (``Layer``, ``Attention``) the forward makes the calls the modules' nodes
make, with the same arguments, in the same order: the QKV block's operator, attention on q, k,
v read in place from the QKV output (or rotated by RoPE first), te.Linear's operator for the
projection, the residual adds (with the hidden dropout's fused op), the MLP block's operator;
the backward makes their backwards in reverse. Outside fp8_autocast (``LayerHP``,
``AttentionHP``) hp_blocks' calls and formulas, F.linear for the projection. With grad mode off
(``infer``) the forward alone. Both backwards free what the node made once it is read
(release.py), as the modules' nodes let it go. layer_block.py decides when a call takes a node
and learns its ``Step``; layer_block_op.py wraps the FP8 nodes for traced graphs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _compiled, compiled_blocks, compiled_grads, fast_linear, ops
from ._autograd import eager_apply
from .attention_fn import _NO_SEQLENS
from .dropout_add_fn import rng_state
from .hp_blocks import linear_grads
from .linear_fn import linear_backward
from .ops import rope as rope_ops
from .release import may_release, release
from .rope import checked_angles

# The attention calls' absent cu_seqlens and rng state: empty tensors, which the core's calls
# take as absent whatever their device (ops/attention.py: _opt).
NO_RNG = torch.empty((0,), dtype=torch.int64)


class Step(NamedTuple):
    """What a learned step needs besides the tensors it reads afresh each call."""

    recipe: object
    key: tuple  # (the input's shape, dtype and device, RoPE, the settings _run lists)
    delayed: bool
    qkv: Optional[compiled_blocks.Codes]
    proj: Optional[fast_linear.Codes]
    mlp: Optional[compiled_blocks.Codes]  # (None: the attention node)
    act: int
    attention: tuple  # attention_fn's Params
    views: tuple  # (shape, stride, offset from the QKV output's start) of q, k, v
    deterministic: bool
    splits: tuple  # rows of each QKV weight (and bias) block
    hp: bool  # outside fp8_autocast: the blocks' high-precision steps (hp_blocks.py)
    norms: tuple  # ((norm, eps, zero_centered_gamma) of the QKV block, of the MLP or None)
    act_name: Optional[str]
    rope_interleaved: bool
    block: Optional["BlockArgs"] = None  # attention_block.cpp's arguments, None: not served


def _attend(qkv: torch.Tensor, step: Step, freqs: Optional[torch.Tensor]) -> tuple:
    """(o, lse, what the backward reads of q, k, v, RoPE's angles as a matrix or None):
    attention over the heads of the QKV output, read in place (_FusedAttentionPacked's call);
    with RoPE angles, q and k rotated first (apply_rotary_pos_emb's checks and fused calls)
    and q, k, v made dense (MultiheadAttention._rope, then _FusedAttention's calls)."""
    start = qkv.storage_offset()
    q, k, v = (qkv.as_strided(sh, st, off + start) for sh, st, off in step.views)
    # (attention dropout: a fresh rng state, drawn where DotProductAttention._fused draws it;
    # the backward takes the same one)
    dropout = step.attention[5] > 0.0
    if _compiled.tracing():  # (layer_block_op's fake: no real tensor may enter)
        no_seqlens = qkv.new_empty(0, dtype=torch.int32)
        rng = rng_state(qkv.device) if dropout else qkv.new_empty(0, dtype=torch.int64)
    else:
        no_seqlens = _NO_SEQLENS
        rng = rng_state(qkv.device) if dropout else NO_RNG
    if freqs is None:
        o, lse = ops.attention_forward(q, k, v, no_seqlens, no_seqlens, rng, *step.attention)
        return o, lse, (qkv, rng), None
    layout, interleaved = step.attention[0], step.rope_interleaved
    freqs = checked_angles(q, freqs, layout, None, 1, None)
    q = rope_ops.rope_forward(q, freqs, layout, interleaved, None, None).contiguous()
    k = rope_ops.rope_forward(k, freqs, layout, interleaved, None, None).contiguous()
    v = v.contiguous()
    o, lse = ops.attention_forward(q, k, v, no_seqlens, no_seqlens, rng, *step.attention)
    return o, lse, (q, k, v, rng), freqs


def _attend_backward(d_o: torch.Tensor, o, lse, held: tuple, step: Step, freqs, free: bool):
    """The gradient of the QKV output [M, F] from d_o (in o's shape): _FusedAttentionPacked's
    backward; with RoPE, _FusedAttention's, each rotation's backward, and the gradients of
    q, k, v written where their views sit in the QKV output (the values autograd's backward
    of the heads' split assembles)."""
    layout, mask, left, right, scale, dropout, max_q, max_kv, backend = step.attention
    if freqs is None:
        qkv, rng = held
        start = qkv.storage_offset()
        q, k, v = (qkv.as_strided(sh, st, off + start) for sh, st, off in step.views)
        d_qkv = ops.attention_backward_packed(qkv, q, k, v, o, d_o, lse, rng, layout, mask,
                                              left, right, scale, dropout, step.deterministic,
                                              backend)
        if free:
            release(qkv, o, lse)
        return d_qkv.view(-1, d_qkv.shape[-1])
    q, k, v, rng = held
    dq, dk, dv = ops.attention_backward(q, k, v, o, d_o, lse, _NO_SEQLENS, _NO_SEQLENS, rng,
                                        layout, mask, left, right, scale, dropout, max_q,
                                        max_kv, step.deterministic, backend, q.dtype)
    if free:
        release(q, k, v, o, lse)
    interleaved = step.rope_interleaved
    dq = rope_ops.rope_backward(dq, freqs, layout, interleaved, None, None)
    dk = rope_ops.rope_backward(dk, freqs, layout, interleaved, None, None)
    rows = sum(sh[-2] * sh[-1] for sh, _, _ in step.views)
    d_qkv = dq.new_empty((dq.numel() // (dq.shape[-2] * dq.shape[-1]), rows))
    for (sh, st, off), g in zip(step.views, (dq, dk, dv), strict=True):
        d_qkv.as_strided(sh, st, off).copy_(g)
    return d_qkv


def _operands(x: torch.Tensor, qkv_parts: tuple, n_w: int, n_b: int) -> tuple:
    """(x as [M, K], the QKV weight and bias joined over their blocks' storage; None without a
    bias): what every node's forward starts from."""
    return (x.view(-1, x.shape[-1]), joined(qkv_parts[:n_w]),
            joined(qkv_parts[n_w:]) if n_b else None)


def _residual(h: torch.Tensor, residual: torch.Tensor, p: float) -> tuple:
    """(residual + dropout(h), the dropout's rng state or None): TransformerLayer._residual's
    fused op with a fresh rng state where p > 0 (dropout_add_fn.dropout_add), else the add."""
    if p == 0.0:
        return residual + h, None
    rng = rng_state(h.device)
    return ops.dropout_add_forward(h, residual, rng, p), rng


# Whether the nodes' backward adds its residual gradients inside the norms' backward (the
# core's grad_input_add: one launch and one tensor fewer a residual, the same bits) instead of
# as adds of their own. On an H200 it made four FP8 layers at hidden 1024 faster in both rounds
# of an A/B in one run (7.27 / 7.46 ms a step off, 6.53 / 6.76 on: model_ab_fold_{a,b}{1,2}.json)
# and at hidden 4096 traded 375 us of adds for 248 us more of norm backward a step
# (kernel_profile_model_fold_{off,on}_4096.json).
fold_residual_grads = True


def _addable(g: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
    """g, a residual gradient reaching the norm input x, where the norm's backward is to add
    it into its grad_input itself (fold_residual_grads, and x's shape and dtype); else None,
    and the caller adds it."""
    if not fold_residual_grads:
        return None
    return g if g.shape == x.shape and g.dtype == x.dtype else None


def _residual_grad(g: torch.Tensor, rng: Optional[torch.Tensor], p: float) -> torch.Tensor:
    """The gradient of h in _residual from the output's (the residual's is g itself)."""
    return g if rng is None else ops.dropout_backward(g, rng, p)


def joined(parts: tuple) -> torch.Tensor:
    """Blocks laid back to back in one storage as one tensor over it (_split_rows._JoinRows's
    forward, without a node of its own: this node's backward splits the gradient)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    shape = (sum(p.shape[0] for p in parts),) + tuple(first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                   first.stride())


# ---------------------------------------------------------------- FP8 (per-tensor recipes)

# Whether the FP8 nodes make their attention half through attention_block.cpp's operators (the
# QKV block, attention, the projection and the residual add in one call forward; the
# projection's and attention's backward in one call) where the step allows it (no RoPE, eager,
# step.block), instead of the operators' calls one by one with Python between them: the same
# core calls, so the same bits, and less host time.
fused_attention_block = True

_LAYOUTS = {"bshd": 0, "sbhd": 1}  # (te_attn_layout)
_BACKENDS = {"auto": -1, "cudnn": 0, "cuda_math": 1, "cpu": 2}  # (te_attn_backend)


class BlockArgs(NamedTuple):
    """What attention_block.cpp's operators take of a step's attention: q, k, v's views of
    the QKV output flattened (shape, stride, offset each), their strides as the core's config
    has them (ops.attention.qkv_strides), and the config's codes."""

    views: list
    strides: list
    layout: int
    mask: int
    window_left: int
    window_right: int
    softmax_scale: float
    dropout: float
    backend: int


def block_args(attention: tuple, views: tuple, strides: Optional[list]) -> Optional[BlockArgs]:
    """The fused operators' arguments of a step's attention (layer_block._learn), or None
    where they do not serve it. ``strides``: ops.attention.qkv_strides of q, k, v as the
    step's views of a fresh QKV output (None: not read in place)."""
    layout, mask, left, right, scale, dropout, _, _, backend = attention
    if strides is None or layout not in _LAYOUTS or backend not in _BACKENDS:
        return None
    flat = [n for shape, stride, offset in views for n in (*shape, *stride, offset)]
    return BlockArgs(flat, strides, _LAYOUTS[layout], ops.attention.MASKS.index(mask), left,
                     right, scale, dropout, _BACKENDS[backend])


def _fused(step: Step, freqs) -> bool:
    return (fused_attention_block and step.block is not None and freqs is None
            and not _compiled.tracing())


def _fp8_attention(x2, step: Step, states, freqs, g1, beta1, w_qkv, b_qkv, w_p, b_p) -> tuple:
    """(projection output [M, N], what the backward reads, q/k/v held, RoPE angles): the QKV
    block's operator, attention, te.Linear's operator for the projection (attention_block.cpp's
    one call where _fused)."""
    if _fused(step, freqs):
        rng = _attention_rng(step, x2)
        status, out, *outs = _compiled.ops.attention_block_fp8_forward.default(
            *_attention_half(x2, step, states, g1, beta1, w_qkv, b_qkv, w_p, b_p, rng),
            ops._backend.stream_of(x2))
        _compiled.raise_if_failed(status)
        return (out, _attention_saved(x2, g1, outs), (outs[6], rng), None)
    (s1, h1, _), (s2, h2, _) = states[:2]
    qkv, *saved = compiled_blocks._linear_forward(x2, g1, beta1, w_qkv, b_qkv, s1, h1, step.qkv,
                                                  True, True)
    o, lse, held, freqs = _attend(qkv, step, freqs)
    o2 = o.view(-1, o.shape[-2] * o.shape[-1])
    out, x_sinv, w_sinv, x_col, w_col = fast_linear._forward(o2, w_p, b_p, s2, h2, step.proj,
                                                             True, True)
    return out, (x2, g1, *saved, o, lse, x_sinv, w_sinv, x_col, w_col), held, freqs


def _attention_rng(step: Step, x2) -> torch.Tensor:
    """The attention dropout's rng state of a fused call (drawn where _attend draws it)."""
    return rng_state(x2.device) if step.block.dropout > 0.0 else NO_RNG


def _attention_half(x2, step: Step, states, g1, beta1, w_qkv, b_qkv, w_p, b_p, rng) -> tuple:
    """attention_block.cpp's forward arguments of the attention half, as both fused forwards
    take them first: the QKV block's as compiled_blocks._linear_forward passes them, the
    projection's as fast_linear._forward does, the attention's (step.block)."""
    (s1, h1, _), (s2, h2, _) = states[:2]
    c, b = step.qkv, step.block
    ws = ops._backend.workspace_for(x2)
    return (x2, g1, beta1, c.norm, c.eps, c.zero_centered_gamma, w_qkv,
            compiled_blocks._in_dtype(b_qkv, x2), w_p, b_p, s1, compiled_blocks._state(s1, h1),
            s2, h2, _compiled.NO_TENSOR if ws is None else ws, c.current, c.fwd_dtype, c.pow2,
            c.epsilon, b.views, b.strides, b.layout, b.mask, b.window_left, b.window_right,
            b.softmax_scale, b.dropout, b.backend, rng)


def _attention_saved(x2, g1, outs) -> tuple:
    """What _fp8_attention saves, from a fused forward's outputs after its first (the QKV
    block's six, the QKV output, o, softmax_lse, the projection's four)."""
    ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, _, o, lse, x_sinv, pw_sinv, x_col, pw_col = \
        outs[:13]
    return (x2, g1, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, o, lse, x_sinv, pw_sinv, x_col,
            pw_col)


_FP8_ATTENTION_SAVED = 14  # (the tensors _fp8_attention saves)


def _fp8_attention_backward(g, saved, held, step: Step, metas, freqs, has: tuple,
                            dtypes: tuple, n_b: int, free: bool, grad_add=None) -> tuple:
    """(grad of x [M, K], of gamma, of beta, of the QKV weight, of its bias, of the projection's
    weight, of its bias) from g [M, N], the projection output's gradient; grad_add (an
    _addable residual gradient of x) added into x's."""
    (x2, g1, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, o, lse, x_sinv, pw_sinv, x_col,
     pw_col) = saved
    has_beta, has_bp = has
    wp_dtype, wqkv_dtype = dtypes
    m1, m2 = metas
    proj_saved = (x_col, x_sinv, pw_col, pw_sinv)
    if _fused(step, freqs) and compiled_grads.usable(step.proj.plan, None, m2[0], g.shape[0], g,
                                                     *proj_saved):
        d_qkv, gw_p, gb_p = _projection_attention_backward(g, o, lse, held, x_sinv, pw_sinv,
                                                           x_col, pw_col, step, m2, wp_dtype,
                                                           has_bp)
        if free:
            release(x_col, pw_col, held[0], o, lse)
    else:
        d_o, gw_p, gb_p = linear_backward(
            g, proj_saved, step.proj.plan, m2, None, None, (True, True, has_bp),
            (o.dtype, wp_dtype, wp_dtype if has_bp else None), g.shape)
        if free:
            release(x_col, pw_col)
        d_qkv = _attend_backward(d_o.view(o.shape), o, lse, held, step, freqs, free)
    c = step.qkv
    # (_compiled.call: in eager mode the operator's call straight away, the arguments known
    # to be plain tensors)
    dx, dg1, dbeta1, gw, gb = _compiled.call(
        compiled_blocks.layernorm_linear_block_backward, d_qkv, x2, mu, rsigma, g1, has_beta,
        ln_sinv, ln_col, w_sinv, w_col, *m1, c.norm, c.zero_centered_gamma, c.current,
        c.fwd_dtype, c.bwd_dtype, c.pow2, c.epsilon, c.algo, c.margin, True, True, wqkv_dtype,
        wqkv_dtype if n_b else None, grad_add)
    return dx, dg1, dbeta1 if has_beta else None, gw, gb, gw_p, gb_p if has_bp else None


def _fp8_layer_fused(x2, step: Step, states, p: float, g1, beta1, w_qkv, b_qkv, w_p, b_p, g2,
                     beta2, w1, b1, w2, b2) -> tuple:
    """Layer's forward (_fp8_attention, the residual, the MLP block's operator, the second
    residual) as attention_block.cpp's one layer_fp8_forward call: (output, the attention
    half's saved tensors, mid, the MLP's saved tensors, q/k/v held, the two residuals' rng
    states or None). rng states drawn in the order of the calls one by one."""
    rng = _attention_rng(step, x2)
    if p > 0.0:
        rng1, rng2 = rng_state(x2.device), rng_state(x2.device)
    else:
        rng1 = rng2 = NO_RNG
    s3, h3, _ = states[2]
    m = step.mlp
    status, out, *outs = _compiled.ops.layer_fp8_forward.default(
        *_attention_half(x2, step, states, g1, beta1, w_qkv, b_qkv, w_p, b_p, rng), g2, beta2,
        m.norm, m.eps, m.zero_centered_gamma, w1, compiled_blocks._in_dtype(b1, x2), step.act,
        w2, compiled_blocks._in_dtype(b2, x2), s3, compiled_blocks._state(s3, h3), p, rng1,
        rng2, ops._backend.stream_of(x2))
    _compiled.raise_if_failed(status)
    dropped = p > 0.0
    return (out, _attention_saved(x2, g1, outs), outs[13], outs[14:], (outs[6], rng),
            rng1 if dropped else None, rng2 if dropped else None)


def _projection_attention_backward(g, o, lse, held, x_sinv, pw_sinv, x_col, pw_col,
                                   step: Step, meta: tuple, wp_dtype, has_bp: bool) -> tuple:
    """(grad of the QKV output [M, F], of the projection's weight, of its bias or None): the
    projection's linear_backward and _attend_backward as attention_block.cpp's one operator
    call."""
    qkv, rng = held
    c, b = step.proj, step.block
    plan = c.plan
    ws = ops._backend.workspace_for(g)
    status, d_qkv, gw_p, gb_p = _compiled.ops.attention_block_fp8_backward.default(
        g, qkv, o, lse, rng, x_sinv, pw_sinv, x_col, pw_col, *meta,
        _compiled.NO_TENSOR if ws is None else ws, c.current, c.fp8_dtype, c.bwd_dtype, c.pow2,
        c.epsilon, c.algo, plan.margin, wp_dtype, wp_dtype if has_bp else None, b.views,
        b.strides, b.layout, b.mask, b.window_left, b.window_right, b.softmax_scale, b.dropout,
        step.deterministic, b.backend, ops._backend.stream_of(g))
    _compiled.raise_if_failed(status)
    return d_qkv, gw_p, gb_p if has_bp else None


def fp8_info(step: Step, metas: tuple, n_w: int, n_b: int, shape, leading: tuple,
             w_qkv_dtype: torch.dtype) -> tuple:
    """What an FP8 node's backward reads besides its saved tensors (its ctx.info), from the
    parameters before the QKV blocks (the attention's four, then the layer's MLP's six): which
    betas and biases there are, and the weights' dtypes (the projection's[, FC1's, FC2's], the
    QKV weight's)."""
    weights = (leading[2], leading[6], leading[8]) if len(leading) == 10 else (leading[2],)
    return (step, metas, n_w, n_b, shape, tuple(t is not None for t in leading[1::2]),
            (*(w.dtype for w in weights), w_qkv_dtype))


def split_grads(step: Step, n_w: int, n_b: int, gw, gb) -> list:
    """The QKV weight's and bias's gradients split back into their blocks (_JoinRows's
    backward)."""
    # (split_with_sizes straight away: Tensor.split's Python wrapper costs more than the split)
    w_grads = list(gw.split_with_sizes(step.splits)) if n_w > 1 else [gw]
    b_grads = (list(gb.split_with_sizes(step.splits)) if n_b > 1 else [gb]) if n_b else []
    return w_grads + b_grads


class Layer(torch.autograd.Function):
    """x -> x + proj(attention(qkv(norm(x)))) -> + mlp(norm(.)): the modules' numbers."""

    @staticmethod
    def forward(ctx, x, step: Step, states, call: tuple, n_w: int, n_b: int, g1, beta1, w_p, b_p,
                g2, beta2, w1, b1, w2, b2, *qkv_parts):
        freqs, p = call  # (RoPE's angles or None, the hidden dropout)
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        if _fused(step, freqs):
            out, saved, mid, saved3, held, rng1, rng2 = _fp8_layer_fused(
                x2, step, states, p, g1, beta1, w_qkv, b_qkv, w_p, b_p, g2, beta2, w1, b1, w2, b2)
        else:
            proj_out, saved, held, freqs = _fp8_attention(x2, step, states, freqs, g1, beta1,
                                                          w_qkv, b_qkv, w_p, b_p)
            mid, rng1 = _residual(proj_out, x2, p)
            s3, h3, _ = states[2]
            mlp_out, *saved3 = compiled_blocks._mlp_forward(mid, g2, beta2, w1, b1, w2, b2, s3,
                                                            h3, step.mlp, step.act, (True,) * 4)
            out, rng2 = _residual(mlp_out, mid, p)
        ctx.save_for_backward(*saved, mid, g2, *saved3, *held)
        ctx.freqs, ctx.dropout = freqs, (p, rng1, rng2)
        ctx.info = fp8_info(step, tuple(m for _, _, m in states), n_w, n_b, shape,
                            (g1, beta1, w_p, b_p, g2, beta2, w1, b1, w2, b2), w_qkv.dtype)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        attention = saved[:_FP8_ATTENTION_SAVED]
        (mid, g2, ln_sinv2, ln_col2, mu2, rs2, w1_sinv, w1_col, h, a_sinv, a_col, w2_sinv,
         w2_col, *held) = saved[_FP8_ATTENTION_SAVED:]
        step, (m1, m2, m3), n_w, n_b, shape, has, dtypes = ctx.info
        has_beta1, has_bp, has_beta2, has_b1, has_b2 = has
        wp_dtype, w1_dtype, w2_dtype, wqkv_dtype = dtypes
        g = grad.reshape(-1, shape[-1]).contiguous()
        p, rng1, rng2 = ctx.dropout
        c = step.mlp
        g_add = _addable(g, mid)
        d_mid, dg2, dbeta2, gw1, gb1, gw2, gb2 = _compiled.call(
            compiled_blocks.layernorm_mlp_block_backward, _residual_grad(g, rng2, p), mid, mu2,
            rs2, g2, has_beta2, ln_sinv2, ln_col2, w1_sinv, w1_col, h, step.act, a_sinv, a_col,
            w2_sinv, w2_col, *m3, c.norm, c.zero_centered_gamma, c.current, c.fwd_dtype,
            c.bwd_dtype, c.pow2, c.epsilon, c.algo, c.margin, True, True, True, True, w1_dtype,
            w1_dtype if has_b1 else None, w2_dtype, w2_dtype if has_b2 else None, g_add)
        # (what the node made goes once read, as the modules' nodes let it go: release.py)
        free = may_release()
        if free:
            release(h, a_col, w2_col, ln_col2, w1_col, mid)
        g_mid = d_mid if g_add is not None else g + d_mid  # (d_mid holds g when folded)
        x_add = _addable(g_mid, attention[0])
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _fp8_attention_backward(
            _residual_grad(g_mid, rng1, p), attention, held, step, (m1, m2), ctx.freqs,
            (has_beta1, has_bp), (wp_dtype, wqkv_dtype), n_b, free, x_add)
        dx = (dx if x_add is not None else g_mid + dx).view(shape)
        return (dx, None, None, None, None, None, dg1, dbeta1, gw_p, gb_p, dg2,
                dbeta2 if has_beta2 else None, gw1, gb1 if has_b1 else None, gw2,
                gb2 if has_b2 else None, *split_grads(step, n_w, n_b, gw, gb))


class Attention(torch.autograd.Function):
    """x -> proj(attention(qkv(norm(x)))): te.MultiheadAttention's numbers."""

    @staticmethod
    def forward(ctx, x, step: Step, states, freqs, n_w: int, n_b: int, g1, beta1, w_p, b_p,
                *qkv_parts):
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        out, saved, held, freqs = _fp8_attention(x2, step, states, freqs, g1, beta1, w_qkv,
                                                 b_qkv, w_p, b_p)
        ctx.save_for_backward(*saved, *held)
        ctx.freqs = freqs
        ctx.info = fp8_info(step, tuple(m for _, _, m in states), n_w, n_b, shape,
                            (g1, beta1, w_p, b_p), w_qkv.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        step, metas, n_w, n_b, shape, has, dtypes = ctx.info
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _fp8_attention_backward(
            g, saved[:_FP8_ATTENTION_SAVED], saved[_FP8_ATTENTION_SAVED:], step, metas, ctx.freqs,
            has, dtypes, n_b, may_release())
        return (dx.view(shape), None, None, None, None, None, dg1, dbeta1, gw_p, gb_p,
                *split_grads(step, n_w, n_b, gw, gb))


apply_layer = eager_apply(Layer)
apply_attention = eager_apply(Attention)


# ---------------------------------------------------------------- high precision


def _hp_attention(x2, step: Step, freqs, g1, beta1, w_qkv, b_qkv, w_p, b_p) -> tuple:
    """hp_blocks' QKV block, attention, F.linear (te.Linear's high-precision step)."""
    norm, eps, zc = step.norms[0]
    ln, mu, rsigma = ops.norm_forward(x2, g1, beta1, norm, eps, zc)
    qkv = F.linear(ln, w_qkv, b_qkv)
    o, lse, held, freqs = _attend(qkv, step, freqs)
    out = F.linear(o.view(-1, o.shape[-2] * o.shape[-1]), w_p, b_p)
    return out, (x2, mu, rsigma, g1, ln, w_qkv, o, lse, w_p), held, freqs


_HP_ATTENTION_SAVED = 9


def _hp_attention_backward(g, saved, held, step: Step, freqs, has: tuple, n_b: int,
                           free: bool, grad_add=None) -> tuple:
    """hp_blocks' formulas backward: as _fp8_attention_backward's."""
    x2, mu, rsigma, g1, ln, w_qkv, o, lse, w_p = saved
    has_beta, has_bp = has
    norm, _, zc = step.norms[0]
    d_o, gw_p, gb_p = linear_grads((True, True, True), g, o.view(-1, o.shape[-2] * o.shape[-1]),
                                    w_p, has_bp)
    d_qkv = _attend_backward(d_o.view(o.shape), o, lse, held, step, freqs, free)
    d_ln, gw, gb = linear_grads((True, True, True), d_qkv, ln, w_qkv, n_b > 0)
    if free:
        release(ln)
    dx, dg1, dbeta1 = ops.norm_backward(d_ln.contiguous(), x2, mu, rsigma, g1, norm, zc,
                                        grad_add)
    return dx, dg1, dbeta1 if has_beta else None, gw, gb, gw_p, gb_p if has_bp else None


class LayerHP(torch.autograd.Function):
    """The layer node outside fp8_autocast: hp_blocks' calls for the QKV block and the MLP
    (the norm's op, F.linear, the activation's op), F.linear for the projection (te.Linear's
    high-precision step), attention on q, k, v read in place; backward by the same formulas
    (hp_blocks.linear_grads for each F.linear), freeing what the node made once read, as the
    modules' nodes would (release.py)."""

    @staticmethod
    def forward(ctx, x, step: Step, call: tuple, n_w: int, n_b: int, g1, beta1, w_p, b_p, g2,
                beta2, w1, b1, w2, b2, *qkv_parts):
        freqs, p = call  # (RoPE's angles or None, the hidden dropout)
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        proj_out, saved, held, freqs = _hp_attention(x2, step, freqs, g1, beta1, w_qkv, b_qkv,
                                                     w_p, b_p)
        mid, rng1 = _residual(proj_out, x2, p)
        norm, eps, zc = step.norms[1]
        ln2, mu2, rs2 = ops.norm_forward(mid, g2, beta2, norm, eps, zc)
        h = F.linear(ln2, w1, b1)
        a = ops.activation_forward(h, step.act_name)
        out, rng2 = _residual(F.linear(a, w2, b2), mid, p)
        ctx.save_for_backward(*saved, mid, mu2, rs2, g2, ln2, w1, h, a, w2, *held)
        ctx.freqs, ctx.dropout = freqs, (p, rng1, rng2)
        ctx.info = (step, n_w, n_b, shape, (beta1 is not None, b_p is not None,
                                            beta2 is not None, b1 is not None, b2 is not None))
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        (mid, mu2, rs2, g2, ln2, w1, h, a, w2, *held) = saved[_HP_ATTENTION_SAVED:]
        step, n_w, n_b, shape, has = ctx.info
        has_beta1, has_bp, has_beta2, has_b1, has_b2 = has
        norm2, _, zc2 = step.norms[1]
        free = may_release()
        g = grad.reshape(-1, shape[-1])
        p, rng1, rng2 = ctx.dropout
        d_a, gw2, gb2 = linear_grads((True, True, True), _residual_grad(g, rng2, p), a, w2,
                                      has_b2)
        d_h, _ = ops.activation_backward(d_a.contiguous(), h, step.act_name, False)
        del d_a
        d_ln2, gw1, gb1 = linear_grads((True, True, True), d_h, ln2, w1, has_b1)
        del d_h
        g_add = _addable(g, mid)
        d_mid, dg2, dbeta2 = ops.norm_backward(d_ln2.contiguous(), mid, mu2, rs2, g2, norm2, zc2,
                                               g_add)
        del d_ln2
        if free:
            release(a, h, ln2, mid)
        g_mid = d_mid if g_add is not None else g + d_mid  # (d_mid holds g when folded)
        x_add = _addable(g_mid, saved[0])
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _hp_attention_backward(
            _residual_grad(g_mid, rng1, p), saved[:_HP_ATTENTION_SAVED], held, step, ctx.freqs,
            (has_beta1, has_bp), n_b, free, x_add)
        dx = (dx if x_add is not None else g_mid + dx).view(shape)
        return (dx, None, None, None, None, dg1, dbeta1, gw_p, gb_p, dg2,
                dbeta2 if has_beta2 else None, gw1, gb1 if has_b1 else None, gw2,
                gb2 if has_b2 else None, *split_grads(step, n_w, n_b, gw, gb))


class AttentionHP(torch.autograd.Function):
    """The attention node outside fp8_autocast."""

    @staticmethod
    def forward(ctx, x, step: Step, freqs, n_w: int, n_b: int, g1, beta1, w_p, b_p, *qkv_parts):
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        out, saved, held, freqs = _hp_attention(x2, step, freqs, g1, beta1, w_qkv, b_qkv, w_p,
                                                b_p)
        ctx.save_for_backward(*saved, *held)
        ctx.freqs = freqs
        ctx.info = (step, n_w, n_b, shape, (beta1 is not None, b_p is not None))
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        step, n_w, n_b, shape, has = ctx.info
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _hp_attention_backward(
            grad.reshape(-1, grad.shape[-1]), saved[:_HP_ATTENTION_SAVED],
            saved[_HP_ATTENTION_SAVED:], step, ctx.freqs, has, n_b, may_release())
        return (dx.view(shape), None, None, None, None, dg1, dbeta1, gw_p, gb_p,
                *split_grads(step, n_w, n_b, gw, gb))


apply_layer_hp = eager_apply(LayerHP)
apply_attention_hp = eager_apply(AttentionHP)


# ---------------------------------------------------------------- without gradients


def infer(layer: bool, states, x, step: Step, call, n_w: int, n_b: int,
          params) -> torch.Tensor:
    """The forward alone (grad mode off: evaluation, inference), as the modules make it then:
    each block's operator without the backward's copies (FP8), or the blocks' calls (high
    precision); nothing saved."""
    freqs, p = call if layer else (call, 0.0)
    g1, beta1, w_p, b_p = params.attention
    shape = x.shape
    x2, w_qkv, b_qkv = _operands(x, params.weights + params.biases, n_w, n_b)
    if step.hp:
        norm, eps, zc = step.norms[0]
        qkv = F.linear(ops.norm_forward(x2, g1, beta1, norm, eps, zc)[0], w_qkv, b_qkv)
    else:
        qkv = compiled_blocks._linear_forward(x2, g1, beta1, w_qkv, b_qkv, *states[0][:2],
                                              step.qkv, False, False)[0]
    o = _attend(qkv, step, freqs)[0]
    o2 = o.view(-1, o.shape[-2] * o.shape[-1])
    if step.hp:
        out = F.linear(o2, w_p, b_p)
    else:
        out = fast_linear._forward(o2, w_p, b_p, *states[1][:2], step.proj, False, False)[0]
    if not layer:
        return out.view(*shape[:-1], out.shape[-1])
    mid = _residual(out, x2, p)[0]
    g2, beta2, w1, b1, w2, b2 = params.mlp
    if step.hp:
        norm, eps, zc = step.norms[1]
        h = F.linear(ops.norm_forward(mid, g2, beta2, norm, eps, zc)[0], w1, b1)
        mlp_out = F.linear(ops.activation_forward(h, step.act_name), w2, b2)
    else:
        mlp_out = compiled_blocks._mlp_forward(mid, g2, beta2, w1, b1, w2, b2, *states[2][:2],
                                               step.mlp, step.act, (False,) * 4)[0]
    return _residual(mlp_out, mid, p)[0].view(shape)
