"""``transformer_engine_torch``: the module name NVIDIA Transformer Engine's programs import as
``tex``. Two of its names are here: ``DType``, so that ``tex.DType.kFloat8E4M3`` can be given
where ``fp8_dtype`` is asked for (``transformer_engine.pytorch.tensor``'s quantizers), and
``thd_get_partitioned_indices``, with which Megatron-LM splits a packed (thd) batch over the
ranks of context parallelism. The rest of that extension is NVIDIA's internals, and asking for
it raises an error that says so.
"""

from __future__ import annotations

import enum
import operator

import torch

from transformer_engine.common import core as _core

# NVIDIA's member names -> the core's DType names; the values are the core's own codes.
_NAMES = {
    "kByte": "uint8", "kInt32": "int32", "kInt64": "int64", "kFloat32": "float32",
    "kFloat16": "float16", "kBFloat16": "bfloat16", "kFloat8E4M3": "float8_e4m3",
    "kFloat8E5M2": "float8_e5m2",
}

DType = enum.IntEnum("DType", {nvidia: int(getattr(_core().DType, ours).value)
                               for nvidia, ours in _NAMES.items()})
DType.__doc__ = "Element types by NVIDIA's ``tex.DType`` names, valued by the core's codes."


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int,
                                rank: int) -> torch.Tensor:
    """The rows of a packed (thd) batch that context-parallel rank ``rank`` of ``world_size``
    holds, in the rank's order: int32 ``[total_tokens / world_size]``, on cu_seqlens' device.

    ``cu_seqlens`` [b + 1] (in): the sequences' cumulative padded lengths (Megatron-LM passes
    ``cu_seqlens_padded``), each length a multiple of ``2 * world_size``. Each sequence is cut
    into ``2 * world_size`` chunks; rank r holds chunks r and ``2 * world_size - 1 - r`` of
    every sequence, one sequence after the other: the layout DotProductAttention's context
    parallelism of thd expects (``transformer_engine.pytorch.context_parallel_thd``).
    ``total_tokens`` (in): the batch's rows, a multiple of ``2 * world_size``; normally
    ``cu_seqlens[-1]``. The lengths are checked where cu_seqlens is on the CPU (reading CUDA
    memory would stall the stream; NVIDIA's kernel asserts them on the device)."""
    from transformer_engine.pytorch.context_parallel_thd import partitioned_indices

    op = "thd_get_partitioned_indices"
    # plain ints, as NVIDIA's binding makes of them (a caller may pass cu_seqlens[-1])
    total_tokens, world_size, rank = (operator.index(v) for v in (total_tokens, world_size, rank))
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1
            or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise TypeError(f"{op}: cu_seqlens must be a 1-D int32 (or int64) tensor of b + 1 >= 2 "
                        f"offsets, got {_describe(cu_seqlens)}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{op}: world_size must be >= 1 and rank in [0, world_size), got "
                         f"world_size {world_size}, rank {rank}")
    if total_tokens <= 0 or total_tokens % (2 * world_size) != 0:
        raise ValueError(f"{op}: total_tokens must be a positive multiple of 2 * world_size = "
                         f"{2 * world_size}, got {total_tokens}")
    if cu_seqlens.device.type == "cpu" and bool((cu_seqlens % (2 * world_size) != 0).any()):
        raise ValueError(f"{op}: every sequence's length must be a multiple of 2 * world_size "
                         f"= {2 * world_size}, got cu_seqlens {cu_seqlens.tolist()}")
    return partitioned_indices(cu_seqlens, world_size, rank,
                               total_tokens // world_size).to(torch.int32)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def __getattr__(name: str):
    raise AttributeError(
        f"transformer_engine_torch.{name} does not exist here: this module gives only DType (the "
        f"element types by NVIDIA's names) and thd_get_partitioned_indices; the other functions "
        f"of NVIDIA's extension are its internals, which this project does not reproduce (use "
        f"transformer_engine.pytorch)")
