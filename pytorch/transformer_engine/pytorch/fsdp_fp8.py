"""FP8 all-gather of weights under torch's FSDP2 (``fully_shard``).

FSDP2 gathers each layer's parameters before its forward and again before its backward. When a
parameter's local shard is a tensor subclass with ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``, the subclass chooses what goes over the wire and what the module is
handed. Two kinds of weight use that here:

- a :class:`Float8Tensor` (weights made under ``fp8_model_init`` / ``quantized_model_init``).
  Per tensor (delayed and current scaling): each shard holds rows of the whole weight
  quantized with one scale, so the gather moves the bytes as they are and the module receives
  a Float8Tensor over them with that scale. In 128x128 blocks (``Float8BlockScaling``): a
  block's scale depends on its own values only, so where FSDP's shards hold whole blocks
  (ceil(rows / world size) a multiple of 128) each shard holds its blocks' bytes and scales,
  the gather moves the bytes and the rows of the scale grid, and the module receives the whole
  weight's Float8Tensor. A shard that would cut through blocks cannot hold part of a block's
  one scale: such a weight shards as its high-precision values, and is gathered and updated
  so (float8_tensor warns once, naming why);
- a high-precision weight opted in with :func:`fp8_all_gather` (wrapped as an
  :class:`FP8AllGatherWeight`): before each gather every rank quantizes its shard as the
  recipe in effect quantizes weights (outside ``fp8_autocast``, where FSDP gathers for the
  backward, as at the last gather). Per tensor: with the scale of the whole weight, from the
  largest of the shards' amaxes (all-reduced over the FSDP group: current scaling of the whole
  weight). In 128x128 blocks: a shard of whole blocks quantizes them itself; where shard
  boundaries cut blocks (any shard size), the ranks first take each block's amax over the
  shards (one all-reduce, max, of the block grid) and each quantizes its part of a cut block
  with the whole block's scale. Either way the gathered bytes and scales are exactly those of
  quantizing the whole weight, and the module again receives a Float8Tensor.

The all-gather moves one byte per weight element (half of bf16, a quarter of fp32), plus, in
128x128 blocks, one fp32 scale per block (with the bytes where the shards are of even size;
where they are not, in a small all-gather of their own, since FSDP takes from a shorter shard
only inputs of the padded shard's size). The modules use the bytes as an FP8 weight
(``_weight_operand``: no second quantization; the column-wise copy the backward reads is the
bytes transposed, which 128x128 blocks allow, and under delayed scaling the weight keeps its
own scale, as an fp8_model_init weight does). Gradients stay high precision and are
reduce-scattered as FSDP does for any parameter.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from . import ops
from .distributed import SharedGroup
from .float8_tensor import Float8Tensor
from .ops._backend import BLOCK, FP8_DTYPES

__all__ = ["FP8AllGatherWeight", "fp8_all_gather", "quantize_with_group_amax",
           "quantize_in_blocks"]

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


# ------------------------------------------------------------------ 128x128 blocks


def _block_slots(rows: int, world: int) -> tuple[int, Optional[list[int]]]:
    """How the block scales of a weight of ``rows`` rows travel when FSDP2 shards it over
    ``world`` ranks (padded shards of ceil(rows / world) rows): (S, picks). Each rank sends
    the S rows of scale_inv of the blocks its padded shard touches (from its first, padded
    with ones), and the gathered rows ``picks`` make the whole grid, each block's from the
    rank that holds its first row; picks None: shards of whole blocks, whose gathered rows
    are the grid in order. The same on every rank."""
    per = -(-rows // world)
    if world == 1 or per % BLOCK == 0:
        return -(-per // BLOCK), None
    first = [i * per // BLOCK for i in range(world)]
    slot_rows = max((i * per + per - 1) // BLOCK - first[i] + 1 for i in range(world))
    picks = []
    for b in range(-(-rows // BLOCK)):
        owner = b * BLOCK // per
        picks.append(owner * slot_rows + b - first[owner])
    return slot_rows, picks


def quantize_in_blocks(x: torch.Tensor, rank: int, world: int, rows: int, fp8_dtype: str,
                       pow2: bool, epsilon: float, group: Any
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[int]]]:
    """This rank's padded shard ``x`` [R, K] of a weight of ``rows`` rows (rows rank * R to
    (rank + 1) * R of the weight zero-padded to world * R rows, as FSDP2 pads its shards),
    quantized in the 128x128 blocks of the whole weight:
    its bytes and every block's scale_inv are those of quantizing the whole weight at once
    (``pow2``, ``epsilon``: the recipe's scale options). Returns (bytes [R, K], this rank's
    slot of scale rows, picks) as :func:`_block_slots` lays them out.

    A shard of whole blocks quantizes them itself. Otherwise the blocks the shard boundaries
    cut need the amax of the whole block: one all-reduce (max) of the grid of the shards'
    block amaxes, then the shard is quantized inside its blocks' full rows (a tile of whole
    blocks) where, in each block it only partly holds, one element outside its own rows is
    set to the whole block's amax, so that the core scales the block as it scales the whole
    weight's, and the shard's own elements with it."""
    import torch.distributed as dist

    per, cols = x.shape[0], x.shape[1]
    slot_rows, picks = _block_slots(rows, world)
    m = x.detach()
    if picks is None:
        data, scale_inv, _, _ = ops.quantize_block(m, fp8_dtype, "block_128x128", True, False,
                                                   pow2, epsilon)
        return data, scale_inv, None
    start = rank * per
    first, last = start // BLOCK, (start + per - 1) // BLOCK
    blocks, offset, col_blocks = last - first + 1, start - first * BLOCK, -(-cols // BLOCK)
    tile = m.new_zeros((blocks * BLOCK, cols))
    tile[offset:offset + per] = m
    magnitudes = torch.nn.functional.pad(tile.abs(), (0, col_blocks * BLOCK - cols))
    amax = torch.zeros((-(-world * per // BLOCK), col_blocks), dtype=torch.float32,
                       device=m.device)
    # (Exact in fp32: the amaxes are values of x's dtype, which they go back to below.)
    amax[first:last + 1] = magnitudes.view(blocks, BLOCK, col_blocks, BLOCK).amax(
        dim=(1, 3)).float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for b in range(blocks):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        if offset <= lo and hi <= offset + per:
            continue  # wholly this shard's: its amax is the shard's own
        free = lo if lo < offset else offset + per  # a row of the block outside the shard
        tile[free, ::BLOCK] = amax[first + b].to(tile.dtype)
    data, scale_inv, _, _ = ops.quantize_block(tile, fp8_dtype, "block_128x128", True, False,
                                               pow2, epsilon)
    return data[offset:offset + per], _padded_slot(scale_inv, slot_rows), picks


def _padded_slot(scale_inv: torch.Tensor, slot_rows: int) -> torch.Tensor:
    """Scale rows padded with ones (the scale of a block of zeros) to ``slot_rows``."""
    if scale_inv.shape[0] == slot_rows:
        return scale_inv
    out = scale_inv.new_ones((slot_rows, scale_inv.shape[1]))
    out[:scale_inv.shape[0]].copy_(scale_inv)
    return out


def _block_inputs(data: torch.Tensor, slot: torch.Tensor, outer_size: torch.Size, world: int,
                  group: Any) -> tuple[tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
    """FSDP's all-gather inputs of a block-scaled shard, and the gathered scale rows where
    they do not ride in FSDP's gather (else None). Shards of even size send their scale rows
    with their bytes; where the shards are uneven, FSDP takes from a shorter shard only
    inputs of the padded shard's size, so the scale rows go in an all-gather of their own."""
    import torch.distributed as dist

    if world == 1:
        # FSDP2 gathers nothing on one rank: it hands the post-gather a copy of the first
        # input alone, so the scale rows go beside it (they are the whole grid already).
        return (data,), slot
    if outer_size[0] == world * data.shape[0]:
        return (data, slot), None
    slots = slot.new_empty((world * slot.shape[0], slot.shape[1]))
    # (all_gather_single: all_gather_into_tensor's newer name, which newer torch asks for.)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(slots, slot.contiguous(), group=group)
    return (data,), slots


def _whole_grid(slots: torch.Tensor, picks: Optional[list[int]], rows: int) -> torch.Tensor:
    """The scale grid of a weight of ``rows`` rows from the gathered slots, in a new tensor."""
    if picks is None:
        return slots[:-(-rows // BLOCK)].clone()
    return slots[torch.tensor(picks, device=slots.device)]


# ------------------------------------------------------------------ Float8Tensor weights


def float8_shard_for_gather(shard: Float8Tensor, mesh, outer_size: torch.Size):
    """Float8Tensor.fsdp_pre_all_gather: (the shard's bytes, [block scales]) and what rebuilds
    the weight."""
    if shard._scaling_mode == "block_128x128":
        return _block_shard_for_gather(shard, mesh, outer_size)
    if shard._scaling_mode != "tensor":  # the layout ops keep no other shards FP8
        raise NotImplementedError(
            f"Float8Tensor.fsdp_pre_all_gather: FSDP2 gathers per-tensor and 128x128 block "
            f"scaled FP8 weights, got scaling_mode={shard._scaling_mode!r}")
    group = mesh.get_group()
    if shard._amax_group is None:  # this shard's first gather
        _agree_on_one_scale(shard, group)
        shard._amax_group = SharedGroup(group)
    data = _padded(shard._data, outer_size, mesh.size())
    # A copy of the scale: the shard's own changes in place when the optimizer updates it.
    return (data,), (shard._scale_inv.clone(), shard._fp8_dtype, tuple(outer_size), "tensor",
                     None)


def _block_shard_for_gather(shard: Float8Tensor, mesh, outer_size: torch.Size):
    """A 128x128 block shard (of whole blocks: float8_tensor keeps no other shard FP8): its
    bytes and its rows of the scale grid, each padded to the padded shard."""
    world = mesh.size()
    slot_rows, picks = _block_slots(outer_size[0], world)
    if picks is not None:
        raise RuntimeError(f"Float8Tensor.fsdp_pre_all_gather: a 128x128 block-scaled shard "
                           f"of a weight {list(outer_size)} on {world} ranks does not hold "
                           f"whole blocks")
    data = _padded(shard._data, outer_size, world)
    slot = _padded_slot(shard._scale_inv, slot_rows)
    inputs, slots = _block_inputs(data, slot, outer_size, world, mesh.get_group())
    return inputs, (slots, shard._fp8_dtype, tuple(outer_size), shard._scaling_mode, None)


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
    bytes (the padding rows left out), with the shards' scale (per tensor) or the whole scale
    grid (128x128 blocks). ``out``: the tensor of an earlier gather, refreshed in place (FSDP
    hands the module the same parameter object)."""
    scale_inv, fp8_dtype, size, mode, picks = metadata
    data = outputs[0].view(-1, *size[1:])[:size[0]]
    if mode != "tensor":
        # The gathered scale rows (FSDP's buffer, or the side gather's), as the whole grid in
        # a tensor of its own: FSDP frees its buffer after the forward, and the column-wise
        # copy's scales made from this grid may be saved for the backward.
        scale_inv = _whole_grid(outputs[1] if scale_inv is None else scale_inv, picks, size[0])
    if out is not None:
        # New tensors in place of the old, not writes into them: autograd may have saved the
        # old ones from the forward for the backward (a write would fail its version check).
        out._data, out._scale_inv, out._scaling_mode = data, scale_inv, mode
        out._transpose = out._transpose_scale_inv = None  # of the bytes before
        return None
    weight = Float8Tensor(data, scale_inv, fp8_dtype, param_dtype, mode)
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
    all-gather differs: each rank sends its shard quantized to ``fp8_dtype`` as the whole
    weight is quantized (with its one scale, or in its 128x128 blocks under block scaling),
    and the module receives the gathered weight as a Float8Tensor. Made by
    :func:`fp8_all_gather`.
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
        """This shard quantized as the whole weight is: (its FP8 bytes, [its block scale
        rows]), metadata."""
        mode, pow2, epsilon = self._gather_scaling()
        world, group = mesh.size(), mesh.get_group()
        shard = _padded(self._weight, outer_size, world)
        size = tuple(outer_size)
        if mode == "tensor":
            data, scale_inv = quantize_with_group_amax(shard, self._fp8_dtype, group)
            return (data,), (scale_inv, self._fp8_dtype, size, mode, None)
        data, slot, picks = quantize_in_blocks(shard, mesh.get_local_rank(), world,
                                               outer_size[0], self._fp8_dtype, pow2, epsilon,
                                               group)
        inputs, slots = _block_inputs(data, slot, outer_size, world, group)
        return inputs, (slots, self._fp8_dtype, size, mode, picks)

    def _gather_scaling(self) -> tuple[str, bool, float]:
        """How this gather quantizes: (scaling mode, power-of-two scales, amax epsilon).
        Inside fp8_autocast as the recipe quantizes weights: in 128x128 blocks under block
        scaling (with its scale options), else per tensor; outside it (FSDP gathers again
        for the backward there) as the last gather did."""
        from . import fp8
        from .quantization import kind_of, plan_of

        state = fp8.STATE
        if state.enabled:
            if kind_of(state.recipe) == "block":
                plan = plan_of(state.recipe)
                if plan.weight_mode != "block_128x128":
                    raise NotImplementedError(
                        "fp8_all_gather: Float8BlockScaling(w_block_scaling_dim=1) is not "
                        "supported: a weight in 1x128 blocks needs its column-wise copy "
                        "quantized from high-precision values, which the gathered FP8 bytes "
                        "are not; use w_block_scaling_dim=2 (the default)")
                self._scaling = ("block_128x128", plan.force_pow2_scales, plan.amax_epsilon)
            else:
                self._scaling = ("tensor", False, 0.0)
        return getattr(self, "_scaling", ("tensor", False, 0.0))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The whole weight as a Float8Tensor of ``param_dtype`` over the gathered bytes."""
        return float8_from_gather(all_gather_outputs, metadata, param_dtype, out)


def fp8_all_gather(model: torch.nn.Module, fp8_dtype: str = "float8_e4m3") -> torch.nn.Module:
    """Opts the high-precision GEMM weights of ``model``'s te modules into FP8 all-gather under
    FSDP2: each becomes an :class:`FP8AllGatherWeight` parameter (same values, same dtype).
    Call it before ``fully_shard`` and before making the optimizer (the parameters are new
    objects). Float8Tensor weights (``fp8_model_init``) gather in FP8 without it.

    The modules then receive their weights quantized to ``fp8_dtype`` (the forward format of
    the usual recipes) in every forward, with or without ``fp8_autocast``: as the whole weight
    is quantized under the recipe in effect, with current scaling of the whole weight, or in
    128x128 blocks under ``Float8BlockScaling`` (whose ``w_block_scaling_dim=1`` is refused);
    outside ``fp8_autocast`` as at the last gather (per tensor before any), and the modules
    compute with the dequantized FP8 weight. Returns ``model``.
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
