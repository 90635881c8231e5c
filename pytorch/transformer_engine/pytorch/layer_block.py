"""te.TransformerLayer's training step as one autograd node, in FP8 and in high precision.

A small layer's eager step is bound by host time. Through its modules, a TransformerLayer's
forward runs six module forwards (the layer, attention, the QKV norm + projection, the core
attention, the output projection, the MLP), each with its checks, plan lookups and state
reads, and five autograd nodes (the joined QKV weight, the QKV block, attention, the
projection, the MLP block), each with its Python wrappers forward and backward
(``benchmarks/results/host_sites_h100.json``). Here the same step is one node whose forward and
backward make the very calls those nodes make, with the same arguments, in the same order
(so the same bits, ``tests/pytorch/test_layer_block.py``). Under per-tensor FP8 (``_Layer``):

    forward:  layernorm_linear_block_forward (QKV) -> attention_forward (q, k, v read in
              place from the QKV output) -> linear_fp8_forward (projection) -> + x ->
              layernorm_mlp_block_forward -> + residual
    backward: the same blocks' backwards in reverse, the residual gradients added as autograd
              adds them.

Outside fp8_autocast (``_LayerHP``): hp_blocks' steps for the QKV block and the MLP, F.linear
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
the forward alone (``_infer``), as the modules do then. Traced by torch.compile, the FP8 nodes
past delayed scaling's first step are one custom op per direction running the node
(``layer_block_op.py``); the rest traces the modules.
``enabled = False`` turns it off (for comparisons), and so does turning off what it stands on
(compiled_blocks, fast_linear, hp_blocks, attention_fn.packed_enabled).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
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
from ._autograd import eager_apply
from .attention_fn import _NO_SEQLENS, _tiles, packed_qkv
from .dropout_add_fn import rng_state
from .fp8 import COMPILED_ALGOS
from .hp_blocks import linear_grads
from .linear_fn import linear_backward
from .module._attention_backend import backend_key, choose_backend, env_backend
from .module._heads import split_heads
from .module._split_rows import back_to_back
from .module.attention import resolve_window
from .ops import rope as rope_ops
from .ops._backend import enum_code
from .quantization import kind_of
from .release import may_release, release
from .rope import checked_angles

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


# The attention calls' absent cu_seqlens and rng state: empty tensors, which the core's calls
# take as absent whatever their device (ops/attention.py: _opt).
_NO_RNG = torch.empty((0,), dtype=torch.int64)


class _Declined(NamedTuple):
    """A recipe and input the node does not take, whatever the next call brings."""

    recipe: object
    key: tuple


class _Step(NamedTuple):
    """What a learned step needs besides the tensors it reads afresh each call."""

    recipe: object
    key: tuple  # (the input's shape, dtype and device, RoPE, the settings _run lists)
    delayed: bool
    qkv: Optional[compiled_blocks.Codes]
    proj: Optional[fast_linear.Codes]
    mlp: Optional[compiled_blocks.Codes]  # (None: the attention node)
    act: int
    attention: tuple  # attention_fn's Params
    views: tuple  # (shape, stride, offset from the QKV output's start) of q, k, v
    deterministic: bool
    splits: tuple  # rows of each QKV weight (and bias) block
    hp: bool  # outside fp8_autocast: the blocks' high-precision steps (hp_blocks.py)
    norms: tuple  # ((norm, eps, zero_centered_gamma) of the QKV block, of the MLP or None)
    act_name: Optional[str]
    rope_interleaved: bool


def _parts(module) -> tuple[list, list]:
    """The QKV weight and bias blocks of the attention's first module."""
    if module._splits is None:
        p = module._parameters
        return [p["weight"]], ([p["bias"]] if p.get("bias") is not None else [])
    weights = [module._parameters[n] for n in module.weight_names]
    return weights, [module._parameters[n] for n in module.bias_names]


def _attention_static_ok(mha) -> bool:
    """A te.MultiheadAttention's configuration the nodes take: what no call can change."""
    qkv, dpa, proj = mha._modules.get("layernorm_qkv"), mha.core_attention, mha.proj
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
    mlp = layer.layernorm_mlp
    if (layer.layer_type != "encoder" or layer.parallel_attention_mlp or layer.output_layernorm
            or layer.apply_residual_connection_post_layernorm or layer.drop_path_rate != 0.0
            or layer.fuse_wgrad_accumulation):
        return False
    if mlp.cfg.return_ln_out or not _module_static_ok(mlp):
        return False
    return _attention_static_ok(layer.self_attention)


def _need_all(tensors) -> bool:
    for t in tensors:
        if t is not None and not t.requires_grad:
            return False
    return True


def _plain(tensors, dtype) -> bool:
    for t in tensors:
        if t is not None and (type(t) not in (torch.Tensor, torch.nn.Parameter)
                              or t.dtype != dtype or not t.is_contiguous()):
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
    qkv_mod, pp = mha.layernorm_qkv, mha.proj._parameters
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
        views = _traced_views(tuple(qkv_out.shape), dtype, mha._local_groups, mha._parts,
                              mha.head_dim, mha.qkv_weight_interleaved)
        if views is None:
            return declined
    else:
        packed = packed_qkv(q, k, v, attention)
        if packed is None:
            return declined
        start = qkv_out.storage_offset()
        views = tuple((shape, stride, offset - start) for shape, stride, offset in packed[1])
    norms = tuple(None if m is None else (m.cfg.norm, m.cfg.eps, m.cfg.zero_centered_gamma)
                  for m in (qkv_mod, mlp))
    common = (attention, views, bool(dpa.deterministic), tuple(w.shape[0] for w in weights), hp,
              norms, None if mlp is None else mlp._act, bool(mha.rotary_pos_interleaved))
    if hp:
        return _Step(None, key, False, None, None, None, 0, *common)
    return _Step(recipe, key, plans[0].kind == "delayed",
                 compiled_blocks._codes(plans[0], qkv_mod.cfg), fast_linear.codes_of(plans[1]),
                 None if mlp is None else compiled_blocks._codes(plans[2], mlp.cfg),
                 0 if mlp is None else enum_code("Activation", mlp._act), *common)


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


@torch._dynamo.assume_constant_result
def _traced_views(shape: tuple, dtype, groups, parts, head_dim, interleaved) -> Optional[tuple]:
    """packed_qkv's views of q, k, v in a fresh QKV output of ``shape``, for a traced forward
    (run once at trace time, on the meta device), or None where they do not tile it."""
    qkv = torch.empty(shape, dtype=dtype, device="meta")
    q, k, v = split_heads(qkv, groups, parts, head_dim, interleaved)
    views = tuple((tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in (q, k, v))
    return views if _tiles(qkv, views) else None


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
            or (traced and recipe is None)
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
    modules = (mha.layernorm_qkv, mha.proj) if mlp is None else (mha.layernorm_qkv, mha.proj,
                                                                 mlp)
    # What can change from call to call, checked before anything is learned (so that a frozen
    # parameter, say, does not send every call through the learning): parameters replaced,
    # frozen or cast, the QKV blocks moved apart, deferred weight gradients, weight caches.
    params = _params(mha, mlp)
    tensors = params.all()
    grad = torch.is_grad_enabled()  # (without it: the forward alone, nothing saved)
    if not (_plain(tensors, x.dtype) and (not grad or _need_all(tensors))):
        return None
    n_w, n_b = len(params.weights), len(params.biases)
    if not traced and ((n_w > 1 and not back_to_back(params.weights))
                       or (n_b > 1 and not back_to_back(params.biases))):
        return None  # (traced: the ops join the blocks, over their storage where they can)
    if any(m._wgrad_store is not None for m in modules):
        return None
    if recipe is not None and any(m._weight_caches for m in modules):
        return None
    dpa = mha.core_attention
    attention_dropout = float(dpa.attention_dropout) if dpa.training else 0.0
    # (what the learned step depends on: the input, and the settings a user may change)
    key = (x.shape, x.dtype, x.device, grad, rotary_pos_emb is not None, mask, window,
           attention_dropout,
           dpa.attention_backend or env_backend(), dpa.softmax_scale, dpa.deterministic,
           mha.rotary_pos_interleaved, mha.layernorm_qkv.cfg,
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
                or (type(step) is _Step and not step.hp
                    and any(m._fp8_recipe is not recipe for m in modules))):
            step = _learn(mha, mlp, x, params, recipe, key, mask, window, attention_dropout,
                          grad)
            owner.__dict__["_layer_block_step"] = step
    if type(step) is not _Step:
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
        return _infer(mlp is not None, states, x, step, call, n_w, n_b, params)
    if step.hp:
        apply = _apply_hp if mlp is not None else _apply_attention_hp
        return apply(x, step, call, n_w, n_b, *blocks)
    apply = _apply if mlp is not None else _apply_attention
    return apply(x, step, states, call, n_w, n_b, *blocks)


def forward(layer, x: torch.Tensor, rotary_pos_emb=None) -> Optional[torch.Tensor]:
    """The layer's step through the one node, or None where the modules' path must run. Called
    by te.TransformerLayer.forward with no argument but the input and RoPE's angles (one
    tensor for q and k; a pair takes the modules' path)."""
    return _run(layer, layer.self_attention, layer.layernorm_mlp, x, rotary_pos_emb,
                layer.self_attn_mask_type, layer.window_size)


def attention_forward(mha, x: torch.Tensor, rotary_pos_emb=None) -> Optional[torch.Tensor]:
    """te.MultiheadAttention's step (norm, QKV projection, attention, output projection) through
    one node, or None where the modules' path must run. Called by its forward with no argument
    but the input and RoPE's angles."""
    return _run(mha, mha, None, x, rotary_pos_emb, mha.attn_mask_type, mha.window_size)


def _attend(qkv: torch.Tensor, step: _Step, freqs: Optional[torch.Tensor]) -> tuple:
    """(o, lse, what the backward reads of q, k, v, RoPE's angles as a matrix or None):
    attention over the heads of the QKV output, read in place (_FusedAttentionPacked's call);
    with RoPE angles, q and k rotated first (apply_rotary_pos_emb's checks and fused calls)
    and q, k, v made dense (MultiheadAttention._rope, then _FusedAttention's calls)."""
    start = qkv.storage_offset()
    q, k, v = (qkv.as_strided(sh, st, off + start) for sh, st, off in step.views)
    # (attention dropout: a fresh rng state, drawn where DotProductAttention._fused draws it;
    # the backward takes the same one)
    dropout = step.attention[5] > 0.0
    if torch.compiler.is_compiling():  # (layer_block_op's fake: no real tensor may enter)
        no_seqlens = qkv.new_empty(0, dtype=torch.int32)
        rng = rng_state(qkv.device) if dropout else qkv.new_empty(0, dtype=torch.int64)
    else:
        no_seqlens = _NO_SEQLENS
        rng = rng_state(qkv.device) if dropout else _NO_RNG
    if freqs is None:
        o, lse = ops.attention_forward(q, k, v, no_seqlens, no_seqlens, rng, *step.attention)
        return o, lse, (qkv, rng), None
    layout, interleaved = step.attention[0], step.rope_interleaved
    freqs = checked_angles(q, freqs, layout, None, 1, None)
    q = rope_ops.rope_forward(q, freqs, layout, interleaved, None, None).contiguous()
    k = rope_ops.rope_forward(k, freqs, layout, interleaved, None, None).contiguous()
    v = v.contiguous()
    o, lse = ops.attention_forward(q, k, v, no_seqlens, no_seqlens, rng, *step.attention)
    return o, lse, (q, k, v, rng), freqs


def _attend_backward(d_o: torch.Tensor, o, lse, held: tuple, step: _Step, freqs, free: bool):
    """The gradient of the QKV output [M, F] from d_o (in o's shape): _FusedAttentionPacked's
    backward; with RoPE, _FusedAttention's, each rotation's backward, and the gradients of
    q, k, v written where their views sit in the QKV output (the values autograd's backward
    of the heads' split assembles)."""
    layout, mask, left, right, scale, dropout, max_q, max_kv, backend = step.attention
    if freqs is None:
        qkv, rng = held
        start = qkv.storage_offset()
        q, k, v = (qkv.as_strided(sh, st, off + start) for sh, st, off in step.views)
        d_qkv = ops.attention_backward_packed(qkv, q, k, v, o, d_o, lse, rng, layout, mask,
                                              left, right, scale, dropout, step.deterministic,
                                              backend)
        if free:
            release(qkv, o, lse)
        return d_qkv.view(-1, d_qkv.shape[-1])
    q, k, v, rng = held
    dq, dk, dv = ops.attention_backward(q, k, v, o, d_o, lse, _NO_SEQLENS, _NO_SEQLENS, rng,
                                        layout, mask, left, right, scale, dropout, max_q,
                                        max_kv, step.deterministic, backend, q.dtype)
    if free:
        release(q, k, v, o, lse)
    interleaved = step.rope_interleaved
    dq = rope_ops.rope_backward(dq, freqs, layout, interleaved, None, None)
    dk = rope_ops.rope_backward(dk, freqs, layout, interleaved, None, None)
    rows = sum(sh[-2] * sh[-1] for sh, _, _ in step.views)
    d_qkv = dq.new_empty((dq.numel() // (dq.shape[-2] * dq.shape[-1]), rows))
    for (sh, st, off), g in zip(step.views, (dq, dk, dv), strict=True):
        d_qkv.as_strided(sh, st, off).copy_(g)
    return d_qkv


def _operands(x: torch.Tensor, qkv_parts: tuple, n_w: int, n_b: int) -> tuple:
    """(x as [M, K], the QKV weight and bias joined over their blocks' storage; None without a
    bias): what every node's forward starts from."""
    return (x.view(-1, x.shape[-1]), _joined(qkv_parts[:n_w]),
            _joined(qkv_parts[n_w:]) if n_b else None)


def _residual(h: torch.Tensor, residual: torch.Tensor, p: float) -> tuple:
    """(residual + dropout(h), the dropout's rng state or None): TransformerLayer._residual's
    fused op with a fresh rng state where p > 0 (dropout_add_fn.dropout_add), else the add."""
    if p == 0.0:
        return residual + h, None
    rng = rng_state(h.device)
    return ops.dropout_add_forward(h, residual, rng, p), rng


def _residual_grad(g: torch.Tensor, rng: Optional[torch.Tensor], p: float) -> torch.Tensor:
    """The gradient of h in _residual from the output's (the residual's is g itself)."""
    return g if rng is None else ops.dropout_backward(g, rng, p)


def _joined(parts: tuple) -> torch.Tensor:
    """Blocks laid back to back in one storage as one tensor over it (_split_rows._JoinRows's
    forward, without a node of its own: this node's backward splits the gradient)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    shape = (sum(p.shape[0] for p in parts),) + tuple(first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                   first.stride())


# ---------------------------------------------------------------- FP8 (per-tensor recipes)


def _fp8_attention(x2, step: _Step, states, freqs, g1, beta1, w_qkv, b_qkv, w_p, b_p) -> tuple:
    """(projection output [M, N], what the backward reads, q/k/v held, RoPE angles): the QKV
    block's operator, attention, te.Linear's operator for the projection."""
    (s1, h1, _), (s2, h2, _) = states[:2]
    qkv, *saved = compiled_blocks._linear_forward(x2, g1, beta1, w_qkv, b_qkv, s1, h1, step.qkv,
                                                  True, True)
    o, lse, held, freqs = _attend(qkv, step, freqs)
    o2 = o.view(-1, o.shape[-2] * o.shape[-1])
    out, x_sinv, w_sinv, x_col, w_col = fast_linear._forward(o2, w_p, b_p, s2, h2, step.proj,
                                                             True, True)
    return out, (x2, g1, *saved, o, lse, x_sinv, w_sinv, x_col, w_col), held, freqs


_FP8_ATTENTION_SAVED = 14  # (the tensors _fp8_attention saves)


def _fp8_attention_backward(g, saved, held, step: _Step, metas, freqs, has: tuple,
                            dtypes: tuple, n_b: int, free: bool) -> tuple:
    """(grad of x [M, K], of gamma, of beta, of the QKV weight, of its bias, of the projection's
    weight, of its bias) from g [M, N], the projection output's gradient."""
    (x2, g1, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, o, lse, x_sinv, pw_sinv, x_col,
     pw_col) = saved
    has_beta, has_bp = has
    wp_dtype, wqkv_dtype = dtypes
    m1, m2 = metas
    d_o, gw_p, gb_p = linear_backward(
        g, (x_col, x_sinv, pw_col, pw_sinv), step.proj.plan, m2, None, None,
        (True, True, has_bp), (o.dtype, wp_dtype, wp_dtype if has_bp else None), g.shape)
    if free:
        release(x_col, pw_col)
    d_qkv = _attend_backward(d_o.view(o.shape), o, lse, held, step, freqs, free)
    c = step.qkv
    dx, dg1, dbeta1, gw, gb = compiled_blocks.layernorm_linear_block_backward(
        d_qkv, x2, mu, rsigma, g1, has_beta, ln_sinv, ln_col, w_sinv, w_col, *m1, c.norm,
        c.zero_centered_gamma, c.current, c.fwd_dtype, c.bwd_dtype, c.pow2, c.epsilon, c.algo,
        c.margin, True, True, wqkv_dtype, wqkv_dtype if n_b else None)
    return dx, dg1, dbeta1 if has_beta else None, gw, gb, gw_p, gb_p if has_bp else None


def fp8_info(step: _Step, metas: tuple, n_w: int, n_b: int, shape, leading: tuple,
             w_qkv_dtype: torch.dtype) -> tuple:
    """What an FP8 node's backward reads besides its saved tensors (its ctx.info), from the
    parameters before the QKV blocks (the attention's four, then the layer's MLP's six): which
    betas and biases there are, and the weights' dtypes (the projection's[, FC1's, FC2's], the
    QKV weight's)."""
    weights = (leading[2], leading[6], leading[8]) if len(leading) == 10 else (leading[2],)
    return (step, metas, n_w, n_b, shape, tuple(t is not None for t in leading[1::2]),
            (*(w.dtype for w in weights), w_qkv_dtype))


def split_grads(step: _Step, n_w: int, n_b: int, gw, gb) -> list:
    """The QKV weight's and bias's gradients split back into their blocks (_JoinRows's
    backward)."""
    w_grads = list(gw.split(list(step.splits))) if n_w > 1 else [gw]
    b_grads = (list(gb.split(list(step.splits))) if n_b > 1 else [gb]) if n_b else []
    return w_grads + b_grads


class _Layer(torch.autograd.Function):
    """x -> x + proj(attention(qkv(norm(x)))) -> + mlp(norm(.)): the modules' numbers."""

    @staticmethod
    def forward(ctx, x, step: _Step, states, call: tuple, n_w: int, n_b: int, g1, beta1, w_p, b_p,
                g2, beta2, w1, b1, w2, b2, *qkv_parts):
        freqs, p = call  # (RoPE's angles or None, the hidden dropout)
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        proj_out, saved, held, freqs = _fp8_attention(x2, step, states, freqs, g1, beta1, w_qkv,
                                                      b_qkv, w_p, b_p)
        mid, rng1 = _residual(proj_out, x2, p)
        s3, h3, m3 = states[2]
        mlp_out, *saved3 = compiled_blocks._mlp_forward(mid, g2, beta2, w1, b1, w2, b2, s3, h3,
                                                        step.mlp, step.act, (True,) * 4)
        out, rng2 = _residual(mlp_out, mid, p)
        ctx.save_for_backward(*saved, mid, g2, *saved3, *held)
        ctx.freqs, ctx.dropout = freqs, (p, rng1, rng2)
        ctx.info = fp8_info(step, tuple(m for _, _, m in states), n_w, n_b, shape,
                            (g1, beta1, w_p, b_p, g2, beta2, w1, b1, w2, b2), w_qkv.dtype)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        attention = saved[:_FP8_ATTENTION_SAVED]
        (mid, g2, ln_sinv2, ln_col2, mu2, rs2, w1_sinv, w1_col, h, a_sinv, a_col, w2_sinv,
         w2_col, *held) = saved[_FP8_ATTENTION_SAVED:]
        step, (m1, m2, m3), n_w, n_b, shape, has, dtypes = ctx.info
        has_beta1, has_bp, has_beta2, has_b1, has_b2 = has
        wp_dtype, w1_dtype, w2_dtype, wqkv_dtype = dtypes
        g = grad.reshape(-1, shape[-1]).contiguous()
        p, rng1, rng2 = ctx.dropout
        c = step.mlp
        d_mid, dg2, dbeta2, gw1, gb1, gw2, gb2 = compiled_blocks.layernorm_mlp_block_backward(
            _residual_grad(g, rng2, p), mid, mu2, rs2, g2, has_beta2, ln_sinv2, ln_col2, w1_sinv,
            w1_col, h, step.act, a_sinv, a_col, w2_sinv, w2_col, *m3, c.norm,
            c.zero_centered_gamma, c.current,
            c.fwd_dtype, c.bwd_dtype, c.pow2, c.epsilon, c.algo, c.margin, True, True, True, True,
            w1_dtype, w1_dtype if has_b1 else None, w2_dtype, w2_dtype if has_b2 else None)
        # (what the node made goes once read, as the modules' nodes let it go: release.py)
        free = may_release()
        if free:
            release(h, a_col, w2_col, ln_col2, w1_col, mid)
        g_mid = g + d_mid
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _fp8_attention_backward(
            _residual_grad(g_mid, rng1, p), attention, held, step, (m1, m2), ctx.freqs,
            (has_beta1, has_bp), (wp_dtype, wqkv_dtype), n_b, free)
        dx = (g_mid + dx).view(shape)
        return (dx, None, None, None, None, None, dg1, dbeta1, gw_p, gb_p, dg2,
                dbeta2 if has_beta2 else None, gw1, gb1 if has_b1 else None, gw2,
                gb2 if has_b2 else None, *split_grads(step, n_w, n_b, gw, gb))


class _Attention(torch.autograd.Function):
    """x -> proj(attention(qkv(norm(x)))): te.MultiheadAttention's numbers."""

    @staticmethod
    def forward(ctx, x, step: _Step, states, freqs, n_w: int, n_b: int, g1, beta1, w_p, b_p,
                *qkv_parts):
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        out, saved, held, freqs = _fp8_attention(x2, step, states, freqs, g1, beta1, w_qkv,
                                                 b_qkv, w_p, b_p)
        ctx.save_for_backward(*saved, *held)
        ctx.freqs = freqs
        ctx.info = fp8_info(step, tuple(m for _, _, m in states), n_w, n_b, shape,
                            (g1, beta1, w_p, b_p), w_qkv.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        step, metas, n_w, n_b, shape, has, dtypes = ctx.info
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _fp8_attention_backward(
            g, saved[:_FP8_ATTENTION_SAVED], saved[_FP8_ATTENTION_SAVED:], step, metas, ctx.freqs,
            has, dtypes, n_b, may_release())
        return (dx.view(shape), None, None, None, None, None, dg1, dbeta1, gw_p, gb_p,
                *split_grads(step, n_w, n_b, gw, gb))


_apply = eager_apply(_Layer)
_apply_attention = eager_apply(_Attention)


# ---------------------------------------------------------------- high precision


def _hp_attention(x2, step: _Step, freqs, g1, beta1, w_qkv, b_qkv, w_p, b_p) -> tuple:
    """hp_blocks' QKV block, attention, F.linear (te.Linear's high-precision step)."""
    norm, eps, zc = step.norms[0]
    ln, mu, rsigma = ops.norm_forward(x2, g1, beta1, norm, eps, zc)
    qkv = F.linear(ln, w_qkv, b_qkv)
    o, lse, held, freqs = _attend(qkv, step, freqs)
    out = F.linear(o.view(-1, o.shape[-2] * o.shape[-1]), w_p, b_p)
    return out, (x2, mu, rsigma, g1, ln, w_qkv, o, lse, w_p), held, freqs


_HP_ATTENTION_SAVED = 9


def _hp_attention_backward(g, saved, held, step: _Step, freqs, has: tuple, n_b: int,
                           free: bool) -> tuple:
    """hp_blocks' formulas backward: as _fp8_attention_backward's."""
    x2, mu, rsigma, g1, ln, w_qkv, o, lse, w_p = saved
    has_beta, has_bp = has
    norm, _, zc = step.norms[0]
    d_o, gw_p, gb_p = linear_grads((True, True, True), g, o.view(-1, o.shape[-2] * o.shape[-1]),
                                    w_p, has_bp)
    d_qkv = _attend_backward(d_o.view(o.shape), o, lse, held, step, freqs, free)
    d_ln, gw, gb = linear_grads((True, True, True), d_qkv, ln, w_qkv, n_b > 0)
    if free:
        release(ln)
    dx, dg1, dbeta1 = ops.norm_backward(d_ln.contiguous(), x2, mu, rsigma, g1, norm, zc)
    return dx, dg1, dbeta1 if has_beta else None, gw, gb, gw_p, gb_p if has_bp else None


class _LayerHP(torch.autograd.Function):
    """The layer node outside fp8_autocast: hp_blocks' calls for the QKV block and the MLP
    (the norm's op, F.linear, the activation's op), F.linear for the projection (te.Linear's
    high-precision step), attention on q, k, v read in place; backward by the same formulas
    (hp_blocks.linear_grads for each F.linear), freeing what the node made once read, as the
    modules' nodes would (release.py)."""

    @staticmethod
    def forward(ctx, x, step: _Step, call: tuple, n_w: int, n_b: int, g1, beta1, w_p, b_p, g2,
                beta2, w1, b1, w2, b2, *qkv_parts):
        freqs, p = call  # (RoPE's angles or None, the hidden dropout)
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        proj_out, saved, held, freqs = _hp_attention(x2, step, freqs, g1, beta1, w_qkv, b_qkv,
                                                     w_p, b_p)
        mid, rng1 = _residual(proj_out, x2, p)
        norm, eps, zc = step.norms[1]
        ln2, mu2, rs2 = ops.norm_forward(mid, g2, beta2, norm, eps, zc)
        h = F.linear(ln2, w1, b1)
        a = ops.activation_forward(h, step.act_name)
        out, rng2 = _residual(F.linear(a, w2, b2), mid, p)
        ctx.save_for_backward(*saved, mid, mu2, rs2, g2, ln2, w1, h, a, w2, *held)
        ctx.freqs, ctx.dropout = freqs, (p, rng1, rng2)
        ctx.info = (step, n_w, n_b, shape, (beta1 is not None, b_p is not None,
                                            beta2 is not None, b1 is not None, b2 is not None))
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        (mid, mu2, rs2, g2, ln2, w1, h, a, w2, *held) = saved[_HP_ATTENTION_SAVED:]
        step, n_w, n_b, shape, has = ctx.info
        has_beta1, has_bp, has_beta2, has_b1, has_b2 = has
        norm2, _, zc2 = step.norms[1]
        free = may_release()
        g = grad.reshape(-1, shape[-1])
        p, rng1, rng2 = ctx.dropout
        d_a, gw2, gb2 = linear_grads((True, True, True), _residual_grad(g, rng2, p), a, w2,
                                      has_b2)
        d_h, _ = ops.activation_backward(d_a.contiguous(), h, step.act_name, False)
        del d_a
        d_ln2, gw1, gb1 = linear_grads((True, True, True), d_h, ln2, w1, has_b1)
        del d_h
        d_mid, dg2, dbeta2 = ops.norm_backward(d_ln2.contiguous(), mid, mu2, rs2, g2, norm2, zc2)
        del d_ln2
        if free:
            release(a, h, ln2, mid)
        g_mid = g + d_mid
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _hp_attention_backward(
            _residual_grad(g_mid, rng1, p), saved[:_HP_ATTENTION_SAVED], held, step, ctx.freqs,
            (has_beta1, has_bp), n_b, free)
        dx = (g_mid + dx).view(shape)
        return (dx, None, None, None, None, dg1, dbeta1, gw_p, gb_p, dg2,
                dbeta2 if has_beta2 else None, gw1, gb1 if has_b1 else None, gw2,
                gb2 if has_b2 else None, *split_grads(step, n_w, n_b, gw, gb))


class _AttentionHP(torch.autograd.Function):
    """The attention node outside fp8_autocast."""

    @staticmethod
    def forward(ctx, x, step: _Step, freqs, n_w: int, n_b: int, g1, beta1, w_p, b_p, *qkv_parts):
        shape = x.shape
        x2, w_qkv, b_qkv = _operands(x, qkv_parts, n_w, n_b)
        out, saved, held, freqs = _hp_attention(x2, step, freqs, g1, beta1, w_qkv, b_qkv, w_p,
                                                b_p)
        ctx.save_for_backward(*saved, *held)
        ctx.freqs = freqs
        ctx.info = (step, n_w, n_b, shape, (beta1 is not None, b_p is not None))
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        step, n_w, n_b, shape, has = ctx.info
        dx, dg1, dbeta1, gw, gb, gw_p, gb_p = _hp_attention_backward(
            grad.reshape(-1, grad.shape[-1]), saved[:_HP_ATTENTION_SAVED],
            saved[_HP_ATTENTION_SAVED:], step, ctx.freqs, has, n_b, may_release())
        return (dx.view(shape), None, None, None, None, dg1, dbeta1, gw_p, gb_p,
                *split_grads(step, n_w, n_b, gw, gb))


_apply_hp = eager_apply(_LayerHP)
_apply_attention_hp = eager_apply(_AttentionHP)


# ---------------------------------------------------------------- without gradients


def _infer(layer: bool, states, x, step: _Step, call, n_w: int, n_b: int,
           params: _Params) -> torch.Tensor:
    """The forward alone (grad mode off: evaluation, inference), as the modules make it then:
    each block's operator without the backward's copies (FP8), or the blocks' calls (high
    precision); nothing saved."""
    freqs, p = call if layer else (call, 0.0)
    g1, beta1, w_p, b_p = params.attention
    shape = x.shape
    x2, w_qkv, b_qkv = _operands(x, params.weights + params.biases, n_w, n_b)
    if step.hp:
        norm, eps, zc = step.norms[0]
        qkv = F.linear(ops.norm_forward(x2, g1, beta1, norm, eps, zc)[0], w_qkv, b_qkv)
    else:
        qkv = compiled_blocks._linear_forward(x2, g1, beta1, w_qkv, b_qkv, *states[0][:2],
                                              step.qkv, False, False)[0]
    o = _attend(qkv, step, freqs)[0]
    o2 = o.view(-1, o.shape[-2] * o.shape[-1])
    if step.hp:
        out = F.linear(o2, w_p, b_p)
    else:
        out = fast_linear._forward(o2, w_p, b_p, *states[1][:2], step.proj, False, False)[0]
    if not layer:
        return out.view(*shape[:-1], out.shape[-1])
    mid = _residual(out, x2, p)[0]
    g2, beta2, w1, b1, w2, b2 = params.mlp
    if step.hp:
        norm, eps, zc = step.norms[1]
        h = F.linear(ops.norm_forward(mid, g2, beta2, norm, eps, zc)[0], w1, b1)
        mlp_out = F.linear(ops.activation_forward(h, step.act_name), w2, b2)
    else:
        mlp_out = compiled_blocks._mlp_forward(mid, g2, beta2, w1, b1, w2, b2, *states[2][:2],
                                               step.mlp, step.act, (False,) * 4)[0]
    return _residual(mlp_out, mid, p)[0].view(shape)
