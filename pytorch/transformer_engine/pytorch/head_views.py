"""Views of a projection's output features as attention heads (module/_heads.py has the two
orders); torch only, so that attention_fn can make them too (a traced step's q, k, v read in
place)."""

from __future__ import annotations

import torch


def head_views(x: torch.Tensor, groups: int, parts: tuple, head_dim: int,
               interleaved: bool) -> list:
    """Views of x [..., F] as [..., parts_i * groups, head_dim] (copies where the heads of a
    part are not adjacent: the interleaved order with more than one group)."""
    lead = x.shape[:-1]
    if not interleaved or groups == 1:  # one view and one split (host time: every forward)
        heads = x.view(*lead, x.shape[-1] // head_dim, head_dim)
        return list(torch.split(heads, [p * groups for p in parts], dim=-2))
    grouped = x.view(*lead, groups, sum(parts), head_dim)
    return [t.reshape(*lead, groups * p, head_dim)
            for t, p in zip(torch.split(grouped, list(parts), dim=-2), parts, strict=True)]
