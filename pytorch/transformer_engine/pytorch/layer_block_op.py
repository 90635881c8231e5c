"""te.TransformerLayer's and te.MultiheadAttention's FP8 nodes (layer_block.py) in the graphs
torch.compile traces: one custom op for the node's forward and one for its backward.

Traced through its modules, a layer becomes five custom ops per direction plus the glue
inductor generates between them (the QKV weights concatenated, q, k, v copied dense, their
gradients concatenated, the residual adds), each call and launch paid on the host at every
step: the compiled step took longer than the eager node's
(``benchmarks/results/host_profile_compile_h100.json``). Here the graph holds one call per
layer and direction, whose implementation is the eager node's forward or backward
(layer_block_nodes.Layer), so the same kernels with the same arguments, and the same bits.

The learned step (layer_block_nodes.Step) travels in the graph as a string, the plain tuple of its
fields that ``_encode`` writes at trace time; the implementations read it back once
(``_decode``, cached). The forward op returns the output and what it made for the backward;
the layer's input and parameters reach the backward through autograd's saved inputs. The
joined QKV weight is one tensor inside the ops: its blocks' storage when they lie back to back
(as te.TransformerLayer lays them out), else a concatenation, and its gradient is split back.

Dropout's rng states are drawn inside the ops as the eager node draws them, in the same order,
so a compiled step's masks are the eager step's. RoPE's angles are an
argument of the ops (with them the node holds q, k, v dense, so the ops return more). What it
takes: layer_block's FP8 nodes (the layer's, the attention's), in grad mode, past delayed
scaling's first step; anything else traced takes the modules' path as before.
"""

from __future__ import annotations

import ast
from typing import NamedTuple, Optional

import torch

from . import _compiled, compiled_blocks, fast_linear, first_step
from .layer_block_nodes import (
    NO_RNG,
    Attention,
    BlockArgs,
    Layer,
    Step,
    fp8_info,
    joined,
    split_grads,
)
from .module._split_rows import back_to_back
from .ops._backend import custom_op
from .quantization import Plan

_NS = "transformer_engine"

# Whether a graph traced on CUDA takes the ops. They give the eager node's bits there (the
# CUDA tests pass on an H100), but the step was slower than through the modules: each op call
# added torch.library.custom_op's Python layers to the eager node's host time, and the
# compiled region its guards and runtime wrappers: on one H100, four layers at hidden 1024
# took 7.42 ms with the ops, 6.79 through the modules and 6.73 eager (benchmarks/results/
# model_layer_op_{on,off}_b_h100.json). The ops are now defined without those layers (_define;
# on the CPU a compiled layer step's cost over eager fell from 1.40 ms to 0.62,
# host_profile_layer_op_{custom_op_,}cpu.json). One H100 run has timed them since: 8.76 ms
# with them against 6.80 through the modules (model_layer_op_on_lean_h100.json,
# model_inplace_1024_h100.json), but its tree also had in-place residual adds in the eager
# node (since backed out) under which that node's own eager step was slow (11.95 ms), so that
# run did not settle it. A clean A/B on an H200 (compiled steps, two rounds each way in one
# run) did: 10.33 / 8.00 ms through the modules, 12.45 / 10.74 with the ops
# (model_ab_layer_ops_compile_{a,b}{1,2}.json). Kernel profiles since (H100, each in its own
# process) show where: with the ops the compiled step runs the eager node's kernels (5.24 ms,
# through the modules 5.80) but leaves the GPU idle longer (2.36 ms against 1.57; eager 0.68),
# so their cost is on the host (kernel_profile_compiled_{ops_on,ops_off,eager}_b34cae1_h100.json).
# Since c5087fa the ops make the eager node's fused calls (attention_block.cpp), and the host
# time turned: on one H100, one layer's compiled step at the tiny shape took 4.14 ms with the
# ops against 5.61 through the modules (eager 3.32 and 3.08; host_profile_layer_op_rounds_
# 9938805_h100.json, host_profile_modules_path_9938805_h100.json), and four layers at hidden
# 1024 7.05 / 8.87 ms with them against 9.03 / 8.32 (model_layer_op_{on,off}{1,2}_6d20565_
# h100.json; that run's modules path read q, k, v through the wrong in-place views). On.
on_cuda = True


class _Ctx:
    """What Layer's or Attention's forward keeps for its backward, outside an autograd
    node."""

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
    mlp = None if step.mlp is None else tuple(step.mlp)
    block = None if step.block is None else tuple(
        tuple(f) if isinstance(f, list) else f for f in step.block)
    return _encode((step.delayed, tuple(step.qkv), (tuple(proj.plan), *tuple(proj)[1:]), mlp,
                    step.act, tuple(step.attention), views, step.deterministic,
                    tuple(step.splits), tuple(step.norms), step.act_name,
                    step.rope_interleaved, block))


_DECODED: dict = {}


def _decode(key: str):
    """The learned step of an op's string argument (read once per string)."""
    step = _DECODED.get(key)
    if step is None:
        (delayed, qkv, proj, mlp, act, attention, views, deterministic, splits, norms,
         act_name, rope_interleaved, block) = ast.literal_eval(key)
        step = _DECODED[key] = Step(
            None, (), delayed, compiled_blocks.Codes(*qkv),
            fast_linear.Codes(Plan(*proj[0]), *proj[1:]),
            None if mlp is None else compiled_blocks.Codes(*mlp), act,
            attention, tuple((torch.Size(sh), st, off) for sh, st, off in views), deterministic,
            splits, False, norms, act_name, rope_interleaved,
            None if block is None else BlockArgs(list(block[0]), list(block[1]), *block[2:]))
    return step


class _Kind(NamedTuple):
    """What differs between the layer node's ops and the attention node's."""

    name: str  # the ops' name prefix
    modules: int  # FP8 modules (QKV, projection[, MLP])
    leading: int  # parameters before the QKV blocks (attention's 4[, the MLP's 6])
    made: int  # what the node makes for its backward, rng states (and RoPE's angles) included


# (with RoPE the node holds q, k and v rotated and dense instead of the QKV output, and the
# angles as a matrix)
_LAYER = _Kind("layer", 3, 10, 28)
_LAYER_ROPE = _Kind("layer_rope", 3, 10, 31)
_ATTENTION = _Kind("attention", 2, 4, 14)
_ATTENTION_ROPE = _Kind("attention_rope", 2, 4, 17)
_KINDS = {(True, False): _LAYER, (True, True): _LAYER_ROPE, (False, False): _ATTENTION,
          (False, True): _ATTENTION_ROPE}


def _states(kind: _Kind, scales, histories, bwd) -> tuple:
    """layer_block's per-module state triples from the ops' arguments."""
    return tuple((scales[i], histories[i], tuple(bwd[3 * i:3 * i + 3]))
                 for i in range(kind.modules))


def _joined_qkv(parts: list, fake: bool) -> Optional[torch.Tensor]:
    """The QKV weight (or bias) blocks as one tensor: over their storage when back to back."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if not fake and back_to_back(parts):
        return joined(tuple(parts))
    return torch.cat(parts)


# params: the node's blocks as layer_block passes them (_Params.all order): the attention's
# (gamma1, beta1, proj weight, proj bias), the layer's MLP's (gamma2, beta2, w1, b1, w2, b2),
# then the QKV weight blocks and bias blocks (n_w, n_b of them).


def _forward(kind: _Kind, x, params, scales, histories, bwd, freqs, key: str, p: float,
             n_w: int, n_b: int, fake: bool) -> tuple:
    step = _decode(key)
    if not fake and step.delayed:
        # (the graph takes this node past every module's first step, layer_block's
        # _past_first_step; a compiled first step leaves its marks, which no graph takes, and
        # the Python steps this node shares would read them)
        for h in (*histories, *bwd[::3]):
            first_step.written_elsewhere_all(h)
    lead = kind.leading
    w_qkv = _joined_qkv(list(params[lead:lead + n_w]), fake)
    b_qkv = _joined_qkv(list(params[lead + n_w:lead + n_w + n_b]), fake)
    qkv = (w_qkv,) if b_qkv is None else (w_qkv, b_qkv)
    ctx = _Ctx()
    states = _states(kind, scales, histories, bwd)
    if kind.modules == 3:
        out = Layer.forward(ctx, x, step, states, (freqs, p), 1, len(qkv) - 1, *params[:lead],
                             *qkv)
        saved = ctx.saved_tensors
        # (all but x2, gamma1 (the first two) and gamma2 (after mid); then the hidden
        # dropout's two rng states)
        _, rng1, rng2 = ctx.dropout
        made = (*saved[2:15], *saved[16:], rng1, rng2)
    else:
        out = Attention.forward(ctx, x, step, states, freqs, 1, len(qkv) - 1, *params[:lead],
                                 *qkv)
        made = ctx.saved_tensors[2:]  # (all but x2 and gamma1)
    if freqs is not None:  # (the angles as the node's matrix, a copy of its own)
        made = (*made, ctx.freqs.clone())
    # (no dropout: an empty rng state of the op's own for each, which the core takes as absent)
    made = tuple(x.new_empty(0, dtype=torch.int64) if t is None or t is NO_RNG else t
                 for t in made)
    if fake:
        return (out, *made)
    # (an op's results may not share storage, and te.Linear's operator carves its input's and
    # weight's FP8 copies, and their scale_invs, from one allocation: the later of each pair,
    # the weight's, is copied)
    shared = _SHARED.get((kind, key))
    if shared is None:
        shared = _SHARED[(kind, key)] = _sharing(made)
    return (out, *(t.clone() if i in shared else t for i, t in enumerate(made)))


# (kind, step) -> the indices of the results that share storage with an earlier one: the same
# at every call of a step, so found at its first
_SHARED: dict = {}


def _sharing(tensors: tuple) -> frozenset:
    seen, found = set(), set()
    for i, t in enumerate(tensors):
        if t.numel():
            where = t.untyped_storage().data_ptr()
            if where in seen:
                found.add(i)
            seen.add(where)
    return frozenset(found)


def _backward(kind: _Kind, grad, x, params, made, bwd, key, p, n_w, n_b) -> tuple:
    rope = kind in (_LAYER_ROPE, _ATTENTION_ROPE)
    step = _decode(key)
    has_b = n_b > 0
    lead = kind.leading
    g1 = params[0]
    ctx = _Ctx()
    metas = tuple(tuple(bwd[3 * i:3 * i + 3]) for i in range(kind.modules))
    # (the ops take the QKV blocks joined: one weight and at most one bias)
    ctx.info = fp8_info(step, metas, 1, int(has_b), x.shape, tuple(params[:lead]),
                        params[lead].dtype)
    x2 = x.view(-1, x.shape[-1])
    if rope:
        made, ctx.freqs = made[:-1], made[-1]
    else:
        ctx.freqs = None
    if kind.modules == 3:  # (gamma2 follows mid in Layer's saved tensors)
        ctx.saved_tensors = (x2, g1, *made[:13], params[4], *made[13:-2])
        ctx.dropout = (p, *((None, None) if p == 0.0 else made[-2:]))
        grads = Layer.backward(ctx, grad)
    else:
        ctx.saved_tensors = (x2, g1, *made)
        grads = Attention.backward(ctx, grad)
    # (x's, the leading parameters', and the joined QKV weight's and bias's gradients whole:
    # _NodeOp.backward splits them)
    out = [grads[0]]
    for g in (*grads[6:6 + lead + 1], grads[7 + lead] if has_b else None):
        out.append(x.new_empty(0) if g is None else g)
    return tuple(out)


def _backward_fake(kind: _Kind, x, params, n_w: int, n_b: int) -> tuple:
    lead = kind.leading
    out = [torch.empty_like(x)]
    out += [torch.empty_like(p) if p is not None else x.new_empty(0) for p in params[:lead]]
    w = params[lead:lead + n_w]
    out.append(w[0].new_empty((sum(t.shape[0] for t in w), *w[0].shape[1:])))
    b = params[lead + n_w:lead + n_w + n_b]
    out.append(b[0].new_empty((sum(t.shape[0] for t in b),)) if n_b else x.new_empty(0))
    return tuple(out)


# The ops' schemas, written out: the FP8 state they write travels as single tensors (a
# functionalized graph takes no written list) and their results as a fixed number of tensors
# (a functionalized op that writes its inputs returns no list).
def _results(n: int) -> str:
    return "(" + ", ".join(["Tensor"] * n) + ")"


def _forward_schema(kind: _Kind) -> str:
    written = [f"Tensor(a{i}!) s{i}" for i in range(kind.modules)]
    written += [f"Tensor(b{i}!) h{i}" for i in range(kind.modules)]
    return (f"(Tensor x, Tensor?[] params, {', '.join(written)}, Tensor[] bwd, Tensor? freqs, "
            f"str key, float p, SymInt n_w, SymInt n_b) -> {_results(1 + kind.made)}")


def _backward_schema(kind: _Kind) -> str:
    written = [f"Tensor(c{3 * i + j}!) {name}{i}" for i in range(kind.modules)
               for j, name in enumerate(("h", "s", "si"))]
    return (f"(Tensor grad, Tensor x, Tensor?[] params, Tensor[] made, {', '.join(written)}, "
            f"str key, float p, SymInt n_w, SymInt n_b) -> {_results(1 + kind.leading + 2)}")


def _define(kind: _Kind):
    """The forward and backward custom ops of ``kind``'s node."""
    m = kind.modules
    fwd_schema, bwd_schema = _forward_schema(kind), _backward_schema(kind)

    def forward(x, params, *rest):
        scales, histories, (bwd, freqs, key, p, n_w, n_b) = rest[:m], rest[m:2 * m], rest[2 * m:]
        return _forward(kind, x, params, scales, histories, bwd, freqs, key, p, n_w, n_b, False)

    def forward_fake(x, params, *rest):
        scales, histories, (bwd, freqs, key, p, n_w, n_b) = rest[:m], rest[m:2 * m], rest[2 * m:]
        # (the same Python on fake tensors: the blocks' and attention's ops give their fakes;
        # _compiled.faking sends the blocks' calls to their ops, not the C++ operators)
        _compiled.faking = True
        try:
            return _forward(kind, x, params, scales, histories, bwd, freqs, key, p, n_w, n_b,
                            True)
        finally:
            _compiled.faking = False

    def backward(grad, x, params, made, *rest):
        bwd, (key, p, n_w, n_b) = rest[:3 * m], rest[3 * m:]
        return _backward(kind, grad, x, params, made, bwd, key, p, n_w, n_b)

    def backward_fake(grad, x, params, made, *rest):
        return _backward_fake(kind, x, params, *rest[3 * m + 2:])

    # (_backend.custom_op, as the blocks' ops: one kernel for every device, not
    # torch.library.custom_op, whose Python autograd, version-counter and dynamo layers these
    # ops do not need and which cost about 0.4 ms a call in a compiled CPU step:
    # benchmarks/results/host_probes.md)
    fwd = custom_op(f"{_NS}::{kind.name}_fp8_forward", schema=fwd_schema)(forward)
    fwd.register_fake(forward_fake)
    bwd = custom_op(f"{_NS}::{kind.name}_fp8_backward", schema=bwd_schema)(backward)
    bwd.register_fake(backward_fake)
    return fwd.op, bwd.op


# forward: the node's output and what it made for the backward; writes the amaxes (and, under
# current scaling, the scales) of the modules' forward state. backward: the gradients of x, of
# the leading parameters and of the joined QKV weight and bias (empty where absent); writes
# the gradients' amaxes and scales into the modules' backward state.
_OPS = {kind: _define(kind) for kind in _KINDS.values()}


class _NodeOp(torch.autograd.Function):
    """A node's two ops as one autograd node of the traced graph (the blocks' custom ops make
    theirs the same way: an op that writes the FP8 state takes no autograd formula of its
    own)."""

    @staticmethod
    def forward(ctx, x, kind: _Kind, key: str, p: float, freqs, n_w: int, n_b: int,
                scales: list, histories: list, bwd: list, *params):
        out, *made = _OPS[kind][0](x, list(params), *scales, *histories, bwd, freqs, key, p,
                                   n_w, n_b)
        ctx.kind, ctx.key, ctx.p, ctx.n_w, ctx.n_b, ctx.bwd = kind, key, p, n_w, n_b, bwd
        ctx.present = tuple(p is not None for p in params)
        ctx.save_for_backward(x, *(p for p in params if p is not None), *made)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        x = saved.pop(0)
        params = [saved.pop(0) if here else None for here in ctx.present]
        kind, n_w, n_b = ctx.kind, ctx.n_w, ctx.n_b
        out = _OPS[kind][1](grad.contiguous(), x, params, saved, *ctx.bwd, ctx.key, ctx.p, n_w,
                            n_b)
        lead = kind.leading
        qkv_grads = split_grads(_decode(ctx.key), n_w, n_b, out[1 + lead], out[2 + lead])
        grads = [g if here else None for g, here in
                 zip((*out[1:1 + lead], *qkv_grads), ctx.present, strict=True)]
        return (out[0], None, None, None, None, None, None, None, None, None, *grads)


def apply(x: torch.Tensor, step, states: tuple, p: float, freqs: Optional[torch.Tensor],
          n_w: int, n_b: int, params: tuple):
    """The step of layer_block's layer node (three modules' states; ``p`` its hidden dropout)
    or attention node (two) in a traced graph, with RoPE's ``freqs`` or None: the output."""
    kind = _KINDS[(len(states) == 3, freqs is not None)]
    scales = [s for s, _, _ in states]
    histories = [h for _, h, _ in states]
    bwd = [t for _, _, b in states for t in b]
    return _NodeOp.apply(x, kind, encode(step), float(p), freqs, n_w, n_b, scales, histories,
                         bwd, *params)
