"""te.RotaryPositionEmbedding and te.apply_rotary_pos_emb: the angles against their formula, the
fused (core) and unfused (torch) paths against a float64 reference written pair by pair, their
gradients against float64 autograd of that reference, torch.compile(fullgraph=True) of both,
and on CUDA the fused kernel against the CPU path bit for bit (rope.h: both evaluate the same
fp32 operations and the same sincos)."""

from __future__ import annotations

import math

import pytest
import torch
from te_torch_tests._tolerances import ROPE_FREQS_RTOL, ROPE_RTOL, assert_within

import transformer_engine.pytorch as te

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------------ references


def reference_freqs(dim, rotary_percent, max_seq_len, offset, base, interleaved, factor=None,
                    pretrained=None):
    """The angles [max_seq_len, rot_dim] in float64 from the documented formula; only the
    exponent k / rot_dim is taken as the fp32 value that the formula defines."""
    rot = int(dim * rotary_percent)
    exponent = (torch.arange(0, rot, 2, dtype=torch.float32) / rot).double()
    inv_freq = 1.0 / base**exponent
    pos = torch.arange(max_seq_len, dtype=torch.float64) + offset
    if factor is not None:
        if pretrained is not None and max_seq_len > pretrained * factor:
            pos = pos * (pretrained / max_seq_len)
        else:
            pos = pos / factor
    half = pos[:, None] * inv_freq[None, :]
    if interleaved:
        return half.repeat_interleave(2, dim=1)
    return torch.cat((half, half), dim=1)


def _pairs(rot, interleaved):
    """Indices of the first and second features of every pair."""
    if interleaved:
        return torch.arange(0, rot, 2), torch.arange(1, rot, 2)
    return torch.arange(rot // 2), torch.arange(rot // 2, rot)


def _rotate_sequence(x, angles, interleaved):
    """x [L, h, d] float64 rotated pair by pair by angles [L, R]; also the magnitude
    |x_i cos a_i| + |x_k sin a_i| of each output (x itself beyond R)."""
    rot = angles.shape[1]
    first, second = _pairs(rot, interleaved)
    a = angles[:, None, :]
    cos, sin = torch.cos(a), torch.sin(a)
    x1, x2 = x[..., first], x[..., second]
    y = x.clone()
    y[..., first] = x1 * cos[..., first] - x2 * sin[..., first]
    y[..., second] = x2 * cos[..., second] + x1 * sin[..., second]
    mag = x.abs().clone()
    mag[..., first] = (x1 * cos[..., first]).abs() + (x2 * sin[..., first]).abs()
    mag[..., second] = (x2 * cos[..., second]).abs() + (x1 * sin[..., second]).abs()
    return y, mag


def reference_rope(x, freqs, tensor_format, interleaved, cu_seqlens=None, start=None):
    """(y, magnitude) in float64 for x in any layout, sequence by sequence: token i of
    sequence b takes angle row start[b] + i. Differentiable in x."""
    f = freqs.double().reshape(freqs.shape[0], freqs.shape[-1])
    x = x.double()
    if tensor_format == "thd":
        bounds = cu_seqlens.tolist()
        seqs = [x[bounds[b]:bounds[b + 1]] for b in range(len(bounds) - 1)]
    else:
        seqs = list(x.transpose(0, 1) if tensor_format == "sbhd" else x)
    ys, mags = [], []
    for b, seq in enumerate(seqs):
        s0 = 0 if start is None else int(start[b])
        y, mag = _rotate_sequence(seq, f[s0:s0 + seq.shape[0]], interleaved)
        ys.append(y)
        mags.append(mag)
    if tensor_format == "thd":
        return torch.cat(ys), torch.cat(mags)
    y, mag = torch.stack(ys), torch.stack(mags)
    if tensor_format == "sbhd":
        return y.transpose(0, 1), mag.transpose(0, 1)
    return y, mag


# ------------------------------------------------------------------ inputs

# (tensor_format, shape of t, cu_seqlens or None); thd has uneven lengths and an empty sequence.
LAYOUTS = [
    ("sbhd", (5, 3, 2, 16), None),
    ("bshd", (3, 5, 2, 16), None),
    ("thd", (11, 2, 16), [0, 4, 4, 9, 11]),
]


def make_case(layout, dtype, rotary_percent, interleaved, with_start, device="cpu"):
    fmt, shape, cu = layout
    batch = len(cu) - 1 if cu is not None else (shape[1] if fmt == "sbhd" else shape[0])
    t = torch.randn(shape).to(dtype).to(device)
    start = torch.tensor([3, 0, 7, 1][:batch], dtype=torch.int32, device=device) \
        if with_start else None
    rope = te.RotaryPositionEmbedding(shape[-1], rotary_percent=rotary_percent,
                                      interleaved=interleaved).to(device)
    freqs = rope(16)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    return t, freqs, cu_t, start


def _kwargs(layout, interleaved, cu, start):
    return dict(tensor_format=layout[0], interleaved=interleaved, cu_seqlens=cu,
                start_positions=start)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent,factor,pretrained,offset,length",
                         [(1.0, None, None, 0, 40), (0.5, 2.0, None, 3, 40),
                          (0.75, 4.0, 8, 0, 40), (0.75, 4.0, 8, 0, 20)])
def test_module_freqs_match_formula(interleaved, rotary_percent, factor, pretrained, offset,
                                    length):
    """Shape [s, 1, 1, rot_dim], float32, and the angles of the formula (with pretrained 8 and
    factor 4, length 40 goes past 32 and squeezes the positions; length 20 does not)."""
    rope = te.RotaryPositionEmbedding(64, rotary_percent=rotary_percent,
                                      seq_len_interpolation_factor=factor,
                                      pretrained_max_position_embeddings=pretrained,
                                      rotary_base=500.0, interleaved=interleaved)
    got = rope(length, offset=offset)
    rot = int(64 * rotary_percent)
    assert got.shape == (length, 1, 1, rot) and got.dtype == torch.float32
    want = reference_freqs(64, rotary_percent, length, offset, 500.0, interleaved, factor,
                           pretrained)
    assert_within(got.reshape(length, rot), want, want.abs(), ROPE_FREQS_RTOL, "freqs")


def test_module_refuses_odd_rotary_dim_and_keeps_no_state():
    with pytest.raises(ValueError, match="RotaryPositionEmbedding: int.*even.*got 3"):
        te.RotaryPositionEmbedding(6, rotary_percent=0.5)
    rope = te.RotaryPositionEmbedding(8)
    assert "inv_freq" not in rope.state_dict()  # follows from the arguments


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("with_start", [False, True], ids=["", "start"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_and_gradients_match_float64_reference(dtype, layout, rotary_percent,
                                                      interleaved, with_start, fused):
    t, freqs, cu, start = make_case(layout, dtype, rotary_percent, interleaved, with_start)
    t.requires_grad_(True)
    kwargs = _kwargs(layout, interleaved, cu, start)
    y = te.apply_rotary_pos_emb(t, freqs, fused=fused, **kwargs)
    assert y.dtype == dtype and y.shape == t.shape
    want, mag = reference_rope(t.detach(), freqs, layout[0], interleaved, cu, start)
    assert_within(y, want, mag, ROPE_RTOL[dtype], "output")
    # Gradient: float64 autograd of the reference, and its own magnitude (the backward is
    # the same kind of computation on the gradient).
    g = torch.randn(t.shape).to(dtype)
    (dt,) = torch.autograd.grad(y, t, g)
    t64 = t.detach().double().requires_grad_(True)
    y64, _ = reference_rope(t64, freqs, layout[0], interleaved, cu, start)
    (dt64,) = torch.autograd.grad(y64, t64, g.double())
    inverse, _ = reference_rope(g.double(), -freqs.double(), layout[0], interleaved, cu, start)
    torch.testing.assert_close(inverse, dt64)  # shared angles: the rotation by -a
    _, gmag = reference_rope(g.double(), freqs, layout[0], interleaved, cu, start)
    assert dt.dtype == dtype
    assert_within(dt, dt64, gmag, ROPE_RTOL[dtype], "grad_input")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_matches_unfused(dtype, layout):
    t, freqs, cu, start = make_case(layout, dtype, 0.5, False, True)
    kwargs = _kwargs(layout, False, cu, start)
    a = te.apply_rotary_pos_emb(t, freqs, **kwargs)
    b = te.apply_rotary_pos_emb(t, freqs, fused=True, **kwargs)
    _, mag = reference_rope(t, freqs, layout[0], False, cu, start)
    assert_within(b, a, mag, 2 * ROPE_RTOL[dtype], "fused vs unfused")


def test_angles_that_differ_within_a_pair_backward_is_the_transpose():
    """Arbitrary freqs (not the module's layout): the fused backward is still the transpose
    of the forward, <f(x), g> = <x, f^T(g)>, as autograd of the unfused path computes it."""
    t = torch.randn(4, 2, 3, 8, dtype=torch.float32, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 6) * 3
    g = torch.randn(4, 2, 3, 8)
    grads = []
    for fused in (False, True):
        y = te.apply_rotary_pos_emb(t, freqs, fused=fused)
        grads.append(torch.autograd.grad(y, t, g)[0])
        lhs = (y.double() * g.double()).sum()
        rhs = (t.detach().double() * grads[-1].double()).sum()
        torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)
    _, gmag = reference_rope(g, freqs, "sbhd", False)
    assert_within(grads[1], grads[0], gmag, 2 * ROPE_RTOL[torch.float32], "grad")


def test_partial_rotary_passes_the_rest_through_bit_for_bit():
    t = torch.randn(3, 2, 2, 10, dtype=torch.bfloat16)
    freqs = te.RotaryPositionEmbedding(10, rotary_percent=0.4)(3)
    for fused in (False, True):
        y = te.apply_rotary_pos_emb(t, freqs, fused=fused)
        assert torch.equal(y[..., 4:], t[..., 4:])


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_bad_arguments_are_refused(fused):
    t = torch.randn(4, 2, 2, 8)
    freqs = te.RotaryPositionEmbedding(8)(4)
    with pytest.raises(NotImplementedError, match="context parallelism of packed .thd. "
                                                  "sequences takes no start_positions"):
        te.apply_rotary_pos_emb(t.reshape(8, 2, 8), freqs, "thd", fused=fused, cp_size=2,
                                cp_rank=1, cu_seqlens=torch.tensor([0, 4, 8]),
                                start_positions=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="cp_rank in"):
        te.apply_rotary_pos_emb(t, freqs, fused=fused, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="apply_rotary_pos_emb: tensor_format"):
        te.apply_rotary_pos_emb(t, freqs, "sbdh", fused=fused)
    with pytest.raises(ValueError, match="freqs must have at least the sequence length 6"):
        te.apply_rotary_pos_emb(torch.randn(6, 2, 2, 8), freqs, fused=fused)
    with pytest.raises(ValueError, match="rot_dim.*at most t's head dimension 4"):
        te.apply_rotary_pos_emb(torch.randn(4, 2, 2, 4), freqs, fused=fused)
    with pytest.raises(ValueError, match="cu_seqlens must be given"):
        te.apply_rotary_pos_emb(torch.randn(4, 2, 8), freqs, "thd", fused=fused)
    with pytest.raises(ValueError, match="start_positions must be an integer vector \\[2\\]"):
        te.apply_rotary_pos_emb(t, freqs, fused=fused, start_positions=torch.zeros(3))
    with pytest.raises(TypeError, match="freqs must be float32"):
        te.apply_rotary_pos_emb(t, freqs.double(), fused=fused)


def test_fused_cpu_checks_positions_against_freqs():
    """The core refuses a start position past the rows of freqs (CPU path; rope.h)."""
    t = torch.randn(4, 2, 2, 8)
    freqs = te.RotaryPositionEmbedding(8)(6)
    start = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="rope_forward: freqs.data must have a row for every "
                                         "position used, up to 6"):
        te.apply_rotary_pos_emb(t, freqs, fused=True, start_positions=start)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 with fused=True"):
        te.apply_rotary_pos_emb(t.double(), freqs, fused=True)


@pytest.mark.slow  # inductor compiles C++ for the unfused graph
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]], ids=["sbhd", "thd"])
def test_compiled_fullgraph_matches_eager(layout, fused):
    torch._dynamo.reset()
    t, freqs, cu, start = make_case(layout, torch.float32, 0.5, True, True)
    t.requires_grad_(True)
    kwargs = _kwargs(layout, True, cu, start)

    def step(x):
        return te.apply_rotary_pos_emb(x, freqs, fused=fused, **kwargs)

    compiled = torch.compile(step, fullgraph=True)  # a graph break raises
    g = torch.randn(t.shape)
    y_eager = step(t)
    y_compiled = compiled(t)
    (d_eager,) = torch.autograd.grad(y_eager, t, g)
    (d_compiled,) = torch.autograd.grad(y_compiled, t, g)
    _, mag = reference_rope(t.detach(), freqs, layout[0], True, cu, start)
    _, gmag = reference_rope(g, freqs, layout[0], True, cu, start)
    # Inductor may evaluate cos/sin and the products with its own (vectorized) code.
    assert_within(y_compiled, y_eager, mag, 2 * ROPE_RTOL[torch.float32], "output")
    assert_within(d_compiled, d_eager, gmag, 2 * ROPE_RTOL[torch.float32], "grad_input")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_percent", [(64, 1.0), (64, 0.5), (20, 0.6)],
                         ids=["vector", "vector-partial", "scalar"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_fused_matches_cpu_bit_for_bit(dtype, layout, head_dim, rotary_percent,
                                            interleaved):
    """The CUDA kernel (its 128-bit path for head_dim 64, its scalar path for 20) writes the
    CPU path's bits, forward and backward (rope.h); the unfused path agrees within tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = {"sbhd": (37, 3, 4, head_dim), "bshd": (3, 37, 4, head_dim),
             "thd": (100, 4, head_dim)}[layout]
    cu = torch.tensor([0, 30, 30, 77, 100], dtype=torch.int32) if layout == "thd" else None
    batch = 4 if layout == "thd" else 3
    start = torch.arange(batch, dtype=torch.int32) * 5
    t = (torch.randn(shape) * 4).to(dtype)
    g = torch.randn(shape).to(dtype)
    freqs = te.RotaryPositionEmbedding(head_dim, rotary_percent=rotary_percent,
                                       interleaved=interleaved)(128)
    results = []
    for device in ("cpu", "cuda"):
        x = t.to(device).requires_grad_(True)
        kwargs = _kwargs((layout,), interleaved, None if cu is None else cu.to(device),
                         start.to(device))
        y = te.apply_rotary_pos_emb(x, freqs.to(device), fused=True, **kwargs)
        (dx,) = torch.autograd.grad(y, x, g.to(device))
        unfused = te.apply_rotary_pos_emb(x.detach(), freqs.to(device), **kwargs)
        results.append((y.detach().cpu(), dx.cpu(), unfused.cpu()))
    (y_cpu, dx_cpu, _), (y_gpu, dx_gpu, unfused_gpu) = results
    assert torch.equal(_bits(y_gpu), _bits(y_cpu))
    assert torch.equal(_bits(dx_gpu), _bits(dx_cpu))
    _, mag = reference_rope(t, freqs, layout, interleaved, cu, start)
    assert_within(unfused_gpu, y_cpu, mag, 2 * ROPE_RTOL[dtype], "unfused on cuda")


@pytest.mark.cuda
def test_cuda_writes_nan_for_positions_past_freqs():
    """The CUDA path does not read start_positions on the host (rope.h): a sequence whose
    positions run past the rows of freqs gets NaN in its rotated features, and only there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    t = torch.randn(4, 2, 2, 16, device="cuda")
    freqs = te.RotaryPositionEmbedding(16, rotary_percent=0.5)(6).cuda()
    start = torch.tensor([0, 4], dtype=torch.int32, device="cuda")  # positions 4..7 of 0..5
    y = te.apply_rotary_pos_emb(t, freqs, fused=True, start_positions=start).cpu()
    assert not y[:, 0].isnan().any()
    assert y[2:, 1, :, :8].isnan().all() and not y[:2, 1].isnan().any()
    assert torch.equal(y[:, 1, :, 8:], t[:, 1, :, 8:].cpu())


def test_math_is_exact_for_quarter_turns():
    """An angle of pi/2 (in fp32) turns the pair (1, 0) into (cos, sin) of that angle."""
    freqs = torch.full((1, 2), math.pi / 2, dtype=torch.float32)
    t = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)
    a = torch.tensor(math.pi / 2, dtype=torch.float32).double()
    for fused in (False, True):
        y = te.apply_rotary_pos_emb(t, freqs, fused=fused).double().flatten()
        torch.testing.assert_close(y, torch.stack((torch.cos(a), torch.sin(a))), rtol=0,
                                   atol=2.0**-24)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_context_parallel_chunks_take_their_positions(fused):
    # Rank r of cp holds chunks r and 2cp-1-r: its rotation equals those rows of the whole
    # sequence's.
    cp, s = 2, 16
    t = torch.randn(s, 2, 2, 8)
    freqs = te.RotaryPositionEmbedding(8)(s)
    whole = te.apply_rotary_pos_emb(t, freqs, fused=fused)
    c = s // (2 * cp)
    for rank in range(cp):
        rows = list(range(rank * c, (rank + 1) * c)) + list(
            range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
        got = te.apply_rotary_pos_emb(t[rows], freqs, fused=fused, cp_size=cp, cp_rank=rank)
        assert torch.equal(got, whole[rows])


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_context_parallel_packed_chunks_take_their_positions(fused):
    # Packed (thd): rank r holds chunks r and 2cp-1-r of every sequence (each sequence's rows a
    # multiple of 2cp; cu_seqlens are the global offsets): each row gets its position within
    # its own sequence, as in the unsplit packing.
    cp, lengths = 2, [8, 4, 12]
    cu = torch.tensor([0, 8, 12, 24])
    t = torch.randn(sum(lengths), 2, 8)
    freqs = te.RotaryPositionEmbedding(8)(max(lengths))
    whole = te.apply_rotary_pos_emb(t, freqs, "thd", fused=fused, cu_seqlens=cu)
    for rank in range(cp):
        rows = []
        for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
            c = n // (2 * cp)
            rows += list(range(start + rank * c, start + (rank + 1) * c))
            rows += list(range(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
        got = te.apply_rotary_pos_emb(t[rows], freqs, "thd", fused=fused, cu_seqlens=cu,
                                      cp_size=cp, cp_rank=rank)
        assert torch.equal(got, whole[rows])
