"""te.distributed.CudaRNGStatesTracker (NVIDIA's and Megatron-LM's named RNG streams) and its
use by te.checkpoint; on the CPU generator here, the current CUDA device's where there is one."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker


def test_fork_runs_on_the_stream_and_leaves_the_default_generator_alone():
    t = CudaRNGStatesTracker()
    t.add("model-parallel-rng", 1234)
    before = torch.get_rng_state()
    with t.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    with t.fork():
        b = torch.rand(4)  # the stream went on
    torch.manual_seed(1234)
    want = torch.rand(8)
    assert torch.equal(torch.cat([a, b]), want)


def test_states_round_trip_and_errors_name_the_method():
    t = CudaRNGStatesTracker()
    t.add("a", 1)
    saved = t.get_states()
    with t.fork("a"):
        x = torch.rand(3)
    t.set_states(saved)
    with t.fork("a"):
        assert torch.equal(torch.rand(3), x)
    with pytest.raises(ValueError, match="seed 1 is already in use"):
        t.add("b", 1)
    with pytest.raises(ValueError, match="a stream named 'a' exists"):
        t.add("a", 2)
    with pytest.raises(KeyError, match="no stream named 'model-parallel-rng'"):
        with t.fork():
            pass
    t.reset()
    assert t.get_states() == {}


def test_checkpoint_recomputes_dropout_on_the_stream_with_the_same_masks():
    t = CudaRNGStatesTracker()
    t.add("model-parallel-rng", 7)
    w = torch.randn(16, 16, requires_grad=True)

    def block(x):
        with t.fork():
            x = torch.nn.functional.dropout(x, 0.5)
        return x @ w

    x = torch.randn(8, 16)
    t0 = t.get_states()
    block(x).sum().backward()
    want = w.grad.clone()
    w.grad = None
    t.set_states(t0)
    te.distributed.checkpoint(block, x, get_rng_state_tracker=lambda: t).sum().backward()
    assert torch.equal(w.grad, want)


def test_gather_along_first_dim_refuses_async():
    with pytest.raises(NotImplementedError, match="async_op=True"):
        te.distributed.gather_along_first_dim(torch.ones(2), None, async_op=True)
