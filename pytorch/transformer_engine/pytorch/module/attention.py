"""DotProductAttention: softmax(q k^T * scale + mask) v, on the fused or the unfused path,
over the backend that ``_attention_backend.py`` chooses; the checks of its inputs."""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import torch

from transformer_engine.common.recipe import Format, Recipe

from .. import attention_bias, distributed, ops, padded_packing
from .. import fp8 as _fp8
from ..attention_fn import fused_attention, fused_attention_fp8, unfused_attention
from ..checkpoint import checkpoint
from ..dropout_add_fn import rng_state
from ..float8_tensor import Float8Tensor, to_high_precision
from ..fp8 import STATE
from ..ops.attention import LAYOUTS, MASKS
from ..quantization import kind_of, record_amax
from ._attention_backend import (
    _CHOICES,
    BACKENDS,
    AttentionBackend,
    _fp8_falls_back,
    backend_key,
    choose_backend,
    env_backend,
)
from ._checks import check_sizes, refuse_non_defaults
from .base import FP8Module
from .linear import _default_device

__all__ = ["AttentionBackend", "DotProductAttention", "get_attention_backend"]

# NVIDIA TE's softmax variants: the plain one, and with an attention sink (one more logit in
# each row's denominator, no value): fixed at 0 ("off-by-one") or learned per head.
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def resolve_window(mask: str, window) -> tuple[int, int]:
    if window is None:
        window = (-1, -1)
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"DotProductAttention: window_size must be (left, right) with each >= -1 "
                         f"(-1: unbounded), got {window}")
    return (left, 0) if "causal" in mask else (left, right)


def _check_inputs(q, k, v, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"DotProductAttention: qkv_format must be one of {LAYOUTS}, got "
                         f"{layout!r}")
    rank = 3 if layout == "thd" else 4
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != rank:
            raise ValueError(f"DotProductAttention: {name} must have {rank} dimensions for "
                             f"qkv_format {layout!r}, got shape {list(t.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"DotProductAttention: query and key must have the same head dim, got "
                         f"{q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0 or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"DotProductAttention: query heads ({q.shape[-2]}) must be a multiple of "
                         f"key heads ({k.shape[-2]}), and value must have key's heads "
                         f"({v.shape[-2]} given)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"DotProductAttention: query, key and value must share a dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    # A meta tensor has no data for the kernels (get_device() is -1 for it and the CPU alike).
    if (q.is_meta or k.is_meta or v.is_meta
            or not q.get_device() == k.get_device() == v.get_device()):
        raise RuntimeError(f"DotProductAttention: query, key and value must be on one CPU or "
                           f"CUDA device, got {q.device}, {k.device}, {v.device}")


def _check_mask(attention_mask, mask: str, layout: str, q, k) -> None:
    """attention_mask as the mask types that read it take it: bool, True = masked out (a
    float mask could mean 1 = keep, or an additive bias; either would be misread), and for the
    padding masks [b, 1, 1, s] per side (a pair (q_mask, kv_mask) when sq != skv)."""
    masks = attention_mask if isinstance(attention_mask, tuple) else (attention_mask,)
    for m in masks:
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"DotProductAttention: attention_mask must be a bool tensor (or, "
                            f"for the padding masks, a pair of them), got {type(m).__name__}")
        if m.dtype != torch.bool:
            raise TypeError(f"DotProductAttention: attention_mask must have dtype torch.bool "
                            f"(True = masked out), got {m.dtype}")
    if mask == "arbitrary":
        if isinstance(attention_mask, tuple):
            raise TypeError("DotProductAttention: attention_mask must be one bool tensor "
                            "[b or 1, h or 1, sq, skv] for the arbitrary mask, got a tuple")
        return
    batch, sq, skv = ((q.shape[0], q.shape[1], k.shape[1]) if layout == "bshd"
                      else (q.shape[1], q.shape[0], k.shape[0]))
    if len(masks) == 1:
        if sq != skv:
            raise ValueError(f"DotProductAttention: attention_mask must be a pair (q_mask "
                             f"[{batch}, 1, 1, {sq}], kv_mask [{batch}, 1, 1, {skv}]) when the "
                             f"query and key lengths differ, got one of shape "
                             f"{list(masks[0].shape)}")
        masks = masks * 2
    if len(masks) != 2:
        raise ValueError(f"DotProductAttention: attention_mask must be a tensor or a pair "
                         f"(q_mask, kv_mask), got a tuple of {len(masks)}")
    for side, m, s in (("q_mask", masks[0], sq), ("kv_mask", masks[1], skv)):
        if list(m.shape) != [batch, 1, 1, s]:
            raise ValueError(f"DotProductAttention: attention_mask ({side}) must have shape "
                             f"[{batch}, 1, 1, {s}] (batch, 1, 1, seqlen; True = padded) for "
                             f"attn_mask_type {mask!r} with qkv_format {layout!r}, got "
                             f"{list(m.shape)}")


def _cu_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cu_seqlens from a padding mask [b, 1, 1, s] (True = padded position)."""
    lengths = (~attention_mask.bool()).reshape(attention_mask.shape[0], -1).sum(dim=1)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def get_attention_backend(query, key, value, *, qkv_format: str = "sbhd",
                          attn_mask_type: str = "causal", window_size=None,
                          softmax_scale: Optional[float] = None, attention_dropout: float = 0.0,
                          cu_seqlens_q=None, max_seqlen_q: Optional[int] = None,
                          max_seqlen_kv: Optional[int] = None, fp8: bool = False,
                          attention_backend: Optional[str] = None) -> AttentionBackend:
    """Which backend DotProductAttention would run for these inputs, and why not the others.
    A backward is assumed when any input requires grad; ``fp8`` asks about FP8 attention under
    the default recipe (HYBRID: E5M2 gradients)."""
    _check_inputs(query, key, value, qkv_format)
    window = resolve_window(attn_mask_type, window_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    k = backend_key(query, key, value, qkv_format, attn_mask_type, window, scale, attention_dropout,
             cu_seqlens_q, max_seqlen_q or 0, max_seqlen_kv or 0,
             Format.HYBRID.bwd_dtype_name if fp8 else "")
    grad = any(t.requires_grad for t in (query, key, value))
    asked = attention_backend or env_backend()
    choose_backend(k, grad, asked)
    return _CHOICES[(k, grad, asked)]


def _runs_fp8(recipe: Optional[Recipe]) -> bool:
    """Whether attention runs in FP8 under ``recipe``: delayed or current scaling that asks
    for it with ``fp8_dpa`` (the other recipes have no such field)."""
    return bool(recipe is not None and getattr(recipe, "fp8_dpa", False)
                and kind_of(recipe) in ("delayed", "current"))


def _diagonal(op: str, mask: str, bottom_right: Optional[bool]) -> str:
    """The mask type under NVIDIA's ``bottom_right_diagonal`` (None: the type's own)."""
    if bottom_right is None or "causal" not in mask:
        return mask
    if not isinstance(bottom_right, bool):
        raise TypeError(f"{op}: bottom_right_diagonal must be None or a bool, got "
                        f"{bottom_right!r}")
    top_left = mask.removesuffix("_bottom_right")
    return top_left + "_bottom_right" if bottom_right else top_left


def _forked(attend, tracker):
    def forked(*args):
        with tracker().fork():
            return attend(*args)
    return forked


class DotProductAttention(FP8Module):
    """Multi-head dot-product attention of already projected heads (no weights).

    Args:
        num_attention_heads: query heads.
        kv_channels: head dim of q and k (an int), or (head_dim_qk, head_dim_v).
        num_gqa_groups: key/value heads (GQA; 1 is MQA); default num_attention_heads.
        attention_dropout: dropout probability of the attention weights (training only).
        qkv_format: ``"sbhd"``, ``"bshd"`` or ``"thd"`` (packed, with cu_seqlens).
        attn_mask_type: one of ``no_mask``, ``causal``, ``causal_bottom_right``, ``padding``,
            ``padding_causal``, ``padding_causal_bottom_right``, ``arbitrary``.
        window_size: (left, right) sliding window, -1 for an unbounded side; causal masks
            force right = 0.
        softmax_scale: default 1 / sqrt(head_dim_qk).
        layer_number, attention_type: kept for API compatibility ("self" or "cross").
        bottom_right_diagonal: NVIDIA's switch of the causal diagonal: True makes the causal
            masks bottom-right aligned (``causal`` -> ``causal_bottom_right``, ``padding_causal``
            -> ``padding_causal_bottom_right``), False top-left; None keeps the mask type's.
        sequence_parallel, tp_size, get_rng_state_tracker, tp_group: NVIDIA's tensor
            parallelism of the block around it (Megatron-LM's): ``num_attention_heads`` and
            ``num_gqa_groups`` count every rank's heads, and this module attends this rank's
            ``1 / tp_size`` of them (``tp_size`` is ``tp_group``'s size when a group is given);
            then the attributes ``num_attention_heads`` and ``num_gqa_groups`` hold the local
            counts. Attention dropout draws from ``get_rng_state_tracker()``'s ``fork()``
            (each rank's heads their own masks) when a tracker is given and
            ``sequence_parallel`` is False, as in NVIDIA TE.
        softmax_type: ``"vanilla"``; ``"off-by-one"`` or ``"learnable"`` add an attention
            sink, one more logit per row in the softmax's denominator that has no value:
            p_j = exp(x_j) / (exp(s_h) + sum_i exp(x_i)), with s_h = 0 (off-by-one) or the
            parameter ``softmax_offset`` [h] (fp32, learnable, starting at 0). Sinks run on the
            unfused path (matmuls and a softmax in torch ops, in fp32), not in the fused
            attention, and not in FP8 or with context parallelism (both raise).
        return_max_logit: False only (the logits' maximum is not implemented); name: kept.
        deterministic: ask the backward for a deterministic dk/dv reduction.
        attention_backend: ``None`` (auto, or ``TE_ATTENTION_BACKEND``) or one of ``BACKENDS``.
        device: where the delayed-scaling state lives (default: the current CUDA device when
            there is one, else the CPU); it follows ``.to()``.

    The output is [s, b, h * dv] for sbhd, [b, s, h * dv] for bshd, [t, h * dv] for thd.
    Under ``fp8_autocast`` with ``fp8_dpa=True`` the fused path runs in FP8: q, k, v in E4M3,
    and the backward takes the output gradient in the recipe's gradient format (E5M2 under
    HYBRID). ``DelayedScaling`` quantizes them with scales from the amaxes of earlier steps,
    kept in this module's state as in every te module (updated at the outermost autocast exit,
    the gradient's in the backward, saved in the state dict); ``Float8CurrentScaling`` with
    scales from their own amax. With ``fp8_mha=True`` too, q, k, v may come as E4M3
    :class:`Float8Tensor` (e.g. from ``te.Linear(..., fp8_output=True)``), used without a
    cast, and the output leaves as a Float8Tensor that ``te.Linear`` takes without one:
    :class:`MultiheadAttention` wires this up.

    The state is that of two GEMMs, attention's own: GEMM 0 is q @ k^T (forward columns 0 = q
    as its "input", 1 = k as its "weight"), GEMM 1 is p @ v (forward column 2 = p, unused: p's
    scale is fixed at the E4M3 maximum since p is in [0, 1]; column 3 = v). Backward column 1
    is the output gradient d_o; column 0 (ds, the logits' gradient) is unused, its scale comes
    from a bound on the data, as do o's (from v's scale) and the FP8 gradients'.

    Example:
        >>> attn = DotProductAttention(4, 16, qkv_format="bshd")  # doctest: +SKIP
        >>> q = k = v = torch.randn(2, 8, 4, 16)  # doctest: +SKIP
        >>> attn(q, k, v).shape  # doctest: +SKIP
        torch.Size([2, 8, 64])
    """

    # NVIDIA's state has three GEMMs' columns, q, k and v sharing one (module/_nvidia_state.py)
    _nvidia_layout = "attention"
    # p's scale is fixed (column 2) and the backward quantizes d_o alone (column 1): the
    # columns no cast writes (attention_fn.py).
    _UNWRITTEN = {"amax_history_fwd": (2,), "amax_history_bwd": (0,)}

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: Optional[tuple[int, int]] = None, *,
                 bottom_right_diagonal: Optional[bool] = None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None,
                 softmax_type: str = "vanilla", return_max_logit: bool = False,
                 name: Optional[str] = None, deterministic: bool = False,
                 attention_backend: Optional[str] = None,
                 device: Union[torch.device, str, None] = None) -> None:
        # (keyword-only after window_size: NVIDIA TE's releases order what follows differently,
        # so a positional argument there would not mean one thing)
        refuse_non_defaults("DotProductAttention", "the logits' maximum is not implemented",
                            return_max_logit=(return_max_logit, False))
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"DotProductAttention: softmax_type must be one of {SOFTMAX_TYPES}, "
                             f"got {softmax_type!r}")
        dims = (kv_channels, kv_channels) if isinstance(kv_channels, int) else tuple(kv_channels)
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        # NVIDIA's tp_size / tp_group: the heads of every rank, this rank attends its share
        # (given only the group, its size)
        if tp_group is not None and tp_size == 1:
            tp_size = distributed.group_size("DotProductAttention", tp_group)
        tp = distributed.check_tensor_parallel("DotProductAttention", tp_group, tp_size, "column")
        num_attention_heads, groups = (
            distributed.check_divisible("DotProductAttention", name, value, tp)
            for name, value in (("num_attention_heads", num_attention_heads),
                                ("num_gqa_groups", groups)))
        attn_mask_type = _diagonal("DotProductAttention", attn_mask_type, bottom_right_diagonal)
        if len(dims) != 2:
            raise ValueError(f"DotProductAttention: kv_channels must be an int or a pair "
                             f"(head_dim_qk, head_dim_v), got {kv_channels!r}")
        check_sizes("DotProductAttention", num_attention_heads=num_attention_heads,
                    kv_channels=dims[0], num_gqa_groups=groups)
        check_sizes("DotProductAttention", kv_channels=dims[1])
        super().__init__(_default_device(device), num_gemms=2)
        if num_attention_heads % groups != 0:
            raise ValueError(f"DotProductAttention: num_attention_heads ({num_attention_heads}) "
                             f"must be a multiple of num_gqa_groups ({groups})")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"DotProductAttention: attention_dropout must be in [0, 1), got "
                             f"{attention_dropout}")
        _check_names(qkv_format, attn_mask_type, attention_backend)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"DotProductAttention: attention_type must be 'self' or 'cross', got "
                             f"{attention_type!r}")
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.head_dim_qk, self.head_dim_v = dims
        self.attention_dropout = attention_dropout
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.window_size = window_size
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(dims[0]))
        self.layer_number, self.attention_type = layer_number, attention_type
        self.deterministic = deterministic
        self.attention_backend = attention_backend
        self.tp_size, self.sequence_parallel, self.name = tp, bool(sequence_parallel), name
        self.get_rng_state_tracker = get_rng_state_tracker
        self.softmax_type = softmax_type
        self._make_sink(softmax_type, _default_device(device))
        self._cp = None
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _make_sink(self, softmax_type: str, device: torch.device) -> None:
        """``softmax_offset``: the attention sink's logit of each (local) query head, fp32 [h]
        as NVIDIA TE keeps it. ``"learnable"``: a parameter, starting at 0 (a sink that weighs
        as much as one key of logit 0); ``"off-by-one"``: zeros that no step changes, a buffer
        outside the state dict; ``"vanilla"``: None."""
        self.softmax_offset = None
        if softmax_type == "vanilla":
            return
        zeros = torch.zeros(self.num_attention_heads, dtype=torch.float32, device=device)
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(zeros)
        else:
            del self.softmax_offset
            self.register_buffer("softmax_offset", zeros, persistent=False)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Splits the sequence over ``cp_group`` (context_parallel.py; None or a group of one
        rank: not split; ``"a2a+p2p"``: the pair [all-to-all group, ring group]).
        ``cp_global_ranks`` and ``cp_stream`` are accepted and unused (the communication runs
        on the current stream). ``cp_comm_type``: ``"p2p"`` a ring of k/v blocks,
        ``"all_gather"`` k and v gathered, ``"a2a"`` the heads split by all-to-all,
        ``"a2a+p2p"`` both; every type computes the same rows (FP8 attention gathers k and v,
        with a warning, under every type)."""
        from ..context_parallel import ContextParallel, check_comm_type

        check_comm_type(cp_comm_type)
        cp = None if cp_group is None else ContextParallel(cp_group, cp_comm_type)
        self._cp = cp if cp is not None and cp.size > 1 else None
        # NVIDIA's attribute, read back by Megatron-LM when it changes the group per batch
        self.cp_comm_type = cp_comm_type

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                pad_between_seqs: Optional[bool] = None, fp8_output: bool = False,
                num_splits: Optional[int] = None, *, attention_backend=None, query=None,
                key=None, value=None, _packed: Optional[tuple] = None):
        """Attention of ``query_layer``, ``key_layer``, ``value_layer`` (NVIDIA's names and
        order; ``query``, ``key``, ``value`` are accepted as keywords too).

        ``checkpoint_core_attention``: recompute attention in the backward (te.checkpoint)
        instead of keeping its activations; inside a checkpoint of an enclosing block it is
        recomputed already. ``fast_zero_fill`` is accepted (padded rows are always zeros).
        ``core_attention_bias_type`` with ``core_attention_bias`` or ``alibi_slopes``: an
        additive bias (attention_bias.py) on the unfused path, in high precision. Padded packed
        sequences, ``inference_params`` (use te.MultiheadAttention's) and ``fp8_output``
        outside ``fp8_mha`` are not implemented: they raise. ``num_splits`` (NVIDIA's split of
        the keys over several FlashAttention-3 kernels) takes None or 1: no backend here splits
        them. (``_packed``: te.MultiheadAttention's (qkv, views) when q, k, v are those
        views of its projection's output, for a traced step: attention_fn.fused_attention.)"""
        if num_splits is not None and num_splits != 1:
            # refused, not ignored: split keys merge partial results, which round otherwise
            raise NotImplementedError(f"DotProductAttention: num_splits={num_splits} is not "
                                      f"implemented: the keys are attended in one pass here "
                                      f"(None or 1)")
        query = _one_of("query_layer", query_layer, "query", query)
        key = _one_of("key_layer", key_layer, "key", key)
        value = _one_of("value_layer", value_layer, "value", value)
        padded = padded_packing.forward_args("DotProductAttention", pad_between_seqs,
                                             cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                             qkv_format or self.qkv_format)
        bias = None
        if attention_bias.check_type("DotProductAttention", core_attention_bias_type,
                                     core_attention_bias, alibi_slopes):
            bias = (core_attention_bias_type, core_attention_bias, alibi_slopes)
            if self._cp is not None:
                raise NotImplementedError("DotProductAttention: an attention bias with "
                                          "context parallelism is not implemented")
        if self.softmax_offset is not None and self._cp is not None:
            raise NotImplementedError(f"DotProductAttention: softmax_type="
                                      f"{self.softmax_type!r} (attention sinks) with context "
                                      "parallelism is not implemented: the ranks' partial "
                                      "softmaxes would each count the sink")
        if inference_params is not None:
            raise NotImplementedError("DotProductAttention: inference_params is not "
                                      "implemented here (only None); te.MultiheadAttention "
                                      "takes it and keeps the KV cache")
        if fp8_output:
            state = STATE
            if not (state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_mha):
                raise NotImplementedError("DotProductAttention: fp8_output=True is supported "
                                          "only under fp8_autocast with a recipe that has "
                                          "fp8_dpa=True and fp8_mha=True (the output is FP8 "
                                          "there anyway); got it outside one")
        args = (query, key, value, attention_mask, qkv_format, cu_seqlens_q, cu_seqlens_kv,
                max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size, attention_backend,
                bias, padded)
        recompute = _fp8.RECOMPUTE
        attend = self._attend if self._cp is None else self._attend_context_parallel
        if _packed is not None and self._cp is None:
            attend = functools.partial(self._attend, packed=_packed)
        tracker = self.get_rng_state_tracker
        if (tracker is not None and not self.sequence_parallel and self.training
                and self.attention_dropout > 0):
            # this rank's heads draw their dropout masks from the tracker's stream (NVIDIA's)
            attend = _forked(attend, tracker)
        # Inside a checkpoint of an enclosing block attention is recomputed already (and
        # checkpoints do not nest).
        if (checkpoint_core_attention and torch.is_grad_enabled()
                and recompute.recording is None and not recompute.replaying):
            return checkpoint(attend, *args, get_rng_state_tracker=tracker)
        return attend(*args)

    def _attend_context_parallel(self, query, key, value, attention_mask, qkv_format,
                                 cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                 attn_mask_type, window_size, attention_backend, bias=None,
                                 padded=None):
        """This rank's rows of attention over the sequence split across the group."""
        from ..context_parallel import attend, attend_packed

        window = window_size if window_size is not None else self.window_size
        layout = qkv_format or self.qkv_format
        if layout == "thd":  # the global cu_seqlens in, this rank's rows out

            def attend_padded(q, k, v, mask, cu_q, cu_kv, cu_qp, cu_kvp, max_q, max_kv):
                return self._attend(q, k, v, None, "thd", cu_q, cu_kv, max_q, max_kv, mask,
                                    None, attention_backend, None, (cu_qp, cu_kvp))

            return attend_packed(attend_padded, self._cp, query, key, value, attention_mask,
                                 window, attn_mask_type or self.attn_mask_type, cu_seqlens_q,
                                 cu_seqlens_kv, padded, max_seqlen_q, max_seqlen_kv)
        if (attention_mask is not None or cu_seqlens_q is not None or cu_seqlens_kv is not None
                or padded is not None or window not in (None, (-1, -1), (-1, 0))):
            raise NotImplementedError("DotProductAttention: context parallelism of sbhd/bshd "
                                      "takes no attention_mask, cu_seqlens or sliding window "
                                      "here (packed sequences: qkv_format 'thd')")

        def one(q, k, v, mask):
            return self._attend(q, k, v, None, layout, None, None, None, None, mask, None,
                                attention_backend)

        state = STATE
        fp8 = state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_dpa
        return attend(one, self._cp, query, key, value, layout,
                      attn_mask_type or self.attn_mask_type, self.softmax_scale,
                      self.attention_dropout if self.training else 0.0, bool(fp8))

    def _attend(self, query, key, value, attention_mask, qkv_format, cu_seqlens_q,
                cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
                attention_backend, bias=None, padded=None, packed=None):
        if padded is not None:
            return self._attend_padded(query, key, value, attention_mask, qkv_format,
                                       cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                       attn_mask_type, window_size, attention_backend, padded)
        layout = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        asked = attention_backend or self.attention_backend or env_backend()
        _check_names(layout, mask, asked)
        _check_inputs(query, key, value, layout)
        if query.shape[-2] != self.num_attention_heads or key.shape[-2] != self.num_gqa_groups:
            raise ValueError(f"DotProductAttention: query/key heads must be "
                             f"{self.num_attention_heads}/{self.num_gqa_groups}, got "
                             f"{query.shape[-2]}/{key.shape[-2]}")
        window = resolve_window(mask, window_size if window_size is not None else self.window_size)
        padding = layout == "thd" or mask.startswith("padding")
        from_mask = padding and cu_seqlens_q is None and layout != "thd"
        if attention_mask is not None and (from_mask or mask == "arbitrary"):
            _check_mask(attention_mask, mask, layout, query, key)
        if from_mask and attention_mask is not None:
            q_mask, kv_mask = (attention_mask if isinstance(attention_mask, tuple)
                               else (attention_mask, attention_mask))
            cu_seqlens_q, cu_seqlens_kv = _cu_from_mask(q_mask), _cu_from_mask(kv_mask)
        if padding and (cu_seqlens_q is None or cu_seqlens_kv is None):
            raise ValueError(f"DotProductAttention: attn_mask_type {mask!r} with qkv_format "
                             f"{layout!r} needs cu_seqlens_q and cu_seqlens_kv (or a padding "
                             "attention_mask for bshd/sbhd)")
        if padding:  # both paths index with them on q's device
            for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
                _check_cu_seqlens(name, cu)
            cu_seqlens_q = cu_seqlens_q.to(device=query.device, dtype=torch.int32)
            cu_seqlens_kv = cu_seqlens_kv.to(device=query.device, dtype=torch.int32)
        if mask == "arbitrary" and attention_mask is None:
            raise ValueError("DotProductAttention: attn_mask_type 'arbitrary' needs attention_mask")
        if layout == "thd" and (max_seqlen_q is None or max_seqlen_kv is None):
            raise ValueError("DotProductAttention: qkv_format 'thd' needs max_seqlen_q and "
                             "max_seqlen_kv (the longest sequence of each)")
        dropout = self.attention_dropout if self.training else 0.0
        if bias is not None or self.softmax_offset is not None:
            return self._attend_unfused_only(query, key, value, attention_mask, layout, mask,
                                             window, dropout, asked, bias, cu_seqlens_q,
                                             cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                             padding)
        recipe = self._fp8_recipe_of_call(query, key, value)
        if recipe is None or not all(_takes_fp8(t) for t in (query, key, value)):
            # FP8 inputs go as they are only into FP8 attention and only as E4M3 per tensor
            query, key, value = (to_high_precision(t) for t in (query, key, value))
        # The recipe's gradient format is d_o's in the FP8 backward (E5M2 under HYBRID).
        fp8_grad = recipe.fp8_format.bwd_dtype_name if recipe is not None else ""
        key_ = backend_key(query, key, value, layout, mask, window, self.softmax_scale, dropout,
                    cu_seqlens_q, max_seqlen_q or 0, max_seqlen_kv or 0, fp8_grad)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        name = choose_backend(key_, grad, asked)
        # Only a slow or missing FP8 choice can fall back: the usual cuDNN call skips this.
        if (recipe is not None and name in ("cuda_math", "!")
                and _fp8_falls_back(key_, grad, asked, query.is_cuda)):
            query, key, value = (to_high_precision(t) for t in (query, key, value))
            recipe, key_ = None, key_[:-1] + ("",)
            name = choose_backend(key_, grad, asked)
        if name == "!":
            raise RuntimeError(f"DotProductAttention: no backend can run this call (asked "
                               f"{asked}): {_CHOICES[(key_, grad, asked)].reasons}")
        if not padding:
            cu_seqlens_q = cu_seqlens_kv = None
        if name == "unfused":
            query, key, value = (to_high_precision(t) for t in (query, key, value))
            o = unfused_attention(query, key, value, layout, mask, window, self.softmax_scale,
                                  dropout, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q or 0,
                                  max_seqlen_kv or 0, attention_mask)
        else:
            o = self._fused(query, key, value, layout, mask, window, dropout, cu_seqlens_q,
                            cu_seqlens_kv, max_seqlen_q or 0, max_seqlen_kv or 0, name, recipe,
                            packed)
            if isinstance(o, Float8Tensor):  # fp8_mha: flattened over the heads already
                return o
        return o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1])

    def _attend_padded(self, query, key, value, attention_mask, layout, cu_seqlens_q,
                       cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
                       attention_backend, padded: tuple):
        """Packed sequences with padding between them (padded_packing.py)."""
        op = "DotProductAttention"
        state = STATE
        if state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_mha:
            raise NotImplementedError(f"{op}: padding between packed sequences "
                                      "(cu_seqlens_*_padded) with fp8_mha=True is not "
                                      "implemented (the output would have to be permuted in "
                                      "FP8); use fp8_mha=False")
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"{op}: cu_seqlens_q_padded / cu_seqlens_kv_padded come with "
                             "cu_seqlens_q and cu_seqlens_kv (each sequence's own lengths)")

        def attend_packed(q, k, v):
            return self._attend(q, k, v, attention_mask, layout, cu_seqlens_q, cu_seqlens_kv,
                                max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
                                attention_backend)

        return padded_packing.attend(op, attend_packed, *(to_high_precision(t) for t in
                                                          (query, key, value)),
                                     cu_seqlens_q, cu_seqlens_kv, padded)

    def _attend_unfused_only(self, query, key, value, attention_mask, layout: str, mask: str,
                             window, dropout: float, asked: Optional[str], bias: Optional[tuple],
                             cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                             padding: bool):
        """Attention with an additive bias (attention_bias.py) or attention sinks
        (``softmax_type``): on the unfused path, the only one that takes them, in high
        precision."""
        op = "DotProductAttention"
        what = ("an attention bias" if bias is not None
                else f"softmax_type={self.softmax_type!r} (attention sinks)")
        if asked not in (None, "auto", "unfused"):
            raise NotImplementedError(f"{op}: {what} runs on the unfused path only (the fused "
                                      f"attention takes none), but attention_backend "
                                      f"{asked!r} was asked for")
        state = STATE
        if state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_dpa:
            raise NotImplementedError(f"{op}: FP8 attention (fp8_dpa=True) with {what} is not "
                                      "implemented: the FP8 attention takes neither; run it "
                                      "with fp8_dpa=False")
        query, key, value = (to_high_precision(t) for t in (query, key, value))
        resolved = None
        if bias is not None:
            if layout == "thd" or mask.startswith("padding"):
                raise NotImplementedError(f"{op}: an attention bias with padded or packed "
                                          f"sequences (qkv_format {layout!r}, attn_mask_type "
                                          f"{mask!r}) is not implemented")
            seq = 0 if layout == "sbhd" else 1
            resolved = attention_bias.resolve(op, *bias, query.shape[1 - seq],
                                              self.num_attention_heads, query.shape[seq],
                                              key.shape[seq], mask, query)
        if not padding:
            cu_seqlens_q = cu_seqlens_kv = None
        sink = self.softmax_offset
        if sink is not None and sink.device != query.device:
            raise ValueError(f"{op}: softmax_offset is on {sink.device} and the inputs on "
                             f"{query.device}: move the module with .to()")
        o = unfused_attention(query, key, value, layout, mask, window, self.softmax_scale,
                              dropout, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q or 0,
                              max_seqlen_kv or 0, attention_mask, resolved, sink)
        return o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1])

    def _fp8_recipe_of_call(self, q, k, v) -> Optional[Recipe]:
        """The recipe this call runs FP8 attention under, or None; under a calibrating
        autocast of delayed scaling, records the amaxes of q, k, v on the way."""
        state = STATE
        if state.enabled:
            return state.recipe if _runs_fp8(state.recipe) else None
        if (state.calibrating and _runs_fp8(state.recipe)
                and kind_of(state.recipe) == "delayed"):
            self._calibrate(q, k, v, state.recipe)
        return None

    def _calibrate(self, q, k, v, recipe: Recipe) -> None:
        """Records the amaxes of q, k, v (high-precision compute) for the next scale update,
        so that the first FP8 step starts from scales that fit the data."""
        _check_state_device(q, self._buffers["amax_history_fwd"])
        self._fit_fp8_meta(recipe)
        history = self.amax_history_fwd
        for column, t in ((0, q), (1, k), (3, v)):
            record_amax(history, column, ops.amax(t.detach().reshape(-1, t.shape[-1])))
        _fp8.register_forward_amaxes(self, recipe)

    def _fused(self, q, k, v, layout, mask, window, dropout, cu_q, cu_kv, max_sq, max_skv,
               backend, recipe: Optional[Recipe], packed: Optional[tuple] = None):
        # Separate empties: torch.compile rejects one tensor passed twice to an autograd.Function.
        def index(cu):
            if cu is None:
                return torch.empty((0,), dtype=torch.int32, device=q.device)
            return cu.to(device=q.device, dtype=torch.int32)

        cu_q, cu_kv = index(cu_q), index(cu_kv)
        if dropout > 0.0:
            rng = rng_state(q.device)  # (torch.manual_seed reproduces it)
        else:
            rng = torch.empty((0,), dtype=torch.int64, device=q.device)
        params = (layout, mask, window[0], window[1], float(self.softmax_scale), float(dropout),
                  int(max_sq), int(max_skv), backend)
        if recipe is not None:
            return self._fused_fp8(q, k, v, cu_q, cu_kv, rng, params, recipe)
        return fused_attention(q, k, v, cu_q, cu_kv, rng, params, self.deterministic, packed)

    def _fused_fp8(self, q, k, v, cu_q, cu_kv, rng, params, recipe: Recipe):
        if kind_of(recipe) == "delayed":  # before _fp8_meta_of registers anything
            _check_state_device(q, self._buffers["scale_fwd"])
        plan, scales, history = self._fp8_meta_of(recipe)
        out_fp8 = bool(recipe.fp8_mha)
        if plan.kind != "delayed":
            return fused_attention_fp8(q, k, v, cu_q, cu_kv, rng, params, self.deterministic,
                                       plan, out_fp8=out_fp8)
        bwd_meta, bwd_recipe, group = self._backward_state(plan, recipe)
        return fused_attention_fp8(q, k, v, cu_q, cu_kv, rng, params, self.deterministic, plan,
                                   scales, history, bwd_meta, bwd_recipe, group, out_fp8)


def _one_of(name: str, value, old_name: str, old_value):
    """A forward input given by NVIDIA's name or by ours (one of them)."""
    if value is not None and old_value is not None:
        raise TypeError(f"DotProductAttention: {name} and {old_name} name the same input; "
                        "give one")
    value = value if value is not None else old_value
    if value is None:
        raise TypeError(f"DotProductAttention: forward needs {name} (or {old_name})")
    return value


def _takes_fp8(t: torch.Tensor) -> bool:
    """Whether FP8 attention takes t as it is: high precision (quantized there) or an E4M3
    Float8Tensor with one scale."""
    return not isinstance(t, Float8Tensor) or (t._fp8_dtype == "float8_e4m3"
                                                and t._scaling_mode == "tensor")


def _check_state_device(q: torch.Tensor, state: torch.Tensor) -> None:
    # get_device() (an int) compares without building device objects on every call.
    if q.get_device() != state.get_device():
        raise RuntimeError(f"DotProductAttention: query must be on the device of the module's "
                           f"delayed-scaling state ({state.device}) in FP8, got {q.device}; "
                           "move the module with .to() or build it with device=")


def _check_cu_seqlens(name: str, cu: torch.Tensor) -> None:
    """Shape always; values only when they are on the CPU (reading CUDA memory would stall
    the stream; the core checks CPU values again)."""
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"DotProductAttention: {name} must have shape [batch + 1], got "
                         f"{list(cu.shape)}")
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"DotProductAttention: {name} must start at 0 and be "
                             f"non-decreasing (cumulative lengths), got {cu.tolist()}")


def _check_names(layout: str, mask: str, backend: Optional[str]) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"DotProductAttention: qkv_format must be one of {LAYOUTS}, got "
                         f"{layout!r}")
    if mask not in MASKS + ("arbitrary",):
        raise ValueError(f"DotProductAttention: attn_mask_type must be one of "
                         f"{MASKS + ('arbitrary',)}, got {mask!r}")
    if backend is not None and backend not in ("auto",) + BACKENDS:
        raise ValueError(f"DotProductAttention: attention_backend must be 'auto' or one of "
                         f"{BACKENDS}, got {backend!r}")
