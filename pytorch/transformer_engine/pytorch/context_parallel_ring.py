"""Context parallelism's ring (``cp_comm_type="p2p"``, and the ``"a2a+p2p"`` ring across
all-to-all groups): each rank keeps its queries and the key/value blocks travel around the
ranks of the ring's group.

At step ``t`` rank ``r`` holds the block of rank ``r - t`` (its chunks of the sequence: two
under "p2p"), sends it on to rank ``r + 1`` and receives the next one from rank ``r - 1``
while it attends its queries to the block it holds. The partial results merge by their
softmax statistics (log-sum-exp, as online softmax does), so a rank never holds more than two
blocks of keys and values, whatever the number of ranks. Under a causal mask a query chunk
``i`` sees a key chunk ``j`` fully when ``j < i``, with the causal mask when ``j == i``, and
not at all when ``j > i`` (those blocks are skipped).

The backward is a ring as well: the blocks travel the same way again, and each block's key and
value gradients travel one step behind it, every rank adding its share, until they come back
to the rank that owns the block. The probabilities are recomputed from the forward's
log-sum-exp (``p = exp(s - lse)``), and ``D = rowsum(dO * O)`` of the whole output, so each
block's gradients are exact shares of the whole.

The blocks are attended with torch math (``q @ k^T``, softmax statistics, ``p @ v``) in fp32
(fp64 inputs stay fp64), on any device: the module's attention does not return its softmax
statistics. Dropout is drawn per block from a seed the backward reuses.
"""

from __future__ import annotations

import torch

__all__ = ["Ring", "ring_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _visible_prefix(q_chunk: int, kv_chunks: tuple[int, ...], causal: bool) -> tuple[int, bool]:
    """How many of a block's chunks (ascending) a query chunk sees (they are a prefix), and
    whether the last of them is its own chunk (then under the causal mask)."""
    if not causal:
        return len(kv_chunks), False
    seen = sum(1 for j in kv_chunks if j <= q_chunk)
    return seen, seen > 0 and kv_chunks[seen - 1] == q_chunk


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where masked: keys past the diagonal that ends at the last key (bottom right)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [b, kv heads, s, d] with each head repeated for its group of query heads."""
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _sum_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over the repeated heads summed back to the kv heads."""
    b, heads, s, d = t.shape
    return t if heads == kv_heads else t.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _keep_mask(seed: int, block: int, shape, dropout: float, device) -> torch.Tensor:
    """The dropout's keep mask of one (step, query chunk) block: drawn from its own seed, so
    the backward draws the same one."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + block)
    return torch.rand(shape, generator=gen, device=device) >= dropout


def block_forward(q, k, v, scale: float, diagonal: bool, keep=None, dropout: float = 0.0):
    """(o, lse) of queries q [b, h, sq, d] over keys k, values v [b, hk, sk, d] (fp32),
    normalized over these keys only; ``diagonal``: the bottom-right causal mask."""
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        s.masked_fill_(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if keep is not None:
        p = p * keep / (1.0 - dropout)
    return torch.matmul(p, v), lse


def block_backward(q, k, v, d_o, lse, delta, scale: float, diagonal: bool, keep=None,
                   dropout: float = 0.0):
    """(dq, dk, dv) of one block, from the whole output's lse and delta = rowsum(dO * O): the
    block's share of the gradients of attention over all keys."""
    kv_heads = k.shape[1]
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        s.masked_fill_(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dp = torch.matmul(d_o, v.transpose(-1, -2))
    p_used = p
    if keep is not None:
        p_used = p * keep / (1.0 - dropout)
        dp = dp * keep / (1.0 - dropout)
    dv = torch.matmul(p_used.transpose(-1, -2), d_o)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(ds, k)
    dk = torch.matmul(ds.transpose(-1, -2), q)
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


class Ring:
    """A ring over ``group``: each rank's chunks of the sequence (``chunks[i]``: those of the
    group's rank i, ascending, all of one length), which are its queries' and its block's."""

    def __init__(self, group, chunks: list[tuple[int, ...]]) -> None:
        import torch.distributed as dist

        self.group, self.chunks = group, chunks
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if len(chunks) != self.size:
            raise ValueError(f"context parallelism's ring: one chunk list per rank of its "
                             f"group ({self.size}), got {len(chunks)}")
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, tensors: list) -> tuple[list, list]:
        """Starts sending ``tensors`` to the next rank and receiving the previous rank's (the
        same shapes); returns (the receive buffers, the works to wait for)."""
        import torch.distributed as dist

        if not tensors or self.size == 1:  # (a ring of one: what it would send comes back)
            return list(tensors), []
        received = [torch.empty_like(t) for t in tensors]
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
               + [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received])
        return received, dist.batch_isend_irecv(ops)

    def block_of_step(self, step: int) -> tuple[int, ...]:
        """The chunks of the block this rank holds at ``step``."""
        return self.chunks[(self.rank - step) % self.size]


def _wait(works) -> None:
    for work in works:
        work.wait()


def _visits(ring: Ring, step: int, q_chunk_len: int, causal: bool):
    """(rows of q, keys of the block seen by them, whether under the causal mask) for each
    local query chunk that sees some of the block at ``step``."""
    kv_chunks = ring.block_of_step(step)
    for i, q_chunk in enumerate(ring.chunks[ring.rank]):
        seen, diagonal = _visible_prefix(q_chunk, kv_chunks, causal)
        if seen:
            yield slice(i * q_chunk_len, (i + 1) * q_chunk_len), seen * q_chunk_len, diagonal


class _RingAttention(torch.autograd.Function):
    """q [b, h, s_local, d], k, v [b, hk, s_local, d] -> o [b, h, s_local, dv] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, causal: bool, scale: float, dropout: float):
        work = _compute_dtype(q.dtype)
        qw = q.to(work)
        n = len(ring.chunks[ring.rank])
        c = q.shape[2] // n
        o = qw.new_zeros((*q.shape[:3], v.shape[-1]))
        lse = qw.new_full(q.shape[:3], float("-inf"))
        seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout > 0.0 else 0
        blocks = (k, v)
        for step in range(ring.size):
            # the next block travels while this one is attended
            incoming, works = ring.exchange(list(blocks) if step + 1 < ring.size else [])
            kb, vb = (t.to(work) for t in blocks)
            for rows, keys, diagonal in _visits(ring, step, c, causal):
                qr = qw[:, :, rows]
                keep = None
                if dropout > 0.0:
                    keep = _keep_mask(seed, step * n + rows.start // c, (*qr.shape[:3], keys),
                                      dropout, q.device)
                ob, lb = block_forward(qr, kb[:, :, :keys], vb[:, :, :keys], scale, diagonal,
                                       keep, dropout)
                _merge(o[:, :, rows], lse[:, :, rows], ob, lb)
            _wait(works)
            blocks = incoming or blocks
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, causal, scale, dropout, seed)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale, dropout, seed = ctx.args
        work = _compute_dtype(q.dtype)
        qw, dow = q.to(work), d_out.to(work)
        delta = (dow * out.to(work)).sum(-1)
        n = len(ring.chunks[ring.rank])
        c = q.shape[2] // n
        dq = torch.zeros_like(qw)
        blocks = (k, v)
        grads = None  # the gradients of the block held at the previous step, to pass on
        for step in range(ring.size):
            travelling = (list(blocks) if step + 1 < ring.size else []) + list(grads or ())
            incoming, works = ring.exchange(travelling)
            kb, vb = (t.to(work) for t in blocks)
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            for rows, keys, diagonal in _visits(ring, step, c, causal):
                keep = None
                if dropout > 0.0:
                    keep = _keep_mask(seed, step * n + rows.start // c, (*qw.shape[:2], c, keys),
                                      dropout, q.device)
                dqb, dkb, dvb = block_backward(qw[:, :, rows], kb[:, :, :keys], vb[:, :, :keys],
                                               dow[:, :, rows], lse[:, :, rows],
                                               delta[:, :, rows], scale, diagonal, keep, dropout)
                dq[:, :, rows] += dqb
                dk[:, :, :keys] += dkb
                dv[:, :, :keys] += dvb
            _wait(works)
            if grads is not None:  # this block's gradients so far, from the previous rank
                dk += incoming[-2]
                dv += incoming[-1]
            grads = (dk, dv)
            if step + 1 < ring.size:
                blocks = incoming[:2]
        # the last block's gradients go home: to the next rank, whose block it is
        (dk, dv), works = ring.exchange(list(grads))
        _wait(works)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None)


def _merge(o, lse, ob, lb) -> None:
    """Merges a block's (o, lse) into the running ones in place (views of the whole)."""
    new = torch.logaddexp(lse, lb)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(ob * torch.exp(lb - new).unsqueeze(-1))
    lse.copy_(new)


def ring_attention(ring: Ring, q, k, v, causal: bool, scale: float,
                   dropout: float) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, by the ring: q [b, h, s_local,
    d], k, v [b, hk, s_local, d] (this rank's chunks, ascending) -> [b, h, s_local, dv]."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), ring, causal, scale, dropout)
