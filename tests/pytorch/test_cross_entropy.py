"""te.parallel_cross_entropy (NVIDIA TE's name): the loss and its gradient against torch's
F.cross_entropy in float64 from the same logits (label smoothing, ignore_idx, the mean over
the kept tokens, the z-loss, the layouts), what it keeps for the backward, torch.compile and
the argument errors, in one process; split over the vocabulary of a tensor-parallel group in
gloo worlds of 2 and 4 ranks (_cross_entropy_rank.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from te_torch_tests._reference import cross_entropy64
from te_torch_tests._tolerances import CROSS_ENTROPY_ATOL, CROSS_ENTROPY_RTOL, assert_within
from te_torch_tests._tp_world import run_world

import transformer_engine.pytorch as te
from transformer_engine.pytorch import cross_entropy

V = 96
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_RANK_SCRIPT = Path(__file__).resolve().parent / "_cross_entropy_rank.py"


def logits(shape, dtype, device="cpu", seed=0) -> torch.Tensor:
    # A spread of 3 keeps the softmax far from uniform: a wrong target or scale shows.
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x.to(dtype=dtype, device=device).requires_grad_()


def targets(shape, device="cpu", ignore_idx=-100, seed=1) -> torch.Tensor:
    t = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::5] = ignore_idx  # every fifth token ignored
    return t.to(device)


def check(loss, x, want, what) -> None:
    """The loss and x.grad against cross_entropy64's (loss, grad, magnitudes)."""
    ref, grad, loss_mag, grad_mag = want
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert loss.dtype == compute and x.grad.dtype == x.dtype, (loss.dtype, x.grad.dtype)
    assert_within(loss, ref, loss_mag, CROSS_ENTROPY_RTOL[compute], f"{what} loss")
    rtol = CROSS_ENTROPY_RTOL[x.dtype]
    grad_mag = grad_mag + CROSS_ENTROPY_ATOL.get(x.dtype, 0.0) / rtol
    assert_within(x.grad, grad, grad_mag, rtol, f"{what} grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_idx", [-100, 7])
def test_loss_and_gradient_match_torch(device, dtype, label_smoothing, ignore_idx):
    x = logits((2, 9, V), dtype, device)
    t = targets((2, 9), device, ignore_idx)
    w = torch.randn(2, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = te.parallel_cross_entropy(x, t, label_smoothing, False, None, ignore_idx)
    assert loss.shape == (2, 9)
    (loss * w.to(device, loss.dtype)).sum().backward()
    check(loss, x, cross_entropy64(x, t, w, label_smoothing, ignore_idx), f"{dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reduce_loss_is_the_mean_over_the_kept_tokens(dtype):
    x, t = logits((3, 5, V), dtype), targets((3, 5))
    loss = te.parallel_cross_entropy(x, t, 0.1, True)
    assert loss.dim() == 0
    loss.backward()
    kept = (t != -100).double()
    ref, grad, loss_mag, grad_mag = cross_entropy64(x, t, kept / kept.sum(), 0.1)
    mean = F.cross_entropy(x.detach().double().reshape(-1, V), t.reshape(-1),
                           label_smoothing=0.1)  # torch's "mean": over the kept tokens too
    torch.testing.assert_close(ref.sum() / kept.sum(), mean)
    check(loss, x, (mean, grad, loss_mag.sum() / kept.sum(), grad_mag), f"{dtype} mean")


def test_a_batch_of_ignored_tokens_gives_zero():
    x = logits((2, 3, V), torch.float32)
    loss = te.parallel_cross_entropy(x, torch.full((2, 3), -100), reduce_loss=True)
    loss.backward()
    assert loss.item() == 0.0 and not x.grad.any()  # torch's mean gives 0 / 0 here


def test_sbhd_flat_and_non_contiguous_layouts_give_the_same():
    x = logits((4, 3, V), torch.float32)  # [s, b, V]
    t = targets((4, 3))
    want = te.parallel_cross_entropy(x, t)
    assert torch.equal(te.parallel_cross_entropy(x, t.reshape(-1)), want)
    # A [b, s, V] view of the same memory (stride(-2) != V), as NVIDIA's regression test.
    got = te.parallel_cross_entropy(x.transpose(0, 1), t.t())
    assert torch.equal(got, want.t())


def test_z_loss_and_the_returned_log_sum_exp():
    x, t = logits((2, 7, V), torch.float32), targets((2, 7))
    w = torch.randn(2, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss, lse = te.parallel_cross_entropy(x, t, 0.1, z_loss_weight=1e-2,
                                          return_log_sum_exp=True)
    assert not lse.requires_grad
    (loss * w.float()).sum().backward()
    check(loss, x, cross_entropy64(x, t, w, 0.1, z_loss_weight=1e-2), "z-loss")
    want = torch.logsumexp(x.detach().double(), dim=-1) * (t != -100)
    assert_within(lse, want, want.abs() + 1, CROSS_ENTROPY_RTOL[torch.float32], "lse")


def test_a_target_outside_the_vocabulary_gives_an_infinite_loss():
    # Checking the ids would cost a device-to-host sync per step; NVIDIA's kernel gives inf.
    x = logits((1, 4, V), torch.float32)
    loss = te.parallel_cross_entropy(x, torch.tensor([[V, -1, 3, 5]]))
    assert loss[0, :2].isinf().all() and loss[0, 2:].isfinite().all()


def test_keeps_the_logits_and_per_token_statistics_only():
    """The backward recomputes the softmax: nothing of the vocabulary's size is kept but
    the logits themselves (the same storage, no float32 copy of bf16 logits); per token a
    float32 log-sum-exp and the int64 target, and the count of kept tokens."""
    x = logits((4, 8, V), torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        te.parallel_cross_entropy(x, targets((4, 8)), 0.1, True)
    big = [t for t in saved if t.numel() > 32]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), [t.shape for t in saved]
    assert sum(t.numel() * t.element_size() for t in saved if t.numel() <= 32) <= 32 * (4 + 8) + 8


def test_traces_under_torch_compile():
    x, t = logits((2, 5, V), torch.bfloat16), targets((2, 5))
    compiled = torch.compile(te.parallel_cross_entropy, fullgraph=True)  # a graph break raises
    loss = compiled(x, t, 0.1, True)
    loss.backward()
    kept = (t != -100).double()
    ref, grad, loss_mag, grad_mag = cross_entropy64(x, t, kept / kept.sum(), 0.1)
    check(loss, x, (ref.sum() / kept.sum(), grad, loss_mag.sum() / kept.sum(), grad_mag),
          "compiled")


def test_bad_arguments_say_what_is_wrong():
    x, t = logits((2, 3, V), torch.float32), targets((2, 3))
    bad = [
        (TypeError, r"target must be an integer tensor of token ids, got torch.float32",
         (x, t.float())),
        (TypeError, r"inp must be a floating-point tensor of logits, got torch.int64",
         (t.unsqueeze(-1), t)),
        (ValueError, r"target must be \[2, 3\] \(inp's shape without the vocabulary\) or "
                     r"\[6\], got \[3, 2\]", (x, t.t())),
        (ValueError, r"inp must be \[\.\.\., vocab / tp\] logits .* got shape \[96\]",
         (x[0, 0], t[0])),
        (ValueError, r"label_smoothing must be a number in \[0, 1\], got 1.5", (x, t, 1.5)),
    ]
    for error, message, args in bad:
        with pytest.raises(error, match=f"^parallel_cross_entropy: {message}"):
            te.parallel_cross_entropy(*args)


def test_is_nvidia_public_name():
    assert te.parallel_cross_entropy is cross_entropy.parallel_cross_entropy
    assert "parallel_cross_entropy" in te.__all__
    # NVIDIA's order: Megatron-LM passes (logits, labels, 0.0, False, tp_group, ...) positionally.
    names = list(inspect.signature(te.parallel_cross_entropy).parameters)
    assert names == ["inp", "target", "label_smoothing", "reduce_loss", "dist_process_group",
                     "ignore_idx", "is_cg_capturable", "z_loss_weight", "return_log_sum_exp"]


def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)


@pytest.mark.slow
def test_four_ranks():
    """Also two groups of two ranks with different logits (about 15 s on 2 cores: four
    processes import torch)."""
    run_world(_RANK_SCRIPT, 4)
