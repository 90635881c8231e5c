"""``te.Linear``: a drop-in ``nn.Linear`` whose GEMMs run in FP8 inside ``fp8_autocast``."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Union

import torch

from transformer_engine.common.plan import GEMM_GRANULE
from transformer_engine.common.recipe import Recipe

from .. import distributed, fast_linear, fp8, sequence_parallel
from ..float8_tensor import Float8Tensor, to_high_precision
from ..linear_fn import Fp8LinearFunction, LinearConsts, takes_fp8_input
from ..quantization import plan_of
from ._checks import (
    check_device,
    check_float_input,
    check_params_dtype,
    check_sizes,
    refuse_unbuilt,
)
from ._deferred_wgrad import linear as hp_linear
from ._deferred_wgrad import run_store
from ._main_grad import route_to_main_grad
from ._split_rows import join_rows, pack_rows
from .base import FP8Module, fp8_weight_param, with_leading_dims

__all__ = ["Linear"]



def _default_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_weight(out_features: int, in_features: int, dtype: torch.dtype, device,
                init_method: Optional[Callable[[torch.Tensor], None]]) -> torch.Tensor:
    """An [out, in] weight: ``init_method(weight)``, or nn.Linear's Kaiming uniform."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    with torch.no_grad():
        if init_method is None:
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
    return weight


def init_stream(get_rng_state_tracker: Optional[Callable], rng_tracker_name: Optional[str]):
    """Where a module draws its initial parameters: the tracker's stream ``rng_tracker_name``
    when both are given (Megatron-LM names one for expert layers, whose experts must differ
    from one expert-parallel rank to the next, and for layers replicated over the tensor-
    parallel group), else torch's default generator (where a split layer draws its whole
    weight and keeps its slice: the values of the unsplit layer, with or without a tracker)."""
    if get_rng_state_tracker is None or rng_tracker_name is None:
        return contextlib.nullcontext()
    return get_rng_state_tracker().fork(rng_tracker_name)


def init_bias(out_features: int, in_features: int, dtype: torch.dtype, device) -> torch.Tensor:
    """nn.Linear's bias: uniform in +-1/sqrt(in_features)."""
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    bias = torch.empty(out_features, dtype=dtype, device=device)
    torch.nn.init.uniform_(bias, -bound, bound)
    return bias


def _split_sizes(out_features: int, parameters_split, name: str) -> Optional[dict[str, int]]:
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        sizes = {str(k): int(v) for k, v in parameters_split.items()}
    else:
        names = list(parameters_split)
        if not names or out_features % len(names):
            raise ValueError(f"{name}: parameters_split must split out_features="
                             f"{out_features} evenly, got {len(names)} names")
        sizes = {str(n): out_features // len(names) for n in names}
    if sum(sizes.values()) != out_features:
        raise ValueError(f"{name}: parameters_split sizes must sum to out_features="
                         f"{out_features}, got {sizes}")
    return sizes


class _LinearBase(FP8Module):
    """What te.Linear and te.LayerNormLinear share: the [out, in] weight (optionally split
    into named row blocks) and the bias."""

    _name = "te.Linear"
    # (recipe, arguments) of the last compiled forward (fast_linear.py); a class default, so
    # that modules pickled before it existed load with none.
    _fast_linear = None
    # Tensor parallelism (distributed.py): "column" or "row" when the layer is split over
    # tp_size > 1 ranks of tp_group, else None. Class defaults: a module pickled before they
    # existed loads as a plain layer.
    _tp_mode: Optional[str] = None
    _shared_tp_group: Optional[distributed.SharedGroup] = None
    tp_size = 1
    # delay_wgrad_compute: the list the backward puts the weight-gradient GEMM on
    # (module/_deferred_wgrad.py), else None. A class default, for pickled modules.
    _wgrad_store: Optional[list] = None
    delay_wgrad_compute = False

    def backward_dw(self) -> None:
        """delay_wgrad_compute: runs the weight-gradient GEMMs the backward passes put aside
        (oldest first) and adds their results to the weight's ``.grad`` (``main_grad`` under
        fuse_wgrad_accumulation). Without the switch there is nothing to run."""
        if self._wgrad_store is not None:
            run_store(self._wgrad_store, self._gemm_weights(), self.fuse_wgrad_accumulation)

    def _delay_wgrad(self, delay_wgrad_compute: bool) -> None:
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self._wgrad_store = [] if self.delay_wgrad_compute else None

    @property
    def tp_group(self):
        """The process group the layer is split over (None: not split)."""
        return None if self._shared_tp_group is None else self._shared_tp_group.group

    def _setup_linear(self, in_features: int, out_features: int, bias: bool, params_dtype,
                      device: torch.device, init_method, parameters_split,
                      tp_mode: Optional[str] = None, tp_group=None, tp_size: int = 1) -> None:
        check_sizes(self._name, in_features=in_features, out_features=out_features)
        check_params_dtype(self._name, params_dtype)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias = bool(bias)
        # Checked before the initializers draw from torch's generator.
        self._splits = _split_sizes(out_features, parameters_split, self._name)
        if tp_mode is not None:
            split, name = ((out_features, "out_features") if tp_mode == "column"
                           else (in_features, "in_features"))
            distributed.check_divisible(self._name, name, split, tp_size)
            if tp_mode == "column" and self._splits is not None:
                # Each named block (e.g. q, k, v) is split over the ranks on its own.
                for split_name, size in self._splits.items():
                    distributed.check_divisible(
                        self._name, f"the size of parameters_split block {split_name!r}",
                        size, tp_size)
            self._tp_mode, self.tp_size = tp_mode, tp_size
            # (None: the group comes later, set_tensor_parallel_group)
            self._shared_tp_group = None if tp_group is None else distributed.SharedGroup(tp_group)
        dtype = params_dtype or torch.get_default_dtype()
        # A parallel layer draws the full weight and bias too (same generator state on every
        # rank: the same values as the layer on one process) and keeps its slice, once it
        # knows its rank in the group.
        weight = init_weight(out_features, in_features, dtype, device, init_method)
        full_bias = init_bias(out_features, in_features, dtype, device) if bias else None
        if self._shared_tp_group is not None:
            weight, full_bias = self._shard(weight, full_bias)
        self._register_params(weight, full_bias)
        if self._shared_tp_group is not None:
            self._mark_partitions()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supplies the tensor-parallel group of a layer built with ``tp_size`` > 1 and no
        ``tp_group`` (NVIDIA's way): the layer then keeps this rank's slice of the weights it
        drew whole at construction, the values it would hold had the group come then (the
        parameters are new objects: make the optimizer after this call). A group is taken
        once; a layer that is not split takes None or a group of one rank."""
        if not distributed.check_group_to_set(self._name, tp_group, self.tp_size,
                                              self.tp_group):
            return
        weight, bias = self._weight_and_bias()
        if isinstance(weight, Float8Tensor):
            raise NotImplementedError(
                f"{self._name}: set_tensor_parallel_group on fp8_model_init weights is not "
                "implemented; pass tp_group when building the module")
        self._shared_tp_group = distributed.SharedGroup(tp_group)
        weight, bias = self._shard(weight.detach(), None if bias is None else bias.detach())
        device = self._parameters.get("weight", weight).device
        self._register_params(weight.to(device), None if bias is None else bias.to(device))
        self._mark_partitions()

    def _mark_partitions(self) -> None:
        """Where each slice lies in the full tensor, for tools that gather or re-split
        (Megatron's attribute names): the GEMM's weights, and its biases in a column layer
        (a row layer's bias is not split; nor is a LayerNormLinear's norm, which is not the
        GEMM's: marked split, its gradient would count once per rank in a gradient norm)."""
        dim = 0 if self._tp_mode == "column" else 1
        split = self._gemm_weights()
        if self._tp_mode == "column":
            split += ([self._parameters.get("bias")] if self._splits is None
                      else [getattr(self, n) for n in self.bias_names])
        for p in split:
            if p is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    def _shard(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """This rank's slice of the full weight and bias: rows (and bias) for "column",
        columns for "row" (the bias is added once, after the sum, and is not split)."""
        import torch.distributed as dist

        rank = dist.get_rank(self.tp_group)
        if self._tp_mode == "column":
            blocks = self._splits or {"": self.out_features}
            rows, start = [], 0
            for size in blocks.values():  # this rank's rows of each block
                n = size // self.tp_size
                rows.append(torch.arange(start + rank * n, start + (rank + 1) * n))
                start += size
            rows = torch.cat(rows).to(weight.device)
            if self._splits is not None:
                self._splits = {name: size // self.tp_size for name, size in blocks.items()}
            # (Indexing copies: the slice alone, not a view holding the full storage.)
            return weight[rows], None if bias is None else bias[rows]
        k = self.in_features // self.tp_size
        return weight[:, rank * k:(rank + 1) * k].clone(), bias

    def _register_params(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return fp8_weight_param(t, plan_of)

        if self._splits is None:
            self.weight = param(weight)
            # Registered even when None (as nn.Linear does), so that the forward finds it in
            # _parameters.
            self.register_parameter("bias", None if bias is None else torch.nn.Parameter(bias))
            return
        self.weight_names, self.bias_names = [], []
        start = 0
        for split, size in self._splits.items():
            rows = slice(start, start + size)
            start += size
            # Views of one weight: the forward reads them as one tensor (join_rows).
            setattr(self, f"{split}_weight", param(weight[rows]))
            self.weight_names.append(f"{split}_weight")
            if bias is not None:
                setattr(self, f"{split}_bias", torch.nn.Parameter(bias[rows]))
                self.bias_names.append(f"{split}_bias")
        self.register_parameter("bias", None) if bias is None else None

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() convert each parameter alone: lay the row blocks back to
        # back again, so that the forward still reads them without a copy.
        out = super()._apply(fn, recurse)
        if getattr(self, "_splits", None) is not None:
            pack_rows([self._parameters[n] for n in self.weight_names])
            pack_rows([self._parameters[n] for n in self.bias_names])
        return out

    def _gemm_weights(self) -> list:
        """The weight parameters of the GEMM (fuse_wgrad_accumulation's)."""
        if self._splits is None:
            return [self._parameters.get("weight")]
        return [getattr(self, n) for n in self.weight_names]

    def _weight_and_bias(self):
        if self._splits is None:
            params = self._parameters  # nn.Module.__getattr__ costs ~0.5 us per name
            if "weight" in params and "bias" in params:
                return params["weight"], params["bias"]
            return self.weight, self.bias  # e.g. a parametrized weight (a property)
        weights = [getattr(self, n) for n in self.weight_names]
        if not self.bias_names:
            return join_rows(weights)[0], None
        weight, bias = join_rows(weights, [getattr(self, n) for n in self.bias_names])
        return weight, bias

    def _fp8_linear(self, inp, weight, bias, recipe: Recipe, is_first_microbatch,
                    fp8_output: bool = False):
        """``inp @ weight^T (+ bias)`` with FP8 GEMMs and this layer's FP8 state: te.Linear's
        FP8 forward, and te.LayerNormLinear's after its sequence-parallel gather of the norm's
        output. ``inp`` may be a per-tensor Float8Tensor (used without a cast)."""
        # torch.autocast picks the activation dtype. The core takes CPU and CUDA tensors only,
        # so is_cuda names the device type (inp.device would build an object per call).
        device_type = "cuda" if inp.is_cuda else "cpu"
        if torch.is_autocast_enabled(device_type):
            inp = inp.to(torch.get_autocast_dtype(device_type))
        check_fp8_shape(inp, self.in_features, self.out_features, self._name)
        if inp.get_device() != weight.get_device():  # (ints: .device would build objects)
            raise RuntimeError(f"{self._name}: input must be on the device of the module's weight "
                               f"({weight.device}), got {inp.device}")
        if inp.dtype not in _FP8_INPUT_DTYPES:
            raise TypeError(f"{self._name}: input must be float32, bfloat16 or float16 in FP8, "
                            f"got {inp.dtype}")
        plan, scales, history = self._fp8_meta_of(recipe)
        if isinstance(inp, Float8Tensor) and not takes_fp8_input(inp, plan):
            inp = to_high_precision(inp)
        grad = torch.is_grad_enabled()
        need_dgrad = grad and inp.requires_grad
        need_wgrad = grad and weight.requires_grad
        bwd_meta, bwd_recipe, group = self._backward_state(plan, recipe)
        store = self._wgrad_store
        if (not fp8_output and is_first_microbatch is None and not self._weight_caches
                and store is None
                and fast_linear.usable(plan, inp, weight, bias, history, bwd_recipe is not None)):
            out = fast_linear.forward(self, inp, weight, bias, plan, scales, history, bwd_meta)
            if out is not None:
                return out
        w = self._weight_operand(plan, weight, need_dgrad, is_first_microbatch, scales, history)
        # Per-tensor scaling shares one scale_inv between the copies; autograd.Function under
        # torch.compile takes no tensor twice, so the column-wise one goes as None.
        col_sinv = None if plan.weight_mode == "tensor" else w.columnwise_scale_inv
        out_meta = self._output_meta(plan) if fp8_output else None
        cfg = LinearConsts(plan, bwd_recipe, group, need_dgrad, need_wgrad, out_meta, store)
        return with_leading_dims(
            Fp8LinearFunction.apply(inp, weight, bias, w.data, w.scale_inv, w.columnwise,
                                    col_sinv, history, scales, bwd_meta, cfg), inp)

    def extra_repr(self) -> str:
        # With parameters_split and a bias there is no "bias" attribute, only <name>_bias.
        bias = getattr(self, "bias", None) is not None or bool(getattr(self, "bias_names", None))
        text = f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"
        if self._tp_mode is not None:
            text += f", parallel_mode={self._tp_mode!r}, tp_size={self.tp_size}"
        return text


class Linear(_LinearBase):
    """``y = x @ weight^T + bias``; in FP8 under :func:`fp8_autocast`, else like nn.Linear.

    Args (in NVIDIA Transformer Engine's order, so that its programs' positional arguments
    mean what they meant there: the third is ``sequence_parallel``, not nn.Linear's ``bias``):
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
        tp_group, tp_size, parallel_mode: tensor parallelism over the torch.distributed
            group ``tp_group`` of ``tp_size`` ranks (tp_size must equal the group's size).
            ``"column"`` splits out_features: each rank holds weight [out/tp, in] and bias
            [out/tp], takes the full input and returns its shard of the output; the input's
            gradient is all-reduced in the backward. ``"row"`` splits in_features: each rank
            holds weight [out, in/tp] and the full bias, takes its shard of the input
            [..., in/tp] and returns the full output (partial products all-reduced, then the
            bias added once). Each rank initializes the full weight and keeps its slice, so
            the same seed on every rank gives the single-process layer's values. In FP8 the
            GEMMs are local; pass ``fp8_group=tp_group`` to :func:`fp8_autocast` so that
            delayed scaling gives every rank the same scales. With ``parameters_split``, a
            column layer splits each named block over the ranks (a rank holds its rows of
            each). ``parallel_mode=None`` (or tp_size 1): not split.
        sequence_parallel: with ``parallel_mode``, activations outside the layer are split
            along their first dimension over the group (distributed.py): a column-parallel
            layer gathers its input, a row-parallel one reduce-scatters its output (and its
            bias, applied to a shard, is marked ``sequence_parallel`` for the caller's
            gradient sum). Under DelayedScaling (with an ``fp8_group`` holding the ranks) and
            Float8CurrentScaling the column layer quantizes its shard with a scale the ranks
            share and gathers the FP8 bytes (sequence_parallel.py). No effect on a layer that
            is not split.
        fuse_wgrad_accumulation: the weight's gradient goes into ``weight.main_grad``
            (Megatron-LM's buffer; see module/_main_grad.py for the contract).
        get_rng_state_tracker, rng_tracker_name: NVIDIA's model-parallel RNG tracker for the
            weight's initialization. With both, the parameters are drawn on the tracker's
            stream ``rng_tracker_name`` (Megatron-LM's expert layers name theirs, so that
            experts differ between expert-parallel ranks); with the tracker alone they are
            drawn from torch's generator, where a split layer draws the whole weight and keeps
            its slice (NVIDIA's draws each slice on the tracker's default stream instead).
        delay_wgrad_compute: the backward computes the input's and bias's gradients and puts
            the weight's GEMM aside; :meth:`backward_dw` runs it and adds the gradient
            (module/_deferred_wgrad.py). The layer then takes the Python path (not the
            compiled operators).
        ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
            ub_name, symmetric_ar_type: NVIDIA's switches for features not built here; their
            defaults run, anything else raises NotImplementedError naming the keyword
            (``ub_name`` is only a name).
        save_original_input: NVIDIA's keeps the input itself for the backward and quantizes
            it again there (memory saved where the caller keeps the input anyway); here the
            backward keeps the FP8 copy the forward made. The values are the same (a tensor
            quantized again with the same scale gives the same bytes), so it is accepted
            either way and kept as the attribute Megatron-LM sets; the memory differs (one
            byte per input element).
        name: kept as ``self.name``.

    Example:
        >>> import transformer_engine.pytorch as te  # doctest: +SKIP
        >>> layer = te.Linear(768, 3072)  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = layer(torch.randn(2048, 768, device=layer.weight.device))
    """

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None,
                 rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, parameters_split=None,
                 device: Union[torch.device, str, None] = None, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        refuse_unbuilt(self._name, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                       ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                       ub_bulk_wgrad=ub_bulk_wgrad, symmetric_ar_type=symmetric_ar_type)
        tp = distributed.check_tensor_parallel(self._name, tp_group, tp_size, parallel_mode)
        check_unsupported(None, 1, parallel_mode, False, fuse_wgrad_accumulation, self._name)
        device = _default_device(device)
        super().__init__(device)
        self.return_bias, self.name, self.ub_name = return_bias, name, ub_name
        # (read and set by callers as NVIDIA's attribute; the backward keeps the FP8 copy of
        # the input either way: see save_original_input in the docstring)
        self.save_original_input = bool(save_original_input)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self._delay_wgrad(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.parallel_mode = parallel_mode
        # (no effect unless the layer is split: a replicated layer sees whole activations)
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        with init_stream(get_rng_state_tracker, rng_tracker_name):
            self._setup_linear(in_features, out_features, bias, params_dtype, device,
                               init_method, parameters_split, parallel_mode if tp > 1 else None,
                               tp_group, tp)
        if self.sequence_parallel and parallel_mode == "row":
            distributed.mark_sequence_parallel(self._parameters.get("bias"))

    # ------------------------------------------------------------------ forward

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: bool = False, fp8_grad: bool = False):
        """``inp`` [..., in_features] -> [..., out_features] (and the bias if return_bias).

        ``is_first_microbatch``: None quantizes the weight at every call; True quantizes it
        and keeps the FP8 copy; False reuses that copy (the weight does not change between
        the microbatches of one optimizer step).

        ``fp8_output``: under a per-tensor FP8 recipe (delayed or current scaling), return the
        output as a :class:`Float8Tensor` in the forward format, for a consumer that takes FP8
        (DotProductAttention under ``fp8_mha``); delayed scaling casts it in the GEMM with this
        module's output scale. Ignored otherwise. An input that is such a Float8Tensor is used
        without a cast.

        ``fp8_grad`` (NVIDIA's: the input's gradient as FP8) must be False: the gradient comes
        back in the input's dtype."""
        if fp8_grad:
            refuse_fp8_grad(self._name)
        if self.fuse_wgrad_accumulation:
            route_to_main_grad(self._gemm_weights())
        if self._tp_mode is not None:
            return self._parallel_forward(inp, is_first_microbatch, fp8_output)
        state = fp8.STATE
        if state.enabled and is_first_microbatch is None and not fp8_output:
            out = fast_linear.steady_forward(self, inp)
            if out is not None:
                return (out, self._parameters["bias"]) if self.return_bias else out
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"te.Linear: input must have in_features={self.in_features} "
                             f"as its last dimension, got shape {list(inp.shape)}")
        weight, bias = self._weight_and_bias()
        check_device(self._name, "input", inp, weight)
        gemm_bias = None if self.return_bias else bias
        out = self._gemm(inp, weight, gemm_bias, state, is_first_microbatch, fp8_output)
        return (out, bias) if self.return_bias else out

    def _forward_after_norm(self, inp: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """``self(norm(inp))`` for te.ops.Sequential, which fuses a te.LayerNorm / te.RMSNorm
        with the Linear after it: inside an FP8 autocast the norm writes this layer's FP8 input
        in its own pass, the computation of te.LayerNormLinear with ``norm``'s parameters and
        this layer's weight and FP8 state. Elsewhere (no FP8, tensor parallelism,
        ``return_bias``) the two run one after the other."""
        state = fp8.STATE
        if not state.enabled or self._tp_mode is not None or self.return_bias:
            return self(norm(inp))
        from ..layernorm_linear_fn import NormConfig
        from .layernorm_linear import fp8_norm_linear  # (it imports this module)

        if inp.dim() == 0 or inp.shape[-1] != norm.hidden_size or \
                norm.hidden_size != self.in_features:
            raise ValueError(f"{self._name}: after {norm._name}({norm.hidden_size}) the input "
                             f"must have in_features={self.in_features} as its last "
                             f"dimension, got shape {list(inp.shape)}")
        weight, bias = self._weight_and_bias()
        check_device(self._name, "input", inp, weight)
        cfg = NormConfig(norm._norm, norm.eps, norm.zero_centered_gamma, False)
        return fp8_norm_linear(self, inp, norm.weight, norm.bias, cfg, weight, bias, state.recipe,
                               None)

    def _gemm(self, inp, weight, gemm_bias, state, is_first_microbatch, fp8_output: bool):
        """``inp @ weight^T (+ gemm_bias)`` in FP8 under an enabled autocast, else in the
        input's dtype (calibrating the FP8 state where asked)."""
        if state.enabled:
            return self._fp8_linear(inp, weight, gemm_bias, state.recipe, is_first_microbatch,
                                    fp8_output)
        if isinstance(inp, Float8Tensor):
            inp = to_high_precision(inp)
        check_float_input(self._name, "input", inp)
        if state.calibrating:
            # (a GroupedLinear's group keeps its calibration metadata on the grouped module,
            # which names itself and the group's index for the call: GroupedLinear.forward)
            owner, group = self.__dict__.get("_calibration_into", (self, -1))
            self._calibrate_gemm_operands((("input", inp, True), ("weight", weight, False)),
                                          state, owner, group)
        # .to() (a no-op for the same dtype) keeps autograd's link to the parameter; a
        # Float8Tensor weight dequantizes in it (__torch_dispatch__).
        return hp_linear(inp, weight.to(inp.dtype),
                         None if gemm_bias is None else gemm_bias.to(inp.dtype),
                         self._wgrad_store)

    def _parallel_forward(self, inp: torch.Tensor, is_first_microbatch, fp8_output: bool):
        """The forward of a column- or row-parallel layer: the local GEMM on this rank's
        slice, and the layer's collective (distributed.py). A row-parallel layer's output is
        high precision (the sum is taken in it): fp8_output is ignored there."""
        if self._shared_tp_group is None:
            distributed.refuse_without_group(self._name, self.tp_size)
        column = self._tp_mode == "column"
        weight, bias = self._weight_and_bias()
        local_in = weight.shape[1]
        if inp.dim() == 0 or inp.shape[-1] != local_in:
            what = ("in_features" if column else
                    f"in_features / tp_size = {self.in_features} / {self.tp_size}")
            raise ValueError(f"te.Linear ({self._tp_mode}-parallel over {self.tp_size} ranks): "
                             f"input must have {local_in} ({what}) as its last dimension, got "
                             f"shape {list(inp.shape)}")
        check_device(self._name, "input", inp, weight)
        sequence = self.sequence_parallel
        state = fp8.STATE
        if state.enabled:  # the GEMM's feature dimensions are the local ones
            check_fp8_shape(inp, local_in, weight.shape[0], self._name)
        if column:
            if sequence:  # this rank's shard of the first dimension: gather the whole
                inp = self._gather_sequence(inp, state)
            elif torch.is_grad_enabled() and inp.requires_grad:
                inp = distributed.copy_to_tensor_parallel(inp, self.tp_group)
            gemm_bias = None if self.return_bias else bias
        else:
            gemm_bias, fp8_output = None, False  # the bias is added once, after the sum
        out = self._gemm(inp, weight, gemm_bias, state, is_first_microbatch, fp8_output)
        if not column:
            out = (distributed.reduce_scatter_to_sequence_parallel(out, self.tp_group,
                                                                   self._name) if sequence
                   else distributed.reduce_from_tensor_parallel(out, self.tp_group))
            if bias is not None and not self.return_bias:
                out = out + bias.to(out.dtype)
        return (out, bias) if self.return_bias else out

    def _gather_sequence(self, inp: torch.Tensor, state) -> torch.Tensor:
        """The whole input of a column-parallel layer from this rank's sequence shard: under
        a per-tensor FP8 recipe whose scale the ranks share, the shard quantized with that
        scale and its FP8 bytes gathered (a Float8Tensor the GEMM takes as it is); else the
        shard gathered as it is (sequence_parallel.py). The gradient is reduce-scattered."""
        group = self.tp_group
        if state.enabled:
            plan, scales, history = self._fp8_meta_of(state.recipe)
            if sequence_parallel.gathers_fp8(plan, state.recipe, group):
                # (an FP8 input with its own scale is re-quantized with the group's)
                inp = fp8_input(self._name, to_high_precision(inp))
                shard = sequence_parallel.quantize_shard(inp, plan, scales, history, group)
                return sequence_parallel.gather_fp8(shard, group)
        return distributed.gather_from_sequence_parallel(inp, group)


_FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_input(op: str, inp: torch.Tensor) -> torch.Tensor:
    """The input in the activation dtype of an FP8 forward (torch.autocast picks it)."""
    device_type = inp.device.type
    if torch.is_autocast_enabled(device_type):
        inp = inp.to(torch.get_autocast_dtype(device_type))
    if inp.dtype not in _FP8_INPUT_DTYPES:
        raise TypeError(f"{op}: input must be float32, bfloat16 or float16 in FP8, got "
                        f"{inp.dtype}")
    return inp


def check_fp8_shape(inp: torch.Tensor, k: int, n: int, op: str) -> None:
    """The feature dimensions of an FP8 GEMM must be multiples of the granule. The token count
    (input.numel() // k) may be anything: the GEMM's FP8 operands are padded to the granule
    (linear_fn.pad_gemm_operands)."""
    for name, value in (("in_features", k), ("out_features", n)):
        if value % GEMM_GRANULE:
            raise ValueError(f"{op}: FP8 GEMMs need feature dimensions that are multiples of "
                             f"{GEMM_GRANULE}; {name} must be a multiple of {GEMM_GRANULE}, "
                             f"got {value} (input shape {list(inp.shape)})")


def refuse_fp8_grad(op: str) -> None:
    raise NotImplementedError(f"{op}: fp8_grad=True (the input's gradient as FP8) is not "
                              "implemented; the gradient comes back in the input's dtype (pass "
                              "fp8_grad=False)")


def check_unsupported(tp_group, tp_size, parallel_mode, sequence_parallel,
                      fuse_wgrad_accumulation, op: str) -> None:
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{op}: parallel_mode must be None, 'column' or 'row', got "
                         f"{parallel_mode!r}")
    group_size = tp_group.size() if tp_group is not None and hasattr(tp_group, "size") else 1
    if tp_size != 1 or group_size != 1:
        raise NotImplementedError(
            f"{op}: tensor parallelism is not implemented yet; tp_size must be 1, got "
            f"{tp_size} (tp_group of size {group_size})")
    if sequence_parallel:
        raise NotImplementedError(f"{op}: sequence_parallel=True is not implemented yet "
                                  "(it needs tensor parallelism)")
    del fuse_wgrad_accumulation  # implemented (module/_main_grad.py); kept for the callers
