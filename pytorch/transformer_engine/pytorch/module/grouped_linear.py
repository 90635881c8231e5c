"""GroupedLinear: ``num_gemms`` linear layers applied to consecutive row groups of one input
(the experts of a mixture-of-experts layer, their tokens sorted by expert).

Each group is its own te.Linear (``gemms[i]``): its FP8 state, its weight and bias. Under
FP8 (delayed, current and block scaling) the groups' GEMMs run as one grouped core call
per phase (forward, dgrad, wgrad; grouped_linear_fn.py), each group quantized by its own
layer: the numbers are exactly those of separate te.Linear layers. Outside FP8 the GEMMs are
grouped the same way in the input's dtype (the core's GEMM, where te.Linear runs torch's;
the last bits differ). FP8 weights outside FP8, calibration and other recipes run the
layers one after the other. NVIDIA's parameter names
(``weight0``, ``bias0``, ...) are attributes of the module and the keys of its
``state_dict``, so checkpoints carry over both ways.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .. import distributed, first_step, fp8
from ..float8_tensor import Float8Tensor
from ..grouped_linear_fn import (
    GroupedConsts,
    GroupedFp8Function,
    GroupedHpFunction,
    GroupMeta,
)
from ..linear_fn import takes_fp8_input
from ..quantization import kind_of, plan_of, quantize_many
from . import _nvidia_state
from ._checks import check_device, check_float_input, check_sizes, refuse_non_defaults
from ._deferred_init import DeferredInit
from ._deferred_wgrad import add_weight_grad
from ._main_grad import route_tree
from .base import nvidia_fp8_meta
from .linear import _FP8_INPUT_DTYPES, Linear, _default_device, check_fp8_shape, init_stream

__all__ = ["GroupedLinear"]

_OURS = "gemms."  # the state_dict prefix of the submodules' entries


class GroupedLinear(DeferredInit, torch.nn.Module):
    """``out[rows of group i] = inp[rows of group i] @ weight{i}^T + bias{i}``.

    Args (NVIDIA TE's):
        num_gemms: number of groups (and of weights).
        in_features, out_features: as te.Linear, the same for every group.
        bias, return_bias, params_dtype, device, init_method: as te.Linear, for each group
            (``return_bias``: the output without the biases, then the list of biases).
        fuse_wgrad_accumulation: each group's weight gradient goes into its ``main_grad``
            (see module/_main_grad.py).
        delay_wgrad_compute: the backward computes the input's (and biases') gradients and
            puts the weights' GEMMs aside; :meth:`backward_dw` runs them (for schedules that
            overlap them with other work).
        get_rng_state_tracker, rng_tracker_name: as for te.Linear (with both, every group's
            parameters are drawn on the tracker's stream ``rng_tracker_name``).
        sequence_parallel, tp_group, tp_size, parallel_mode, ub_*: accepted at their defaults
            (``tp_group`` also as a group of one rank, which Megatron-LM passes for unsplit
            experts); other values raise NotImplementedError (no tensor parallelism for the
            groups here).
        save_original_input: accepted as on te.Linear (the values do not change).

    ``forward(inp, m_splits, is_first_microbatch=None)``: ``inp`` [sum(m_splits), in_features]
    (a leading shape is flattened), ``m_splits`` the rows of each group in order.
    """

    _name = "te.GroupedLinear"

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device: Union[torch.device, str, None] = None, ub_overlap_rs: bool = False,
                 ub_overlap_ag: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__()
        op = self._name
        check_sizes(op, num_gemms=num_gemms)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"{op}: parallel_mode must be None, 'column' or 'row', got "
                             f"{parallel_mode!r}")
        if tp_group is not None and distributed.group_size(op, tp_group) == 1:
            tp_group = None  # a group of one rank splits nothing
        # On one rank a column- or row-parallel layer is the whole layer (Megatron-LM builds
        # its experts so, with an expert tensor-parallel group of one rank).
        self.parallel_mode = parallel_mode
        # NVIDIA's attributes (Megatron-LM reads them): tp_size is the tensor-parallel group's
        # size, or the tp_size given without a group; this module splits nothing, so 1.
        self.tp_size, self.sequence_parallel = 1, False
        split_mode = parallel_mode if tp_group is not None or tp_size != 1 else None
        refuse_non_defaults(
            op, "the groups are not split over ranks",
            sequence_parallel=(sequence_parallel, False),
            tp_group=(tp_group, None), tp_size=(tp_size, 1), parallel_mode=(split_mode, None),
            ub_overlap_rs=(ub_overlap_rs, False), ub_overlap_ag=(ub_overlap_ag, False))
        self.save_original_input, self.ub_name = bool(save_original_input), ub_name
        device = _default_device(device)
        self.num_gemms = int(num_gemms)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.return_bias, self.use_bias, self.name = return_bias, bias, name
        self.apply_bias = bias and not return_bias  # (NVIDIA's attribute)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        with init_stream(get_rng_state_tracker, rng_tracker_name):
            self.gemms = torch.nn.ModuleList(
                Linear(in_features, out_features, bias=bias, return_bias=return_bias,
                       params_dtype=params_dtype, device=device, init_method=init_method,
                       fuse_wgrad_accumulation=fuse_wgrad_accumulation)
                for _ in range(self.num_gemms))
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        # delay_wgrad_compute: the backward's weight-gradient GEMMs, run by backward_dw()
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self._wgrad_store: list = []
        self._register_state_dict_hook(_to_nvidia_names)
        self._register_load_state_dict_pre_hook(_from_nvidia_names)
        self._register_load_state_dict_pre_hook(_from_group_states, with_module=True)

    def __getattr__(self, name: str):
        # weight{i} / bias{i}: NVIDIA's names of the groups' parameters
        for kind in ("weight", "bias"):
            if name.startswith(kind) and name[len(kind):].isdigit():
                i = int(name[len(kind):])
                gemms = self._modules["gemms"]
                if i < len(gemms):
                    return getattr(gemms[i], kind)
        return super().__getattr__(name)

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int],
                is_first_microbatch: Optional[bool] = None):
        op = self._name
        splits = [int(m) for m in m_splits]
        if len(splits) != self.num_gemms or any(m < 0 for m in splits):
            raise ValueError(f"{op}: m_splits must be {self.num_gemms} non-negative row "
                             f"counts, got {list(m_splits)}")
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"{op}: input must have in_features={self.in_features} as its last "
                             f"dimension, got shape {list(inp.shape)}")
        # (A 2-D Float8Tensor stays as it is: FP8 tokens from moe_permute.)
        rows = inp if inp.dim() == 2 else inp.reshape(-1, self.in_features)
        if sum(splits) != rows.shape[0]:
            raise ValueError(f"{op}: m_splits must add up to the input's {rows.shape[0]} rows, "
                             f"got {splits} (sum {sum(splits)})")
        if self.fuse_wgrad_accumulation:
            route_tree(self)
        state = fp8.STATE
        out = None
        if state.enabled:
            out = self._grouped_fp8(rows, splits, state.recipe, is_first_microbatch)
        elif not state.calibrating and not isinstance(rows, Float8Tensor):
            out = self._grouped_high_precision(rows, splits)
        if out is not None:
            out = out.view(*inp.shape[:-1], self.out_features)
            if self.return_bias:
                return out, [g._parameters["bias"] for g in self.gemms]
            return out
        if self.delay_wgrad_compute:
            raise NotImplementedError(
                f"{op}: delay_wgrad_compute needs the grouped path, which this call cannot "
                "take (FP8 weights outside fp8_autocast, calibration, or an FP8 input in "
                "another format than the recipe's): run it inside fp8_autocast, or without "
                "delay_wgrad_compute")
        outs, biases = [], []
        for i, (gemm, part) in enumerate(zip(self.gemms, torch.split(rows, splits),
                                             strict=True)):
            if state.calibrating:
                # (each group keeps its calibration metadata on this module, as
                # input_gemm<i>_... and weight_gemm<i>_...: calibration.py)
                gemm.__dict__["_calibration_into"] = (self, i)
                try:
                    y = gemm(part, is_first_microbatch)
                finally:
                    del gemm.__dict__["_calibration_into"]
            else:
                y = gemm(part, is_first_microbatch)
            if self.return_bias:
                y, b = y
                biases.append(b)
            outs.append(y)
        out = torch.cat(outs).view(*inp.shape[:-1], self.out_features)
        return (out, biases) if self.return_bias else out


    def backward_dw(self) -> None:
        """delay_wgrad_compute: runs the weight-gradient GEMMs that the backward passes put
        aside (oldest first) and adds each group's gradient to its weight's ``.grad`` (to
        ``main_grad`` under fuse_wgrad_accumulation). The biases' gradients came with the
        backward."""
        while self._wgrad_store:
            grads = torch.chunk(self._wgrad_store.pop(0)(), self.num_gemms)
            for gemm, g in zip(self.gemms, grads, strict=True):
                add_weight_grad(gemm.weight, g, self.fuse_wgrad_accumulation)

    def _grouped_high_precision(self, rows: torch.Tensor, splits: list):
        """Outside FP8: the groups' GEMMs in the input's dtype, grouped
        (grouped_linear_fn.GroupedHpFunction), or None for the layers one after the other
        (FP8 weights, which dequantize there)."""
        device_type = "cuda" if rows.is_cuda else "cpu"
        if torch.is_autocast_enabled(device_type):
            rows = rows.to(torch.get_autocast_dtype(device_type))
        check_float_input(self._name, "input", rows)
        weights, biases = [], []
        for gemm in self.gemms:
            weight, bias = gemm._weight_and_bias()
            if isinstance(weight, Float8Tensor):
                return None
            check_device(self._name, "input", rows, weight)
            # .to() (a no-op for the same dtype) keeps autograd's link to the parameter
            weights.append(weight.to(rows.dtype))
            biases.append(bias)
        params = weights + (biases if self.use_bias and not self.return_bias else [])
        store = self._wgrad_store if self.delay_wgrad_compute else None
        return GroupedHpFunction.apply(rows, tuple(splits), store, *params)

    # ------------------------------------------------ NVIDIA's FP8 state and attributes

    def get_extra_state(self) -> torch.Tensor:
        """The groups' FP8 state as NVIDIA's GroupedLinear writes its own: one uint8 tensor
        holding the pickled dict of NVIDIA's layout for ``num_gemms`` GEMMs (an empty tensor
        where no group holds FP8 state worth saving, as NVIDIA's), with this library's own
        pieces under one key NVIDIA's loader ignores (module/_nvidia_state.py)."""
        gemms = list(self.gemms)
        if not any(g._nvidia_checkpoint() for g in gemms):
            return torch.empty(0, dtype=torch.uint8)
        parts = [g.get_extra_state() for g in gemms]
        name = type(self).__name__
        state = _nvidia_state.merge_gemms(name, parts)
        ours = {"recipes": [p["recipe"] for p in parts],
                "first_step": [g._fp8_first_step for g in gemms],
                "empty": [{key: sorted(getattr(g._buffers[key], first_step._MARK, ()))
                           for key in _nvidia_state._HISTORIES} for g in gemms]}
        nvidia = _nvidia_state.to_nvidia(state, gemms[0]._nvidia_recipe(), self.num_gemms, ours)
        return _nvidia_state.encode(nvidia)

    def set_extra_state(self, state: Any) -> None:
        """Loads the groups' FP8 state: NVIDIA's GroupedLinear's one ``_extra_state`` (a
        uint8 tensor, a BytesIO before its 2.0; ours is written so), GEMM i's columns into
        ``gemms[i]`` (module/_nvidia_state.py), with our pieces where the state holds them;
        or our earlier checkpoints' per-group states (``gemms.<i>._extra_state``, gathered
        into a list by the load hook). Everything is checked before anything is written."""
        name = type(self).__name__
        if state is None:
            return
        gemms = list(self.gemms)
        if isinstance(state, list):  # our earlier form: each group's own state (or None)
            if len(state) != self.num_gemms:
                raise ValueError(f"{name}.set_extra_state: expected the states of "
                                 f"{self.num_gemms} groups, got {len(state)}")
            checked = [g._checked_extra_state(s) for g, s in zip(gemms, state, strict=True)]
            for gemm, part in zip(gemms, checked, strict=True):
                if part is not None:
                    gemm._install_extra_state(part)
            return
        if not isinstance(state, (torch.Tensor, io.BytesIO)):
            raise ValueError(f"{name}.set_extra_state: expected NVIDIA Transformer Engine's "
                             "extra state (a uint8 tensor or a BytesIO), got "
                             f"{type(state).__name__}")
        nvidia = _nvidia_state.decode(name, state)
        if nvidia is None:
            return
        ours = _nvidia_state.to_ours(name, nvidia, "gemms", self.num_gemms,
                                     gemms[0]._buffers["amax_history_fwd"].shape[0])
        pieces = nvidia.get(_nvidia_state.OURS_KEY)
        if pieces is not None:
            ours = _nvidia_state.with_ours(name, ours, pieces, self.num_gemms)
        parts = _nvidia_state.split_gemms(ours, self.num_gemms)
        if pieces is not None:
            for part, summary in zip(parts, pieces["recipes"], strict=True):
                part["recipe"] = dict(summary)
        checked = [g._checked_extra_state(part) for g, part in zip(gemms, parts, strict=True)]
        if pieces is not None:  # the first-step marks as they were, not as the values say
            checked = [(buffers, {k: list(v) for k, v in marks.items()}, summary)
                       for (buffers, _, summary), marks in zip(checked, pieces["empty"],
                                                               strict=True)]
        for gemm, part in zip(gemms, checked, strict=True):
            gemm._install_extra_state(part)
        if pieces is not None:
            for gemm, step in zip(gemms, pieces["first_step"], strict=True):
                gemm._fp8_first_step = step

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"  # NVIDIA's only: ours are the groups'
        if key in missing_keys:
            missing_keys.remove(key)

    @property
    def fp8(self) -> bool:
        """NVIDIA's attribute: whether the groups run in FP8 (te.Linear's ``fp8``)."""
        return any(g.fp8 for g in self.gemms)

    @fp8.setter
    def fp8(self, value: bool) -> None:
        for g in self.gemms:
            g.fp8 = value

    @property
    def fp8_calibration(self) -> bool:
        """NVIDIA's attribute: whether the groups' last forward calibrated."""
        return any(g.fp8_calibration for g in self.gemms)

    @fp8_calibration.setter
    def fp8_calibration(self, value: bool) -> None:
        for g in self.gemms:
            g.fp8_calibration = value

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """NVIDIA's (Megatron-LM calls it before loading a state dict): each group's
        ``init_fp8_metadata``, and ``fp8_group`` from the current autocast."""
        del num_gemms
        for g in self.gemms:
            g.init_fp8_metadata()
        state = fp8.STATE
        if state.enabled or state.calibrating:
            self.fp8_meta["fp8_group"] = state.group

    @property
    def fp8_meta(self) -> dict:
        """NVIDIA's FP8 metadata (as te.Linear's): the first group's recipe, and whether any
        group holds FP8 state worth saving."""
        gemms = self.gemms
        return nvidia_fp8_meta(self, gemms[0]._nvidia_recipe(),
                               any(g._nvidia_checkpoint() for g in gemms), self.num_gemms)

    def _weight_operands(self, metas, weights, need_col: bool, is_first_microbatch) -> list:
        """Each group's weight copy as its te.Linear makes it (_weight_operand); fresh casts
        of every group in one core call where they are (quantization.quantize_many)."""
        plan = metas[0].plan
        if _fresh_weights(self.gemms, weights, is_first_microbatch):
            return quantize_many(plan, "weight", [w.detach() for w in weights], True,
                                   need_col, [(m.scales, m.history) for m in metas], 1)
        return [gemm._weight_operand(m.plan, w, need_col, is_first_microbatch, m.scales,
                                     m.history)
                for gemm, m, w in zip(self.gemms, metas, weights, strict=True)]

    def _grouped_fp8(self, rows: torch.Tensor, splits: list, recipe, is_first_microbatch):
        """The FP8 forward with the groups' GEMMs grouped (grouped_linear_fn.py), or None
        where the layers run one after the other instead: a recipe other than per-tensor or
        block scaling, or an FP8 (Float8Tensor) input the plan cannot take as it is (another
        format or scaling mode)."""
        if kind_of(recipe) not in ("delayed", "current", "block"):
            return None
        if isinstance(rows, Float8Tensor):
            plan = plan_of(recipe)
            if not takes_fp8_input(rows, plan):
                return None  # the layers one after the other dequantize it
        else:
            device_type = "cuda" if rows.is_cuda else "cpu"
            if torch.is_autocast_enabled(device_type):
                rows = rows.to(torch.get_autocast_dtype(device_type))
        check_fp8_shape(rows, self.in_features, self.out_features, self._name)
        if rows.dtype not in _FP8_INPUT_DTYPES:
            raise TypeError(f"{self._name}: input must be float32, bfloat16 or float16 in FP8, "
                            f"got {rows.dtype}")
        grad = torch.is_grad_enabled()
        need_dgrad = grad and rows.requires_grad
        params, biases, metas = [], [], []
        for gemm in self.gemms:
            weight, bias = gemm._weight_and_bias()
            check_device(self._name, "input", rows, weight)
            plan, scales, history = gemm._fp8_meta_of(recipe)
            bwd_meta, bwd_recipe, group = gemm._backward_state(plan, recipe)
            metas.append(GroupMeta(plan, scales, history, bwd_meta, bwd_recipe, group))
            params.append(weight)
            biases.append(bias)
        w_ops = self._weight_operands(metas, params, need_dgrad, is_first_microbatch)
        need_wgrad = grad and any(w.requires_grad for w in params)
        if self.use_bias and not self.return_bias:
            params += biases
        store = self._wgrad_store if self.delay_wgrad_compute else None
        cfg = GroupedConsts(tuple(splits), tuple(metas), need_dgrad, need_wgrad, store)
        return GroupedFp8Function.apply(rows, cfg, tuple(w_ops), *params)


def _fresh_weights(gemms, weights, is_first_microbatch) -> bool:
    """Whether every group's weight copy is a fresh cast of a plain weight (no first-microbatch
    cache kept or dropped, no FP8 parameter), which _weight_operand would make as quantize does."""
    return (is_first_microbatch is None
            and not any(g._weight_caches for g in gemms)
            and not any(isinstance(w, Float8Tensor) for w in weights))


def _to_nvidia_names(module, state_dict, prefix, local_metadata):
    """gemms.{i}.weight -> weight{i} (bias likewise); the groups' FP8 states are in the
    module's one ``_extra_state`` (get_extra_state), so theirs are dropped."""
    for key in [k for k in state_dict if k.startswith(prefix + _OURS)]:
        index, _, rest = key[len(prefix + _OURS):].partition(".")
        if rest in ("weight", "bias"):
            state_dict[f"{prefix}{rest}{index}"] = state_dict.pop(key)
        elif rest == "_extra_state":
            del state_dict[key]
    return state_dict


def _from_group_states(module, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
    """Our earlier checkpoints kept each group's FP8 state as ``gemms.{i}._extra_state``: they
    go to the module's set_extra_state together (as a list), unless the checkpoint also has
    the module's own ``_extra_state``, which wins."""
    keys = [f"{prefix}{_OURS}{i}._extra_state" for i in range(module.num_gemms)]
    if not any(k in state_dict for k in keys):
        return
    states = [state_dict.pop(k, None) for k in keys]
    state_dict.setdefault(prefix + "_extra_state", states)


def _from_nvidia_names(state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        for kind in ("weight", "bias"):
            if rest.startswith(kind) and rest[len(kind):].isdigit():
                state_dict[f"{prefix}{_OURS}{rest[len(kind):]}.{kind}"] = state_dict.pop(key)
