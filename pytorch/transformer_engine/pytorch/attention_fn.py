"""The two paths of DotProductAttention as autograd functions.

* Fused: the core's attention entry points (cuDNN, the CUDA math path or the CPU reference),
  forward and backward; FP8 under ``fp8_dpa`` (E4M3 q, k, v and o; the backward takes d_o in
  the recipe's gradient format and returns high-precision gradients), with delayed scaling
  (the module's amax histories and scales) or current scaling. Under ``fp8_mha`` q, k, v may
  arrive as E4M3 Float8Tensors (used as they are) and o leaves as one.
* Unfused: ``q @ k^T`` and ``p @ v`` as torch matmuls around the core's scaled masked softmax,
  for what the fused kernels do not take (arbitrary masks, shapes cuDNN rejects).

Both compute the same function (``attention.h``); they draw different dropout masks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from transformer_engine.common.plan import FP8_MAX

from . import attention_bias, ops
from .first_step import step_scales
from .float8_tensor import Float8Tensor
from .head_views import head_views
from .linear_fn import update_backward
from .ops.attention import operand_strides_of
from .quantization import Plan, record_amax

__all__ = ["fused_attention", "fused_attention_fp8", "unfused_attention"]

# (layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
#  max_seqlen_kv, backend): the non-tensor arguments of the fused ops, in their order.
Params = tuple


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, rng, params, deterministic):
        # The core reads dense q, k, v; made dense once here and saved so, the backward does
        # not copy them again (they are usually strided views of the QKV projection's output,
        # which saving the dense copies also lets go).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = ops.attention_forward(q, k, v, cu_q, cu_kv, rng, *params)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_kv, rng)
        ctx.params = params
        ctx.deterministic = deterministic
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse, cu_q, cu_kv, rng = ctx.saved_tensors
        dq, dk, dv = ops.attention_backward(q, k, v, o, d_o.contiguous(), lse, cu_q, cu_kv, rng,
                                            *ctx.params[:-1], ctx.deterministic, ctx.params[-1],
                                            q.dtype)
        return dq, dk, dv, None, None, None, None, None


class _FusedAttentionPacked(torch.autograd.Function):
    """Attention of q, k, v that tile one projection output ``qkv`` (packed_qkv): the core
    reads them in place and writes dq, dk, dv into one gradient of qkv, so neither the dense
    copies of q, k, v nor the concatenation of their gradients happen."""

    @staticmethod
    def forward(ctx, qkv, views, rng, params, deterministic, split=None):
        q, k, v = _views(qkv, views, split)
        o, lse = ops.attention_forward(q, k, v, _NO_SEQLENS, _NO_SEQLENS, rng, *params)
        ctx.save_for_backward(qkv, o, lse, rng)
        ctx.views, ctx.params, ctx.deterministic, ctx.split = views, params, deterministic, split
        return o

    @staticmethod
    def backward(ctx, d_o):
        qkv, o, lse, rng = ctx.saved_tensors
        q, k, v = _views(qkv, ctx.views, ctx.split)
        layout, mask, left, right, scale, dropout, _, _, backend = ctx.params
        d_qkv = ops.attention_backward_packed(qkv, q, k, v, o, d_o.contiguous(), lse, rng, layout,
                                              mask, left, right, scale, dropout,
                                              ctx.deterministic, backend)
        return d_qkv, None, None, None, None, None


def _views(qkv: torch.Tensor, views: tuple, split: Optional[tuple] = None) -> tuple:
    """q, k, v as views of qkv: (shape, stride, offset from qkv's first element) each. A
    forward traced by dynamo, which cannot read storage offsets, makes them with view and
    split ops from ``split``, head_views' (groups, parts, head_dim, interleaved): not with
    as_strided of a slice, whose offset Inductor drops in some torch releases (on an H100
    with torch 2.11 that read k and v from q's place). Elsewhere (eager, or a backward traced
    on fake tensors outside dynamo) one as_strided each at an explicit offset, the cheaper
    call."""
    if torch.compiler.is_compiling():
        if split is None:
            raise ValueError("attention: a traced step reading q, k, v in place needs their "
                             "split (head_views' arguments), got none")
        return tuple(head_views(qkv, *split))
    start = qkv.storage_offset()
    return tuple(qkv.as_strided(shape, stride, start + offset) for shape, stride, offset in views)


_NO_SEQLENS = torch.empty((0,), dtype=torch.int32)
# Whether fused_attention reads packed q, k, v in place (benchmarks turn it off to compare).
packed_enabled = True
_TILINGS: dict = {}  # packed_qkv's verdicts by the views' geometry


def _tiles(qkv: torch.Tensor, views: tuple) -> bool:
    """Whether the views (shape, stride, offset from qkv's start) cover each element of the
    contiguous qkv exactly once, with the same row stride: a projection output's heads."""
    rows = None
    spans = []
    for shape, stride, offset in views:
        st = operand_strides_of(shape, stride, qkv.element_size())
        if st is None or offset < 0 or (offset * qkv.element_size()) % 16:
            return False
        row, head = st
        if rows is not None and row != rows:
            return False
        rows = row
        spans += [(offset + h * head, offset + h * head + shape[3]) for h in range(shape[2])]
    spans.sort()
    tokens = views[0][0][0] * views[0][0][1]
    if any(v[0][0] * v[0][1] != tokens for v in views) or qkv.numel() != tokens * rows:
        return False
    at = 0
    for start, end in spans:
        if start != at:
            return False
        at = end
    return at == rows


def packed_qkv(q, k, v, params: Params) -> Optional[tuple]:
    """(qkv, views: (shape, stride, offset from qkv's first element) of q, k, v) when q, k and
    v are views that tile one contiguous tensor (the heads of a QKV projection's output, split
    by module._heads.split_heads) and the core takes them in place (bshd/sbhd, no padding
    mask); None otherwise. Eager only: a trace cannot read the views' storage (a traced
    MultiheadAttention gives fused_attention the views itself)."""
    qkv = q._base
    if (qkv is None or k._base is not qkv or v._base is not qkv or not qkv.is_contiguous()
            or torch.compiler.is_compiling() or params[0] == "thd"
            or params[1].startswith("padding") or qkv.data_ptr() % 16):
        return None
    start = qkv.storage_offset()
    views = tuple((t.shape, t.stride(), t.storage_offset() - start) for t in (q, k, v))
    key = (qkv.shape, qkv.dtype, views)
    fits = _TILINGS.get(key)
    if fits is None:
        if len(_TILINGS) >= 256:
            _TILINGS.clear()
        fits = _TILINGS[key] = _tiles(qkv, views)
    return (qkv, views) if fits else None


def fused_attention(q, k, v, cu_q, cu_kv, rng, params: Params, deterministic: bool = False,
                    packed: Optional[tuple] = None):
    """o = attention(q, k, v) through the core (cu_q, cu_kv, rng: tensors, empty if absent).
    Views of one projection output are read in place: found by packed_qkv, or given as
    ``packed`` = (qkv, views) by a caller that made q, k, v as those views of qkv (a traced
    MultiheadAttention, where packed_qkv cannot look at the views' storage)."""
    if not packed_enabled or cu_q.numel() != 0:
        packed = None
    elif packed is None:
        packed = packed_qkv(q, k, v, params)
    elif (params[0] == "thd" or params[1].startswith("padding")
          or any(tuple(t.shape) != tuple(shape) or tuple(t.stride()) != tuple(stride)
                 for t, (shape, stride, _) in zip((q, k, v), packed[1], strict=True))):
        packed = None
    if packed is not None:
        return _FusedAttentionPacked.apply(*packed[:2], rng, params, deterministic, *packed[2:])
    return _FusedAttention.apply(q, k, v, cu_q, cu_kv, rng, params, deterministic)


E4M3_MAX = FP8_MAX["float8_e4m3"]
# Columns of the module's delayed-scaling state (module/attention.py): forward 0 = q, 1 = k,
# 3 = v (2 = p, whose scale is fixed); backward 1 = d_o.
_QKV_COLUMNS = (0, 1, 3)
_DO_COLUMN = 1


def _quantize(plan, x: torch.Tensor, fmt: str, scales: Optional[torch.Tensor], column: int,
              history: Optional[torch.Tensor]):
    """Per-tensor quantization of ``x`` (any shape) to ``fmt`` by the plan's kind: (FP8 bytes
    in x's shape, scale [1], scale_inv [1], amax [1] of x). Delayed scaling casts with
    ``scales[column]`` in one pass and raises ``history[0, column]`` by the amax (``history``
    None: a checkpoint's recompute, which records nothing); current scaling reads x twice
    (amax, then cast).

    The amax returned is the cast's own output, never a view of the history: the backward's
    bounds are built on it, and the history is updated in place around it, which a graph
    traced by torch.compile did not keep in order with a read of a view (on CUDA, where
    cuDNN's FP8 gradients use the bounds, compiled training gave gradients 93% off eager)."""
    rows = x.reshape(-1, x.shape[-1])
    if plan.kind == "delayed":
        # An empty history column: the scale from x's own amax (first_step.py).
        scales = step_scales(scales, column, history, column, fmt, plan.margin,
                             lambda gate: ops.amax(rows, gate))
        scale = scales[column:column + 1]
        data, _, scale_inv, amax = ops.quantize(rows, scale, fmt, True, False)
        if history is not None:
            record_amax(history, column, amax)
    else:
        data, _, scale, scale_inv, amax = ops.quantize_current(
            rows, fmt, True, False, plan.force_pow2_scales, plan.amax_epsilon)
    return data.view(x.shape), scale, scale_inv, amax


def _operand(plan, x: torch.Tensor, scales: Optional[torch.Tensor], column: int,
             history: Optional[torch.Tensor]):
    """q, k or v as an E4M3 operand, like :func:`_quantize`: an E4M3 Float8Tensor as it is
    (its scale unused, its amax unknown: fp8_max * scale_inv bounds it), anything else
    quantized."""
    if isinstance(x, Float8Tensor):
        scale_inv = x._scale_inv
        return x._data, None, scale_inv, E4M3_MAX * scale_inv
    return _quantize(plan, x, "float8_e4m3", scales, column, history)


def _operand_bound(amax: torch.Tensor, scale_inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """A bound on |values| of a quantized operand: its amax, or fp8_max * scale_inv when that
    is smaller (a delayed scale from earlier steps can make the cast saturate)."""
    return torch.minimum(amax, FP8_MAX[fmt] * scale_inv)


def _max_row_norm(x: torch.Tensor) -> torch.Tensor:
    """max over rows of the 2-norm of the last dim, [1] fp32 (no host sync). The norms are
    reduced in fp32 and rounded to x's dtype (no fp32 copy of x, which would be one more
    write and read of twice x's bytes); a bf16 rounding (2^-8 relative) is well inside the
    factor 2 of room the scales built on it leave."""
    return torch.linalg.vector_norm(x, dim=-1).amax().float().reshape(1)


def _grads_in_fp8(backend: str, device: torch.device) -> bool:
    """Whether the FP8 backward writes FP8 gradients (then widened here). cuDNN's FP8 backward
    writes fp16/bf16 ones only on sm_100 with cuDNN 9.13 or newer, so the core asks it for FP8
    ones everywhere (the CUDA math path takes those too, which covers "auto" on CUDA); the CPU
    and the CUDA math path asked by name write the input dtype, which saves a rounding."""
    return backend == "cudnn" or (backend == "auto" and device.type == "cuda")


def _seqlen_q(shape, layout: str, max_seqlen_q: int) -> int:
    return max_seqlen_q if layout == "thd" else shape[1 if layout == "bshd" else 0]


def _backward_scales(ctx, do_norm: torch.Tensor, amax_do: Optional[torch.Tensor],
                     fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dp_scales [2], grad_scales [3] or empty) of the FP8 backward, from bounds that hold for
    any data, so that nothing saturates and no step needs the amax of an earlier one.

    With dp_ij = d_o_i . v_j (times 1 / (1 - dropout) where kept) and D_i = sum_j p_ij dp_ij,
    ds_ij = scale * p_ij (dp_ij - D_i) = scale * p_ij (1 - p_ij) (dp_ij - D'_ij), D'_ij being
    a weighted mean of the row's other dp: |ds| <= scale * max |dp| / 2, and
    max |dp| <= keep * max_i |d_o_i| * max_j |v_j| =: B / scale (Cauchy-Schwarz). Each scale
    below leaves a factor 2 over its bound for the FP8 roundings of o, p, ds and the inputs
    (each at most 1/8 relative): fp8_max / B for ds.
    dq_i = sum_j ds_ij k_j: sum_j |ds_ij| <= scale * 2 max |dp| = 2 B, so |dq| <= 2 B amax(k).
    dk_j = sum over the <= group * seqlen_q queries i of ds_ij q_i: |dk| <= n B / 2 amax(q).
    dv_j = sum_i dropout(p_ij) d_o_i: |dv| <= n keep amax(d_o).
    amax(q), amax(k) (ctx.amax_qk) and amax(d_o) bound the quantized operands
    (_operand_bound), whatever scaling produced them.
    The dk and dv bounds grow with the sequence, so typical values sit about log2(seqlen_q)
    binades below the format's maximum: E5M2 (30 binades of normal values) keeps them normal
    for any practical length, E4M3 (15) up to a few thousand queries."""
    q, k = ctx.qkv_shapes
    layout, _, _, _, softmax_scale, dropout, max_sq = ctx.params[:7]
    keep = 1.0 / (1.0 - dropout)
    fp8_max = FP8_MAX[fmt]
    bound_dp = (softmax_scale * keep) * do_norm * ctx.v_norm
    tiny = 1e-30  # an all-zero d_o: any finite scale will do
    dp_scale = fp8_max / bound_dp.clamp_min(tiny)
    dp_scales = torch.cat([dp_scale, 1.0 / dp_scale])
    if not ctx.fp8_grads:
        return dp_scales, dp_scale.new_empty((0,))
    n = (q[-2] // k[-2]) * _seqlen_q(q, layout, max_sq)
    amax_q, amax_k = ctx.amax_qk[0:1], ctx.amax_qk[1:2]
    bounds = torch.cat([4.0 * bound_dp * amax_k, n * bound_dp * amax_q,
                        (2.0 * n * keep) * amax_do])
    return dp_scales, fp8_max / bounds.clamp_min(tiny)


class _FusedAttentionFP8(torch.autograd.Function):
    """Forward arguments after rng: the forward scales and history of delayed scaling (None
    under current scaling; history None in a checkpoint's recompute), the backward's
    (history, scale, scale_inv) as one tuple or None, and ``cfg`` = (params, deterministic,
    plan, recipe when the backward update takes the general path else None, amax group,
    whether o leaves in FP8: a Float8Tensor [..., heads * head_dim_v], whether a backward can
    follow)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, rng, scales, history, bwd_meta, cfg):
        params, deterministic, plan, recipe, group, out_fp8, grad = cfg
        quantized = [_operand(plan, t, scales, column, history)
                     for t, column in zip((q, k, v), _QKV_COLUMNS, strict=True)]
        descales = torch.cat([sinv for _, _, sinv, _ in quantized])
        # p is in [0, 1]: the largest E4M3 value maps 1 without overflow.
        # (Filled on the device: a torch.tensor from a list would be a pageable host copy,
        # which stalls the host and has no place in a captured CUDA graph.)
        s_scales = torch.full((2,), E4M3_MAX, dtype=torch.float32, device=q.device)
        s_scales[1:].fill_(1.0 / E4M3_MAX)
        # o is written in E4M3 too (Hopper's cuDNN takes no other output of an FP8 forward) and
        # widened here. Each row of o averages rows of v, so |o| <= max |v| <= E4M3_MAX /
        # scale_v (the cast saturates there) but for the rounding of p to E4M3: half of v's
        # scale keeps o clear of the format's maximum.
        # (o's scale from its scale_inv, not from v's scale: an FP8 v arrives with its
        # scale_inv only, and the two ways could differ in the last bit.)
        o_scale_inv = quantized[2][2] * 2.0
        o_scale = torch.reciprocal(o_scale_inv)
        qf, kf, vf = (data for data, _, _, _ in quantized)
        # Without a backward, no softmax statistics: cuDNN's FP8 forward runs 1-3.5% faster
        # without them (benchmarks/results/gpu_checks.md). (Its bf16 forward does not, so
        # _FusedAttention always asks for them.)
        o8, lse, _, _ = ops.attention_forward_fp8(qf, kf, vf, descales, s_scales, cu_q, cu_kv, rng,
                                               *params, o_scale, torch.uint8, not grad)
        if out_fp8:
            flat = o8.view(*o8.shape[:-2], o8.shape[-2] * o8.shape[-1])
            o = Float8Tensor(flat, o_scale_inv, "float8_e4m3", q.dtype)
        else:
            o = ops.dequantize(o8, o_scale_inv, "float8_e4m3", "tensor", q.dtype)
        # The backward runs in FP8 on what the forward ran on: the E4M3 q, k, v and o (their
        # descales in one [4] tensor), softmax_lse and the softmax factors.
        ctx.save_for_backward(qf, kf, vf, o8, lse, torch.cat([descales, o_scale_inv]), s_scales,
                              cu_q, cu_kv, rng)
        ctx.fp8_grads = _grads_in_fp8(params[-1], q.device)
        # Only a backward reads them (one more pass over v; the bounds of q and k).
        ctx.v_norm = None
        if grad:
            ctx.v_norm = _max_row_norm(v.dequantize() if isinstance(v, Float8Tensor) else v)
        ctx.amax_qk = None
        if grad and ctx.fp8_grads:
            ctx.amax_qk = _operand_bound(torch.cat([quantized[0][3], quantized[1][3]]),
                                         descales[:2], "float8_e4m3")
        ctx.qkv_shapes = (q.shape, k.shape)
        ctx.params, ctx.deterministic, ctx.dtype = params, deterministic, q.dtype
        # Attributes, not saved tensors: the backward updates them in place.
        ctx.bwd_meta, ctx.plan, ctx.recipe, ctx.group = bwd_meta, plan, recipe, group
        return o

    @staticmethod
    def backward(ctx, d_o):
        qf, kf, vf, o8, lse, descales, s_scales, cu_q, cu_kv, rng = ctx.saved_tensors
        d_o = d_o.reshape(o8.shape)  # an FP8 o left flattened over the heads
        plan = ctx.plan
        fmt = plan.bwd_dtype
        history, scale, _ = ctx.bwd_meta if plan.kind == "delayed" else (None, None, None)
        do8, _, do_scale_inv, amax_do = _quantize(plan, d_o, fmt, scale, _DO_COLUMN, history)
        amax_do = _operand_bound(amax_do, do_scale_inv, fmt) if ctx.fp8_grads else None
        if plan.kind == "delayed":
            update_backward(ctx.bwd_meta, plan, ctx.recipe, ctx.group)
        dp_scales, grad_scales = _backward_scales(ctx, _max_row_norm(d_o), amax_do, fmt)
        grad_dtype = torch.uint8 if ctx.fp8_grads else ctx.dtype
        dq, dk, dv, _, _ = ops.attention_backward_fp8(
            qf, kf, vf, o8, do8, lse, torch.cat([descales, do_scale_inv]), s_scales, dp_scales,
            cu_q, cu_kv, rng, *ctx.params[:-1], ctx.deterministic, ctx.params[-1], fmt,
            grad_scales, grad_dtype)
        if ctx.fp8_grads:
            dq, dk, dv = (ops.dequantize(g, 1.0 / grad_scales[i:i + 1], fmt, "tensor", ctx.dtype)
                          for i, g in enumerate((dq, dk, dv)))
        return dq, dk, dv, None, None, None, None, None, None, None


def fused_attention_fp8(q, k, v, cu_q, cu_kv, rng, params: Params, deterministic: bool,
                        plan: Plan, scales: Optional[torch.Tensor] = None,
                        history: Optional[torch.Tensor] = None, bwd_meta: Optional[tuple] = None,
                        recipe: Any = None, group: Any = None, out_fp8: bool = False):
    """Attention in FP8: q, k, v and o in E4M3; the backward quantizes d_o to the plan's
    gradient format (E5M2 under HYBRID) and returns gradients in q's dtype (see
    _backward_scales for the other factors). q, k, v may be E4M3 Float8Tensors (per tensor),
    used as they are; ``out_fp8`` returns o as a Float8Tensor flattened over the heads
    ([..., heads * head_dim_v]) instead of widening it.

    ``plan.kind`` "delayed" quantizes q, k, v with ``scales`` columns 0, 1, 3 and raises those
    columns of ``history`` (None: record nothing, a checkpoint's recompute); the backward
    quantizes d_o with column 1 of ``bwd_meta`` = (history, scale, scale_inv) and then updates
    those scales (through ``recipe`` and ``group`` when given: user callables or an amax
    group). "current" scales each tensor by its own amax and takes none of them."""
    if plan.kind not in ("delayed", "current"):
        raise ValueError(f"fused_attention_fp8: plan.kind must be 'delayed' or 'current', got "
                         f"{plan.kind!r}")
    if plan.kind == "delayed" and (scales is None or bwd_meta is None):
        raise ValueError("fused_attention_fp8: delayed scaling must be given scales and "
                         f"bwd_meta, got {type(scales).__name__} and {type(bwd_meta).__name__}")
    # Whether a backward can follow, read here: inside the Function's forward grad mode is off,
    # and ctx.needs_input_grad says True under no_grad for inputs that require grad.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _FusedAttentionFP8.apply(q, k, v, cu_q, cu_kv, rng, scales, history, bwd_meta,
                                    (params, deterministic, plan, recipe, group, out_fp8, grad))


class _ScaledSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, mask_type, scale):
        y = ops.scaled_softmax_forward(x, mask, mask_type, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return ops.scaled_softmax_backward(dy.contiguous(), y, ctx.scale), None, None, None


def _lengths(cu: Optional[torch.Tensor], batch: int, seqlen: int, device) -> torch.Tensor:
    if cu is None or cu.numel() == 0:
        return torch.full((batch,), seqlen, dtype=torch.int64, device=device)
    return (cu[1:] - cu[:-1]).to(torch.int64)


def _softmax_mask(mask: str, window: tuple[int, int], lq, lk, sq: int, skv: int, padding: bool,
                  device, explicit: bool = False) -> tuple[str, torch.Tensor]:
    """The softmax's mask kind and its uint8 mask [b or 1, 1, sq, skv] (nonzero = masked);
    with ``explicit``, always the "arbitrary" kind and its whole mask (no kind implied)."""
    left, right = window
    causal = "causal" in mask
    bottom_right = mask.endswith("bottom_right")
    if causal:
        right = 0
    if not padding and left < 0 and not explicit:
        if right < 0:
            return "none", torch.empty((0,), dtype=torch.uint8, device=device)
        if right == 0:
            return ("causal_bottom_right" if bottom_right else "causal",
                    torch.empty((0,), dtype=torch.uint8, device=device))
    i = torch.arange(sq, device=device).view(1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, skv)
    lq, lk = lq.view(-1, 1, 1), lk.view(-1, 1, 1)
    diag = i + (lk - lq if bottom_right else 0)
    allowed = (i < lq) & (j < lk)
    if left >= 0:
        allowed = allowed & (j >= diag - left)
    if right >= 0:
        allowed = allowed & (j <= diag + right)
    return "arbitrary", (~allowed).unsqueeze(1).to(torch.uint8)


def _pad_thd(x: torch.Tensor, cu: torch.Tensor, seqlen: int):
    """THD [t, h, d] -> [b, h, s, d] (zeros past each length) and the gather index."""
    batch = cu.shape[0] - 1
    pos = torch.arange(seqlen, device=x.device).view(1, seqlen)
    lengths = (cu[1:] - cu[:-1]).view(batch, 1).to(torch.int64)
    valid = pos < lengths
    index = (cu[:-1].view(batch, 1).to(torch.int64) + pos).clamp(max=max(x.shape[0] - 1, 0))
    padded = x[index] * valid.view(batch, seqlen, 1, 1).to(x.dtype)
    return padded.transpose(1, 2), index, valid


def _softmax_with_sink(scores: torch.Tensor, masked: torch.Tensor, scale: float,
                       sink: torch.Tensor) -> torch.Tensor:
    """softmax(scale * scores) over each row's unmasked keys and one more logit, the row's
    head's ``sink`` (an attention sink: it takes a share of the weight and has no value), in
    fp32, in scores' dtype: p_j = exp(x_j) / (exp(sink_h) + sum_i exp(x_i)). A row whose keys
    are all masked gives zeros (the sink takes all), not NaN. ``masked``: uint8, nonzero =
    masked, broadcast over [b, h, sq, skv]; ``sink``: [h] (0 for NVIDIA's "off-by-one")."""
    logits = scores.float() * scale
    if masked.numel():
        logits = logits.masked_fill(masked.bool(), float("-inf"))
    column = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    p = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    return p.to(scores.dtype)


def unfused_attention(q, k, v, layout: str, mask: str, window: tuple[int, int],
                      softmax_scale: float, dropout: float, cu_q, cu_kv, max_seqlen_q: int,
                      max_seqlen_kv: int, attention_mask: Optional[torch.Tensor] = None,
                      bias: Optional[attention_bias.Bias] = None,
                      sink: Optional[torch.Tensor] = None):
    """o = attention(q, k, v) as matmul -> scaled masked softmax -> dropout -> matmul, in q's
    layout and dtype. attention_mask (bool, True = masked, [b or 1, h or 1, sq, skv]) is the
    mask itself for the "arbitrary" mask type. ``bias`` is added to the scores (in fp32) before
    or after the scale, as attention_bias.py says. ``sink`` ([h], one logit per query head):
    the softmax's denominator has one more term per row (_softmax_with_sink), in torch ops
    (autograd differentiates it, the sink included)."""
    if layout == "thd":
        qh, q_index, q_valid = _pad_thd(q, cu_q, max_seqlen_q)
        kh, _, _ = _pad_thd(k, cu_kv, max_seqlen_kv)
        vh, _, _ = _pad_thd(v, cu_kv, max_seqlen_kv)
    elif layout == "bshd":
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    else:
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    batch, heads, sq, _ = qh.shape
    skv = kh.shape[2]
    group = heads // kh.shape[1]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2))
    if mask == "arbitrary":
        kind, m = "arbitrary", attention_mask.to(torch.uint8)
        if m.dim() != 4 or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads):
            raise ValueError(f"DotProductAttention: attention_mask must be [{batch} or 1, "
                             f"{heads} or 1, {sq}, {skv}] (batch, heads, sq, skv) for the "
                             f"arbitrary mask, got {list(m.shape)}")
        m = m.expand(m.shape[0], m.shape[1], sq, skv)
    else:
        padding = layout == "thd" or mask.startswith("padding")
        lq = _lengths(cu_q if padding else None, batch, sq, q.device)
        lk = _lengths(cu_kv if padding else None, batch, skv, q.device)
        kind, m = _softmax_mask(mask, window, lq, lk, sq, skv, padding, q.device,
                                explicit=sink is not None)
    scale = softmax_scale
    if bias is not None:
        scores, scale = attention_bias.add(scores, bias, softmax_scale)
    if sink is not None:
        p = _softmax_with_sink(scores, m, scale, sink)
    else:
        p = _ScaledSoftmax.apply(scores.contiguous(), m.contiguous(), kind, scale)
    if p.dtype != vh.dtype:  # (fp32 scores of a bias)
        p = p.to(vh.dtype)
    if dropout > 0.0:
        p = torch.nn.functional.dropout(p, dropout, training=True)
    o = torch.matmul(p, vh)  # [b, h, sq, dv]
    if layout == "bshd":
        return o.transpose(1, 2).contiguous()
    if layout == "sbhd":
        return o.permute(2, 0, 1, 3).contiguous()
    rows = o.transpose(1, 2)[q_valid]  # [valid tokens, h, dv] in packing order
    out = o.new_zeros((q.shape[0], heads, o.shape[-1]))
    return out.index_put((q_index[q_valid],), rows)
