"""``te.LayerNormLinear``: LayerNorm (or RMSNorm) then a linear layer, fused in FP8.

In FP8 under delayed scaling the norm writes the GEMM's FP8 input and its transpose itself
(``layernorm_linear_fn.py``); in high precision it is te.LayerNorm followed by nn.Linear.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from transformer_engine.common.recipe import Recipe

from .. import compiled_blocks, distributed, fp8, hp_blocks, sequence_parallel
from ..layernorm_linear_fn import Fp8LayerNormLinearFunction, NormConfig, NormLinearConsts
from ._checks import check_device, check_params_dtype, check_sizes, refuse_unbuilt
from ._deferred_wgrad import linear as hp_linear
from ._main_grad import route_to_main_grad
from .base import with_leading_dims
from .layernorm import apply_norm
from .linear import (
    _default_device,
    _LinearBase,
    check_fp8_shape,
    check_unsupported,
    fp8_input,
    refuse_fp8_grad,
)

__all__ = ["LayerNormLinear"]

NORMALIZATIONS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def norm_config(op: str, normalization: str, eps: float, zero_centered_gamma: bool,
                return_layernorm_output: bool) -> NormConfig:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{op}: normalization must be one of {tuple(NORMALIZATIONS)}, got "
                         f"{normalization!r}")
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    return NormConfig(NORMALIZATIONS[normalization], float(eps), bool(zero_centered_gamma),
                      bool(return_layernorm_output))


def gathered_ln_out(module: torch.nn.Module, shard: Optional[torch.Tensor],
                    group) -> Optional[torch.Tensor]:
    """The norm output a sequence-parallel block returns: this rank's shard, or with
    ``return_layernorm_output_gathered`` the whole sequence's."""
    if shard is None or not getattr(module, "return_layernorm_output_gathered", False):
        return shard
    return distributed.gather_from_sequence_parallel(shard, group)


def register_norm_params(module: torch.nn.Module, hidden: int, cfg: NormConfig,
                         dtype: torch.dtype, device: torch.device) -> None:
    """``layer_norm_weight`` (1, or 0 with zero_centered_gamma, which stores g - 1) and, for
    LayerNorm, ``layer_norm_bias`` (0)."""
    weight = torch.full((hidden,), 0.0 if cfg.zero_centered_gamma else 1.0, dtype=dtype,
                        device=device)
    module.layer_norm_weight = torch.nn.Parameter(weight)
    if cfg.norm == "layernorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype,
                                                                device=device))
    else:
        module.register_parameter("layer_norm_bias", None)


def norm_params(module: torch.nn.Module, dtype: torch.dtype):
    """The module's gamma and beta for the kernels (cast_norm_params)."""
    return cast_norm_params(module.layer_norm_weight, module.layer_norm_bias, dtype)


def cast_norm_params(gamma: torch.Tensor, beta, dtype: torch.dtype):
    """gamma and beta for the kernels, which take fp32 or the input's dtype (any other dtype
    is cast; autograd casts the gradient back)."""
    if gamma.dtype not in (dtype, torch.float32):
        gamma = gamma.to(dtype)
        beta = None if beta is None else beta.to(dtype)
    return gamma, beta


def parallel_norm_inputs(inp: torch.Tensor, norm: tuple, group) -> tuple:
    """The input and the norm's (gamma, beta) of a block whose first GEMM is column-parallel
    (without sequence parallelism: see sequence_parallel_norm). Each rank's GEMM gives only
    its share of the gradient of the norm's output, and the norm's backward is linear in that
    gradient: so each rank's input, gamma and beta gradients are shares too, summed over the
    ranks in the backward (the fused FP8 functions run the norm's backward themselves, so the
    sum cannot come between the GEMM and the norm)."""
    grad = torch.is_grad_enabled()

    def copy(t):
        if t is None or not (grad and t.requires_grad):
            return t
        return distributed.copy_to_tensor_parallel(t, group)

    return copy(inp), (copy(norm[0]), copy(norm[1]))


def sequence_parallel_norm(module, inp: torch.Tensor, state) -> tuple:
    """The norm of a sequence-parallel block (te.LayerNormLinear, te.LayerNormMLP) on this
    rank's shard of the tokens, gathered over the group for the column-parallel GEMM after
    it: (the whole norm output, this rank's shard of it in high precision or None).

    Under a per-tensor FP8 recipe whose scale the ranks share (sequence_parallel.gathers_fp8)
    the norm writes FP8 with that scale and the FP8 bytes are gathered (a Float8Tensor, which
    the GEMM takes as it is); otherwise the norm's output is gathered in the input's dtype.
    Either way the norm runs on the shard only. The gather's backward reduce-scatters the
    gradient of the norm's output (each rank's GEMM gives a share of it) before the norm's
    backward, so the input gradient is this rank's shard of the whole one, and gamma's and
    beta's gradients are this shard's shares, which the caller sums over the group (their
    ``sequence_parallel`` mark)."""
    cfg, group = module.cfg, module.tp_group
    gamma, beta = norm_params(module, inp.dtype)
    if state.enabled:
        plan, scales, history = module._fp8_meta_of(state.recipe)
        if sequence_parallel.gathers_fp8(plan, state.recipe, group):
            q, ln_out = sequence_parallel.norm_to_fp8(inp, gamma, beta, cfg, plan, scales,
                                                      history, group)
            return sequence_parallel.gather_fp8(q, group), ln_out
    ln_out = apply_norm(inp, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma)
    return (distributed.gather_from_sequence_parallel(ln_out, group),
            ln_out if cfg.return_ln_out else None)


def parallel_ln_out(ln_out: torch.Tensor, group) -> torch.Tensor:
    """The norm's output returned by a parallel block: its gradient (the same on every rank)
    joins the gradient shares that are summed over the ranks, so it enters on one rank."""
    if torch.is_grad_enabled() and ln_out.requires_grad:
        return distributed.gradient_on_first_rank(ln_out, group)
    return ln_out


def check_input(op: str, inp: torch.Tensor, features: int, param: torch.Tensor) -> None:
    """Shape, dtype and device (``param``'s, one of the module's parameters) of the input."""
    if inp.dim() == 0 or inp.shape[-1] != features:
        raise ValueError(f"{op}: input must have {features} features as its last dimension, "
                         f"got shape {list(inp.shape)}")
    if inp.dtype not in _DTYPES:
        raise TypeError(f"{op}: input must be float32, bfloat16 or float16, got {inp.dtype}")
    check_device(op, "input", inp, param)


def fp8_norm_linear(module, inp, gamma, beta, cfg: NormConfig, weight, bias, recipe: Recipe,
                    is_first_microbatch, fp8_output: bool = False):
    """The FP8 forward of ``norm(inp) @ weight^T (+ bias)`` with ``module``'s FP8 state (a
    module with one GEMM's state: te.LayerNormLinear, and te.Linear after a norm that
    te.ops.Sequential fuses with it)."""
    inp = fp8_input(module._name, inp)
    check_fp8_shape(inp, module.in_features, module.out_features, module._name)
    plan, scales, history = module._fp8_meta_of(recipe)
    gamma, beta = cast_norm_params(gamma, beta, inp.dtype)
    grad = torch.is_grad_enabled()
    need_dgrad = grad and (inp.requires_grad or gamma.requires_grad
                           or (beta is not None and beta.requires_grad))
    need_wgrad = grad and weight.requires_grad
    bwd_meta, bwd_recipe, group = module._backward_state(plan, recipe)
    store = module._wgrad_store
    if not fp8_output and compiled_blocks.usable(
            plan, bwd_recipe, history, inp, (weight,), (bias,),
            (gamma,) if beta is None else (gamma, beta), cfg, is_first_microbatch, module):
        # the whole block in two operator calls (forward, backward)
        out = compiled_blocks.layernorm_linear(inp, gamma, beta, weight, bias, plan, cfg, scales,
                                               history, bwd_meta, need_dgrad, need_wgrad)
        if out is not None:
            return with_leading_dims(out, inp)
    w = module._weight_operand(plan, weight, need_dgrad, is_first_microbatch, scales, history)
    col_sinv = None if plan.weight_mode == "tensor" else w.columnwise_scale_inv
    out_meta = module._output_meta(plan) if fp8_output else None
    consts = NormLinearConsts(plan, bwd_recipe, group, cfg, need_dgrad, need_wgrad, out_meta,
                              store)
    return with_leading_dims(Fp8LayerNormLinearFunction.apply(
        inp, gamma, beta, weight, bias, w.data, w.scale_inv, w.columnwise, col_sinv, history,
        scales, bwd_meta, consts), inp)


class LayerNormLinear(_LinearBase):
    """``norm(x) @ weight^T + bias`` with LayerNorm or RMSNorm over the last dimension; the
    GEMMs in FP8 under :func:`fp8_autocast`.

    Args (in NVIDIA Transformer Engine's order, as te.Linear's):
        in_features, out_features: sizes of the input (normalized over) and output features.
        eps: added to the variance (LayerNorm) or mean square (RMSNorm).
        bias: learn the linear layer's additive bias.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (no ``layer_norm_bias``).
        zero_centered_gamma: ``layer_norm_weight`` holds ``gamma - 1`` (initialized to 0):
            better precision near 1 in low-precision parameters.
        return_layernorm_output: also return the norm's output (high precision; e.g. for a
            residual taken after the norm). Its gradient joins the block's. Under sequence
            parallelism: this rank's shard of it (the tokens its norm computed).
        return_layernorm_output_gathered: under sequence parallelism, return the norm's
            output over the whole sequence instead (one all-gather of it in its dtype, whose
            backward reduce-scatters the gradient); without it, no effect.
        return_bias: return the bias instead of adding it (see te.Linear).
        params_dtype, device, init_method, parameters_split, fuse_wgrad_accumulation,
            name: as te.Linear.
        sequence_parallel: as te.Linear; the norm runs on this rank's shard of the first
            dimension and its output is gathered for the GEMM (as FP8 bytes where te.Linear
            gathers FP8); the norm's parameters are marked ``sequence_parallel``.
        tp_group, tp_size, parallel_mode: as te.Linear, ``"column"`` only: each rank holds
            the full norm parameters and its rows of the weight, normalizes the full input
            and returns its shard of the output features; the gradients of the input and of
            the norm's parameters are all-reduced in the backward. ``"row"`` is refused (the
            norm needs every input feature on every rank).
        get_rng_state_tracker, delay_wgrad_compute (with :meth:`backward_dw`), ub_overlap_ag,
            ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_wgrad, ub_bulk_dgrad, ub_name,
            symmetric_ar_type: as te.Linear.

    Returns ``output``, then the bias when ``return_bias``, then the norm's output when
    ``return_layernorm_output``.

    Example:
        >>> layer = te.LayerNormLinear(1024, 3072, normalization="RMSNorm")  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = layer(torch.randn(2048, 1024, device=layer.weight.device))
    """

    _name = "te.LayerNormLinear"

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False,
                 device: Union[torch.device, str, None] = None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, name: Optional[str] = None) -> None:
        refuse_unbuilt(self._name, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                       ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
                       ub_bulk_dgrad=ub_bulk_dgrad, symmetric_ar_type=symmetric_ar_type)
        tp = distributed.check_tensor_parallel(self._name, tp_group, tp_size, parallel_mode)
        if tp > 1 and parallel_mode == "row":
            # Each rank would hold a slice of the input features, but the norm needs all of
            # them: it would have to gather the input first.
            raise NotImplementedError(
                f"{self._name}: parallel_mode='row' is not implemented (the norm needs the "
                "full input features on every rank); use parallel_mode='column', or te.Linear "
                "for a row-parallel layer")
        check_unsupported(None, 1, parallel_mode, False, fuse_wgrad_accumulation, self._name)
        check_sizes(self._name, in_features=in_features, out_features=out_features)
        check_params_dtype(self._name, params_dtype)
        cfg = norm_config(self._name, normalization, eps, zero_centered_gamma,
                               return_layernorm_output)
        device = _default_device(device)
        super().__init__(device)
        self.cfg, self.normalization = cfg, normalization
        self.return_bias, self.name, self.parallel_mode = return_bias, name, parallel_mode
        self.ub_name = ub_name
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        self.get_rng_state_tracker = get_rng_state_tracker
        self._delay_wgrad(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        dtype = params_dtype or torch.get_default_dtype()
        register_norm_params(self, int(in_features), cfg, dtype, device)
        self._setup_linear(in_features, out_features, bias, params_dtype, device, init_method,
                           parameters_split, parallel_mode if tp > 1 else None, tp_group, tp)
        # (no effect unless the layer is split)
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        if self.sequence_parallel:
            distributed.mark_sequence_parallel(self.layer_norm_weight,
                                               getattr(self, "layer_norm_bias", None))

    @property
    def eps(self) -> float:
        return self.cfg.eps

    @property
    def zero_centered_gamma(self) -> bool:
        return self.cfg.zero_centered_gamma

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalization={self.normalization}, eps={self.cfg.eps}"

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """``inp`` [..., in_features] -> [..., out_features] (see the class docstring for
        what else comes back); ``is_first_microbatch``, ``fp8_output`` and ``fp8_grad`` as for
        te.Linear."""
        if fp8_grad:
            refuse_fp8_grad(self._name)
        if self.fuse_wgrad_accumulation:
            route_to_main_grad(self._gemm_weights())
        if self._tp_mode is not None:
            return self._parallel_forward(inp, is_first_microbatch, fp8_output)
        check_input(self._name, inp, self.in_features, self.layer_norm_weight)
        weight, bias = self._weight_and_bias()
        gemm_bias = None if self.return_bias else bias
        state = fp8.STATE
        if state.enabled:
            out = self._fp8_forward(inp, weight, gemm_bias, state.recipe, is_first_microbatch,
                                    fp8_output)
        else:
            out = self._hp_forward(inp, weight, gemm_bias, state)
        if self.cfg.return_ln_out:
            out, ln_out = out
        else:
            ln_out = None
        result = (out,) + ((bias,) if self.return_bias else ()) + \
            ((ln_out,) if ln_out is not None else ())
        return result if len(result) > 1 else out

    def _parallel_forward(self, inp, is_first_microbatch, fp8_output: bool):
        """A column-parallel block: the norm on the full input on every rank (on this rank's
        sequence shard, then gathered, under sequence parallelism), the GEMM on this rank's
        rows of the weight (its shard of the output features); the gradients of the input and
        of the norm's parameters summed over the ranks (parallel_norm_inputs; reduce-scattered
        before the norm's backward under sequence parallelism, sequence_parallel_norm)."""
        if self._shared_tp_group is None:
            distributed.refuse_without_group(self._name, self.tp_size)
        check_input(self._name, inp, self.in_features, self.layer_norm_weight)
        weight, bias = self._weight_and_bias()
        gemm_bias = None if self.return_bias else bias
        group = self.tp_group
        state = fp8.STATE
        if state.enabled:
            inp = fp8_input(self._name, inp)
            check_fp8_shape(inp, self.in_features, weight.shape[0], self._name)
        if self.sequence_parallel:
            ln_full, ln_out = sequence_parallel_norm(self, inp, state)
            if state.enabled:
                out = self._fp8_linear(ln_full, weight, gemm_bias, state.recipe,
                                       is_first_microbatch, fp8_output)
            else:
                out = self._hp_forward(ln_full, weight, gemm_bias, state, normalized=True)
                if self.cfg.return_ln_out:
                    out = out[0]  # (the gathered norm output; this rank's shard is returned)
            ln_out = gathered_ln_out(self, ln_out, group)
        else:
            inp, norm = parallel_norm_inputs(inp, norm_params(self, inp.dtype), group)
            if state.enabled:
                out = self._fp8_forward(inp, weight, gemm_bias, state.recipe,
                                        is_first_microbatch, fp8_output, norm)
            else:
                out = self._hp_forward(inp, weight, gemm_bias, state, norm)
            ln_out = None
            if self.cfg.return_ln_out:
                out, ln_out = out
                ln_out = parallel_ln_out(ln_out, group)
        result = (out,) + ((bias,) if self.return_bias else ()) + \
            ((ln_out,) if ln_out is not None else ())
        return result if len(result) > 1 else out

    def _hp_forward(self, inp, weight, bias, state, norm=None, normalized: bool = False):
        # norm: (gamma, beta) as the parallel forward hands them over; normalized: inp is the
        # norm's output already (sequence parallelism normalizes each shard, then gathers)
        cfg = self.cfg
        w = weight.to(inp.dtype)
        b = None if bias is None else bias.to(inp.dtype)
        if normalized:
            ln_out = inp
        else:
            gamma, beta = norm_params(self, inp.dtype) if norm is None else norm
            if (not (cfg.return_ln_out or self._wgrad_store is not None or state.calibrating)
                    and hp_blocks.usable(inp, gamma, beta, w, b)):
                return hp_blocks.layernorm_linear(inp, gamma, beta, w, b, cfg.norm, cfg.eps,
                                                  cfg.zero_centered_gamma)
            ln_out = apply_norm(inp, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma)
        if state.calibrating:
            self._calibrate_gemm_operands((("input", ln_out, True), ("weight", weight, False)),
                                          state)
        out = hp_linear(ln_out, w, b, self._wgrad_store)
        return (out, ln_out) if cfg.return_ln_out else out

    def _fp8_forward(self, inp, weight, bias, recipe: Recipe, is_first_microbatch,
                     fp8_output: bool = False, norm=None):
        gamma, beta = (self.layer_norm_weight, self.layer_norm_bias) if norm is None else norm
        return fp8_norm_linear(self, inp, gamma, beta, self.cfg, weight, bias, recipe,
                               is_first_microbatch, fp8_output)
