"""``Float8Tensor``: a torch tensor whose storage is FP8.

It looks like a high-precision tensor (its ``dtype`` is the dtype it dequantizes to) but holds
FP8 bytes plus their ``scale_inv`` (per tensor, or per block), the FP8 format, and optionally
the transposed ("column-wise") copy that the backward GEMMs read. te modules use the bytes
directly; any other torch op sees the dequantized values (``__torch_dispatch__`` falls back to
high precision). In-place ops (an optimizer step, ``copy_`` from ``load_state_dict``) compute
in high precision and quantize the result back into the same bytes, with a scale from its own
amax, so the tensor stays FP8 throughout.

Under torch's FSDP2 (``fully_shard``) a Float8Tensor parameter stays FP8 when cut into shards
(the layout ops below keep its bytes and scales), and its all-gather moves those bytes
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, implemented in :mod:`.fsdp_fp8`). A
per-tensor weight cuts anywhere: each shard holds bytes of the whole weight quantized with one
scale. A 128x128 block-scaled weight cuts into FP8 shards only at multiples of 128 rows, where
each shard holds whole blocks with their own scales; cut elsewhere, its pieces are its
high-precision values (with a warning, once, when it is split so: that is how FSDP2 shards).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_map

from . import ops
from .ops._backend import BLOCK, FP8_DTYPES, SCALING_MODES, TORCH_FP8, as_bytes, block_grid

__all__ = ["Float8Tensor", "to_high_precision"]

_aten = torch.ops.aten
_HIGH = (torch.float32, torch.bfloat16, torch.float16)
_PASSTHROUGH = {_aten.detach.default, _aten.alias.default}
# Ops that only lay out a Float8Tensor's bytes (how FSDP2 cuts a parameter into shards and
# pads them): they run on the bytes and keep the scales (per tensor: the one scale; 128x128
# blocks: the rows of the scale grid of whole blocks), so the result is FP8 too. Whatever
# would cut through a block, and 1x128 block tensors, take the high-precision fallback.
_LAYOUT_MODES = ("tensor", "block_128x128")
_LAYOUT = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.slice.Tensor,
           _aten.as_strided.default, _aten.new_zeros.default, _aten.new_empty.default,
           _aten.view.default}

# Set by quantized_model_init(preserve_high_precision_init_val=True) while modules are built:
# quantize() then keeps a CPU copy of the value it quantized (the initial weight).
_PRESERVE_INIT = [False]


def _fp8_name(data: torch.Tensor, fp8_dtype: Optional[str]) -> str:
    for name, native in TORCH_FP8.items():
        if data.dtype == native:
            if fp8_dtype not in (None, name):
                raise ValueError(f"Float8Tensor: fp8_dtype must match the data's dtype "
                                 f"{data.dtype}, got {fp8_dtype!r}")
            return name
    if data.dtype != torch.uint8:
        raise TypeError(f"Float8Tensor: data must be uint8 bytes or a torch float8 tensor, "
                        f"got {data.dtype}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"Float8Tensor: fp8_dtype must be one of {FP8_DTYPES} for uint8 "
                         f"data, got {fp8_dtype!r}")
    return fp8_dtype


class Float8Tensor(torch.Tensor):
    """FP8 data with its scale_inv, seen by torch as a ``dtype`` tensor of the same shape.

    Args:
        data: the FP8 values as uint8 bytes, or a ``torch.float8_e4m3fn`` / ``float8_e5m2``
            tensor (then ``fp8_dtype`` may be omitted).
        scale_inv: fp32; [1] for per-tensor scaling, the block grid of tensor.h otherwise.
        fp8_dtype: ``"float8_e4m3"`` or ``"float8_e5m2"``.
        dtype: the high-precision dtype the tensor presents and dequantizes to.
        scaling_mode: ``"tensor"``, ``"block_1x128"`` or ``"block_128x128"``.
        transpose, transpose_scale_inv: optional column-wise copy ([K, M] of the [M, K] view)
            and its scale_inv (per-tensor: the same as ``scale_inv``).
        shape: the shape the tensor presents, when not the data's: a block-scaled matrix
            seen flat (FSDP2 keeps a flat view of each shard) keeps its [M, K] bytes, which
            its scale grid is laid over.
        scale_options: (force_pow2_scales, amax_epsilon) of the quantization that made it,
            which an in-place update (an optimizer step) quantizes with again.

    Example:
        >>> x = torch.randn(32, 64)
        >>> q = Float8Tensor.quantize(x)  # doctest: +SKIP
        >>> (q.dequantize() - x).abs().max() < 0.1 * x.abs().max()  # doctest: +SKIP
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: Optional[str] = None,
                dtype: torch.dtype = torch.float32, scaling_mode: str = "tensor",
                transpose: Optional[torch.Tensor] = None,
                transpose_scale_inv: Optional[torch.Tensor] = None, requires_grad: bool = False,
                shape: Optional[tuple] = None, scale_options: tuple = (False, 0.0)):
        fp8_dtype = _fp8_name(data, fp8_dtype)
        if dtype not in _HIGH:
            raise TypeError(f"Float8Tensor: dtype must be one of {_HIGH}, got {dtype}")
        if scaling_mode not in SCALING_MODES:
            raise ValueError(f"Float8Tensor: scaling_mode must be one of {SCALING_MODES}, "
                             f"got {scaling_mode!r}")
        shape = data.shape if shape is None else torch.Size(shape)
        if shape.numel() != data.numel():
            raise ValueError(f"Float8Tensor: shape {list(shape)} must hold the data's "
                             f"{data.numel()} elements")
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=data.device, requires_grad=requires_grad)
        self._data = as_bytes(data)
        self._scale_inv = scale_inv
        self._fp8_dtype = fp8_dtype
        self._scaling_mode = scaling_mode
        self._transpose = None if transpose is None else as_bytes(transpose)
        self._transpose_scale_inv = transpose_scale_inv
        self._high_precision_init_val = None
        # Set on an FSDP2 shard by its first all-gather (fsdp_fp8): the group whose ranks
        # hold the other shards. In-place updates then take their amax over the whole
        # weight, so that every shard keeps one scale.
        self._amax_group = None
        # True on a weight FSDP2 gathered: its column-wise copy is not kept, since FSDP frees
        # the gathered bytes after the forward and the copy would hold the whole weight.
        self._gathered = False
        self._scale_options = (bool(scale_options[0]), float(scale_options[1]))
        return self

    # ------------------------------------------------------------ making and reading

    @classmethod
    def quantize(cls, x: torch.Tensor, fp8_dtype: str = "float8_e4m3", *,
                 scaling_mode: str = "tensor", with_transpose: bool = False,
                 force_pow2_scales: bool = False, amax_epsilon: float = 0.0) -> "Float8Tensor":
        """Quantizes ``x`` with a scale from its own amax (per tensor) or per block; the scale
        options are kept for in-place updates, which quantize with them again."""
        x = x.detach()
        m = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        if scaling_mode == "tensor":
            data, col, _, sinv, _ = ops.quantize_current(m, fp8_dtype, True, with_transpose,
                                                          force_pow2_scales, amax_epsilon)
            col_sinv = sinv if with_transpose else None
        else:
            data, sinv, col, col_sinv = ops.quantize_block(
                m, fp8_dtype, scaling_mode, True, with_transpose, force_pow2_scales,
                amax_epsilon)
            col_sinv = col_sinv if with_transpose else None
        out = cls(data.view(x.shape), sinv, fp8_dtype, x.dtype, scaling_mode,
                  col if with_transpose else None, col_sinv,
                  scale_options=(force_pow2_scales, amax_epsilon))
        if _PRESERVE_INIT[0]:
            # On the CPU: the point of FP8 weights is not to hold a high-precision copy on
            # the GPU.
            out._high_precision_init_val = x.to("cpu", copy=True)
        return out

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The value this tensor was quantized from when it was made inside
        ``quantized_model_init(preserve_high_precision_init_val=True)`` (a CPU tensor of
        ``self.dtype``), or None (made elsewhere, or cleared)."""
        return self._high_precision_init_val

    def clear_high_precision_init_val(self) -> None:
        """Drops the kept initial value (e.g. once the optimizer's master weights hold it)."""
        self._high_precision_init_val = None

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The high-precision values, as a plain tensor of ``dtype`` (default: self.dtype)."""
        data = self._data.reshape(-1, self._data.shape[-1]) if self._data.dim() else \
            self._data.reshape(1, 1)
        out = ops.dequantize(data, self._scale_inv, self._fp8_dtype, self._scaling_mode,
                             dtype or self.dtype)
        return out.view(self.shape)

    def transpose_data(self, cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The column-wise copy [K, M] and its scale_inv, made (and kept) on first use.

        Per-tensor data and 128x128 tiles transpose byte for byte (a tile holds the same
        elements in the matrix and in its transpose, so its scale moves with it); 1x128 runs
        do not, such a tensor must be quantized ``with_transpose=True``. ``cache=False``
        leaves the tensor as it is (torch.compile traces no change to a tensor's parts)."""
        if self._transpose is not None:
            return self._transpose, self._transpose_scale_inv
        if self._scaling_mode == "block_1x128":
            raise ValueError("Float8Tensor.transpose_data: 1x128 blocks run along rows, so "
                             "the column-wise copy must come from quantization "
                             "(with_transpose=True)")
        data = ops.transpose(self._data.reshape(-1, self._data.shape[-1]))
        scale_inv = (self._scale_inv if self._scaling_mode == "tensor"
                     else self._scale_inv.t().contiguous())
        if cache and not self._gathered:
            self._transpose, self._transpose_scale_inv = data, scale_inv
        return data, scale_inv

    def __repr__(self, *, tensor_contents=None) -> str:
        extra = ", with transpose" if self._transpose is not None else ""
        head = (f"Float8Tensor(fp8_dtype={self._fp8_dtype}, scaling_mode={self._scaling_mode}, "
                f"shape={list(self.shape)}, dtype={self.dtype}, device={self.device}{extra}")
        # Values only for real data: under tracing (torch.compile formats tensors in messages
        # and logs) reading them would be a data-dependent op in the traced graph.
        if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
                or type(self._data) is not torch.Tensor):
            return head + ")"
        return (head + f", scale_inv={self._scale_inv.flatten()[:4].tolist()}, "
                f"values={self.dequantize().flatten()[:6].tolist()})")

    # ------------------------------------------------------------ FSDP2 (fully_shard)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's all-gather input of this shard: its FP8 bytes (see :mod:`.fsdp_fp8`)."""
        from .fsdp_fp8 import float8_shard_for_gather

        return float8_shard_for_gather(self, mesh, outer_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The whole weight as a Float8Tensor over the gathered bytes."""
        from .fsdp_fp8 import float8_from_gather

        return float8_from_gather(all_gather_outputs, metadata, param_dtype, out)

    # ------------------------------------------------------------ torch.compile, pickling

    def __tensor_flatten__(self):
        names = ["_data", "_scale_inv"]
        if self._transpose is not None:
            names += ["_transpose", "_transpose_scale_inv"]
        return names, (self._fp8_dtype, self.dtype, self._scaling_mode, self.requires_grad,
                       self._scale_options)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        fp8_dtype, dtype, mode, requires_grad, options = meta
        data = inner["_data"]
        return Float8Tensor(data, inner["_scale_inv"], fp8_dtype, dtype, mode,
                            inner.get("_transpose"), inner.get("_transpose_scale_inv"),
                            requires_grad=requires_grad,
                            shape=None if outer_size == data.shape else outer_size,
                            scale_options=options)

    def __reduce_ex__(self, protocol):
        return _rebuild, (self._data, self._scale_inv, self._fp8_dtype, self.dtype,
                          self._scaling_mode, self._transpose, self._transpose_scale_inv,
                          self.requires_grad, self._presented_shape(), self._scale_options)

    def _presented_shape(self) -> Optional[tuple]:
        """The shape, where it is not the data's (a flat view of block-scaled bytes); else
        None."""
        return None if self.shape == self._data.shape else tuple(self.shape)

    # ------------------------------------------------------------ dispatch

    def _with(self, **changes) -> "Float8Tensor":
        fields = dict(data=self._data, scale_inv=self._scale_inv, fp8_dtype=self._fp8_dtype,
                      dtype=self.dtype, scaling_mode=self._scaling_mode,
                      transpose=self._transpose, transpose_scale_inv=self._transpose_scale_inv,
                      scale_options=self._scale_options)
        fields.update(changes)
        if "shape" not in fields and fields["data"].shape == self._data.shape:
            fields["shape"] = self._presented_shape()  # the same bytes (moved, cloned)
        return Float8Tensor(**fields)

    def _view(self, data: torch.Tensor, scale_inv: Optional[torch.Tensor] = None,
              **changes) -> "Float8Tensor":
        """A Float8Tensor over ``data`` (a view of this tensor's bytes) sharing this tensor's
        scale_inv (per tensor), or ``scale_inv`` (a view of its block grid's rows), as a
        view shares its base's storage: a write through the view (FSDP copies a shard into
        its padded buffer so) reaches both."""
        same = data.shape == self._data.shape
        out = self._with(data=data, scale_inv=self._scale_inv if scale_inv is None else scale_inv,
                         transpose=self._transpose if same else None,
                         transpose_scale_inv=self._transpose_scale_inv if same else None,
                         **changes)
        out._amax_group, out._gathered = self._amax_group, self._gathered
        return out

    def _assign(self, values: torch.Tensor) -> None:
        """Quantizes ``values`` into this tensor's own buffers (current scaling; on an FSDP2
        shard with the amax of the whole weight, reduced over the shard's group)."""
        if self._amax_group is not None and self._scaling_mode == "tensor":
            from .fsdp_fp8 import quantize_with_group_amax

            data, scale_inv = quantize_with_group_amax(values.to(self.dtype), self._fp8_dtype,
                                                       self._amax_group.group)
            self._copy_from(Float8Tensor(data.view(self.shape), scale_inv, self._fp8_dtype,
                                         self.dtype))
            return
        # (A flat view of block-scaled bytes quantizes the matrix its grid is laid over.)
        pow2, epsilon = self._scale_options
        fresh = Float8Tensor.quantize(values.to(self.dtype).reshape(self._data.shape),
                                      self._fp8_dtype,
                                      scaling_mode=self._scaling_mode,
                                      with_transpose=self._scaling_mode != "tensor"
                                      and self._transpose is not None,
                                      force_pow2_scales=pow2, amax_epsilon=epsilon)
        self._copy_from(fresh)

    def _copy_from(self, src: "Float8Tensor") -> None:
        """Writes src's bytes and scales into this tensor's buffers, in place: its aliases
        (``detach()``, ``.data``) share the buffers and must see the new values too."""
        self._data.copy_(src._data)
        self._scale_inv.copy_(src._scale_inv)
        if self._transpose is None:
            return
        if src._transpose is None and src._scaling_mode == "block_1x128":
            self._transpose = self._transpose_scale_inv = None  # cannot follow; remade
            return
        col, col_sinv = src.transpose_data(cache=False)
        self._transpose.copy_(col)
        if self._transpose_scale_inv is not self._scale_inv:  # per tensor they are one
            self._transpose_scale_inv.copy_(col_sinv)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PASSTHROUGH:
            out = args[0]._with()
            # An alias is the same tensor (nn.Parameter detaches what it wraps): it keeps the
            # initial value too.
            out._high_precision_init_val = args[0]._high_precision_init_val
            out._amax_group, out._gathered = args[0]._amax_group, args[0]._gathered
            return out
        # (Eager only: FSDP shards eagerly, and a traced graph keeps the fallback's plain
        # tensors, which the custom ops it calls take.)
        if (func in _LAYOUT and args[0]._scaling_mode in _LAYOUT_MODES
                and not torch.compiler.is_compiling()):
            out = _layout(func, *args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is _aten.clone.default:
            t = args[0]
            clone = lambda x: None if x is None else x.clone()  # noqa: E731
            return t._with(data=t._data.clone(), scale_inv=t._scale_inv.clone(),
                           transpose=clone(t._transpose),
                           transpose_scale_inv=clone(t._transpose_scale_inv))
        if func is _aten._to_copy.default:
            return _to_copy(args[0], **kwargs)
        if func is _aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            same = (isinstance(src, Float8Tensor) and src._fp8_dtype == dst._fp8_dtype
                    and src._scaling_mode == dst._scaling_mode)
            if same:  # byte for byte: a checkpoint loads back exactly
                dst._copy_from(_to_copy(src, device=dst.device))
            else:
                dst._assign(_unwrap(src).to(dst.device))
            return dst
        unwrapped_args = tree_map(_unwrap, args)
        unwrapped_kwargs = tree_map(_unwrap, kwargs)
        out = func(*unwrapped_args, **unwrapped_kwargs)
        target = args[0] if args else None
        if func._schema.is_mutable and isinstance(target, Float8Tensor):
            # An in-place op (optimizer step): it ran on a high-precision copy; store it back.
            target._assign(unwrapped_args[0])
            return target
        if func._schema.is_mutable and isinstance(target, (list, tuple)):
            # A foreach op in place (the optimizers' default for DTensor parameters on GPUs,
            # which FSDP2's are): each Float8Tensor of the list likewise.
            for t, values in zip(target, unwrapped_args[0], strict=True):
                if isinstance(t, Float8Tensor):
                    t._assign(values)
        return out


def _layout(func, t: Float8Tensor, *args, **kwargs):
    """``func`` (one of _LAYOUT; ``args`` those after the tensor) on the bytes of ``t`` (per
    tensor or in 128x128 blocks); NotImplemented where the result would not be whole rows of
    t, for a block tensor rows of whole blocks (see _rows): the caller then falls back to high
    precision."""
    block = t._scaling_mode != "tensor"
    if block and func is not _aten.view.default and (t.dim() != 2
                                                     or t.shape != t._data.shape):
        # Blocks are laid over a matrix's rows: only a matrix (not one seen flat, nor a
        # stack of them) is cut or padded.
        return NotImplemented
    if func in (_aten.new_zeros.default, _aten.new_empty.default):
        if kwargs.get("dtype") not in (None, t.dtype):
            return NotImplemented
        size = list(args[0])
        # A block tensor: only matrices of whole blocks of rows, or of t's rows (the padded
        # shard FSDP copies an FP8 shard into; where its shards are not FP8, which happens
        # when their row count is no multiple of 128, neither is their padded buffer).
        if block and (len(size) != 2 or (size[0] % BLOCK and size[0] != t.shape[0])):
            return NotImplemented
        device = kwargs.get("device") or t.device
        make = torch.zeros if func is _aten.new_zeros.default else torch.empty
        data = make(size, dtype=torch.uint8, device=device)  # FP8 zero is byte 0
        if block:  # each block of zeros has scale 1, as quantizing zeros gives
            scale_inv = torch.ones(block_grid(*size, t._scaling_mode), dtype=torch.float32,
                                   device=device)
            return Float8Tensor(data, scale_inv, t._fp8_dtype, t.dtype, t._scaling_mode,
                                scale_options=t._scale_options)
        return Float8Tensor(data, t._scale_inv.clone().to(device), t._fp8_dtype, t.dtype,
                            scale_options=t._scale_options)
    if func is _aten.view.default:
        # Only the flat view (FSDP keeps its shard so) and the identity (DTensor.to_local,
        # which a distributed checkpoint reads and writes through): any other view keeps
        # giving high-precision values, which code that reshapes FP8 activations expects.
        # Block-scaled bytes stay the matrix their scale grid is laid over, seen flat.
        size = list(args[0])
        if size in ([-1], [t.numel()]):
            return (t._view(t._data, shape=(t.numel(),)) if block
                    else t._view(t._data.view(-1)))
        if size != list(t.shape):
            return NotImplemented
        return t._view(t._data if block else t._data.view(size))
    if func is _aten.as_strided.default:
        # Only a leading run of whole rows (how FSDP2 takes the unpadded weight out of its
        # gathered buffer): anything else is no view of the bytes alone.
        size, stride = list(args[0]), list(args[1])
        offset = args[2] if len(args) > 2 else kwargs.get("storage_offset")
        contiguous = stride == [math.prod(size[i + 1:]) for i in range(len(size))]
        if (not size or not contiguous or offset not in (None, 0) or not t._data.is_contiguous()
                or size[1:] != list(t.shape[1:]) or size[0] > t.shape[0]):
            return NotImplemented
        out = _rows(t, 0, size[0])
        return NotImplemented if out is None else out
    # split(split_size, dim), split_with_sizes(split_sizes, dim), slice(dim, start, end, step)
    slicing = func is _aten.slice.Tensor
    names = ("dim", "start", "end", "step") if slicing else ("sizes", "dim")
    given = dict(zip(names, args, strict=False))  # (trailing arguments may be left out)
    given.update(kwargs)
    dim = given.get("dim", 0)
    if t.dim() == 0 or dim % t.dim() != 0:
        return NotImplemented
    if not slicing:
        sizes = given.get("sizes", given.get("split_size", given.get("split_sizes")))
        pieces, start = [], 0
        for d in t._data.split(sizes, 0):
            piece = _rows(t, start, start + d.shape[0])
            if piece is None:
                _warn_block_split(t, sizes)
                return NotImplemented
            pieces.append(piece)
            start += d.shape[0]
        return pieces
    if given.get("step", 1) != 1:
        return NotImplemented
    rows = range(t.shape[0])[given.get("start"):given.get("end")]
    out = _rows(t, rows.start, max(rows.start, rows.stop))
    return NotImplemented if out is None else out


def _rows(t: Float8Tensor, start: int, end: int) -> Optional[Float8Tensor]:
    """Rows [start, end) of ``t`` as a Float8Tensor over its bytes, or None where they make
    none. Per tensor any rows do. In 128x128 blocks the rows must start a block (their scales
    are the rows of the grid from there) and end one, or end the tensor, or end where the
    rest of their last block is zero bytes (FSDP's padding of a shorter last shard): a write
    through the view rescales that whole block, which other nonzero rows could not follow."""
    if t._scaling_mode == "tensor":
        return t._view(t._data[start:end])
    if start % BLOCK:
        return None
    stop = min(t.shape[0], -(-end // BLOCK) * BLOCK)
    if end < stop and bool(t._data[end:stop].any()):
        return None
    return t._view(t._data[start:end], t._scale_inv[start // BLOCK:-(-end // BLOCK)])


# (shape, piece sizes) of the block tensors already warned about (warned once each).
_WARNED_SPLITS: set = set()


def _warn_block_split(t: Float8Tensor, sizes) -> None:
    """Warns, once per shape and piece size, that a 128x128 block tensor was split off its
    block rows (FSDP2 shards so): its pieces are high-precision values, not FP8."""
    key = (tuple(t.shape), str(sizes))
    if key in _WARNED_SPLITS:
        return
    _WARNED_SPLITS.add(key)
    warnings.warn(
        f"Float8Tensor: a 128x128 block-scaled FP8 tensor of shape {list(t.shape)} is split "
        f"into pieces of {sizes} rows, which do not all start at a multiple of 128 rows: a "
        f"piece would cut through blocks whose scales cover 128 rows, so the pieces are its "
        f"high-precision values. Under FSDP2 (shards of ceil(rows / world size) rows) this "
        f"weight is then sharded, all-gathered and updated in high precision, not as FP8, and "
        f"an optimizer step no longer quantizes it back as the unsharded FP8 weight's step "
        f"does. FSDP2 shards of a multiple of 128 rows stay FP8.", UserWarning, stacklevel=2)


def _unwrap(x: Any) -> Any:
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def _to_copy(t: Float8Tensor, dtype=None, device=None, **_ignored) -> torch.Tensor:
    """Device moves keep the FP8 bytes; so does a change to another high-precision dtype (the
    dtype it dequantizes to), which is what ``module.bfloat16()`` asks of an FP8 weight. Any
    other dtype gets plain values."""
    if dtype is not None and dtype not in _HIGH:
        return t.dequantize(torch.float32).to(device=device, dtype=dtype)
    fields = {"dtype": dtype or t.dtype}
    if device is not None:
        for name in ("data", "scale_inv", "transpose", "transpose_scale_inv"):
            value = getattr(t, "_" + name)
            fields[name] = None if value is None else value.to(device)
    return t._with(**fields)


def _rebuild(data, scale_inv, fp8_dtype, dtype, mode, transpose, transpose_scale_inv,
             requires_grad, shape=None, scale_options=(False, 0.0)):
    return Float8Tensor(data, scale_inv, fp8_dtype, dtype, mode, transpose, transpose_scale_inv,
                        requires_grad=requires_grad, shape=shape, scale_options=scale_options)


# torch.load defaults to weights_only=True, which loads only allow-listed globals.
torch.serialization.add_safe_globals([_rebuild, Float8Tensor])


class _ToHighPrecision(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.dequantize()

    @staticmethod
    def backward(ctx, grad):
        return grad


def to_high_precision(t: torch.Tensor) -> torch.Tensor:
    """A Float8Tensor's values as a plain tensor of its dtype, with the gradient passing
    through to it (``dequantize()`` is not differentiable); any other tensor as it is."""
    return _ToHighPrecision.apply(t) if isinstance(t, Float8Tensor) else t
