"""Cross entropy over logits split along the vocabulary, under NVIDIA TE's name
``parallel_cross_entropy``: the language model's loss when its output layer is
column-parallel (a vocabulary-parallel head), every tensor-parallel rank holding
``V / tp`` consecutive vocabulary entries of each token's logits.

The ranks exchange per-token statistics only, never logits: one MAX all-reduce (the row's
maximum, and the target's logit, which only the rank holding the target's column contributes)
and one SUM all-reduce (the sum of exponentials, plus the sum of the logits when label
smoothing needs their mean). The backward needs no communication: a rank's slice of the
gradient is softmax - smoothed one-hot on its own columns, recomputed from the saved logits
and each token's log-sum-exp, so the forward keeps nothing of the vocabulary's size beyond the
logits autograd holds anyway.

Plain torch operations (no fused kernel): any device, float64/float32/bfloat16/float16
logits (the arithmetic in float32, float64 for float64 logits), and it traces under
torch.compile.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist

__all__ = ["parallel_cross_entropy"]

_OP = "parallel_cross_entropy"


def _check(inp, target, label_smoothing) -> None:
    if not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
        got = inp.dtype if isinstance(inp, torch.Tensor) else type(inp).__name__
        raise TypeError(f"{_OP}: inp must be a floating-point tensor of logits, got {got}")
    if inp.dim() < 2 or inp.shape[-1] == 0:
        raise ValueError(f"{_OP}: inp must be [..., vocab / tp] logits with at least one token "
                         f"dimension and a vocabulary slice, got shape {list(inp.shape)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() \
            or target.is_complex() or target.dtype == torch.bool:
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"{_OP}: target must be an integer tensor of token ids, got {got}")
    tokens = list(inp.shape[:-1])
    if list(target.shape) not in (tokens, [math.prod(tokens)]):
        raise ValueError(f"{_OP}: target must be {tokens} (inp's shape without the vocabulary) "
                         f"or [{math.prod(tokens)}], got {list(target.shape)}")
    if target.device != inp.device:
        raise ValueError(f"{_OP}: target must be on inp's device {inp.device}, got "
                         f"{target.device}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_OP}: label_smoothing must be a number in [0, 1], got "
                         f"{label_smoothing!r}")


def _target_columns(target: torch.Tensor, start: int, width: int):
    """Each token's target column in this rank's slice (clamped into it, for indexing) and
    whether the slice holds it."""
    col = target - start
    return col.clamp(0, width - 1).unsqueeze(1), (col >= 0) & (col < width)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, target, label_smoothing, reduce_loss, group, ignore_idx,
                z_loss_weight):
        rank, world = (0, 1) if group is None else (dist.get_rank(group),
                                                   dist.get_world_size(group))
        width = inp.shape[-1]
        vocab, start = width * world, rank * width
        compute = torch.float64 if inp.dtype == torch.float64 else torch.float32
        logits = inp.reshape(-1, width)
        target = target.reshape(-1).long()

        col, owned = _target_columns(target, start, width)
        # -inf where another rank holds the target, so the MAX all-reduce takes the owner's
        # logit. A target in no rank's slice (outside [0, V)) stays -inf: its loss is inf, as
        # NVIDIA's kernel gives, where an error would cost a device-to-host sync per step.
        picked = torch.where(owned, logits.gather(1, col).squeeze(1).to(compute), -math.inf)
        maxes = torch.stack([logits.amax(dim=-1).to(compute), picked])
        if world > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        row_max, target_logit = maxes.unbind(0)
        # Shifted by the row's global maximum, no exp overflows. Half-precision logits meet
        # the float32 maximum inside the subtraction: its result is the only float32 tensor of
        # their size, a temporary.
        sums = [torch.exp(logits - row_max.unsqueeze(1)).sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(logits.sum(dim=-1, dtype=compute))
        sums = torch.stack(sums)
        if world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = row_max + torch.log(sums[0])

        loss = lse - target_logit
        if label_smoothing > 0:
            # torch's definition: (1 - eps) * nll + eps * mean over the whole vocabulary of
            # -log p, and -log p_j = lse - x_j.
            loss = (1 - label_smoothing) * loss + label_smoothing * (lse - sums[1] / vocab)
        if z_loss_weight:
            loss = loss + z_loss_weight * lse.square()
        kept = target != ignore_idx
        loss = torch.where(kept, loss, 0.0)
        # Every rank holds the same targets, so the count needs no all-reduce; clamped so that
        # a batch of ignored tokens gives 0, not 0 / 0.
        count = kept.sum().clamp(min=1)

        ctx.save_for_backward(inp, lse, target, count)
        ctx.start, ctx.vocab, ctx.ignore_idx = start, vocab, ignore_idx
        ctx.label_smoothing, ctx.z_loss_weight = label_smoothing, z_loss_weight
        ctx.reduce_loss = reduce_loss
        log_sum_exp = torch.where(kept, lse, 0.0).reshape(inp.shape[:-1])
        ctx.mark_non_differentiable(log_sum_exp)
        loss = loss.sum() / count if reduce_loss else loss.reshape(inp.shape[:-1])
        return loss, log_sum_exp

    @staticmethod
    def backward(ctx, grad_loss, _grad_log_sum_exp):
        inp, lse, target, count = ctx.saved_tensors
        width = inp.shape[-1]
        eps, z = ctx.label_smoothing, ctx.z_loss_weight
        # softmax, in the compute dtype (the subtraction promotes half-precision logits)
        grad = torch.exp(inp.reshape(-1, width) - lse.unsqueeze(1))
        if z:
            grad.mul_((1 + 2 * z * lse).unsqueeze(1))  # d(z lse^2)/dx = 2 z lse softmax
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        col, owned = _target_columns(target, ctx.start, width)
        grad.scatter_add_(1, col, (owned.to(grad.dtype) * -(1 - eps)).unsqueeze(1))
        scale = grad_loss / count if ctx.reduce_loss else grad_loss.reshape(-1)
        scale = torch.where(target != ctx.ignore_idx, scale.to(grad.dtype), 0.0)
        grad.mul_(scale.unsqueeze(1))
        return grad.to(inp.dtype).reshape(inp.shape), None, None, None, None, None, None


def parallel_cross_entropy(
    inp: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: Optional[dist.ProcessGroup] = None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    z_loss_weight: float = 0.0,
    *,
    return_log_sum_exp: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Cross entropy of logits split over the vocabulary across ``dist_process_group``.

    Args:
        inp: the logits, ``[b, s, V / tp]`` or ``[s, b, V / tp]`` (any leading shape): this
            rank's slice, rank ``r`` of the group holding vocabulary entries
            ``[r * V / tp, (r + 1) * V / tp)`` (equal slices, as NVIDIA requires).
        target: the token ids over the whole vocabulary, ``inp``'s shape without its last
            dimension (or flattened), the same on every rank. An id outside ``[0, V)`` other
            than ``ignore_idx`` is not checked (that would need a device-to-host sync): its
            loss is inf.
        label_smoothing: torch's: the loss is ``(1 - eps) * nll + eps * mean_j(-log p_j)``
            over the whole vocabulary.
        reduce_loss: return the mean over the tokens that are not ignored (0 if all are),
            a 0-dimensional tensor; else the loss of every token, ``inp``'s leading shape.
        dist_process_group: the tensor-parallel group; None: ``inp`` holds the whole
            vocabulary.
        ignore_idx: tokens with this target get loss 0 and gradient 0.
        is_cg_capturable: accepted for NVIDIA's signature; no host sync happens either way.
        z_loss_weight: adds ``z_loss_weight * lse**2`` to each token's loss (z-loss),
            ``lse`` being the log-sum-exp of its logits.
        return_log_sum_exp: also return each token's log-sum-exp (0 for ignored tokens,
            no gradient).

    Returns:
        The loss, float32 (float64 for float64 logits), differentiable in ``inp``; with
        ``return_log_sum_exp``, ``(loss, log_sum_exp)``. Every rank of the group gets the same
        loss and the gradient of its own vocabulary slice.

    Example:

    >>> import torch  # doctest: +SKIP
    >>> import transformer_engine.pytorch as te  # doctest: +SKIP
    >>> logits = torch.randn(2, 8, 1000, requires_grad=True)  # doctest: +SKIP
    >>> labels = torch.randint(0, 1000, (2, 8))  # doctest: +SKIP
    >>> te.parallel_cross_entropy(logits, labels, reduce_loss=True).backward()  # doctest: +SKIP
    """
    del is_cg_capturable  # nothing here reads a device value on the host
    _check(inp, target, label_smoothing)
    loss, log_sum_exp = _VocabParallelCrossEntropy.apply(
        inp, target, float(label_smoothing), bool(reduce_loss), dist_process_group,
        int(ignore_idx), float(z_loss_weight))
    return (loss, log_sum_exp) if return_log_sum_exp else loss
