"""``FusedAdam``: NVIDIA Transformer Engine's Adam / AdamW optimizer (``te.optimizers.FusedAdam``).

NVIDIA's runs its own multi-tensor CUDA kernels. Here the update of a parameter group is torch's
fused Adam kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``, on CPU and CUDA): one call
per device for all of the group's tensors, on float32 values. What NVIDIA's kernels add around
the update is done around that call:

- master weights: the update runs on the optimizer's float32 copy of each parameter
  (``state[p]["master_param"]``), then the parameter gets the result in its own dtype: rounded
  for bf16/fp16, quantized in place for an FP8 :class:`Float8Tensor` (its own current scale);
- ``store_param_remainders``: a bf16 parameter plus the 16 low bits of its float32 master (int16)
  are that master exactly, so the master takes half the memory;
- optimizer states kept in fp16 (scaled per tensor), bf16 or FP8 (``torch.uint8``) are expanded
  to float32 for the update and stored back.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from itertools import chain
from typing import Optional

import torch

from ..float8_tensor import Float8Tensor

__all__ = ["FusedAdam"]

_STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_MASTER_DTYPES = (torch.float32, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# fp16 states are stored divided by a per-tensor scale that maps their absmax to half of fp16's
# largest value (NVIDIA's choice): the other half is headroom, so no value overflows.
_FP16_RANGE = torch.finfo(torch.float16).max / 2.0


def _names(dtypes) -> str:
    return ", ".join("torch.uint8 (FP8)" if d == torch.uint8 else str(d) for d in dtypes)


def _resolve_set_to_none(owner: str, set_grad_none: Optional[bool],
                        set_to_none: Optional[bool]) -> bool:
    """``zero_grad``'s choice between None and zeros: the deprecated constructor flag wins
    (a contradicting call is an error, as in NVIDIA's), else the call's, else None."""
    if set_grad_none is not None:
        if set_to_none is not None and set_to_none != set_grad_none:
            raise ValueError(f"{owner}.zero_grad: set_to_none must match the constructor's "
                             f"set_grad_none={set_grad_none}, got {set_to_none}")
        return set_grad_none
    return True if set_to_none is None else set_to_none


def _checked_work(param_groups: list, gradient_of, check) -> list:
    """Per parameter group, its (parameter, gradient) pairs that have a gradient, every pair
    checked before the step changes anything (so a refused parameter leaves all unchanged)."""
    work = []
    for group in param_groups:
        items = [(p, g) for p in group["params"] if (g := gradient_of(p)) is not None]
        for p, g in items:
            check(p, g)
        work.append(items)
    return work


def _closure_loss(closure) -> Optional[torch.Tensor]:
    """torch.optim's closure convention: the loss it returns, computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master held as a bf16 parameter plus its low 16 bits (int16)."""
    high = param.view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    # The parameter is the master rounded up where the dropped half is at least 0x8000, which
    # is where the remainder, read as a signed int16, is negative: undo that rounding first.
    high = high - (low < 0).to(torch.int32)
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def _split_remainder(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Writes ``master`` (float32) into a bf16 parameter (rounded to nearest, ties away from
    zero, as NVIDIA's kernel rounds) and its low 16 bits into ``remainder``."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps: 0x8000 and above read as negative
    high = (bits >> 16) + (low < 0).to(torch.int32)
    remainder.copy_(low)
    param.view(torch.int16).copy_(high.to(torch.int16))


class FusedAdam(torch.optim.Optimizer):
    """Adam with decoupled weight decay (AdamW) by default, or L2 Adam (``adam_w_mode=False``),
    with optional float32 master weights and low-precision optimizer states.

    NVIDIA TE's arguments, order and defaults. Per element, with ``g`` the gradient
    (``p.decoupled_grad`` with ``use_decoupled_grad=True``, else ``p.grad``) and ``t`` the
    group's step::

        g = g + weight_decay * p                            (adam_w_mode=False only)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / c1) / (sqrt(v / c2) + eps) + weight_decay * p    (the last term: adam_w_mode)
        p = p - lr * u

    with ``c1 = 1 - beta1**t``, ``c2 = 1 - beta2**t`` (1 with ``bias_correction=False``).
    Parameters may be float32, bf16, fp16 or FP8 :class:`Float8Tensor` (needs
    ``master_weights=True``); those without a gradient are left alone.

    Args:
        params: parameters or parameter-group dicts.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (``0 <= beta < 1``).
        amsgrad: must be False (NVIDIA's has no AMSGrad either).
        bias_correction: divide the moments by ``1 - beta**t``.
        adam_w_mode: decoupled weight decay (AdamW); False: L2 penalty added to the gradient.
        capturable: CUDA-graph safe: ``lr`` becomes a tensor and the step counter a device
            tensor, nothing syncs with the host; ``step(grad_scaler=...)`` (a ``GradScaler``
            passes itself) unscales the gradients and skips the update, step count included,
            on inf/NaN. Needs float32 states and master weights; no FP8 parameters.
        master_weights: keep a copy of each parameter in ``master_weight_dtype`` and update that.
        master_weight_dtype: torch.float32, or torch.float16 (scaled per tensor).
        exp_avg_dtype, exp_avg_sq_dtype: torch.float32, torch.float16 (scaled per tensor),
            torch.bfloat16, or torch.uint8 meaning FP8 E4M3 (a Float8Tensor, current scaling).
        use_decoupled_grad: read gradients from ``p.decoupled_grad`` (e.g. float32 gradients
            of bf16 or FP8 parameters, which ``p.grad`` cannot hold).
        store_param_remainders: for bf16 parameters with float32 master weights, keep only
            the master's low 16 bits (int16): the bf16 parameter holds the rest. No effect on
            other parameters.
        set_grad_none: deprecated (use ``zero_grad(set_to_none=...)``).

    Example:
        >>> model = torch.nn.Linear(4, 4).bfloat16()
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
        >>> model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["master_param"].dtype
        torch.float32
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *,
                 bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False,
                 set_grad_none: Optional[bool] = None):
        if amsgrad:
            # NotImplementedError is a RuntimeError, what NVIDIA's raises here.
            raise NotImplementedError("FusedAdam: amsgrad must be False (the AMSGrad variant "
                                      "is not implemented, as in NVIDIA TE), got True")
        for name, beta in zip(("betas[0]", "betas[1]"), betas, strict=True):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdam: {name} must be in [0, 1), got {beta}")
        if master_weights and master_weight_dtype not in _MASTER_DTYPES:
            raise ValueError(f"FusedAdam: master_weight_dtype must be one of "
                             f"{_names(_MASTER_DTYPES)}, got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _STATE_DTYPES:
                raise ValueError(f"FusedAdam: {name} must be one of {_names(_STATE_DTYPES)}, "
                                 f"got {dtype}")
        if capturable:
            # Non-float32 states are expanded into fresh float32 buffers every step, which a
            # CUDA graph cannot replay (NVIDIA's refuses these too).
            for name, dtype in (("master_weight_dtype",
                                 master_weight_dtype if master_weights else torch.float32),
                                ("exp_avg_dtype", exp_avg_dtype),
                                ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
                if dtype != torch.float32:
                    raise ValueError(f"FusedAdam: {name} must be torch.float32 with "
                                     f"capturable=True, got {dtype}")
            if store_param_remainders:
                raise ValueError("FusedAdam: store_param_remainders must be False with "
                                 "capturable=True, got True")
        if capturable:
            lr = torch.tensor(lr, dtype=torch.float32)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self.use_decoupled_grad = use_decoupled_grad
        # As NVIDIA's: only with float32 masters (per parameter: only bf16 ones).
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)
        self._scales: dict = {}  # param -> {state name: float32 [1] scale of an fp16 state}
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = group["lr"].to(group["params"][0].device)
            # GradScaler.step then leaves unscaling and skipping to step(grad_scaler=...).
            self._step_supports_amp_scaling = True
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("FusedAdam: set_grad_none is deprecated; use zero_grad(set_to_none=...)",
                          DeprecationWarning, stacklevel=2)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Sets the gradients (``decoupled_grad`` with ``use_decoupled_grad``) to None, or to
        zeros with ``set_to_none=False``."""
        set_to_none = _resolve_set_to_none("FusedAdam", self.set_grad_none, set_to_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    # ------------------------------------------------------------ states

    def _uses_remainder(self, param: torch.Tensor) -> bool:
        return (self.store_param_remainders and param.dtype == torch.bfloat16
                and not isinstance(param, Float8Tensor))

    def _initialize_state(self, param: torch.Tensor, name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        """Allocates ``state[param][name]`` in its configured dtype (zeros if asked)."""
        dtype, shape, device = self.name_to_dtype_map[name], param.shape, param.device
        if store_param_remainders:
            data = torch.zeros(shape, dtype=torch.int16, device=device)
        elif dtype == torch.uint8:
            data = Float8Tensor.quantize(torch.zeros(shape, device=device), "float8_e4m3")
        else:
            data = torch.empty(shape, dtype=dtype, device=device)
            if zero_buffer:
                data.zero_()
        self.state[param][name] = data
        if dtype == torch.float16 and not store_param_remainders:
            self._scales.setdefault(param, {})[name] = torch.ones(1, device=device)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        """Zero moments and, with master weights, the master copy of ``param``'s value."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:  # zero remainders: the master is the bf16 value
                value = (param.dequantize(torch.float32) if isinstance(param, Float8Tensor)
                         else param.detach().float())
                self.set_scaled_state(param, "master_param", value)

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """``state[param][state_name]`` as float32 values: the state itself when it is float32
        (the int16 remainders when they stand for the master), else an expanded copy."""
        state = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if state.dtype == torch.int16 or dtype == torch.float32:
            return state
        if dtype == torch.uint8:
            return state.dequantize(torch.float32)
        if dtype == torch.float16:
            return state.float() * self._scales[param][state_name]
        return state.float()

    def set_scaled_state(self, param: torch.Tensor, state_name: str,
                         unscaled_state: torch.Tensor) -> None:
        """Stores float32 values (int16 remainders for a master kept so) as
        ``state[param][state_name]`` in its configured dtype, scaling fp16 per tensor."""
        remainder = state_name == "master_param" and self._uses_remainder(param)
        want = torch.int16 if remainder else torch.float32
        if unscaled_state.dtype != want:
            raise TypeError(f"FusedAdam.set_scaled_state: {state_name} of this parameter must "
                            f"be given as {want}, got {unscaled_state.dtype}")
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainder)
        dst = self.state[param][state_name]
        if self.name_to_dtype_map[state_name] == torch.float16 and not remainder:
            scale = self._scales[param][state_name]
            if unscaled_state.numel():
                scale.copy_(unscaled_state.abs().amax() / _FP16_RANGE)
            inverse = torch.where(scale > 0, scale.reciprocal(), 0.0)
            dst.copy_(unscaled_state.to(dst.device) * inverse)
        else:  # a cast; a Float8Tensor quantizes with a scale from its new amax
            dst.copy_(unscaled_state)

    def state_dict(self) -> dict:
        """torch's state dict with every state as float32 values (int16 remainders stay)."""
        state_dict = super().state_dict()
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for index, param in zip(saved, params, strict=True):
            if index in state_dict["state"]:
                # A new dict: torch's packed state shares the optimizer's own.
                state_dict["state"][index] = {name: self.get_unscaled_state(param, name)
                                              for name in state_dict["state"][index]}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then each state stored again in its configured dtype from the dict's
        float32 values (torch's would cast them to the parameter's dtype)."""
        super().load_state_dict(state_dict)
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for index, param in zip(saved, params, strict=True):
            if index not in state_dict["state"]:
                continue
            self.state[param] = {}
            for name, value in state_dict["state"][index].items():
                if value is not None:
                    keep = value.dtype == torch.int16
                    self.set_scaled_state(param, name, value if keep else value.float())

    # ------------------------------------------------------------ the step

    def _gradient(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        if self.use_decoupled_grad:
            return getattr(param, "decoupled_grad", None)
        return param.grad

    def _check(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise TypeError("FusedAdam: gradients must be dense, got a sparse gradient of "
                            f"shape {list(grad.shape)}")
        if isinstance(param, Float8Tensor):
            if not self.master_weights:
                raise ValueError(f"FusedAdam: master_weights must be True for FP8 "
                                 f"(Float8Tensor) parameters, got False for a parameter of "
                                 f"shape {list(param.shape)}")
            if self.capturable:
                raise ValueError("FusedAdam: capturable must be False with FP8 (Float8Tensor) "
                                 "parameters, got True")
        elif param.dtype not in _PARAM_DTYPES:
            raise TypeError(f"FusedAdam: parameters must be {_names(_PARAM_DTYPES)} or FP8 "
                            f"Float8Tensor, got {param.dtype} of shape {list(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One update of every parameter that has a gradient. ``grad_scaler`` is used only
        with ``capturable=True`` (see the class); otherwise GradScaler handles scaling itself."""
        loss = _closure_loss(closure)
        work = _checked_work(self.param_groups, self._gradient, self._check)
        for group, items in zip(self.param_groups, work, strict=True):
            self._step_group(group, items, grad_scaler)
        return loss

    def _step_group(self, group: dict, items: list, grad_scaler) -> None:
        if not group["params"]:
            return
        for p in group["params"]:  # as NVIDIA's: every parameter gets states, graded or not
            if len(self.state[p]) == 0:
                self.initialize_state(p, self._uses_remainder(p))
        found_inf, grad_scale = {}, {}
        if self.capturable and grad_scaler is not None and items:
            found_inf = grad_scaler._check_inf_per_device(self)
            scale = grad_scaler._get_scale_async()
            grad_scale = {d: scale.to(d) for d in found_inf}
        self._advance_step(group, found_inf)

        calls = {}  # device -> (weights, grads, exp_avgs, exp_avg_sqs), all float32
        after = []  # (param, exp_avg, exp_avg_sq, weight): stored back after the kernels
        for p, g in items:
            weight = self._math_weight(p, self.state[p])
            exp_avg = self.get_unscaled_state(p, "exp_avg")
            exp_avg_sq = self.get_unscaled_state(p, "exp_avg_sq")
            weights, grads, exp_avgs, exp_avg_sqs = calls.setdefault(p.device, ([], [], [], []))
            weights.append(weight)
            grads.append(g if g.dtype == torch.float32 else g.float())  # the one cast
            exp_avgs.append(exp_avg)
            exp_avg_sqs.append(exp_avg_sq)
            after.append((p, exp_avg, exp_avg_sq, weight))

        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        for device, (weights, grads, exp_avgs, exp_avg_sqs) in calls.items():
            kernel(weights, grads, exp_avgs, exp_avg_sqs, [],
                   [self._kernel_step(group, device)] * len(weights), lr=group["lr"],
                   beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                   eps=group["eps"], amsgrad=False, maximize=False,
                   grad_scale=grad_scale.get(device), found_inf=found_inf.get(device))
        self._store_back(after)

    def _advance_step(self, group: dict, found_inf: dict) -> None:
        """Counts the step in the group (as NVIDIA's): a Python int, or with ``capturable`` an
        int32 device tensor that does not count a step skipped for inf/NaN gradients."""
        if not self.capturable:
            group["step"] = group.get("step", 0) + 1
            return
        if "step" not in group:
            group["step"] = torch.zeros(1, dtype=torch.int32, device=group["params"][0].device)
        if found_inf:
            skipped = sum(f.to(group["step"].device) for f in found_inf.values())
            group["step"] += (1 - skipped).to(torch.int32)
        else:
            group["step"] += 1

    def _kernel_step(self, group: dict, device: torch.device) -> torch.Tensor:
        """The step the fused kernel bias-corrects with, a float32 0-d tensor on ``device``."""
        if not group["bias_correction"]:
            # The kernel always divides by 1 - beta**t: beta**inf is exactly 0 for the
            # 0 <= beta < 1 the constructor admits, so both corrections are exactly 1.
            return torch.full((), math.inf, device=device)
        step = group["step"]
        if isinstance(step, torch.Tensor):
            return step.to(device=device, dtype=torch.float32).reshape(())
        return torch.full((), float(step), device=device)

    def _math_weight(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        """The float32 values the update runs on: the parameter itself (float32), its master
        (float32 in place, else an expanded copy), or a float32 copy of the parameter."""
        if p.dtype == torch.float32 and not isinstance(p, Float8Tensor):
            return p  # NVIDIA's updates float32 parameters directly even with master weights
        if self.master_weights:
            if self._uses_remainder(p):
                return _join_remainder(p, state["master_param"])
            return self.get_unscaled_state(p, "master_param")
        return p.float()

    def _store_back(self, after: list) -> None:
        """Stores the updated float32 values into states and parameters of other dtypes."""
        plain_params, plain_values = [], []
        for p, exp_avg, exp_avg_sq, weight in after:
            state = self.state[p]
            for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if value is not state[name]:
                    self.set_scaled_state(p, name, value)
            if weight is p:
                if self.master_weights:  # kept equal to the parameter
                    self.set_scaled_state(p, "master_param", weight)
                continue
            if self.master_weights and self._uses_remainder(p):
                _split_remainder(weight, p, state["master_param"])
                continue
            if self.master_weights and weight is not state["master_param"]:
                self.set_scaled_state(p, "master_param", weight)
            if isinstance(p, Float8Tensor):
                p.copy_(weight)  # quantized in place, with a scale from the new values' amax
            else:
                plain_params.append(p)
                plain_values.append(weight)
        if plain_params:
            torch._foreach_copy_(plain_params, plain_values)
