"""``CudaRNGStatesTracker``: named RNG streams for tensor-parallel dropout (NVIDIA's and
Megatron-LM's tracker, at ``te.distributed.CudaRNGStatesTracker``).

A split attention block draws its dropout masks inside ``tracker.fork()`` (module
``multihead_attention.py``), so each rank's heads get their own masks from a stream seeded per
rank, while the default generator, which draws everything else (hidden dropout, init), stays
in step across the ranks. ``te.checkpoint(..., get_rng_state_tracker=...)`` saves and restores
the streams with the recompute, so a recomputed dropout draws the same masks.

The streams are those of the current CUDA device, or of the CPU generator on a machine without
CUDA (the same class serves the CPU tests of the parallel modules).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["CudaRNGStatesTracker"]

_DEFAULT = "model-parallel-rng"


def _cuda() -> bool:
    return torch.cuda.is_available()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states: ``add(name, seed)`` makes one, ``fork(name)`` runs a block on it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every stream."""
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the streams' states (what a checkpoint saves)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the streams' states (what a checkpoint restores)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"CudaRNGStatesTracker.add: seed must be an int, got {seed!r}")
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already in use")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a stream named {name!r} exists")
        self.seeds_.add(seed)
        outer = _get_state()
        try:
            if _cuda():
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states_[name] = _get_state()
        finally:
            _set_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = _DEFAULT) -> Iterator[None]:
        """Runs the block on stream ``name``, which then keeps the advanced state; the
        default generator is back where it was afterwards."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no stream named {name!r}; add it "
                           f"first (known: {sorted(self.states_)})")
        outer = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(outer)
