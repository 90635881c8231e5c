"""te.TransformerLayer's training step as one autograd node, in FP8 and in high precision.

A small layer's eager step is bound by host time. Through its modules, a TransformerLayer's
forward runs six module forwards (the layer, attention, the QKV norm + projection, the core
attention, the output projection, the MLP), each with its checks, plan lookups and state
reads, and five autograd nodes (the joined QKV weight, the QKV block, attention, the
projection, the MLP block), each with its Python wrappers forward and backward
(``benchmarks/results/host_sites_h100.json``). Here the same step is one node whose forward and
backward make the very calls those nodes make, with the same arguments, in the same order
(so the same bits, ``tests/pytorch/test_layer_block.py``). The nodes live in
``layer_block_nodes.py``; this file decides when a call takes one, and learns its step. Under
per-tensor FP8 (``Layer``):

    forward:  layernorm_linear_block_forward (QKV) -> attention_forward (q, k, v read in
              place from the QKV output) -> linear_fp8_forward (projection) -> + x ->
              layernorm_mlp_block_forward -> + residual
    backward: the same blocks' backwards in reverse, the residual gradients added as autograd
              adds them.

Outside fp8_autocast (``LayerHP``): hp_blocks' steps for the QKV block and the MLP, F.linear
for the projection, the same attention; backward by the same formulas. Both backwards free
what the node made once it is read (release.py), as the modules' nodes let it go.

The layer learns the step once per recipe, input and settings (``_learn``: every condition the
modules' own paths check, and the attention's backend), and later forwards under them go
straight to the node after the checks of what can change between calls (``_run``: the
configuration, the parameters, the autocast), as te.Linear's steady path does
(fast_linear.steady_forward). te.MultiheadAttention's step is such a node too
(``attention_forward``): the first half of the layer's.

What it takes: an encoder layer with the pre-norm residuals (no post-norm, output norm or
parallel attention-MLP), no drop path (hidden and attention dropout as the modules apply
them, with their rng states drawn in the same order; no rng tracker), causal or no mask without
a window, bshd or sbhd, no tensor, sequence or context parallelism, no KV cache, attention
bias, q/k norms or forward arguments other than the input and one tensor of RoPE angles for
q and k (te.RotaryPositionEmbedding's), parameters that are
plain tensors in the input's dtype that all need gradients (in grad mode), the QKV weights
back to back in one storage (as te.TransformerLayer lays them out), no deferred weight
gradients; in FP8 per-tensor delayed (core update, no amax group) or current scaling without
FP8 attention; in high precision, not calibrating. Everything else, and a delayed-scaling
first step, takes the modules' path. With grad mode off (evaluation, inference) the nodes run
the forward alone (``infer``), as the modules do then. Traced by torch.compile, the FP8 nodes
past delayed scaling's first step are one custom op per direction running the node
(``layer_block_op.py``); the rest traces the modules.
``enabled = False`` turns it off (for comparisons), and so does turning off what it stands on
(compiled_blocks, fast_linear, hp_blocks, attention_fn.packed_enabled).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import (
    _compiled,
    attention_fn,
    compiled_blocks,
    fast_linear,
    first_step,
    fp8,
    hp_blocks,
    layer_block_op,
    layernorm_mlp_fn,
    ops,
)
from .attention_fn import packed_qkv
from .fp8 import COMPILED_ALGOS
from .layer_block_nodes import (
    Step,
    apply_attention,
    apply_attention_hp,
    apply_layer,
    apply_layer_hp,
    block_args,
    infer,
)
from .module._attention_backend import backend_key, choose_backend, env_backend
from .module._heads import packed_views, split_heads
from .module._split_rows import back_to_back
from .module.attention import resolve_window
from .ops._backend import enum_code
from .quantization import kind_of

enabled = True

# FC1 outputs up to this size take the MLP block's operators whole; larger ones take the
# modules' path. The modules' MLP goes to its memory-lean Python steps from
# layernorm_mlp_fn.LEAN_BYTES (128 MiB) on: FC2's saved input freed before its dgrad and, under
# delayed scaling, FC1's gradient made in chunks. One backward call keeps FC1's output, FC2's
# FP8 input and the activation's gradient until it returns instead: a transient peak of about
# three FC1 outputs' worth in one layer's backward, for a step that is not bound by the host
# (at hidden 2048 and 8192 tokens, FC1's output is 128 MiB and those steps' host time is the
# step's time: benchmarks/results/model_layer_block_h100_0901716.json). Below 512 MiB, so
# that the getting-started layer (16384 tokens, FFN 16384: 512 MiB) keeps the lean order and
# its memory.
WHOLE_MLP_BYTES = 4 * layernorm_mlp_fn.LEAN_BYTES




class _Declined(NamedTuple):
    """A recipe and input the node does not take, whatever the next call brings."""

    recipe: object
    key: tuple


def _parts(module) -> tuple[list, list]:
    """The QKV weight and bias blocks of the attention's first module."""
    if module._splits is None:
        p = module._parameters
        return [p["weight"]], ([p["bias"]] if p.get("bias") is not None else [])
    weights = [module._parameters[n] for n in module.weight_names]
    return weights, [module._parameters[n] for n in module.bias_names]


def _attention_static_ok(mha) -> bool:
    """A te.MultiheadAttention's configuration the nodes take: what no call can change."""
    sub = mha._modules  # (submodules read from their dict: nn.Module's __getattr__ is slow)
    qkv, dpa, proj = sub.get("layernorm_qkv"), sub["core_attention"], sub["proj"]
    if (qkv is None or mha.attention_type != "self" or mha.return_layernorm_output
            or mha.return_bias or mha.qk_norm_type is not None or mha.tp_size != 1
            or mha.fuse_wgrad_accumulation or dpa._cp is not None
            or getattr(dpa, "softmax_offset", None) is not None
            or (dpa.attention_dropout != 0.0 and dpa.get_rng_state_tracker is not None)
            or mha.qkv_format not in ("bshd", "sbhd")):
        return False
    if qkv.cfg.return_ln_out or proj._splits is not None:
        return False
    return all(_module_static_ok(m) for m in (qkv, proj))


def _module_static_ok(m) -> bool:
    return not (getattr(m, "tp_size", 1) != 1 or getattr(m, "sequence_parallel", False)
                or getattr(m, "_tp_mode", None) is not None or m.fuse_wgrad_accumulation
                or getattr(m, "return_bias", False))


def _layer_static_ok(layer) -> bool:
    """A te.TransformerLayer's configuration the layer node takes."""
    mlp = layer._modules["layernorm_mlp"]
    if (layer.layer_type != "encoder" or layer.parallel_attention_mlp or layer.output_layernorm
            or layer.apply_residual_connection_post_layernorm or layer.drop_path_rate != 0.0
            or layer.fuse_wgrad_accumulation):
        return False
    if mlp.cfg.return_ln_out or not _module_static_ok(mlp):
        return False
    return _attention_static_ok(layer._modules["self_attention"])


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(tensors, dtype, need_grads: bool) -> bool:
    """Whether the node takes these parameters: plain contiguous tensors of the input's
    dtype, each requiring its gradient when ``need_grads``."""
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.dtype != dtype
                              or not t.is_contiguous()
                              or (need_grads and not t.requires_grad)):
            return False
    return True


class _Params(NamedTuple):
    """The parameters a node takes, read afresh at every call."""

    attention: tuple  # (QKV norm's gamma, beta; projection's weight, bias)
    mlp: tuple  # (norm's gamma, beta; FC1's weight, bias; FC2's weight, bias); () without one
    weights: tuple  # the QKV weight's row blocks (one without parameters_split)
    biases: tuple  # the QKV bias's row blocks (none without a bias)

    def all(self) -> tuple:
        return (*self.attention, *self.mlp, *self.weights, *self.biases)


def _params(mha, mlp) -> _Params:
    sub = mha._modules
    qkv_mod, pp = sub["layernorm_qkv"], sub["proj"]._parameters
    weights, biases = _parts(qkv_mod)
    qp = qkv_mod._parameters
    mlp_params = () if mlp is None else tuple(
        mlp._parameters.get(n) for n in ("layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                         "fc1_bias", "fc2_weight", "fc2_bias"))
    return _Params((qp["layer_norm_weight"], qp.get("layer_norm_bias"), pp["weight"],
                    pp.get("bias")), mlp_params, tuple(weights), tuple(biases))


def _learn(mha, mlp, x: torch.Tensor, params: _Params, recipe, key: tuple, mask: str, window,
           dropout: float, grad: bool):
    """The step of ``mha`` (and ``mlp`` after it, for the layer node; None for the attention
    node) for this recipe and input, whose call _run has checked; where the modules' path must
    run (each module's own rule, checked as its forward checks it), a _Declined for this
    recipe and input, or None where the reason passes by the next call (a delayed-scaling
    first step's empty history): the next call learns again."""
    declined = _Declined(recipe, key)
    qkv_mod, dpa, proj = mha.layernorm_qkv, mha.core_attention, mha.proj
    modules = (qkv_mod, proj) if mlp is None else (qkv_mod, proj, mlp)
    if mask not in ("causal", "no_mask"):
        return declined
    window_pair = resolve_window(mask, window)
    if window_pair != ((-1, 0) if mask == "causal" else (-1, -1)):
        return declined
    hp = recipe is None
    if getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False):
        return declined
    weights, dtype = params.weights, x.dtype
    plans = []
    for m in (() if hp else modules):
        plan, scales, history = m._fp8_meta_of(recipe)
        _, bwd_recipe, group = m._backward_state(plan, recipe)
        if bwd_recipe is not None or group is not None:
            return declined
        if plan.kind not in ("delayed", "current") or (plan.kind == "delayed"
                                                       and plan.algo not in COMPILED_ALGOS):
            return declined
        if not (_compiled.serves_traced(plan, history) if torch.compiler.is_compiling()
                else _compiled.serves(plan, history, (x,))):
            return None
        plans.append(plan)
    tokens = x.numel() // x.shape[-1]
    w_qkv_rows = sum(w.shape[0] for w in weights)
    if tokens == 0 or (mlp is not None and ops.activation.has_params(mlp._act)):
        return declined
    if not hp:  # (the FP8 GEMMs' granules; the MLP block's operators whole)
        sizes = [x.shape[-1], w_qkv_rows, proj._parameters["weight"].shape[0], tokens]
        if mlp is not None:
            sizes += [mlp.fc1_weight.shape[0], mlp.fc2_weight.shape[1]]
            if tokens * mlp.fc1_weight.shape[0] * dtype.itemsize >= WHOLE_MLP_BYTES:
                return declined
        if any(n % 16 for n in sizes):
            return declined
    # The attention: q, k, v as the heads of the QKV output, read in place, on the backend the
    # core attention would choose for them.
    layout = mha.qkv_format
    qkv_out = torch.empty((*x.shape[:-1], w_qkv_rows), dtype=dtype, device=x.device)
    q, k, v = split_heads(qkv_out, mha._local_groups, mha._parts, mha.head_dim,
                          mha.qkv_weight_interleaved)
    asked = dpa.attention_backend or env_backend()
    if asked not in ("auto", "cudnn", "cuda_math", "cpu"):
        return declined
    backend = choose_backend(backend_key(q, k, v, layout, mask, window_pair, dpa.softmax_scale,
                                         dropout, None, 0, 0, ""), grad, asked)
    if backend in ("unfused", "!"):
        return declined
    attention = (layout, mask, window_pair[0], window_pair[1], float(dpa.softmax_scale),
                 float(dropout), 0, 0, backend)
    if torch.compiler.is_compiling():  # (packed_qkv reads the data pointer: eager only)
        views = packed_views(tuple(qkv_out.shape), dtype, mha._local_groups, mha._parts,
                             mha.head_dim, mha.qkv_weight_interleaved)
        if views is None:
            return declined
        # (of q, k, v read in place, as the core's config takes them; the QKV output is a
        # fresh allocation inside the node's op)
        strides = ops.attention.qkv_strides_of(layout, mask, views, dtype.itemsize)
    else:
        packed = packed_qkv(q, k, v, attention)
        if packed is None:
            return declined
        views = packed[1]
        strides = ops.attention.qkv_strides(layout, mask, q, k, v)
    norms = tuple(None if m is None else (m.cfg.norm, m.cfg.eps, m.cfg.zero_centered_gamma)
                  for m in (qkv_mod, mlp))
    common = (attention, views, bool(dpa.deterministic), tuple(w.shape[0] for w in weights), hp,
              norms, None if mlp is None else mlp._act, bool(mha.rotary_pos_interleaved))
    if hp:
        return Step(None, key, False, None, None, None, 0, *common)
    codes = (compiled_blocks._codes(plans[0], qkv_mod.cfg), fast_linear.codes_of(plans[1]),
             None if mlp is None else compiled_blocks._codes(plans[2], mlp.cfg))
    # (the fused calls cast every operand with the QKV block's codes: the plans must agree)
    casts = {(c.current, c.fwd_dtype, c.pow2, c.epsilon) for c in codes[::2] if c is not None}
    casts.add((codes[1].current, codes[1].fp8_dtype, codes[1].pow2, codes[1].epsilon))
    return Step(recipe, key, plans[0].kind == "delayed", *codes,
                0 if mlp is None else enum_code("Activation", mlp._act), *common,
                block_args(attention, views, strides) if len(casts) == 1 else None)


def _past_first_step(modules) -> bool:
    """Whether a traced delayed-scaling step of ``modules`` is past the first step for each
    (first_step.trace_module's "later"), known before any of them is traced: asking their
    _fp8_meta_of would advance their first-step state, and the modules' path, if it runs
    instead, must find that state as it was."""
    for m in modules:
        state = m._fp8_first_step
        if state == "first" or (state == "eager" and any(
                first_step.has_empty(m._buffers[name])
                for name in ("amax_history_fwd", "amax_history_bwd"))):
            return False
    return True


def _run(owner, mha, mlp, x: torch.Tensor, rotary_pos_emb, mask: str, window):
    """The node's step of ``owner`` (the layer, or the attention module alone with ``mlp``
    None), or None where the modules' path must run."""
    state = fp8.STATE
    # (it stands on packed attention and, in FP8, on the whole blocks and te.Linear's
    # compiled path; in high precision on the blocks' one-node steps)
    if not (enabled and attention_fn.packed_enabled):
        return None
    if state.enabled:
        if not (_compiled.ops is not None and compiled_blocks.enabled and fast_linear.enabled):
            return None
    elif state.calibrating or not hp_blocks.enabled:
        return None
    # The configuration, read at every call: users change dropout rates, and a context- or
    # tensor-parallel group is set after construction.
    if not (_attention_static_ok(mha) if mlp is None else _layer_static_ok(owner)):
        return None
    recipe = state.recipe if state.enabled else None
    # (traced by torch.compile: the FP8 layer node as one custom op per direction,
    # layer_block_op.py)
    traced = torch.compiler.is_compiling()
    if (type(x) is not torch.Tensor or state.group is not None
            or (traced and (recipe is None or (x.is_cuda and not layer_block_op.on_cuda)))
            or (not traced and _get_current_dispatch_mode() is not None)):
        return None
    r = fp8.RECOMPUTE
    if r.recording is not None or r.replay is not None:
        return None
    device_type = "cuda" if x.is_cuda else x.device.type
    if torch.is_autocast_enabled(device_type):
        return None
    if rotary_pos_emb is not None and type(rotary_pos_emb) is not torch.Tensor:
        return None
    sub = mha._modules
    modules = ((sub["layernorm_qkv"], sub["proj"]) if mlp is None
               else (sub["layernorm_qkv"], sub["proj"], mlp))
    # What can change from call to call, checked before anything is learned (so that a frozen
    # parameter, say, does not send every call through the learning): parameters replaced,
    # frozen or cast, the QKV blocks moved apart, deferred weight gradients, weight caches.
    params = _params(mha, mlp)
    tensors = params.all()
    grad = torch.is_grad_enabled()  # (without it: the forward alone, nothing saved)
    if not _plain(tensors, x.dtype, grad):
        return None
    n_w, n_b = len(params.weights), len(params.biases)
    if not traced and ((n_w > 1 and not back_to_back(params.weights))
                       or (n_b > 1 and not back_to_back(params.biases))):
        return None  # (traced: the ops join the blocks, over their storage where they can)
    if any(m._wgrad_store is not None for m in modules):
        return None
    if recipe is not None and any(m._weight_caches for m in modules):
        return None
    dpa = sub["core_attention"]
    attention_dropout = float(dpa.attention_dropout) if dpa.training else 0.0
    # (what the learned step depends on: the input, and the settings a user may change)
    key = (x.shape, x.dtype, x.device, grad, rotary_pos_emb is not None, mask, window,
           attention_dropout,
           dpa.attention_backend or env_backend(), dpa.softmax_scale, dpa.deterministic,
           mha.rotary_pos_interleaved, modules[0].cfg,
           None if mlp is None else (mlp.cfg, mlp._act))
    # (the layer's hidden dropout in training, as TransformerLayer._residual applies it)
    p = float(owner.hidden_dropout) if mlp is not None and owner.training else 0.0
    if traced:  # (learned at trace time, and kept by the graph)
        if not grad or (kind_of(recipe) == "delayed" and not _past_first_step(modules)):
            return None
        step = _learn(mha, mlp, x, params, recipe, key, mask, window, attention_dropout, grad)
    else:
        step = owner.__dict__.get("_layer_block_step")
        if (step is None or step.recipe is not recipe or step.key != key
                or (type(step) is Step and not step.hp
                    and any(m._fp8_recipe is not recipe for m in modules))):
            step = _learn(mha, mlp, x, params, recipe, key, mask, window, attention_dropout,
                          grad)
            owner.__dict__["_layer_block_step"] = step
    if type(step) is not Step:
        return None
    x = x.contiguous()
    call = rotary_pos_emb if mlp is None else (rotary_pos_emb, p)
    blocks = (*params.attention, *params.mlp, *params.weights, *params.biases)
    if not step.hp and step.delayed:
        for m in modules:
            state.pending[id(m)] = (m, recipe, None)  # fp8.register_forward_amaxes
    states = None if step.hp else tuple(
        (m._buffers["scale_fwd"], m._buffers["amax_history_fwd"],
         (m._buffers["amax_history_bwd"], m._buffers["scale_bwd"], m._buffers["scale_inv_bwd"]))
        for m in modules)
    if traced:
        return layer_block_op.apply(x, step, states, p, rotary_pos_emb, n_w, n_b, blocks)
    if not grad:
        return infer(mlp is not None, states, x, step, call, n_w, n_b, params)
    if step.hp:
        apply = apply_layer_hp if mlp is not None else apply_attention_hp
        return apply(x, step, call, n_w, n_b, *blocks)
    apply = apply_layer if mlp is not None else apply_attention
    return apply(x, step, states, call, n_w, n_b, *blocks)


def forward(layer, x: torch.Tensor, rotary_pos_emb=None) -> Optional[torch.Tensor]:
    """The layer's step through the one node, or None where the modules' path must run. Called
    by te.TransformerLayer.forward with no argument but the input and RoPE's angles (one
    tensor for q and k; a pair takes the modules' path)."""
    sub = layer._modules
    return _run(layer, sub["self_attention"], sub["layernorm_mlp"], x, rotary_pos_emb,
                layer.self_attn_mask_type, layer.window_size)


def attention_forward(mha, x: torch.Tensor, rotary_pos_emb=None) -> Optional[torch.Tensor]:
    """te.MultiheadAttention's step (norm, QKV projection, attention, output projection) through
    one node, or None where the modules' path must run. Called by its forward with no argument
    but the input and RoPE's angles."""
    return _run(mha, mha, None, x, rotary_pos_emb, mha.attn_mask_type, mha.window_size)
