"""Tensor parallelism on torch.distributed: the collectives of the parallel layers, as autograd
functions, and the checks of the arguments that describe the group.

A column-parallel layer (``parallel_mode="column"``) holds a slice of the output features:
its input is the full activation, which every rank has, so the forward needs no collective;
the input's gradient is the sum of every rank's partial gradient (all-reduce in the
backward). A row-parallel layer (``parallel_mode="row"``) holds a slice of the input features:
its output is a partial sum, all-reduced in the forward; the output's gradient is already
whole on every rank (nothing in the backward).

Sequence parallelism (``sequence_parallel=True``, Megatron's scheme) keeps the activations
between the parallel regions split along their first dimension (the sequence of an sbhd
tensor): a column-parallel layer all-gathers its input along that dimension (its gradient is
reduce-scattered back), a row-parallel layer reduce-scatters its partial output instead of
all-reducing it (its gradient is all-gathered). Parameters applied to a sequence shard (a
row-parallel bias, the norm of a block that gathers its input) then get a gradient from that
shard only: as in NVIDIA's modules they carry ``param.sequence_parallel = True``, and the
caller sums their gradients over the group (Megatron's finalize step does).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .rng_tracker import CudaRNGStatesTracker

# (and ``checkpoint``, te.checkpoint under NVIDIA's path, and ``fp8_all_gather``, FSDP2's FP8
# all-gather of high-precision weights: both made on first use, see the end)
__all__ = ["CudaRNGStatesTracker", "activation_recompute_forward", "copy_to_tensor_parallel",
           "gather_along_first_dim", "gather_from_sequence_parallel", "get_all_rng_states",
           "gradient_on_first_rank", "in_fp8_activation_recompute_phase",
           "is_fp8_activation_recompute_enabled",
           "reduce_from_tensor_parallel", "reduce_scatter_to_sequence_parallel"]

PARALLEL_MODES = (None, "column", "row")


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    # The collective writes in place: a fresh contiguous tensor, so that no view or saved
    # tensor of the caller changes.
    out = t.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def gather_first_dim(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dimension 0, in rank order."""
    import torch.distributed as dist

    t = t.contiguous()
    out = t.new_empty((t.shape[0] * dist.get_world_size(group), *t.shape[1:]))
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def reduce_scatter_first_dim(t: torch.Tensor, group: Any, op: str) -> torch.Tensor:
    """The sum over the ranks of ``t``, this rank's share of dimension 0."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if t.dim() == 0 or t.shape[0] % size:
        raise ValueError(f"{op}: sequence parallelism splits the first dimension over the "
                         f"{size} ranks, so it must be divisible by {size}, got shape "
                         f"{list(t.shape)}")
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // size, *t.shape[1:]))
    # (reduce_scatter_single is the newer name; older releases have only the other)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, t, op=dist.ReduceOp.SUM, group=group)
    return out


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along dimension 0 in the forward; reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return gather_first_dim(inp, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_first_dim(grad, ctx.group, "sequence parallelism"), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along dimension 0 in the forward; all-gather of the gradient."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, group: Any, op: str) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_first_dim(inp, group, op)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_first_dim(grad, ctx.group), None, None


def gather_from_sequence_parallel(inp: torch.Tensor, group: Any) -> torch.Tensor:
    """The input of a column-parallel layer under sequence parallelism: every rank's shard of
    the first dimension, gathered; its gradient is summed over ``group`` and split again."""
    return _GatherFromSequenceParallel.apply(inp, group)


def reduce_scatter_to_sequence_parallel(inp: torch.Tensor, group: Any,
                                        op: str = "sequence parallelism") -> torch.Tensor:
    """The output of a row-parallel layer under sequence parallelism: the sum over ``group``
    of every rank's ``inp``, this rank's share of the first dimension (``op`` names the layer
    in the error for a dimension the ranks cannot share)."""
    return _ReduceScatterToSequenceParallel.apply(inp, group, op)


def gather_along_first_dim(inp: torch.Tensor, process_group: Any, async_op: bool = False
                           ) -> tuple[torch.Tensor, None]:
    """NVIDIA's helper: every rank's ``inp`` concatenated along dimension 0 (in rank order),
    and None for the work handle (the gather completes before it returns)."""
    if async_op:
        raise NotImplementedError("gather_along_first_dim: async_op=True is not supported; "
                                  "the gather completes before the call returns")
    return gather_first_dim(inp, process_group), None


def mark_sequence_parallel(*params) -> None:
    """Marks parameters whose gradient comes from this rank's sequence shard only."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity in the forward; all-reduce (sum) of the gradient in the backward."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return inp.view_as(inp)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce (sum) in the forward; identity for the gradient."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(inp, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GradientOnFirstRank(torch.autograd.Function):
    """Identity in the forward; the gradient passes on the group's first rank and is zero on
    the others."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.first = dist.get_rank(group) == 0
        return inp.view_as(inp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.first else torch.zeros_like(grad)), None


def gradient_on_first_rank(inp: torch.Tensor, group: Any) -> torch.Tensor:
    """``inp`` itself, for a value every rank holds whole whose gradient joins one that is
    summed over ``group`` later (e.g. a norm's output returned next to a column-parallel
    layer's partial input gradient): every rank receives the same gradient, so passing it on
    one rank only adds it once to the sum."""
    return _GradientOnFirstRank.apply(inp, group)


def copy_to_tensor_parallel(inp: torch.Tensor, group: Any) -> torch.Tensor:
    """The input of a column-parallel layer: ``inp`` itself; its gradient is summed over
    ``group``."""
    return _CopyToTensorParallel.apply(inp, group)


def reduce_from_tensor_parallel(inp: torch.Tensor, group: Any) -> torch.Tensor:
    """The output of a row-parallel layer: the sum of every rank's ``inp`` over ``group``."""
    return _ReduceFromTensorParallel.apply(inp, group)


class SharedGroup:
    """A module's process group. A deep copy of the module (an EMA copy, a test's reference)
    shares it: a group names live communicators, which cannot be copied. (Pickling still
    fails on the group itself: a process group means nothing in another process.)"""

    __slots__ = ("group",)

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo) -> "SharedGroup":
        return self


# ------------------------------------------------------------------ argument checks


def group_size(op: str, tp_group: Any) -> int:
    """The size of ``tp_group`` (a torch.distributed ProcessGroup)."""
    size = getattr(tp_group, "size", None)
    if not callable(size):
        raise TypeError(f"{op}: tp_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(tp_group).__name__}")
    return int(size())


def check_tensor_parallel(op: str, tp_group: Any, tp_size: int,
                          parallel_mode: Optional[str]) -> int:
    """Checks a module's (tp_group, tp_size, parallel_mode); returns the number of ranks the
    parallel dimension is split over (1: not split)."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"{op}: parallel_mode must be None, 'column' or 'row', got "
                         f"{parallel_mode!r}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{op}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is None:
        # NVIDIA's way: the group comes later, through set_tensor_parallel_group; the module
        # is split over tp_size ranks and refuses to run until then.
        return tp_size if parallel_mode is not None else 1
    size = group_size(op, tp_group)
    if tp_size != size:
        raise ValueError(f"{op}: tp_size must equal the size of tp_group ({size}), got "
                         f"{tp_size}")
    return size if parallel_mode is not None else 1


def check_group_to_set(op: str, tp_group: Any, tp_size: int, current: Any) -> bool:
    """The checks of ``set_tensor_parallel_group``: True when a module split over ``tp_size``
    ranks and still without its group (``current`` None) is to take ``tp_group`` now; False
    when there is nothing to do (not split, and no group of more than one rank given; or the
    same group again)."""
    if tp_size == 1:
        if tp_group is not None and group_size(op, tp_group) != 1:
            raise ValueError(f"{op}: set_tensor_parallel_group got a group of "
                             f"{group_size(op, tp_group)} ranks, but the module is not split "
                             "(build it with tp_size and a parallel mode)")
        return False
    if current is not None:
        if tp_group is current:
            return False
        raise ValueError(f"{op}: the module has its tensor-parallel group already; "
                         "set_tensor_parallel_group takes a group only once")
    if tp_group is None:
        raise ValueError(f"{op}: set_tensor_parallel_group needs the group of the tp_size="
                         f"{tp_size} ranks the module is split over, got None")
    if group_size(op, tp_group) != tp_size:
        raise ValueError(f"{op}: the group must have tp_size={tp_size} ranks, got "
                         f"{group_size(op, tp_group)}")
    return True


def refuse_without_group(op: str, tp_size: int) -> None:
    raise RuntimeError(f"{op}: the module is split over tp_size={tp_size} ranks but has no "
                       "tensor-parallel group yet; call set_tensor_parallel_group(tp_group) "
                       "before its forward")


def check_divisible(op: str, name: str, value: int, tp_size: int) -> int:
    """``value // tp_size``, the per-rank share of a split dimension."""
    if value % tp_size:
        raise ValueError(f"{op}: {name} must be divisible by tp_size={tp_size}, got {value}")
    return value // tp_size


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False,
                                 recompute_phase: bool = False) -> Iterator[None]:
    """NVIDIA's context for an activation checkpoint of the caller's own (Megatron-LM's
    ``CheckpointFunction``): wrap the first forward in
    ``activation_recompute_forward(activation_recompute=True)`` and the recompute in the
    backward in ``activation_recompute_forward(activation_recompute=True,
    recompute_phase=True)``. Under delayed scaling each module's recompute then quantizes with
    the forward scales its first run used (taken back per module, first in first out), and
    records no amax; the result is the first run's bits, as with :func:`te.checkpoint`. Outside
    an enabled ``fp8_autocast``, or with ``activation_recompute=False``, it changes nothing.
    A first run whose recompute never comes keeps its scale copies (a few floats per module)."""
    from . import fp8

    if not (activation_recompute and fp8.STATE.enabled):
        yield
        return
    r = fp8.RECOMPUTE
    saved = (r.recording, r.sources, r.replay, r.index, r.queue)
    if recompute_phase:
        r.recording = r.sources = None
        r.replay, r.index, r.queue = fp8.QUEUED, 0, False
    else:
        r.recording, r.sources, r.queue = [], [], True
    try:
        yield
    finally:
        r.recording, r.sources, r.replay, r.index, r.queue = saved


def is_fp8_activation_recompute_enabled() -> bool:
    """Inside the first run of :func:`activation_recompute_forward` (NVIDIA's query)."""
    from . import fp8

    return fp8.RECOMPUTE.queue


def in_fp8_activation_recompute_phase() -> bool:
    """Inside the recompute phase of :func:`activation_recompute_forward`."""
    from . import fp8

    return fp8.RECOMPUTE.replay is fp8.QUEUED


def get_all_rng_states() -> dict:
    """The RNG states of the tracker that te modules draw from by default: empty here (each
    module takes its tracker as ``get_rng_state_tracker``; NVIDIA's CUDA-graph code asks for
    the states of its global tracker, which this package does not keep)."""
    return {}


def __getattr__(name: str):
    # te.checkpoint under NVIDIA's path, imported on first use (it imports the modules, which
    # import this one).
    if name == "checkpoint":
        from .checkpoint import checkpoint

        return checkpoint
    if name == "fp8_all_gather":  # (fsdp_fp8 imports this module)
        from .fsdp_fp8 import fp8_all_gather

        return fp8_all_gather
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
