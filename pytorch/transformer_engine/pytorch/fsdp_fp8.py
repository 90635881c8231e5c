"""FP8 all-gather of weights under torch's FSDP2 (``fully_shard``).

FSDP2 gathers each layer's parameters before its forward and again before its backward. When a
parameter's local shard is a tensor subclass with ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``, the subclass chooses what goes over the wire and what the module is
handed. Two kinds of weight use that here:

- a :class:`Float8Tensor` (weights made under ``fp8_model_init`` / ``quantized_model_init``):
  each shard holds rows of the whole weight quantized with one scale, so the gather moves the
  bytes as they are and the module receives a Float8Tensor over them with that scale;
- a high-precision weight opted in with :func:`fp8_all_gather` (wrapped as an
  :class:`FP8AllGatherWeight`): before each gather every rank quantizes its shard with the
  scale of the whole weight, from the largest of the shards' amaxes (all-reduced over the FSDP
  group: current scaling of the whole weight), so the gathered bytes are exactly those of
  quantizing the whole weight, and the module again receives a Float8Tensor.

Either way the all-gather moves one byte per weight element (half of bf16, a quarter of fp32)
and the modules use the bytes as an FP8 weight (``_weight_operand``: no second quantization,
and under delayed scaling the weight keeps its own scale, as an fp8_model_init weight does).
Gradients stay high precision and are reduce-scattered as FSDP does for any parameter.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from . import ops
from .distributed import SharedGroup
from .float8_tensor import Float8Tensor
from .ops._backend import FP8_DTYPES

__all__ = ["FP8AllGatherWeight", "fp8_all_gather", "quantize_with_group_amax"]

_aten = torch.ops.aten


# ------------------------------------------------------------------ one scale for all shards


def scale_from_amax(amax: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """Current scaling's scale for a tensor whose amax is ``amax`` ([1] fp32): the core's
    computation, fed the amax itself (the amax of [amax] is amax)."""
    scale, _ = ops.current_scale(amax.reshape(1, 1), fp8_dtype, False, 0.0)
    return scale


def quantize_with_group_amax(x: torch.Tensor, fp8_dtype: str, group: Any
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard ``x`` of a weight, quantized with the scale of the whole weight: the
    amax is the max over the shards of ``group`` (one all-reduce of 4 bytes). Returns the FP8
    bytes (x's shape, uint8) and scale_inv ([1] fp32), which every rank gets alike."""
    import torch.distributed as dist

    m = x.detach().reshape(-1, x.shape[-1])
    amax = ops.amax(m) if m.numel() else m.new_zeros(1, dtype=torch.float32)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = scale_from_amax(amax, fp8_dtype)
    # A shard without rows (more ranks than rows) still takes scale_inv from the core, as the
    # others do: each rank builds the gathered weight with its own copy.
    rows = m if m.shape[0] else m.new_zeros(1, m.shape[1])
    data, _, scale_inv, _ = ops.quantize(rows, scale, fp8_dtype, True, False)
    return data[:m.shape[0]].view(x.shape), scale_inv


def _padded(data: torch.Tensor, outer_size: torch.Size, world: int) -> torch.Tensor:
    """The shard with the zero rows FSDP pads the last shards with (all-gather inputs are of
    equal size); the shard itself where it is whole."""
    rows = math.ceil(outer_size[0] / world)
    if data.shape[0] == rows:
        return data
    out = data.new_zeros((rows, *data.shape[1:]))
    out[:data.shape[0]].copy_(data)
    return out


# ------------------------------------------------------------------ Float8Tensor weights


def float8_shard_for_gather(shard: Float8Tensor, mesh, outer_size: torch.Size):
    """Float8Tensor.fsdp_pre_all_gather: (the shard's bytes,) and what rebuilds the weight."""
    if shard._scaling_mode != "tensor":  # the layout ops keep only per-tensor shards FP8
        raise NotImplementedError(
            f"Float8Tensor.fsdp_pre_all_gather: FSDP2 gathers per-tensor scaled FP8 weights, "
            f"got scaling_mode={shard._scaling_mode!r}")
    group = mesh.get_group()
    if shard._amax_group is None:  # this shard's first gather
        _agree_on_one_scale(shard, group)
        shard._amax_group = SharedGroup(group)
    data = _padded(shard._data, outer_size, mesh.size())
    # A copy of the scale: the shard's own changes in place when the optimizer updates it.
    return (data,), (shard._scale_inv.clone(), shard._fp8_dtype, tuple(outer_size))


def _agree_on_one_scale(shard: Float8Tensor, group: Any) -> None:
    """Makes every shard of the weight hold one scale. A weight quantized whole and then
    sharded does already (nothing changes); shards written one by one before their first
    gather (e.g. loaded from high-precision values) are quantized again with the scale of
    the whole weight. One all-reduce of 8 bytes and one host sync, once per shard."""
    import torch.distributed as dist

    s = shard._scale_inv.reshape(1).float()
    extremes = torch.cat([s, -s])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if bool(extremes[0] == -extremes[1]):
        return
    data, scale_inv = quantize_with_group_amax(shard.dequantize(), shard._fp8_dtype, group)
    shard._copy_from(Float8Tensor(data, scale_inv, shard._fp8_dtype, shard.dtype))


def float8_from_gather(outputs, metadata, param_dtype: torch.dtype, out=None):
    """fsdp_post_all_gather of both kinds: the whole weight as a Float8Tensor over the gathered
    bytes (the padding rows left out), with the shards' scale. ``out``: the tensor of an
    earlier gather, refreshed in place (FSDP hands the module the same parameter object)."""
    scale_inv, fp8_dtype, size = metadata
    data = outputs[0].view(-1, *size[1:])[:size[0]]
    if out is not None:
        # New tensors in place of the old, not writes into them: autograd may have saved the
        # old ones from the forward for the backward (a write would fail its version check).
        out._data, out._scale_inv = data, scale_inv
        out._transpose = out._transpose_scale_inv = None  # of the bytes before
        return None
    weight = Float8Tensor(data, scale_inv, fp8_dtype, param_dtype)
    weight._gathered = True
    # No inner tensors of its own to free: its bytes are FSDP's gather buffer, which FSDP
    # frees and refills itself.
    return weight, ()


# ------------------------------------------------------------------ high-precision weights


# Ops whose result is again the weight (or a piece of it, as FSDP cuts and pads it): the
# wrapper is kept, so that a shard still gathers in FP8. Any other op gets plain tensors.
_KEEP = {_aten.detach.default, _aten.alias.default, _aten.clone.default, _aten._to_copy.default,
         _aten.view.default, _aten.as_strided.default, _aten.slice.Tensor, _aten.split.Tensor,
         _aten.split_with_sizes.default, _aten.new_zeros.default, _aten.new_empty.default,
         _aten.empty_like.default, _aten.zeros_like.default}


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 gathers as FP8 (see the module docstring).

    It holds the weight itself (the optimizer's master copy, in its own dtype) and is that
    tensor to every op: in-place updates change it, other ops see its values. Only FSDP2's
    all-gather differs: each rank sends its shard quantized to ``fp8_dtype`` with the scale
    of the whole weight, and the module receives the gathered weight as a Float8Tensor.
    Made by :func:`fp8_all_gather`.
    """

    @staticmethod
    def __new__(cls, weight: torch.Tensor, fp8_dtype: str = "float8_e4m3",
                requires_grad: bool = False):
        if fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"FP8AllGatherWeight: fp8_dtype must be one of {FP8_DTYPES}, "
                             f"got {fp8_dtype!r}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, weight.shape, strides=weight.stride(), storage_offset=weight.storage_offset(),
            dtype=weight.dtype, device=weight.device, requires_grad=requires_grad)
        self._weight = weight
        self._fp8_dtype = fp8_dtype
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP8AllGatherWeight(fp8_dtype={self._fp8_dtype}, weight={self._weight!r})"

    def __tensor_flatten__(self):
        return ["_weight"], (self._fp8_dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_weight"], meta[0])

    def __reduce_ex__(self, protocol):
        # A checkpoint holds the plain weight: it loads anywhere, with or without FSDP.
        return self._weight.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (Inside lists too: foreach ops, the optimizers' default on GPUs, take lists.)
        fp8_dtype = next(a._fp8_dtype for a in tree_leaves((args, kwargs)) if isinstance(a, cls))
        unwrap = lambda t: t._weight  # noqa: E731
        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        if func in _KEEP:
            return tree_map_only(torch.Tensor, lambda t: cls(t, fp8_dtype), out)
        if func._schema.is_mutable and args and isinstance(args[0], cls):
            return args[0]  # an in-place op changed the weight itself
        return out

    # ------------------------------------------------------------ FSDP2 (fully_shard)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This shard quantized with the whole weight's scale: (its FP8 bytes,), metadata."""
        shard = _padded(self._weight, outer_size, mesh.size())
        data, scale_inv = quantize_with_group_amax(shard, self._fp8_dtype, mesh.get_group())
        return (data,), (scale_inv, self._fp8_dtype, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The whole weight as a Float8Tensor of ``param_dtype`` over the gathered bytes."""
        return float8_from_gather(all_gather_outputs, metadata, param_dtype, out)


def fp8_all_gather(model: torch.nn.Module, fp8_dtype: str = "float8_e4m3") -> torch.nn.Module:
    """Opts the high-precision GEMM weights of ``model``'s te modules into FP8 all-gather under
    FSDP2: each becomes an :class:`FP8AllGatherWeight` parameter (same values, same dtype).
    Call it before ``fully_shard`` and before making the optimizer (the parameters are new
    objects). Float8Tensor weights (``fp8_model_init``) gather in FP8 without it.

    The modules then receive their weights quantized (current scaling of the whole weight, to
    ``fp8_dtype``, the forward format of the usual recipes) in every forward, with or without
    ``fp8_autocast``: outside it they compute with the dequantized FP8 weight. Returns
    ``model``.
    """
    from torch.distributed.tensor import DTensor

    from .module.base import FP8Module

    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_all_gather: fp8_dtype must be one of {FP8_DTYPES}, "
                         f"got {fp8_dtype!r}")
    found = False
    for module_name, module in model.named_modules():
        if not isinstance(module, FP8Module):
            continue
        found = True
        for name, p in list(module.named_parameters(recurse=False)):
            # The GEMM weights are the 2-D parameters (norm weights and biases are 1-D).
            if p.dim() != 2 or isinstance(p, (Float8Tensor, FP8AllGatherWeight)):
                continue
            if isinstance(p, DTensor):
                raise ValueError(
                    f"fp8_all_gather: {module_name or type(model).__name__}.{name} is a "
                    f"DTensor already (sharded): call fp8_all_gather(model) before "
                    f"fully_shard")
            wrapped = FP8AllGatherWeight(p.detach(), fp8_dtype)
            setattr(module, name, torch.nn.Parameter(wrapped, requires_grad=p.requires_grad))
    if not found:
        raise ValueError(f"fp8_all_gather: model must hold te modules (whose weights it "
                         f"gathers in FP8), got a {type(model).__name__} without any")
    return model
