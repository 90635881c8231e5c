"""Quantizers under NVIDIA's names: objects that turn a high-precision tensor into a
:class:`~transformer_engine.pytorch.Float8Tensor` the way one recipe role does.

- ``Float8Quantizer(scale, amax, fp8_dtype)``: delayed scaling's cast with a given ``scale``
  ([1] fp32); each quantization writes the tensor's amax into ``amax``.
- ``Float8CurrentScalingQuantizer(fp8_dtype, device)``: the scale from the tensor's own amax.
- ``Float8BlockQuantizer(fp8_dtype, rowwise=..., columnwise=..., block_scaling_dim=2)``: a
  scale per 128 x 128 block (``block_scaling_dim=2``) or per 1 x 128 row block (1).

``fp8_dtype`` is our format name (``"float8_e4m3"``, ``"float8_e5m2"``), a torch float8 dtype,
or a member of ``transformer_engine.common.recipe.Format`` (E4M3 / E5M2). The row-wise data is
always made (te modules and ``dequantize`` read it); ``columnwise=True`` adds the transposed
copy the backward GEMMs read.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from ..float8_tensor import Float8Tensor
from ..ops._backend import FP8_DTYPES, TORCH_FP8

_BY_TORCH = {v: k for k, v in TORCH_FP8.items()}


def _fp8_name(owner: str, fp8_dtype) -> str:
    if isinstance(fp8_dtype, str) and fp8_dtype in FP8_DTYPES:
        return fp8_dtype
    if isinstance(fp8_dtype, torch.dtype) and fp8_dtype in _BY_TORCH:
        return _BY_TORCH[fp8_dtype]
    name = getattr(fp8_dtype, "name", None)  # recipe.Format.E4M3 / E5M2
    if name in ("E4M3", "E5M2"):
        return f"float8_{name.lower()}"
    if name in ("kFloat8E4M3", "kFloat8E5M2"):  # NVIDIA's tex.DType (transformer_engine_torch)
        return f"float8_{name[-4:].lower()}"
    raise TypeError(f"{owner}: fp8_dtype must be one of {FP8_DTYPES}, a torch float8 dtype, "
                    f"recipe.Format.E4M3 / E5M2 or tex.DType.kFloat8E4M3 / kFloat8E5M2, got "
                    f"{fp8_dtype!r}")


def _matrix(owner: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16,
                                                          torch.float16):
        raise TypeError(f"{owner}: the tensor to quantize must be float32, bfloat16 or "
                        f"float16, got {getattr(x, 'dtype', type(x).__name__)}")
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


class Quantizer:
    """What the quantizers share: the usage flags and the call forms."""

    _owner = "Quantizer"

    def __init__(self, fp8_dtype, rowwise: bool, columnwise: bool) -> None:
        self.dtype = _fp8_name(self._owner, fp8_dtype)
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def set_usage(self, *, rowwise: Optional[bool] = None,
                  columnwise: Optional[bool] = None) -> None:
        """Which copies later quantizations make (the row-wise one always: see the module)."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def __call__(self, tensor: torch.Tensor) -> Float8Tensor:
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor, *, out: Optional[Float8Tensor] = None
                 ) -> Float8Tensor:
        """``tensor`` as a Float8Tensor (of ``tensor``'s dtype); with ``out``, written into
        ``out``'s bytes instead (shapes must match) and ``out`` returned."""
        q = self._quantize(tensor)
        if out is None:
            return q
        return self.update_quantized(tensor, out, _made=q)

    def update_quantized(self, src: torch.Tensor, dst: Float8Tensor, *,
                         _made: Optional[Float8Tensor] = None) -> Float8Tensor:
        """Quantizes ``src`` into the existing Float8Tensor ``dst`` (its bytes and scale)."""
        if not isinstance(dst, Float8Tensor) or dst.shape != src.shape:
            raise ValueError(f"{self._owner}.update_quantized: dst must be a Float8Tensor of "
                             f"src's shape {list(src.shape)}, got "
                             f"{type(dst).__name__} {list(getattr(dst, 'shape', []))}")
        q = _made if _made is not None else self._quantize(src)
        dst._copy_from(q)
        return dst

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32,
                   device=None) -> Float8Tensor:
        """An uninitialized Float8Tensor of ``shape`` (scale_inv 1) presenting ``dtype``."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        data = torch.empty(tuple(shape), dtype=torch.uint8, device=device)
        return Float8Tensor(data, torch.ones(1, device=device), self.dtype, dtype)

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        raise NotImplementedError


class Float8Quantizer(Quantizer):
    """Delayed scaling's cast: ``scale`` [1] fp32 given, the amax written into ``amax`` [1]."""

    _owner = "Float8Quantizer"

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *,
                 rowwise: bool = True, columnwise: bool = True) -> None:
        for name, t in (("scale", scale), ("amax", amax)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == 1):
                raise TypeError(f"Float8Quantizer: {name} must be a float32 tensor of one "
                                f"element, got {getattr(t, 'dtype', type(t).__name__)} of "
                                f"{getattr(t, 'numel', lambda: '?')()} elements")
        super().__init__(fp8_dtype, rowwise, columnwise)
        self.scale, self.amax = scale, amax

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        m = _matrix(self._owner, tensor)
        scale = self.scale.reshape(1).to(m.device)
        data, col, sinv, amax = ops.quantize(m, scale, self.dtype, True, self.columnwise_usage)
        with torch.no_grad():
            self.amax.copy_(amax.reshape(self.amax.shape))
        return Float8Tensor(data.view(tensor.shape), sinv, self.dtype, tensor.dtype, "tensor",
                            col if self.columnwise_usage else None,
                            sinv if self.columnwise_usage else None)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: the scale from the tensor's own amax (``force_pow2_scales`` rounds it
    down to a power of two; ``amax_epsilon`` is a floor under the amax)."""

    _owner = "Float8CurrentScalingQuantizer"

    def __init__(self, fp8_dtype, device=None, *, rowwise: bool = True,
                 columnwise: bool = True, with_amax_reduction: bool = False,
                 amax_reduction_group=None, force_pow2_scales: bool = False,
                 amax_epsilon: float = 0.0) -> None:
        if with_amax_reduction or amax_reduction_group is not None:
            raise NotImplementedError("Float8CurrentScalingQuantizer: with_amax_reduction / "
                                      "amax_reduction_group are not supported here (only "
                                      "False / None)")
        super().__init__(fp8_dtype, rowwise, columnwise)
        self.force_pow2_scales, self.amax_epsilon = bool(force_pow2_scales), float(amax_epsilon)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scale = torch.ones(1, device=device)
        self.amax = torch.zeros(1, device=device)

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        m = _matrix(self._owner, tensor)
        data, col, scale, sinv, amax = ops.quantize_current(
            m, self.dtype, True, self.columnwise_usage, self.force_pow2_scales,
            self.amax_epsilon)
        self.scale, self.amax = scale, amax
        return Float8Tensor(data.view(tensor.shape), sinv, self.dtype, tensor.dtype, "tensor",
                            col if self.columnwise_usage else None,
                            sinv if self.columnwise_usage else None)


class Float8BlockQuantizer(Quantizer):
    """A scale per block: 128 x 128 (``block_scaling_dim=2``) or 1 x 128 (1)."""

    _owner = "Float8BlockQuantizer"

    def __init__(self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True,
                 amax_epsilon: float = 0.0, force_pow2_scales: bool = True,
                 block_scaling_dim: int = 2) -> None:
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer: block_scaling_dim must be 1 or 2, got "
                             f"{block_scaling_dim!r}")
        super().__init__(fp8_dtype, rowwise, columnwise)
        self.amax_epsilon, self.force_pow2_scales = float(amax_epsilon), bool(force_pow2_scales)
        self.mode = "block_128x128" if block_scaling_dim == 2 else "block_1x128"

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        m = _matrix(self._owner, tensor)
        data, sinv, col, col_sinv = ops.quantize_block(
            m, self.dtype, self.mode, True, self.columnwise_usage, self.force_pow2_scales,
            self.amax_epsilon)
        return Float8Tensor(data.view(tensor.shape), sinv, self.dtype, tensor.dtype, self.mode,
                            col if self.columnwise_usage else None,
                            col_sinv if self.columnwise_usage else None)
