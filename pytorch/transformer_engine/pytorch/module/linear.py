"""``te.Linear``: a drop-in ``nn.Linear`` whose GEMMs run in FP8 inside ``fp8_autocast``."""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from transformer_engine.common.recipe import Recipe

from .. import fp8, ops
from ..float8_tensor import Float8Tensor
from ..linear_fn import Fp8LinearFunction
from ..quantization import Operand, Plan, make_plan, quantize, record_amax
from .base import FP8Module, recipe_summary

__all__ = ["Linear"]

_PLANS: dict = {}
# FP8 tensor cores work on 16x16 granules: every GEMM dimension must be a multiple of 16.
_FP8_GRANULE = 16


def _plan(recipe: Recipe) -> Plan:
    plan = _PLANS.get(recipe)
    if plan is None:
        plan = _PLANS[recipe] = make_plan(recipe)
    return plan


def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_sizes(out_features: int, parameters_split) -> Optional[dict[str, int]]:
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        sizes = {str(k): int(v) for k, v in parameters_split.items()}
    else:
        names = list(parameters_split)
        if not names or out_features % len(names):
            raise ValueError(f"te.Linear: parameters_split must split out_features="
                             f"{out_features} evenly, got {len(names)} names")
        sizes = {str(n): out_features // len(names) for n in names}
    if sum(sizes.values()) != out_features:
        raise ValueError(f"te.Linear: parameters_split sizes must sum to out_features="
                         f"{out_features}, got {sizes}")
    return sizes


class Linear(FP8Module):
    """``y = x @ weight^T + bias``; in FP8 under :func:`fp8_autocast`, else like nn.Linear.

    Args:
        in_features, out_features: sizes of the input and output features (K and N).
        bias: learn an additive bias.
        return_bias: return ``(output, bias)`` with the bias not added, for a caller that
            fuses it into what follows.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        device: where the parameters live (default: the current CUDA device when there is
            one, else the CPU).
        init_method: ``init_method(weight)`` initializes the [out, in] weight in place;
            default: nn.Linear's (Kaiming uniform).
        parameters_split: names (even split) or ``{name: size}`` of row blocks of the weight
            kept as separate parameters ``<name>_weight`` / ``<name>_bias`` (e.g. q, k, v).
        tp_group, tp_size, parallel_mode, sequence_parallel: tensor parallelism; accepted
            for compatibility, only ``tp_size=1`` is implemented.
        fuse_wgrad_accumulation: accumulating wgrad into ``main_grad``; not implemented.

    Example:
        >>> import transformer_engine.pytorch as te  # doctest: +SKIP
        >>> layer = te.Linear(768, 3072)  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = layer(torch.randn(2048, 768, device=layer.weight.device))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 parameters_split=None, tp_group=None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, name: Optional[str] = None) -> None:
        _check_unsupported(tp_group, tp_size, parallel_mode, sequence_parallel,
                           fuse_wgrad_accumulation)
        device = _default_device(device)
        super().__init__(device)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.return_bias, self.name = return_bias, name
        self.parallel_mode = parallel_mode
        dtype = params_dtype or torch.get_default_dtype()
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        with torch.no_grad():
            if init_method is None:
                torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            else:
                init_method(weight)
        full_bias = None
        if bias:
            bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
            full_bias = torch.empty(out_features, dtype=dtype, device=device)
            torch.nn.init.uniform_(full_bias, -bound, bound)
        self._splits = _split_sizes(out_features, parameters_split)
        self._register_params(weight, full_bias)
        self._weight_cache: Optional[Operand] = None

    def _register_params(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        init = fp8.MODEL_INIT
        fp8_mode = _plan(init.recipe).weight_mode if init.enabled else None

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            if fp8_mode is None:
                return torch.nn.Parameter(t)
            q = Float8Tensor.quantize(t, _plan(init.recipe).fwd_dtype, scaling_mode=fp8_mode)
            return torch.nn.Parameter(q)

        if self._splits is None:
            self.weight = param(weight)
            self.bias = None if bias is None else torch.nn.Parameter(bias)
            return
        self.weight_names, self.bias_names = [], []
        start = 0
        for split, size in self._splits.items():
            rows = slice(start, start + size)
            start += size
            setattr(self, f"{split}_weight", param(weight[rows].clone()))
            self.weight_names.append(f"{split}_weight")
            if bias is not None:
                setattr(self, f"{split}_bias", torch.nn.Parameter(bias[rows].clone()))
                self.bias_names.append(f"{split}_bias")
        self.register_parameter("bias", None) if bias is None else None

    def _weight_and_bias(self):
        if self._splits is None:
            return self.weight, self.bias
        weight = torch.cat([getattr(self, n) for n in self.weight_names])
        bias = torch.cat([getattr(self, n) for n in self.bias_names]) if self.bias_names \
            else None
        return weight, bias

    def extra_repr(self) -> str:
        bias = self.bias is not None or bool(getattr(self, "bias_names", None))
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"

    # ------------------------------------------------------------------ forward

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``inp`` [..., in_features] -> [..., out_features] (and the bias if return_bias).

        ``is_first_microbatch``: None quantizes the weight at every call; True quantizes it
        and keeps the FP8 copy; False reuses that copy (the weight does not change between
        the microbatches of one optimizer step)."""
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"te.Linear: input must have in_features={self.in_features} "
                             f"as its last dimension, got shape {list(inp.shape)}")
        weight, bias = self._weight_and_bias()
        state = fp8.STATE
        gemm_bias = None if self.return_bias else bias
        if state.enabled:
            out = self._fp8_forward(inp, weight, gemm_bias, state.recipe, is_first_microbatch)
        else:
            if state.calibrating and state.recipe.delayed():
                self._calibrate(inp, weight, state.recipe)
            # .to() (a no-op for the same dtype) keeps autograd's link to the parameter; a
            # Float8Tensor weight dequantizes in it (__torch_dispatch__).
            out = F.linear(inp, weight.to(inp.dtype),
                           None if gemm_bias is None else gemm_bias.to(inp.dtype))
        return (out, bias) if self.return_bias else out

    def _calibrate(self, inp: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> None:
        """Records the forward amaxes (high-precision compute) for the next scale update."""
        self._fit_fp8_meta(recipe)
        w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight
        record_amax(self.amax_history_fwd, 0, ops.amax(inp.detach().reshape(-1, inp.shape[-1])))
        record_amax(self.amax_history_fwd, 1, ops.amax(w.detach()))
        fp8.register_forward_amaxes(self, recipe)

    def _fp8_forward(self, inp, weight, bias, recipe: Recipe, is_first_microbatch):
        plan = _plan(recipe)
        device_type = inp.device.type
        if torch.is_autocast_enabled(device_type):  # torch.autocast picks the activation dtype
            inp = inp.to(torch.get_autocast_dtype(device_type))
        _check_fp8_shape(inp, self.in_features, self.out_features)
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"te.Linear: input must be float32, bfloat16 or float16 in FP8, "
                            f"got {inp.dtype}")
        self._recipe_summary = recipe_summary(recipe)
        if plan.kind == "delayed":
            self._fit_fp8_meta(recipe)
            fp8.register_forward_amaxes(self, recipe)
        grad = torch.is_grad_enabled()
        need_dgrad = grad and inp.requires_grad
        need_wgrad = grad and weight.requires_grad
        w = self._weight_operand(plan, weight, need_dgrad, is_first_microbatch)
        # Per-tensor scaling shares one scale_inv between the copies; autograd.Function under
        # torch.compile takes no tensor twice, so the column-wise one goes as None.
        col_sinv = None if plan.weight_mode == "tensor" else w.columnwise_scale_inv
        group = fp8.STATE.group
        general = plan.kind == "delayed" and (plan.algo == "callable" or group is not None)
        return Fp8LinearFunction.apply(
            inp, weight, bias, w.data, w.scale_inv, w.columnwise, col_sinv,
            self.amax_history_fwd, self.scale_fwd, self.amax_history_bwd, self.scale_bwd,
            self.scale_inv_bwd, plan, recipe if general else None, group, need_dgrad,
            need_wgrad)

    def _weight_operand(self, plan: Plan, weight, need_col: bool, is_first_microbatch):
        if (isinstance(weight, Float8Tensor) and weight._fp8_dtype == plan.fwd_dtype
                and weight._scaling_mode == plan.weight_mode):
            empty = weight._data.new_empty(0)
            cache = not torch.compiler.is_compiling()
            col, col_sinv = weight.transpose_data(cache) if need_col else (empty, empty)
            return Operand(weight._data, weight._scale_inv, col, col_sinv, plan.fwd_dtype,
                           plan.weight_mode)
        cached = self._weight_cache
        if (is_first_microbatch is False and cached is not None and cached.mode == plan.weight_mode
                and cached.fp8_dtype == plan.fwd_dtype
                and (cached.columnwise.numel() > 0 or not need_col)):
            return cached
        w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight.detach()
        op, amax = quantize(plan, "weight", w, True, need_col, self.scale_fwd[1:2])
        if amax is not None:
            record_amax(self.amax_history_fwd, 1, amax)
        self._weight_cache = op if is_first_microbatch is not None else None
        return op


def _check_fp8_shape(inp: torch.Tensor, k: int, n: int) -> None:
    m = inp.numel() // k if k else 0
    for name, value in (("in_features", k), ("out_features", n),
                        ("tokens (input.numel() // in_features)", m)):
        if value % _FP8_GRANULE:
            raise ValueError(f"te.Linear: FP8 GEMMs need dimensions that are multiples of "
                             f"{_FP8_GRANULE}; {name} must be a multiple of {_FP8_GRANULE}, "
                             f"got {value} (input shape {list(inp.shape)})")


def _check_unsupported(tp_group, tp_size, parallel_mode, sequence_parallel,
                       fuse_wgrad_accumulation) -> None:
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"te.Linear: parallel_mode must be None, 'column' or 'row', got "
                         f"{parallel_mode!r}")
    group_size = tp_group.size() if tp_group is not None and hasattr(tp_group, "size") else 1
    if tp_size != 1 or group_size != 1:
        raise NotImplementedError(
            f"te.Linear: tensor parallelism is not implemented yet; tp_size must be 1, got "
            f"{tp_size} (tp_group of size {group_size})")
    if sequence_parallel:
        raise NotImplementedError("te.Linear: sequence_parallel=True is not implemented yet "
                                  "(it needs tensor parallelism)")
    if fuse_wgrad_accumulation:
        raise NotImplementedError("te.Linear: fuse_wgrad_accumulation=True is not implemented "
                                  "yet")
