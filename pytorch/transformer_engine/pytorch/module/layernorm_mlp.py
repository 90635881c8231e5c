"""``te.LayerNormMLP``: the Transformer's MLP block, norm -> FC1 -> activation -> FC2.

In FP8 the whole block is one autograd function (``layernorm_mlp_fn.py``) whose kernels write
the GEMM operands in FP8 themselves; in high precision it is te.LayerNorm, nn.Linear, the
core's activation and nn.Linear, with the same activation formulas as the FP8 path.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from transformer_engine.common.activation_params import check_no_params, clamped_swiglu_params
from transformer_engine.common.recipe import Recipe

from .. import compiled_blocks, distributed, fp8, hp_blocks, ops
from ..checkpoint import checkpoint
from ..float8_tensor import Float8Tensor
from ..layernorm_mlp_fn import Fp8LayerNormMLPFunction, MlpConsts, large_block
from ..ops.activation import GATED, clamped_swiglu
from ._checks import check_params_dtype, check_sizes, refuse_unbuilt
from ._deferred_wgrad import linear as hp_linear
from ._deferred_wgrad import run_store
from ._main_grad import route_to_main_grad
from .base import FP8Module, fp8_weight_param, with_leading_dims
from .layernorm import apply_norm
from .layernorm_linear import (
    check_input,
    fp8_input,
    gathered_ln_out,
    norm_config,
    norm_params,
    parallel_ln_out,
    parallel_norm_inputs,
    register_norm_params,
    sequence_parallel_norm,
)
from .linear import (
    _default_device,
    check_fp8_shape,
    check_unsupported,
    init_bias,
    init_weight,
    plan_of,
)

__all__ = ["LayerNormMLP"]

ACTIVATIONS = ("gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu", "reglu", "qgeglu",
               "sreglu", "glu", "clamped_swiglu")


def check_activation(op: str, activation) -> None:
    """``activation`` must be one the core computes."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def activation_spec(op: str, activation: str, params: Optional[dict]) -> str:
    """The kernels' ``act`` (ops.activation) of ``activation`` with NVIDIA's
    ``activation_params`` (clamped_swiglu's ``limit``, ``alpha``, ``glu_linear_offset``: see
    transformer_engine.common.activation_params; the others take none)."""
    check_activation(op, activation)
    try:
        if activation != "clamped_swiglu":
            check_no_params(activation, params)
            return activation
        return clamped_swiglu(*clamped_swiglu_params(params))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


class _ActivationFunction(torch.autograd.Function):
    """``act(h)`` over the last dimension of h (any rank) by the core's kernels, as the matrix
    [M, N] (see with_leading_dims)."""

    @staticmethod
    def forward(ctx, h, act: str):
        x = h.reshape(-1, h.shape[-1])
        y = ops.activation_forward(x, act)
        ctx.save_for_backward(x)
        ctx.act, ctx.shape = act, h.shape
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        dy = grad_output.reshape(x.shape[0], -1).to(x.dtype).contiguous()
        dx, _ = ops.activation_backward(dy, x, ctx.act, False)
        return dx.view(ctx.shape), None


def apply_activation(h: torch.Tensor, act: str) -> torch.Tensor:
    """``act(h)`` in h's leading dimensions (see with_leading_dims)."""
    return with_leading_dims(_ActivationFunction.apply(h, act), h)


class LayerNormMLP(FP8Module):
    """``fc2(act(fc1(norm(x))))`` with the GEMMs in FP8 under :func:`fp8_autocast`.

    Args (in NVIDIA Transformer Engine's order, so that its programs' positional arguments
    mean what they meant there):
        hidden_size: the input's and the output's features (normalized over).
        ffn_hidden_size: features between the GEMMs. A gated activation (geglu, swiglu,
            reglu, qgeglu, sreglu, glu) takes FC1's output as [a, b] halves, so FC1 has
            2 * ffn_hidden_size rows.
        eps, normalization, zero_centered_gamma, return_layernorm_output: the norm's, as in
            te.LayerNormLinear.
        bias: learn FC1's and FC2's biases.
        activation: one of ``gelu`` (tanh approximation), ``relu``, ``silu``, ``qgelu``
            (x sigmoid(1.702 x)), ``srelu`` (relu(x)^2), ``geglu``, ``swiglu``, ``reglu``,
            ``qgeglu``, ``sreglu`` (act(a) * b), ``glu`` (sigmoid(a) * b),
            ``clamped_swiglu`` (g sigmoid(alpha g) * (u + glu_linear_offset) with
            g = min(a, limit), u = clamp(b, -limit, limit), as in GPT-OSS).
        activation_params: clamped_swiglu's ``{"limit": 7.0, "alpha": 1.702,
            "glu_linear_offset": 1.0}`` (these are the defaults; any subset); None for the
            other activations.
        return_bias: return FC2's bias instead of adding it.
        params_dtype, device: as te.Linear.
        init_method, output_layer_init_method: initialize FC1's resp. FC2's weight in place
            (default: nn.Linear's).
        tp_group, tp_size, set_parallel_mode: tensor parallelism over the torch.distributed
            group ``tp_group`` of ``tp_size`` ranks (tp_size must equal the group's size).
            With ``set_parallel_mode=True`` FC1 is column-parallel and FC2 row-parallel: each
            rank holds ``ffn_hidden_size / tp_size`` of the features between the GEMMs (FC1's
            rows, of each half under a gated activation; FC2's columns) and FC1's bias slice,
            and the full norm parameters and FC2 bias. Every rank takes the full input and
            returns the full output: FC2's partial products are all-reduced in the forward,
            then FC2's bias is added once; the gradients of the input and of the norm's
            parameters are all-reduced in the backward. Each rank initializes the full weights
            and keeps its slices (the same seed on every rank gives the single-process
            block's values). In FP8 the GEMMs are local; pass ``fp8_group=tp_group`` to
            :func:`fp8_autocast` so that delayed scaling gives every rank the same scales.
            ``set_parallel_mode=False``: not split.
        sequence_parallel: with ``set_parallel_mode``, the input and output are this rank's
            shard of the first dimension (te.Linear): the norm runs on the shard and its
            output is gathered for FC1 (as FP8 bytes under DelayedScaling with an
            ``fp8_group`` holding the ranks, and Float8CurrentScaling), the output is
            reduce-scattered; the norm's parameters and FC2's bias are marked
            ``sequence_parallel`` for the caller's gradient sum over the group.
        fuse_wgrad_accumulation: both weights' gradients go into their ``main_grad``
            (Megatron-LM's buffers; see module/_main_grad.py).
        return_layernorm_output_gathered: as te.LayerNormLinear's.
        checkpoint: keep only the block's input for the backward and run the forward again
            there (te.checkpoint of the block, with this step's FP8 scales and RNG state):
            FC1's output, the activation and their FP8 copies are not kept between the
            passes. NVIDIA's recomputes FC1 and the activation only; here FC2's forward GEMM
            runs again too. Inside an activation checkpoint (te.checkpoint, or a layer's
            own) the block is recomputed by that one.
        get_rng_state_tracker, seq_length, micro_batch_size: accepted and kept; unused
            (as te.Linear's tracker; the sizes are for NVIDIA's JIT warm-up).
        delay_wgrad_compute: as te.Linear's, for both weights (:meth:`backward_dw`); the
            backward then keeps FC2's operands to the end (not the memory-lean order).
        ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad,
            symmetric_ar_type: as te.Linear.

    Returns ``output``, then FC2's bias when ``return_bias``, then the norm's output when
    ``return_layernorm_output``.

    Example:
        >>> mlp = te.LayerNormMLP(1024, 4096, activation="swiglu")  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = mlp(torch.randn(2048, 1024, device=mlp.fc1_weight.device))
    """

    _name = "te.LayerNormMLP"
    # Tensor parallelism (set_parallel_mode=True over tp_size > 1 ranks): class defaults, so
    # that a module pickled before they existed loads as a plain block.
    _shared_tp_group: Optional[distributed.SharedGroup] = None
    tp_size = 1

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, return_bias: bool = False,
                 get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 tp_size: int = 1,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", activation_params: Optional[dict] = None,
                 output_layer_init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 fuse_wgrad_accumulation: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False,
                 seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 set_parallel_mode: bool = False, zero_centered_gamma: bool = False,
                 device: Union[torch.device, str, None] = None, ub_overlap_ag: bool = False,
                 name: Optional[str] = None, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, checkpoint: bool = False) -> None:
        refuse_unbuilt(self._name, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                       ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                       ub_bulk_wgrad=ub_bulk_wgrad, symmetric_ar_type=symmetric_ar_type)
        if not isinstance(set_parallel_mode, bool):
            raise TypeError(f"{self._name}: set_parallel_mode must be a bool, got "
                            f"{set_parallel_mode!r}")
        # FC1's mode stands for the pair (FC2 is then row-parallel).
        tp = distributed.check_tensor_parallel(self._name, tp_group, tp_size,
                                               "column" if set_parallel_mode else None)
        check_unsupported(None, 1, None, False, fuse_wgrad_accumulation, self._name)
        check_sizes(self._name, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        if tp > 1:
            distributed.check_divisible(self._name, "ffn_hidden_size", ffn_hidden_size, tp)
        check_params_dtype(self._name, params_dtype)
        act = activation_spec(self._name, activation, activation_params)
        cfg = norm_config(self._name, normalization, eps, zero_centered_gamma,
                          return_layernorm_output)
        device = _default_device(device)
        super().__init__(device, num_gemms=2)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.activation, self.normalization, self.cfg = activation, normalization, cfg
        self.activation_params = activation_params
        self._act = act  # the kernels' name of the activation, with its parameters
        self.return_bias, self.name, self.set_parallel_mode = return_bias, name, set_parallel_mode
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        self.checkpoint = bool(checkpoint)
        # delay_wgrad_compute: the lists FC1's and FC2's weight-gradient GEMMs go on
        # (module/_deferred_wgrad.py), else None
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self._wgrad_store = ([], []) if self.delay_wgrad_compute else None
        self.get_rng_state_tracker = get_rng_state_tracker
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        dtype = params_dtype or torch.get_default_dtype()
        register_norm_params(self, self.hidden_size, cfg, dtype, device)
        fc1_out = self.ffn_hidden_size * (2 if activation in GATED else 1)
        w1 = init_weight(fc1_out, self.hidden_size, dtype, device, init_method)
        b1 = init_bias(fc1_out, self.hidden_size, dtype, device) if bias else None
        w2 = init_weight(self.hidden_size, self.ffn_hidden_size, dtype, device,
                         output_layer_init_method)
        b2 = init_bias(self.hidden_size, self.ffn_hidden_size, dtype, device) if bias else None
        self.tp_size = tp
        if tp > 1 and tp_group is not None:
            # Drawn whole (the same generator state on every rank), then this rank's slices;
            # without the group, once set_tensor_parallel_group gives it.
            w1, b1, w2 = self._shard(w1, b1, w2, tp_group, tp)
        self._register_fc_params(w1, b1, w2, b2)
        # (no effect unless the block is split)
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        if self.sequence_parallel:  # applied to sequence shards: the caller sums them
            distributed.mark_sequence_parallel(self.layer_norm_weight,
                                               getattr(self, "layer_norm_bias", None),
                                               self.fc2_bias)

    # (class defaults, for modules pickled before these existed)
    delay_wgrad_compute = False
    _wgrad_store: Optional[tuple] = None

    def backward_dw(self) -> None:
        """delay_wgrad_compute: runs FC1's and FC2's weight-gradient GEMMs the backward passes
        put aside and adds their results to the weights' gradients (as te.Linear's)."""
        if self._wgrad_store is not None:
            for store, weight in zip(self._wgrad_store, (self.fc1_weight, self.fc2_weight),
                                     strict=True):
                run_store(store, [weight], self.fuse_wgrad_accumulation)

    @property
    def tp_group(self):
        """The process group the block is split over (None: not split)."""
        return None if self._shared_tp_group is None else self._shared_tp_group.group

    def _register_fc_params(self, w1, b1, w2, b2) -> None:
        self.fc1_weight = fp8_weight_param(w1, plan_of)
        self.register_parameter("fc1_bias", None if b1 is None else torch.nn.Parameter(b1))
        self.fc2_weight = fp8_weight_param(w2, plan_of)
        self.register_parameter("fc2_bias", None if b2 is None else torch.nn.Parameter(b2))
        if self._shared_tp_group is not None:
            # Where each slice lies in the full tensor (Megatron's attribute names); FC2's
            # bias is not split.
            for p, dim in ((self.fc1_weight, 0), (self.fc1_bias, 0), (self.fc2_weight, 1)):
                if p is not None:
                    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supplies the tensor-parallel group of a block built with ``set_parallel_mode=True``,
        ``tp_size`` > 1 and no ``tp_group`` (NVIDIA's way): it then keeps this rank's slices
        of the weights drawn whole at construction (as te.Linear.set_tensor_parallel_group;
        the parameters are new objects)."""
        if not distributed.check_group_to_set(self._name, tp_group, self.tp_size,
                                              self.tp_group):
            return
        w1, w2 = self.fc1_weight, self.fc2_weight
        if isinstance(w1, Float8Tensor) or isinstance(w2, Float8Tensor):
            raise NotImplementedError(
                f"{self._name}: set_tensor_parallel_group on fp8_model_init weights is not "
                "implemented; pass tp_group when building the module")
        b1, b2 = self.fc1_bias, self.fc2_bias
        w1, b1, w2 = self._shard(w1.detach(), None if b1 is None else b1.detach(),
                                 w2.detach(), tp_group, self.tp_size)
        self._register_fc_params(w1, b1, w2, None if b2 is None else b2.detach())
        if self.sequence_parallel:  # (the new FC2 bias)
            distributed.mark_sequence_parallel(self.fc2_bias)

    def _shard(self, w1, b1, w2, group, tp: int):
        """This rank's rows of FC1 (of each half [a, b] under a gated activation, so that the
        rank's a and b features stay paired) and its columns of FC2."""
        import torch.distributed as dist

        self._shared_tp_group, self.tp_size = distributed.SharedGroup(group), tp
        rank = dist.get_rank(group)
        n = self.ffn_hidden_size // tp
        halves = 2 if self.activation in GATED else 1
        rows = torch.cat([torch.arange(h * self.ffn_hidden_size + rank * n,
                                       h * self.ffn_hidden_size + (rank + 1) * n)
                          for h in range(halves)]).to(w1.device)
        # (Indexing copies: the slices alone, not views holding the full storage.)
        return (w1[rows], None if b1 is None else b1[rows],
                w2[:, rank * n:(rank + 1) * n].clone())

    def extra_repr(self) -> str:
        text = (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}, "
                f"bias={self.fc1_bias is not None}")
        if self._shared_tp_group is not None:
            text += f", set_parallel_mode=True, tp_size={self.tp_size}"
        return text

    def _gemm_weights(self) -> list:
        """FC1's and FC2's weights (fuse_wgrad_accumulation's)."""
        return [self._parameters.get("fc1_weight"), self._parameters.get("fc2_weight")]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``inp`` [..., hidden_size] -> [..., hidden_size] (see the class docstring for what
        else comes back); ``is_first_microbatch`` as for te.Linear, for both weights."""
        recompute = fp8.RECOMPUTE
        if (getattr(self, "checkpoint", False) and torch.is_grad_enabled()
                and recompute.recording is None and not recompute.replaying):
            return checkpoint(self._forward, inp, is_first_microbatch)
        return self._forward(inp, is_first_microbatch)

    def _forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]):
        if self.fuse_wgrad_accumulation:
            route_to_main_grad(self._gemm_weights())
        if self.tp_size > 1:
            return self._parallel_forward(inp, is_first_microbatch)
        check_input(self._name, inp, self.hidden_size, self.layer_norm_weight)
        fc2_bias = None if self.return_bias else self.fc2_bias
        state = fp8.STATE
        if state.enabled:
            out = self._fp8_forward(inp, fc2_bias, state.recipe, is_first_microbatch)
        else:
            out = self._hp_forward(inp, fc2_bias, state)
        ln_out = None
        if self.cfg.return_ln_out:
            out, ln_out = out
        result = (out,) + ((self.fc2_bias,) if self.return_bias else ()) + \
            ((ln_out,) if ln_out is not None else ())
        return result if len(result) > 1 else out

    def _parallel_forward(self, inp, is_first_microbatch):
        """FC1 column-parallel, FC2 row-parallel: the local block without FC2's bias, the sum
        of the ranks' outputs, then the bias once. The gradients of the input and of the
        norm's parameters are summed over the ranks (parallel_norm_inputs). Under sequence
        parallelism the norm runs on this rank's shard and its output is gathered
        (sequence_parallel_norm; in FP8 under the per-tensor recipes), and the output is
        reduce-scattered."""
        if self._shared_tp_group is None:
            distributed.refuse_without_group(self._name, self.tp_size)
        check_input(self._name, inp, self.hidden_size, self.layer_norm_weight)
        group = self.tp_group
        state = fp8.STATE
        if state.enabled:
            inp = fp8_input(self._name, inp)
            # The GEMMs' feature dimensions are the local ones.
            check_fp8_shape(inp, self.hidden_size, self.fc2_weight.shape[1], self._name)
        if self.sequence_parallel:
            ln_full, ln_out = sequence_parallel_norm(self, inp, state)
            if state.enabled:
                out = self._fp8_forward(ln_full, None, state.recipe, is_first_microbatch,
                                        normalized=True)
            else:
                out = self._hp_forward(ln_full, None, state, normalized=True)
                if self.cfg.return_ln_out:
                    out = out[0]  # (the gathered norm output; this rank's shard is returned)
            ln_out = gathered_ln_out(self, ln_out, group)
        else:
            inp, norm = parallel_norm_inputs(inp, norm_params(self, inp.dtype), group)
            if state.enabled:
                out = self._fp8_forward(inp, None, state.recipe, is_first_microbatch, norm)
            else:
                out = self._hp_forward(inp, None, state, norm)
            ln_out = None
            if self.cfg.return_ln_out:
                out, ln_out = out
                ln_out = parallel_ln_out(ln_out, group)
        out = (distributed.reduce_scatter_to_sequence_parallel(out, group, self._name)
               if self.sequence_parallel else distributed.reduce_from_tensor_parallel(out, group))
        if self.fc2_bias is not None and not self.return_bias:
            out = out + self.fc2_bias.to(out.dtype)
        result = (out,) + ((self.fc2_bias,) if self.return_bias else ()) + \
            ((ln_out,) if ln_out is not None else ())
        return result if len(result) > 1 else out

    def _hp_forward(self, inp, fc2_bias, state, norm=None, normalized: bool = False):
        cfg, dtype = self.cfg, inp.dtype
        # norm: (gamma, beta) as the parallel forward hands them over; normalized: inp is the
        # norm's output already (sequence parallelism normalizes each shard, then gathers)
        w1, w2 = self.fc1_weight.to(dtype), self.fc2_weight.to(dtype)
        b1 = None if self.fc1_bias is None else self.fc1_bias.to(dtype)
        b2 = None if fc2_bias is None else fc2_bias.to(dtype)
        if normalized:
            ln_out = inp
        else:
            gamma, beta = norm_params(self, dtype) if norm is None else norm
            if (not (cfg.return_ln_out or self._wgrad_store is not None or state.calibrating)
                    and hp_blocks.usable(inp, gamma, beta, w1, b1, w2, b2)):
                return hp_blocks.layernorm_mlp(inp, gamma, beta, w1, b1, w2, b2, cfg.norm,
                                               cfg.eps, cfg.zero_centered_gamma, self._act)
            ln_out = apply_norm(inp, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma)
        stores = self._wgrad_store or (None, None)
        h = hp_linear(ln_out, w1, b1, stores[0])
        a = apply_activation(h, self._act)
        if state.calibrating:
            self._calibrate_gemm_operands((("fc1_input", ln_out, True),
                                           ("fc1_weight", self.fc1_weight, False),
                                           ("fc2_input", a, True),
                                           ("fc2_weight", self.fc2_weight, False)), state)
        out = hp_linear(a, w2, b2, stores[1])
        return (out, ln_out) if cfg.return_ln_out else out

    def _fp8_forward(self, inp, fc2_bias, recipe: Recipe, is_first_microbatch, norm=None,
                     normalized: bool = False):
        # normalized: inp is the norm's output already (sequence parallelism's gathered one,
        # checked before its norm; a Float8Tensor in the per-tensor recipes): the block
        # function then skips its norm (no NormConfig) and returns that output's gradient
        w1, b1, w2 = self.fc1_weight, self.fc1_bias, self.fc2_weight
        if normalized:
            gamma = beta = cfg = None
        else:
            inp = fp8_input(self._name, inp)
            check_fp8_shape(inp, self.hidden_size, w1.shape[0], self._name)
            check_fp8_shape(inp, self.hidden_size, self.ffn_hidden_size, self._name)
            gamma, beta = norm_params(self, inp.dtype) if norm is None else norm
            cfg = self.cfg
        plan, scales, history = self._fp8_meta_of(recipe)
        grad = torch.is_grad_enabled()
        need_dgrad = grad and (inp.requires_grad or (gamma is not None and gamma.requires_grad)
                               or (beta is not None and beta.requires_grad))
        need_wgrad1 = grad and w1.requires_grad
        need_fc1 = need_dgrad or need_wgrad1 or (grad and b1 is not None and b1.requires_grad)
        need = (need_dgrad, need_wgrad1, grad and w2.requires_grad, need_fc1)
        bwd_meta, bwd_recipe, group = self._backward_state(plan, recipe)
        stores = self._wgrad_store
        if cfg is not None and norm is None and compiled_blocks.usable(
                plan, bwd_recipe, history, inp, (w1, w2), (b1, fc2_bias),
                (gamma,) if beta is None else (gamma, beta), cfg, is_first_microbatch, self):
            # the whole block in two operator calls (forward, backward)
            out = compiled_blocks.layernorm_mlp(inp, gamma, beta, w1, b1, w2, fc2_bias, self._act,
                                                plan, cfg, scales, history, bwd_meta, need)
            if out is not None:
                return with_leading_dims(out, inp)
        # Copies quantized for this forward alone: the backward may free them once read.
        own_weights = is_first_microbatch is None and not isinstance(w1, Float8Tensor) \
            and not isinstance(w2, Float8Tensor)
        # A large block's backward makes its weights' column-wise copies itself
        # (layernorm_mlp_fn.late_weight_columns): out of the forward's peak and the saved
        # bytes, for one more read of each weight.
        late = own_weights and need_fc1 and stores is None \
            and not torch.compiler.is_compiling() \
            and large_block(inp.numel() // inp.shape[-1], w1.shape[0], inp.dtype)
        q1 = self._weight_operand(plan, w1, need_dgrad and not late, is_first_microbatch,
                                  scales, history, 0)
        q2 = self._weight_operand(plan, w2, need_fc1 and not late, is_first_microbatch, scales,
                                  history, 1)
        per_tensor = plan.weight_mode == "tensor"
        # (delayed scaling: the scales the copies were made with, which an update may replace
        # before the backward)
        late_scales = scales.clone() if late and plan.kind == "delayed" else None
        consts = MlpConsts(plan, bwd_recipe, group, cfg, self._act, need, own_weights, stores,
                           late, late_scales)
        return with_leading_dims(Fp8LayerNormMLPFunction.apply(
            inp, gamma, beta, w1, b1, q1.data, q1.scale_inv, q1.columnwise,
            None if per_tensor else q1.columnwise_scale_inv, w2, fc2_bias, q2.data,
            q2.scale_inv, q2.columnwise, None if per_tensor else q2.columnwise_scale_inv,
            history, scales, bwd_meta, consts), inp)
