"""``InferenceParams``: the key/value cache of incremental decoding.

Each self-attention layer (keyed by its ``layer_number``) gets a contiguous cache of keys and
values, ``[max_batch_size, max_sequence_length, num_heads_kv, head_dim]`` (bshd), allocated
at its first forward with ``inference_params`` (or by :meth:`InferenceParams.allocate_memory`);
``is_paged=True`` views the same bytes as pages of ``page_size`` tokens.
A forward writes the new tokens' keys and values (after RoPE) into it and attends over
everything cached so far, with the causal diagonal aligned to the last token.

Two ways to say where the new tokens go:

* ``pre_step(step_dict)`` before each forward (Transformer Engine 2.x): ``step_dict`` maps a
  sequence id to its number of new tokens, in batch order. A new id starts a sequence, a known
  id continues it, a known id left out is finished and frees its cache row. The input holds
  the sequences in that order, each one's new tokens first (padded to the longest).
* ``sequence_len_offset`` (Transformer Engine 1.x): without ``pre_step``, every sequence of
  the batch (cache rows ``batch_size_offset`` on) gets the input's tokens at positions
  ``sequence_len_offset`` on; the caller adds the input's length to it after each forward.

Packed input (``qkv_format="thd"``, [tokens, hidden]) needs ``pre_step``: the tokens are the
sequences' new tokens one sequence after the other, in ``step_dict``'s order, with no padding;
the step's ``cu_seqlens`` come from ``step_dict`` (the layer's ``cu_seqlens_q`` argument is not
read). Attention runs over the cache as for padded input: the queries are laid out as
[batch, longest step, heads, dim] for the kernel and the output is packed again.

RoPE positions follow the cache: token ``i`` of a step takes position ``cached length + i``,
so ``rotary_pos_emb`` is the table of every position (``RotaryPositionEmbedding(max_len)``).
Cross attention keeps no cache (its keys and values come from ``encoder_output`` each step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Optional

import torch

__all__ = ["InferenceParams"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
# Masks a step turns into: its causal diagonal through the last cached token.
_CAUSAL = ("causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right")


class _Step:
    """Where pre_step's new tokens go, worked out once on the host for every layer; device
    copies of its index tensors are made at the first layer that needs them."""

    def __init__(self, lens: list, pre: list, rows: list) -> None:
        self.batch, self.lens, self.pre, self.rows = len(lens), lens, pre, rows
        self.max_q = max(lens)
        self.max_kv = max(p + n for p, n in zip(pre, lens, strict=True))
        # All sequences alike (the usual batch decode): slices instead of index lists.
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        self.row_slice = (rows[0], rows[0] + len(rows)) if consecutive else None
        self.same_start = len(set(pre)) == 1
        self.uniform = consecutive and len(set(lens)) == 1 and self.same_start
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_kv = [0]
        for p, n in zip(pre, lens, strict=True):
            cu_kv.append(cu_kv[-1] + p + n)
        tok_b = [b for b, n in enumerate(lens) for _ in range(n)]
        tok_t = [t for n in lens for t in range(n)]
        self._host = {
            "cu_q": torch.tensor(cu, dtype=torch.int32),
            "cu_kv": torch.tensor(cu_kv, dtype=torch.int32),
            "start": torch.tensor(pre, dtype=torch.int32),
            "rows": torch.tensor(rows, dtype=torch.long),
            "tok_b": torch.tensor(tok_b, dtype=torch.long),
            "tok_t": torch.tensor(tok_t, dtype=torch.long),
            "dst_row": torch.tensor([rows[b] for b in tok_b], dtype=torch.long),
            "dst_pos": torch.tensor([pre[b] + t for b, t in zip(tok_b, tok_t, strict=True)],
                                    dtype=torch.long),
        }
        self._on: dict = {}

    def on(self, device: torch.device) -> dict:
        got = self._on.get(device)
        if got is None:
            got = self._on[device] = _to_device(self._host, device)
        return got


def _to_device(host: dict, device: torch.device) -> dict:
    """The host tensors on ``device``. To a GPU, in one asynchronous copy per dtype from
    pinned memory: a copy from pageable memory would make the host wait for every kernel
    queued before it, once per decoding step, and leave the GPU idle while the host
    prepares the next step."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in host.items()}
    out = {}
    for dtype in {v.dtype for v in host.values()}:
        names = [k for k, v in host.items() if v.dtype == dtype]
        packed = torch.cat([host[k] for k in names]).pin_memory()
        parts = packed.to(device, non_blocking=True).split([host[k].numel() for k in names])
        out.update(zip(names, parts, strict=True))
    return out


class InferenceParams:
    """KV cache for incremental decoding through te.TransformerLayer / te.MultiheadAttention.

    Args:
        max_batch_size: sequences the cache holds at once.
        max_sequence_length: tokens per sequence the cache holds (prompt and generated).
        num_heads_kv, head_dim_k, head_dim_v, dtype: the cache's key/value heads, head dims
            and dtype; None takes them from the first layer that uses the cache (its keys and
            values; ``head_dim_v`` defaults to ``head_dim_k``).
        is_paged, total_num_pages, page_size: a paged cache: each layer's keys and values
            as ``total_num_pages`` pages of ``page_size`` tokens, ``[total_num_pages,
            page_size, heads, head_dim]``, with ``page_table`` [max_batch_size, pages per
            sequence] naming each cache row's pages. As in NVIDIA TE, ``total_num_pages`` must
            be ``max_batch_size * max_sequence_length / page_size``; the pages of a row are
            fixed (row r owns pages r * pages_per_seq on), so the paged cache holds the same
            bytes as the contiguous one, viewed as pages.
        max_ctx_len: the longest step of packed (thd) input; accepted and unused (the steps
            say their lengths in pre_step).
        qkv_format: layout of the incoming tensors, ``"bshd"``, ``"sbhd"`` or ``"thd"``; the
            layers pass their own (``attn_input_format``), this is kept for compatibility.
        custom_cache_manager: a user cache manager; not supported (must be None).

    Example (greedy decoding; ``model`` a stack of te.TransformerLayer with distinct
    ``layer_number``s, bshd, ``self_attn_mask_type="causal"``)::

        params = te.InferenceParams(batch, max_len)
        freqs = te.RotaryPositionEmbedding(head_dim)(max_len)
        params.pre_step(OrderedDict((i, prompt_len) for i in range(batch)))
        h = model(embed(prompt), inference_params=params, rotary_pos_emb=freqs)
        for _ in range(new_tokens):
            params.pre_step(OrderedDict((i, 1) for i in range(batch)))
            h = model(embed(next_token(h[:, -1])), inference_params=params,
                      rotary_pos_emb=freqs)
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int,
                 num_heads_kv: Optional[int] = None, head_dim_k: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, head_dim_v: Optional[int] = None,
                 is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, max_ctx_len: Optional[int] = None,
                 qkv_format: str = "bshd", custom_cache_manager=None) -> None:
        op = "InferenceParams"
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
        for name, value in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k),
                            ("head_dim_v", head_dim_v)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{op}: {name} must be None or a positive int, got {value!r}")
        if dtype is not None and dtype not in _FLOAT:
            raise TypeError(f"{op}: dtype must be None or one of {_FLOAT}, got {dtype}")
        if is_paged:
            _check_pages(max_batch_size, max_sequence_length, total_num_pages, page_size)
        if custom_cache_manager is not None:
            raise NotImplementedError(f"{op}: custom_cache_manager is not supported; it must "
                                      "be None")
        if qkv_format not in ("bshd", "sbhd", "thd"):
            raise ValueError(f"{op}: qkv_format must be 'bshd', 'sbhd' or 'thd', got "
                             f"{qkv_format!r}")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.is_paged = bool(is_paged)
        self.total_num_pages, self.page_size = total_num_pages, page_size
        self.max_ctx_len, self.input_qkv_format = max_ctx_len, qkv_format
        # layer_number -> (k_cache, v_cache) (as pages when paged); key_value_memory_dict is
        # its 1.x name.
        self.cache: dict = {}
        self.key_value_memory_dict = self.cache
        self._owners: dict = {}
        self.reset()

    # ------------------------------------------------------------------ public API

    def reset(self) -> None:
        """Forget every sequence (the allocated caches stay, to be overwritten)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.sequences: OrderedDict = OrderedDict()
        self.sequences_pre_step: OrderedDict = OrderedDict()
        self.batch_size = 0
        self._slots: dict = {}
        self._step: Optional[_Step] = None

    def __repr__(self) -> str:
        return (f"InferenceParams(max_batch_size={self.max_batch_size}, "
                f"max_sequence_length={self.max_sequence_length}, "
                f"num_heads_kv={self.num_heads_kv}, head_dim_k={self.head_dim_k}, "
                f"head_dim_v={self.head_dim_v}, dtype={self.dtype}, is_paged={self.is_paged})")

    @property
    def page_table(self) -> torch.Tensor:
        """Pages of each cache row, int32 [max_batch_size, pages per sequence] (paged only)."""
        if not self.is_paged:
            raise RuntimeError("InferenceParams.page_table: the cache is not paged")
        per_row = self.max_sequence_length // self.page_size
        return torch.arange(self.max_batch_size * per_row, dtype=torch.int32).view(
            self.max_batch_size, per_row)

    def convert_paged_to_nonpaged(self, layer_number: int) -> tuple:
        """Layer ``layer_number``'s keys and values of the current sequences, in batch order,
        as [batch_size, max_sequence_length, heads, head_dim]."""
        k, v = (self._rows(t) for t in self.cache[layer_number])
        rows = torch.tensor([self._slots[s] for s in self.sequences], dtype=torch.long,
                            device=k.device)
        return k.index_select(0, rows), v.index_select(0, rows)

    def allocate_memory(self, layer_number: int, device=None) -> None:
        """Allocates layer ``layer_number``'s cache now (a forward does it when needed); needs
        num_heads_kv, head_dim_k and dtype. ``device``: default the current CUDA device when
        there is one, else the CPU."""
        missing = [n for n in ("num_heads_kv", "head_dim_k", "dtype") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"InferenceParams.allocate_memory: needs {', '.join(missing)} "
                             "(given to the constructor), got None; or let the first forward "
                             "allocate the cache from its keys and values")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        self.cache[layer_number] = self._allocate(self.num_heads_kv, self.head_dim_k,
                                                  self.head_dim_v, self.dtype, device)

    def _allocate(self, heads: int, dim_k: int, dim_v: int, dtype, device) -> tuple:
        lead = ((self.total_num_pages, self.page_size) if self.is_paged else
                (self.max_batch_size, self.max_sequence_length))
        return (torch.zeros(*lead, heads, dim_k, dtype=dtype, device=device),
                torch.zeros(*lead, heads, dim_v, dtype=dtype, device=device))

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """A cache tensor as rows [max_batch_size, max_sequence_length, heads, dim] (a view of
        the pages when paged)."""
        return t.view(self.max_batch_size, self.max_sequence_length, *t.shape[2:])

    def pre_step(self, step_dict: Mapping) -> OrderedDict:
        """Declares the next forward's sequences: ``{seq_id: new tokens}`` in batch order.
        Returns the sequences' lengths after the step."""
        op = "InferenceParams.pre_step"
        if not isinstance(step_dict, Mapping) or not step_dict:
            raise ValueError(f"{op}: step_dict must be a non-empty mapping seq_id -> number of "
                             f"new tokens, got {step_dict!r}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"{op}: step_dict must have at most max_batch_size="
                             f"{self.max_batch_size} sequences, got {len(step_dict)}")
        for seq, n in step_dict.items():
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ValueError(f"{op}: the new tokens of sequence {seq!r} must be a positive "
                                 f"int, got {n!r}")
            total = self.sequences.get(seq, 0) + n
            if total > self.max_sequence_length:
                raise ValueError(f"{op}: sequence {seq!r} would hold {total} tokens, more than "
                                 f"max_sequence_length={self.max_sequence_length}")
        for seq in [s for s in self._slots if s not in step_dict]:  # finished: free the row
            del self._slots[seq]
            del self.sequences[seq]
        free = sorted(set(range(self.max_batch_size)) - set(self._slots.values()))
        for seq in step_dict:
            if seq not in self._slots:
                self._slots[seq] = free.pop(0)
        self.sequences_pre_step = OrderedDict((s, self.sequences.get(s, 0)) for s in step_dict)
        self.sequences = OrderedDict((s, self.sequences_pre_step[s] + n)
                                     for s, n in step_dict.items())
        self.batch_size = len(step_dict)
        self._step = _Step([int(n) for n in step_dict.values()],
                           list(self.sequences_pre_step.values()),
                           [self._slots[s] for s in step_dict])
        return self.sequences

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """The cached length of each sequence of the step before its new tokens (int32
        [batch_size]), on the CPU."""
        if self._step is None:
            return torch.full((self.batch_size,), self.sequence_len_offset, dtype=torch.int32)
        return self._step._host["start"]

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """Offsets of the step's new tokens per sequence (int32 [batch_size + 1], CPU)."""
        return self._need_step("cu_seqlens_q")._host["cu_q"]

    @property
    def cu_seqlens_kv(self) -> torch.Tensor:
        """Offsets of the sequences' cached tokens after the step (int32 [batch + 1], CPU)."""
        return self._need_step("cu_seqlens_kv")._host["cu_kv"]

    def swap_key_value_dict(self, batch_indices) -> None:
        """Reorders the cached sequences of every layer: row i takes row batch_indices[i]
        (e.g. beam search); the sequence_len_offset style only."""
        if self._step is not None:
            raise RuntimeError("InferenceParams.swap_key_value_dict: only for the "
                               "sequence_len_offset style; with pre_step, give the sequence ids "
                               "in the new order instead")
        for k, v in self.cache.values():
            for t in (self._rows(k), self._rows(v)):
                idx = torch.as_tensor(batch_indices, dtype=torch.long, device=t.device)
                t[:idx.numel()] = t.index_select(0, idx)

    # ------------------------------------------------------ used by MultiheadAttention

    def _need_step(self, what: str) -> _Step:
        if self._step is None:
            raise RuntimeError(f"InferenceParams.{what}: call pre_step() first")
        return self._step

    def _check_input(self, batch: int, seqlen: int) -> None:
        """Whether a step's input of ``batch`` sequences and ``seqlen`` positions fits."""
        step = self._step
        if step is not None:
            if batch != step.batch or seqlen < step.max_q:
                raise ValueError(f"InferenceParams: the input must hold the {step.batch} "
                                 f"sequences of pre_step with at least {step.max_q} positions "
                                 f"each, got batch {batch} and {seqlen} positions")
            return
        o, b0 = int(self.sequence_len_offset), int(self.batch_size_offset)
        if o < 0 or o + seqlen > self.max_sequence_length:
            raise ValueError(f"InferenceParams: sequence_len_offset + the input's length must "
                             f"be in [0, max_sequence_length={self.max_sequence_length}], got "
                             f"{o} + {seqlen}")
        if b0 < 0 or b0 + batch > self.max_batch_size:
            raise ValueError(f"InferenceParams: batch_size_offset + the input's batch must be "
                             f"in [0, max_batch_size={self.max_batch_size}], got {b0} + {batch}")

    def _check_packed(self, tokens: int) -> _Step:
        """Whether a packed (thd) step's input of ``tokens`` tokens is pre_step's."""
        step = self._need_step("a packed (thd) step")
        if tokens != sum(step.lens):
            raise ValueError(f"InferenceParams: packed (thd) input must hold the "
                             f"{sum(step.lens)} new tokens of pre_step ({step.lens}), got "
                             f"{tokens}")
        return step

    def _rope_positions(self, device: torch.device):
        """(start_positions tensor [batch] or None, offset int) of this step's tokens."""
        step = self._step
        if step is None:
            return None, int(self.sequence_len_offset)
        if step.same_start:  # one offset for all: a slice of the table, no index tensor
            return None, step.pre[0]
        return step.on(device)["start"], 0

    def _packed_rope(self, device: torch.device) -> tuple:
        """(cu_seqlens, start_positions) of a packed step's tokens, for RoPE."""
        idx = self._need_step("a packed (thd) step").on(device)
        return idx["cu_q"], idx["start"]

    def _cache_of(self, layer_number: int, owner, k: torch.Tensor, v: torch.Tensor):
        owners = self._owners
        if owners.setdefault(layer_number, id(owner)) != id(owner):
            raise ValueError(f"InferenceParams: layer_number {layer_number} is used by two "
                             "attention modules; give every te.TransformerLayer (or "
                             "te.MultiheadAttention) of the model a distinct layer_number")
        got = self.cache.get(layer_number)
        if got is None:
            got = self._allocate(k.shape[-2], k.shape[-1], v.shape[-1], self.dtype or k.dtype,
                                 k.device)
            self.cache[layer_number] = got
        kc, vc = self._rows(got[0]), self._rows(got[1])
        if kc.shape[2:] != k.shape[-2:] or vc.shape[2:] != v.shape[-2:]:
            raise ValueError(f"InferenceParams: the cache of layer {layer_number} holds "
                             f"[heads, head_dim] {list(kc.shape[2:])} / {list(vc.shape[2:])}, "
                             f"got keys {list(k.shape[-2:])} and values {list(v.shape[-2:])}")
        if kc.device != k.device:
            raise ValueError(f"InferenceParams: the cache of layer {layer_number} is on "
                             f"{kc.device}, got keys on {k.device}")
        return kc, vc

    def _append(self, layer_number: int, owner, k: torch.Tensor, v: torch.Tensor,
                mask: str) -> tuple:
        """Writes a step's keys and values (bshd) into the cache; returns (keys, values) of the
        whole cached sequences (bshd, in k's dtype), the mask type to attend with, and
        (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv), the cu_seqlens None when
        the mask has no padding."""
        kc, vc = self._cache_of(layer_number, owner, k, v)
        step = self._step
        s = k.shape[1]
        self._check_input(k.shape[0], s)
        if step is None:
            return self._append_at_offset(kc, vc, k, v, mask)
        if step.uniform and s == step.lens[0]:
            (r0, r1), p0 = step.row_slice, step.pre[0]
            kc[r0:r1, p0:p0 + s] = k
            vc[r0:r1, p0:p0 + s] = v
            keys, values = kc[r0:r1, :p0 + s], vc[r0:r1, :p0 + s]
            mask = _bottom_right(mask, padding=False)
            return _as(keys, k), _as(values, v), mask, (None, None, s, p0 + s)
        idx = step.on(k.device)
        return self._write_tokens(kc, vc, k[idx["tok_b"], idx["tok_t"]],
                                  v[idx["tok_b"], idx["tok_t"]], mask, s)

    def _write_tokens(self, kc, vc, k, v, mask: str, max_q: int) -> tuple:
        """_append's result for a step's tokens k, v [tokens, heads, dim] in pre_step's order:
        written at their sequences' rows and positions, then every sequence's cached keys and
        values, padded to the longest."""
        step = self._step
        idx = step.on(k.device)
        kc.index_put_((idx["dst_row"], idx["dst_pos"]), k.to(kc.dtype))
        vc.index_put_((idx["dst_row"], idx["dst_pos"]), v.to(vc.dtype))
        keys, values = kc[:, :step.max_kv], vc[:, :step.max_kv]
        if step.row_slice is not None:
            keys, values = (t[step.row_slice[0]:step.row_slice[1]] for t in (keys, values))
        else:
            keys, values = keys.index_select(0, idx["rows"]), values.index_select(0, idx["rows"])
        mask = _bottom_right(mask, padding=True)
        return (_as(keys, k), _as(values, v), mask,
                (idx["cu_q"], idx["cu_kv"], max_q, step.max_kv))

    def _append_packed(self, layer_number: int, owner, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, mask: str) -> tuple:
        """_append for a packed (thd) step, q, k, v [tokens, heads, dim]: (q as [batch, longest
        step, heads, dim], keys, values, mask, seqlens as _append's, and ``unpack``, which takes
        the attention output [batch, longest step, ...] back to [tokens, ...]). The caller has
        checked the step's token count (_check_packed, before its RoPE)."""
        step = self._need_step("a packed (thd) step")
        kc, vc = self._cache_of(layer_number, owner, k, v)
        idx = step.on(q.device)
        at = (idx["tok_b"], idx["tok_t"])
        q_padded = q.new_zeros(step.batch, step.max_q, *q.shape[1:]).index_put(at, q)
        return (q_padded, *self._write_tokens(kc, vc, k, v, mask, step.max_q),
                lambda o: o[at])

    def _append_at_offset(self, kc, vc, k, v, mask: str) -> tuple:
        b, s = k.shape[0], k.shape[1]
        o, b0 = int(self.sequence_len_offset), int(self.batch_size_offset)
        if mask.startswith("padding") or mask == "arbitrary":
            raise NotImplementedError(f"InferenceParams: attn_mask_type {mask!r} with the "
                                      "sequence_len_offset style; use pre_step() for sequences "
                                      "of different lengths")
        kc[b0:b0 + b, o:o + s] = k
        vc[b0:b0 + b, o:o + s] = v
        keys, values = kc[b0:b0 + b, :o + s], vc[b0:b0 + b, :o + s]
        return (_as(keys, k), _as(values, v), _bottom_right(mask, padding=False),
                (None, None, s, o + s))


def _check_pages(max_batch_size: int, max_sequence_length: int, total_num_pages, page_size):
    op = "InferenceParams"
    if not isinstance(page_size, int) or page_size <= 0 or max_sequence_length % page_size:
        raise ValueError(f"{op}: a paged cache needs a positive page_size dividing "
                         f"max_sequence_length={max_sequence_length}, got {page_size!r}")
    pages = max_batch_size * (max_sequence_length // page_size)
    if total_num_pages != pages:
        raise ValueError(f"{op}: a paged cache needs total_num_pages = max_batch_size * "
                         f"max_sequence_length / page_size = {pages}, got {total_num_pages!r}")


def _as(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return cached if cached.dtype == new.dtype else cached.to(new.dtype)


def _bottom_right(mask: str, padding: bool) -> str:
    """The mask of attending from a step's tokens to the whole cached sequences."""
    if mask == "arbitrary":
        raise NotImplementedError("InferenceParams: attn_mask_type 'arbitrary' is not supported "
                                  "with a KV cache")
    causal = mask in _CAUSAL
    if padding:
        return "padding_causal_bottom_right" if causal else "padding"
    return "causal_bottom_right" if causal else "no_mask"
