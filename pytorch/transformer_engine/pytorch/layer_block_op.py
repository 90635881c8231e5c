"""te.TransformerLayer's FP8 node (layer_block.py) in the graphs torch.compile traces: one custom
op for the layer's forward and one for its backward.

Traced through its modules, a layer becomes five custom ops per direction plus the glue
inductor generates between them (the QKV weights concatenated, q, k, v copied dense, their
gradients concatenated, the residual adds), each call and launch paid on the host at every
step: the compiled step took longer than the eager node's
(``benchmarks/results/host_profile_compile_h100.json``). Here the graph holds one call per layer
and direction, whose implementation is the eager node's forward or backward (``_Layer``), so
the same kernels with the same arguments, and the same bits.

The learned step (layer_block._Step) travels in the graph as a string, the plain tuple of its
fields that ``_encode`` writes at trace time; the implementations read it back once
(``_decode``, cached). The forward op returns the output and what it made for the backward;
the layer's input and parameters reach the backward through autograd's saved inputs. The
joined QKV weight is one tensor inside the ops: its blocks' storage when they lie back to back
(as te.TransformerLayer lays them out), else a concatenation, and its gradient is split back.

What it takes: layer_block's FP8 layer node without RoPE and without dropout, in grad mode;
anything else traced takes the modules' path as before.
"""

from __future__ import annotations

import ast
from typing import Optional

import torch

from . import compiled_blocks, fast_linear, first_step
from .module._split_rows import back_to_back
from .quantization import Plan

_NS = "transformer_engine"


class _Ctx:
    """What _Layer's forward keeps for its backward, outside an autograd node."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


@torch._dynamo.assume_constant_result
def _encode(fields: tuple) -> str:
    """The learned step's fields (plain tuples of constants), as the ops' string argument."""
    return repr(fields)


def encode(step) -> str:
    """_encode of layer_block's _Step (traced: its fields as plain tuples)."""
    views = tuple((tuple(sh), tuple(st), int(off)) for sh, st, off in step.views)
    proj = step.proj
    return _encode((step.delayed, tuple(step.qkv), (tuple(proj.plan), *tuple(proj)[1:]),
                    tuple(step.mlp), step.act, tuple(step.attention), views, step.deterministic,
                    tuple(step.splits), tuple(step.norms), step.act_name))


_DECODED: dict = {}


def _decode(key: str):
    step = _DECODED.get(key)
    if step is None:
        from .layer_block import _Step

        (delayed, qkv, proj, mlp, act, attention, views, deterministic, splits, norms,
         act_name) = ast.literal_eval(key)
        step = _DECODED[key] = _Step(
            None, (), delayed, compiled_blocks.Codes(*qkv),
            fast_linear.Codes(Plan(*proj[0]), *proj[1:]), compiled_blocks.Codes(*mlp), act,
            attention, tuple((torch.Size(sh), st, off) for sh, st, off in views), deterministic,
            splits, False, norms, act_name, False)
    return step


def _states(scales, histories, bwd) -> tuple:
    """layer_block's per-module state triples from the ops' lists."""
    return tuple((scales[i], histories[i], tuple(bwd[3 * i:3 * i + 3])) for i in range(3))


def _joined_qkv(parts: list, splits: tuple, fake: bool) -> Optional[torch.Tensor]:
    """The QKV weight (or bias) blocks as one tensor: over their storage when back to back."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if not fake and back_to_back(parts):
        from .layer_block import _joined

        return _joined(tuple(parts))
    return torch.cat(parts)


# params: the node's blocks as layer_block passes them (_Params.all order): the attention's
# (gamma1, beta1, proj weight, proj bias), the MLP's (gamma2, beta2, w1, b1, w2, b2), then the
# QKV weight blocks and bias blocks (n_w, n_b of them).


def _forward(x, params, scales, histories, bwd, key: str, n_w: int, n_b: int, fake: bool):
    from .layer_block import _Layer

    step = _decode(key)
    if not fake and step.delayed:
        # (the graph takes this node past every module's first step, layer_block's
        # _past_first_step; a compiled first step leaves its marks, which no graph takes, and the
        # Python steps this node shares would read them)
        for h in (*histories, bwd[0], bwd[3], bwd[6]):
            first_step.written_elsewhere_all(h)
    w_qkv = _joined_qkv(list(params[10:10 + n_w]), step.splits, fake)
    b_qkv = _joined_qkv(list(params[10 + n_w:10 + n_w + n_b]), step.splits, fake)
    ctx = _Ctx()
    out = _Layer.forward(ctx, x, step, _states(scales, histories, bwd), (None, 0.0), 1,
                         int(b_qkv is not None), *params[:10], w_qkv,
                         *(() if b_qkv is None else (b_qkv,)))
    saved = ctx.saved_tensors
    # what the node made: all but x2, gamma1 (the first two), gamma2 (after mid) and the
    # attention's rng state (last; an empty constant without dropout)
    made = (*saved[2:15], *saved[16:-1])
    if fake:
        return [out, *made]
    # (an op's results may not share storage, and te.Linear's operator carves its input's and
    # weight's FP8 copies, and their scale_invs, from one allocation: the later of each pair,
    # the weight's, is copied)
    seen, results = set(), [out]
    for t in made:
        where = t.untyped_storage().data_ptr() if t.numel() else None
        results.append(t.clone() if where in seen else t)
        seen.add(where)
    return results


# (the FP8 state the ops write travels as single tensors: a functionalized graph takes no
# written list)
# (and its results as a fixed number of tensors: a functionalized op that writes its inputs
# returns no list)
_MADE = 25  # (what _Layer saves without RoPE and dropout, less x, the two gammas and the rng)


def _results(n: int) -> str:
    return "(" + ", ".join(["Tensor"] * n) + ")"


@torch.library.custom_op(
    f"{_NS}::layer_fp8_forward", mutates_args=("s1", "s2", "s3", "h1", "h2", "h3"),
    schema="(Tensor x, Tensor?[] params, Tensor(a2!) s1, Tensor(a3!) s2, Tensor(a4!) s3, "
           "Tensor(a5!) h1, Tensor(a6!) h2, Tensor(a7!) h3, Tensor[] bwd, str key, SymInt n_w, "
           f"SymInt n_b) -> {_results(1 + _MADE)}")
def layer_fp8_forward(x, params, s1, s2, s3, h1, h2, h3, bwd, key, n_w, n_b):
    """The layer node's forward: [output, what the backward reads]; writes the amaxes (and,
    under current scaling, the scales) of the three modules' forward state."""
    return tuple(_forward(x, params, (s1, s2, s3), (h1, h2, h3), bwd, key, n_w, n_b, False))


@layer_fp8_forward.register_fake
def _(x, params, s1, s2, s3, h1, h2, h3, bwd, key, n_w, n_b):
    # (the same Python on fake tensors: the blocks' and attention's ops give their fakes)
    return tuple(_forward(x, params, (s1, s2, s3), (h1, h2, h3), bwd, key, n_w, n_b, True))


def _backward(grad, x, params, made, bwd, key, n_w, n_b):
    from .layer_block import _NO_RNG, _Layer

    step = _decode(key)
    has_b = n_b > 0
    g1, beta1, w_p, b_p, g2, beta2, w1, b1, w2, b2 = params[:10]
    ctx = _Ctx()
    ctx.saved_tensors = (x.view(-1, x.shape[-1]), g1, *made[:13], g2, *made[13:], _NO_RNG)
    ctx.freqs, ctx.dropout = None, (0.0, None, None)
    metas = tuple(tuple(bwd[3 * i:3 * i + 3]) for i in range(3))
    ctx.info = (step, metas, 1, int(has_b), x.shape,
                (beta1 is not None, b_p is not None, beta2 is not None, b1 is not None,
                 b2 is not None), (w_p.dtype, w1.dtype, w2.dtype, params[10].dtype))
    grads = _Layer.backward(ctx, grad)
    # (the joined QKV weight's and bias's gradients whole: _LayerOp.backward splits them)
    out = [grads[0]]
    for g in (*grads[6:16], grads[16], grads[17] if has_b else None):
        out.append(x.new_empty(0) if g is None else g)
    return out


_BWD = tuple(f"{name}{i}" for i in (1, 2, 3) for name in ("h", "s", "si"))


@torch.library.custom_op(
    f"{_NS}::layer_fp8_backward", mutates_args=_BWD,
    schema="(Tensor grad, Tensor x, Tensor?[] params, Tensor[] made, "
           + ", ".join(f"Tensor(b{i}!) {n}" for i, n in enumerate(_BWD))
           + f", str key, SymInt n_w, SymInt n_b) -> {_results(13)}")
def layer_fp8_backward(grad, x, params, made, h1, s1, si1, h2, s2, si2, h3, s3, si3, key, n_w,
                       n_b):
    """The layer node's backward: the gradients of x, of the attention's and MLP's ten
    parameters and of the joined QKV weight and bias (empty where absent); writes the
    gradients' amaxes and scales into the three modules' backward state (amax history, scale,
    scale_inv of each)."""
    return tuple(_backward(grad, x, params, made, (h1, s1, si1, h2, s2, si2, h3, s3, si3), key,
                           n_w, n_b))


@layer_fp8_backward.register_fake
def _(grad, x, params, made, h1, s1, si1, h2, s2, si2, h3, s3, si3, key, n_w, n_b):
    out = [torch.empty_like(x)]
    out += [torch.empty_like(p) if p is not None else x.new_empty(0) for p in params[:10]]
    w = params[10:10 + n_w]
    out.append(w[0].new_empty((sum(t.shape[0] for t in w), *w[0].shape[1:])))
    b = params[10 + n_w:10 + n_w + n_b]
    out.append(b[0].new_empty((sum(t.shape[0] for t in b),)) if n_b else x.new_empty(0))
    return tuple(out)


class _LayerOp(torch.autograd.Function):
    """The two ops as one autograd node of the traced graph (the blocks' custom ops make theirs
    the same way: an op that writes the FP8 state takes no autograd formula of its own)."""

    @staticmethod
    def forward(ctx, x, key: str, n_w: int, n_b: int, scales: list, histories: list, bwd: list,
                *params):
        out, *made = layer_fp8_forward(x, list(params), *scales, *histories, bwd, key, n_w, n_b)
        ctx.key, ctx.n_w, ctx.n_b, ctx.bwd = key, n_w, n_b, bwd
        ctx.present = tuple(p is not None for p in params)
        ctx.n_made = len(made)
        ctx.save_for_backward(x, *(p for p in params if p is not None), *made)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        x = saved.pop(0)
        params = [saved.pop(0) if here else None for here in ctx.present]
        out = layer_fp8_backward(grad.contiguous(), x, params, saved, *ctx.bwd, ctx.key,
                                 ctx.n_w, ctx.n_b)
        step = _decode(ctx.key)
        n_w, n_b = ctx.n_w, ctx.n_b
        w_grads = list(out[11].split(list(step.splits))) if n_w > 1 else [out[11]]
        b_grads = (list(out[12].split(list(step.splits))) if n_b > 1 else [out[12]]) if n_b else []
        grads = [g if here else None
                 for g, here in zip((*out[1:11], *w_grads, *b_grads), ctx.present, strict=True)]
        return (out[0], None, None, None, None, None, None, *grads)


def apply(x: torch.Tensor, step, states: tuple, n_w: int, n_b: int, params: tuple):
    """The layer node's step in a traced graph: the output."""
    scales = [s for s, _, _ in states]
    histories = [h for _, h, _ in states]
    bwd = [t for _, _, b in states for t in b]
    return _LayerOp.apply(x, encode(step), n_w, n_b, scales, histories, bwd, *params)
