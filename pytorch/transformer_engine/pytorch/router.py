"""NVIDIA TE's MoE router functions, under NVIDIA's path ``transformer_engine.pytorch.router``:
the score function with the top-k choice of experts (``fused_topk_with_score_function``), the
scores of the load-balancing loss (``fused_compute_score_for_moe_aux_loss``) and that loss
(``fused_moe_aux_loss``), as Megatron-LM calls them with ``moe_router_fusion``.

Plain torch operations inside autograd Functions, not fused kernels: any device, and they trace
under torch.compile. The numerics are those of NVIDIA's kernels: the logits are read into
float32 and every step is float32; the probabilities come back in the logits' dtype, the
aux-loss scores in float32, the loss in the probabilities' dtype. float64 is refused, as
NVIDIA's kernels refuse it.

The backward recomputes the score function from the saved logits and the chosen experts'
indices (NVIDIA keeps a float32 copy of the scores instead); its formulas are written out
below, since autograd through ``sqrt(softplus(x))`` gives NaN where softplus underflows to 0.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["RoutingMapFormat", "fused_topk_with_score_function",
           "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
# NVIDIA's kernels add this to the sum that normalises sigmoid / sqrtsoftplus scores (a row of
# zeros gives zeros, not NaN) and to 2 * sqrtsoftplus(x) in its derivative (0 where it underflows).
_EPS = 1e-20


class RoutingMapFormat(enum.IntEnum):
    """Layout of the routing map: ``BYTEMAP`` bool ``[..., num_experts]``; ``BITMAP_U8`` uint8
    ``[..., ceil(num_experts / 8)]``, bit ``e % 8`` of byte ``e // 8`` set when the token goes
    to expert ``e`` (least significant bit first)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


def _map_format(op: str, value) -> RoutingMapFormat:
    names = {"bytemap": RoutingMapFormat.BYTEMAP, "bitmap_u8": RoutingMapFormat.BITMAP_U8}
    if isinstance(value, str) and value in names:
        return names[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return RoutingMapFormat(value)
    raise ValueError(f"{op}: routing_map_format must be 'bytemap', 'bitmap_u8', a "
                     f"RoutingMapFormat or 0 / 1, got {value!r}")


def _check_logits(op: str, name: str, x, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {got}")
    if x.dtype == torch.float64:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16 (NVIDIA's router "
                         f"does not support float64 either), got torch.float64")
    if x.dim() < min_dim or x.shape[-1] == 0:
        raise ValueError(f"{op}: {name} must be [..., num_experts] with num_experts > 0 and at "
                         f"least {min_dim} dimension(s), got shape {list(x.shape)}")


def _check_topk(op: str, topk, num_experts: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"{op}: topk must be an int in [1, num_experts={num_experts}], "
                         f"got {topk!r}")


def _check_score_function(op: str, score_function) -> None:
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"{op}: score_function must be one of {_SCORE_FUNCTIONS}, "
                         f"got {score_function!r}")


def _activation(x: torch.Tensor, score_function: str) -> torch.Tensor:
    return torch.sigmoid(x) if score_function == "sigmoid" else F.softplus(x).sqrt()


def _activation_grad(x: torch.Tensor, a: torch.Tensor, score_function: str) -> torch.Tensor:
    """d a / d x, given a = _activation(x)."""
    if score_function == "sigmoid":
        return a * (1 - a)
    return torch.sigmoid(x) / (2 * a + _EPS)  # d sqrt(softplus(x)) = sigmoid(x) / (2 sqrt(.))


def _normalise_grad(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The gradient through p = a / (sum(a) + eps) along the last dimension."""
    total = a.sum(-1, keepdim=True) + _EPS
    return g / total - (g * a).sum(-1, keepdim=True) / total.square()


def _softmax_grad(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return p * (g - (g * p).sum(-1, keepdim=True))


def _select(scores: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int]) -> torch.Tensor:
    """Indices [tokens, topk] of the highest scores, in descending order; with group_topk, only
    among the group_topk groups (of consecutive experts) whose topk / group_topk highest scores
    add up to the most."""
    if group_topk:
        tokens, experts = scores.shape
        size = experts // num_groups
        group_scores = scores.view(tokens, num_groups, size).topk(
            topk // group_topk, dim=-1).values.sum(-1)
        chosen = group_scores.topk(group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
        scores = scores.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    return scores.topk(topk, dim=-1).indices


def _routing_map(index: torch.Tensor, num_experts: int, fmt: RoutingMapFormat) -> torch.Tensor:
    """The [tokens, ...] routing map of the experts in ``index`` (unique within a row)."""
    tokens = index.shape[0]
    if fmt == RoutingMapFormat.BYTEMAP:
        return torch.zeros(tokens, num_experts, dtype=torch.bool,
                           device=index.device).scatter(1, index, True)
    # Distinct experts set distinct bits, so adding the bits of a byte is or-ing them.
    bits = torch.zeros(tokens, (num_experts + 7) // 8, dtype=index.dtype, device=index.device)
    bits.scatter_add_(1, index // 8, torch.ones_like(index) << (index % 8))
    return bits.to(torch.uint8)


class _TopkWithScoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, topk, use_pre_softmax, num_groups, group_topk,
                scaling_factor, score_function):
        x = logits.reshape(-1, logits.shape[-1]).float()
        if score_function == "softmax" and use_pre_softmax:
            scores = torch.softmax(x, dim=-1)
            index = _select(scores, topk, num_groups, group_topk)
            probs = scores.gather(1, index)
        elif score_function == "softmax":
            index = _select(x, topk, num_groups, group_topk)
            probs = torch.softmax(x.gather(1, index), dim=-1)
        else:
            scores = _activation(x, score_function)
            # The bias steers the choice only: the probabilities are the unbiased scores.
            biased = scores if expert_bias is None else scores + expert_bias.float()
            index = _select(biased, topk, num_groups, group_topk)
            probs = scores.gather(1, index)
            if topk > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + _EPS)
        probs = probs * scaling_factor
        out = torch.zeros_like(x, dtype=logits.dtype).scatter(1, index, probs.to(logits.dtype))
        ctx.save_for_backward(logits, index)
        ctx.mark_non_differentiable(index)
        ctx.topk, ctx.scaling_factor, ctx.score_function = topk, scaling_factor, score_function
        ctx.pre_softmax = use_pre_softmax and score_function == "softmax"
        return out.reshape(logits.shape), index

    @staticmethod
    def backward(ctx, grad_probs, _grad_index):
        logits, index = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1]).float()
        # Only the chosen experts' probabilities depend on the logits.
        g = grad_probs.reshape(x.shape).float().gather(1, index) * ctx.scaling_factor
        if ctx.pre_softmax:
            dx = _softmax_grad(torch.zeros_like(x).scatter(1, index, g), torch.softmax(x, -1))
        else:
            chosen = x.gather(1, index)
            if ctx.score_function == "softmax":
                dchosen = _softmax_grad(g, torch.softmax(chosen, dim=-1))
            else:
                scores = _activation(chosen, ctx.score_function)
                if ctx.topk > 1:
                    g = _normalise_grad(g, scores)
                dchosen = g * _activation_grad(chosen, scores, ctx.score_function)
            dx = torch.zeros_like(x).scatter(1, index, dchosen)
        return dx.to(logits.dtype).reshape(logits.shape), None, None, None, None, None, None, None


def _check_groups(op: str, num_groups, group_topk, topk: int, num_experts: int) -> None:
    if not group_topk:
        return
    ok = (isinstance(num_groups, int) and isinstance(group_topk, int) and num_groups > 0
          and num_experts % num_groups == 0 and 0 < group_topk <= num_groups
          and topk % group_topk == 0 and topk // group_topk <= num_experts // num_groups)
    if not ok:
        raise ValueError(f"{op}: num_groups and group_topk must be ints, num_groups a divisor "
                         f"of num_experts={num_experts}, group_topk a divisor of topk={topk} "
                         f"and at most num_groups, topk / group_topk at most num_experts / "
                         f"num_groups, got num_groups={num_groups!r}, group_topk={group_topk!r}")


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    scaling_factor: Optional[float],
    score_function: str,
    expert_bias: Optional[torch.Tensor],
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
    topk_indices: Optional[torch.Tensor] = None,
    qb_histogram: Optional[torch.Tensor] = None,
    qb_bin_bounds: Optional[torch.Tensor] = None,
    qb_histogram_mode: Optional[str] = None,
):
    """Each token's top-k experts and their routing probabilities.

    Args:
        logits: ``[..., num_experts]``, float32, bfloat16 or float16.
        topk: experts per token.
        use_pre_softmax: with ``"softmax"``: softmax over all experts, then the top k of it;
            else the top k logits, then the softmax of those k. Ignored by the other score
            functions.
        num_groups, group_topk: with ``group_topk`` (not None or 0), the experts form
            ``num_groups`` groups of consecutive experts; a group's score is the sum of its
            ``topk / group_topk`` highest scores and the top k are chosen within the
            ``group_topk`` best groups.
        scaling_factor: multiplies the probabilities (None: 1).
        score_function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"``
            (``sqrt(softplus(x))``); with the latter two and ``topk > 1`` the chosen scores are
            divided by their sum (+ 1e-20).
        expert_bias: ``[num_experts]``, sigmoid / sqrtsoftplus only: added to the scores to
            choose the experts, not to the probabilities; it gets no gradient.
        routing_map_format: ``"bytemap"`` / ``RoutingMapFormat.BYTEMAP`` (bool
            ``[..., num_experts]``) or ``"bitmap_u8"`` / ``RoutingMapFormat.BITMAP_U8``
            (uint8 ``[..., ceil(num_experts / 8)]``, least significant bit first).
        topk_indices: an int16 / int32 / int64 buffer ``[..., topk]``: filled with each token's
            experts (highest score first) and returned in place of the routing map.
        qb_histogram, qb_bin_bounds, qb_histogram_mode: NVIDIA's Quantile Balancing; not
            supported here (NotImplementedError).

    Returns:
        ``(probs, routing_map)``: ``probs`` in the logits' shape and dtype, zero for the
        experts not chosen, differentiable in ``logits``; the routing map as above (or
        ``topk_indices``).

    Example:

    >>> logits = torch.randn(6, 8, requires_grad=True)  # doctest: +SKIP
    >>> probs, routing_map = fused_topk_with_score_function(  # doctest: +SKIP
    ...     logits, 2, False, None, None, None, "sigmoid", torch.zeros(8))
    """
    op = "fused_topk_with_score_function"
    if any(v is not None for v in (qb_histogram, qb_bin_bounds, qb_histogram_mode)):
        raise NotImplementedError(f"{op}: Quantile Balancing (qb_histogram, qb_bin_bounds, "
                                  f"qb_histogram_mode) is not supported here; they must be None")
    _check_logits(op, "logits", logits)
    num_experts = logits.shape[-1]
    _check_topk(op, topk, num_experts)
    _check_score_function(op, score_function)
    _check_groups(op, num_groups, group_topk, topk, num_experts)
    fmt = _map_format(op, routing_map_format)
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError(f"{op}: expert_bias must be None with score_function 'softmax' "
                             f"(it is for 'sigmoid' and 'sqrtsoftplus'), got a tensor")
        if not isinstance(expert_bias, torch.Tensor) or not expert_bias.is_floating_point() \
                or expert_bias.shape != (num_experts,) or expert_bias.device != logits.device:
            got = (f"{expert_bias.dtype} {list(expert_bias.shape)} on {expert_bias.device}"
                   if isinstance(expert_bias, torch.Tensor) else type(expert_bias).__name__)
            raise ValueError(f"{op}: expert_bias must be a floating-point tensor "
                             f"[{num_experts}] on {logits.device}, got {got}")
    if topk_indices is not None:
        if not isinstance(topk_indices, torch.Tensor) \
                or topk_indices.dtype not in (torch.int16, torch.int32, torch.int64) \
                or topk_indices.shape != (*logits.shape[:-1], topk) \
                or topk_indices.device != logits.device:
            got = (f"{topk_indices.dtype} {list(topk_indices.shape)} on {topk_indices.device}"
                   if isinstance(topk_indices, torch.Tensor) else type(topk_indices).__name__)
            raise ValueError(f"{op}: topk_indices must be an int16, int32 or int64 tensor "
                             f"{[*logits.shape[:-1], topk]} on {logits.device}, got {got}")
    scale = 1.0 if scaling_factor is None else float(scaling_factor)
    probs, index = _TopkWithScoreFunction.apply(
        logits, expert_bias, topk, bool(use_pre_softmax), num_groups, group_topk, scale,
        score_function)
    if topk_indices is not None:
        with torch.no_grad():
            topk_indices.copy_(index.reshape(topk_indices.shape))
        return probs, topk_indices
    routing_map = _routing_map(index, num_experts, fmt)
    return probs, routing_map.reshape(*logits.shape[:-1], routing_map.shape[-1])


class _ScoresForAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score_function):
        x = logits.reshape(-1, logits.shape[-1]).float()
        if score_function == "softmax":
            scores = torch.softmax(x, dim=-1)
        else:
            scores = _activation(x, score_function)
            scores = scores / (scores.sum(-1, keepdim=True) + _EPS)
        index = scores.topk(topk, dim=-1).indices
        ctx.save_for_backward(logits)
        ctx.mark_non_differentiable(index)
        ctx.score_function = score_function
        return scores.reshape(logits.shape), index

    @staticmethod
    def backward(ctx, grad_scores, _grad_index):
        (logits,) = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1]).float()
        g = grad_scores.reshape(x.shape).float()
        if ctx.score_function == "softmax":
            dx = _softmax_grad(g, torch.softmax(x, dim=-1))
        else:
            scores = _activation(x, ctx.score_function)
            dx = _normalise_grad(g, scores) * _activation_grad(x, scores, ctx.score_function)
        return dx.to(logits.dtype).reshape(logits.shape), None, None


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
):
    """The scores of the load-balancing loss and each token's top-k experts by them.

    Args:
        logits: ``[..., num_experts]``, float32, bfloat16 or float16.
        topk: experts per token in the routing map.
        score_function: ``"softmax"`` over all experts, or ``"sigmoid"`` / ``"sqrtsoftplus"``
            divided by their sum over all experts (+ 1e-20), whatever ``topk``, as NVIDIA's
            current kernel and Megatron-LM's unfused path do (older NVIDIA kernels skipped the
            division for ``topk == 1``).
        routing_map_format: as for :func:`fused_topk_with_score_function`.

    Returns:
        ``(routing_map, scores)``: the routing map of the ``topk`` highest scores; the scores,
        float32 in the logits' shape, differentiable in ``logits``.
    """
    op = "fused_compute_score_for_moe_aux_loss"
    _check_logits(op, "logits", logits)
    _check_topk(op, topk, logits.shape[-1])
    _check_score_function(op, score_function)
    fmt = _map_format(op, routing_map_format)
    scores, index = _ScoresForAuxLoss.apply(logits, topk, score_function)
    routing_map = _routing_map(index, logits.shape[-1], fmt)
    return routing_map.reshape(*logits.shape[:-1], routing_map.shape[-1]), scores


class _AuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tokens_per_expert, coeff):
        # coeff is num_experts * coeff / (topk * total_num_tokens**2), a float or a 0-d tensor.
        tokens = tokens_per_expert.float()
        loss = (probs.float().sum(0) * tokens).sum() * coeff
        is_tensor = isinstance(coeff, torch.Tensor)
        ctx.save_for_backward(tokens, coeff if is_tensor else None)
        ctx.coeff, ctx.rows = None if is_tensor else coeff, probs.shape[0]
        return loss.to(probs.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        tokens, coeff = ctx.saved_tensors
        coeff = ctx.coeff if coeff is None else coeff
        row = (grad_loss.float() * coeff * tokens).to(grad_loss.dtype)
        return row.repeat(ctx.rows, 1), None, None


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Union[int, torch.Tensor],
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """The switch load-balancing loss,
    ``sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff
    / (topk * total_num_tokens**2)``.

    Args:
        probs: ``[num_tokens, num_experts]``, float32, bfloat16 or float16.
        tokens_per_expert: ``[num_experts]``, integer or floating.
        total_num_tokens: an int, or a one-element tensor (read on the device, no host
            sync; NVIDIA's takes a 0-d int64 CUDA tensor there).
        num_experts, topk, coeff: the constants of the formula.

    Returns:
        A 0-d tensor in the probabilities' dtype (the sums are float32), differentiable in
        ``probs``.
    """
    op = "fused_moe_aux_loss"
    _check_logits(op, "probs", probs, min_dim=2)
    if probs.dim() != 2:
        raise ValueError(f"{op}: probs must be [num_tokens, num_experts], got shape "
                         f"{list(probs.shape)}")
    cols = probs.shape[1]
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.shape != (cols,) \
            or tokens_per_expert.is_complex() or tokens_per_expert.device != probs.device:
        got = (f"{tokens_per_expert.dtype} {list(tokens_per_expert.shape)} on "
               f"{tokens_per_expert.device}" if isinstance(tokens_per_expert, torch.Tensor)
               else type(tokens_per_expert).__name__)
        raise ValueError(f"{op}: tokens_per_expert must be a real tensor [{cols}] on "
                         f"{probs.device}, got {got}")
    for name, value in (("num_experts", num_experts), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    constant = num_experts * float(coeff) / topk
    if isinstance(total_num_tokens, torch.Tensor):
        if total_num_tokens.numel() != 1:
            raise ValueError(f"{op}: total_num_tokens must be an int or a one-element tensor, "
                             f"got shape {list(total_num_tokens.shape)}")
        total = total_num_tokens.reshape(()).to(device=probs.device, dtype=torch.float32)
        constant = constant / total / total
    elif isinstance(total_num_tokens, (int, float)) and not isinstance(total_num_tokens, bool) \
            and int(total_num_tokens) >= 1:
        total = int(total_num_tokens)  # NVIDIA's int(), for a count held in a float
        constant = constant / total / total
    else:
        raise ValueError(f"{op}: total_num_tokens must be a positive int or a one-element "
                         f"tensor, got {total_num_tokens!r}")
    return _AuxLoss.apply(probs, tokens_per_expert, constant)
