"""The delayed-scaling update as a custom op: many amax histories, one core call."""

from __future__ import annotations

import torch

from ._backend import check_fp8_dtype, core, custom_op, raw, stream_of, te_dtype


@custom_op(
    "transformer_engine::delayed_scaling_update",
    mutates_args=("amax_histories", "scales", "scale_invs"),
)
def delayed_scaling_update(amax_histories: list[torch.Tensor], scales: list[torch.Tensor],
                           scale_invs: list[torch.Tensor], fp8_dtype: str, algo: str,
                           margin: int) -> None:
    """In place, for every group i: scales[i] and scale_invs[i] ([n] fp32) from
    amax_histories[i] ([H, n] fp32) by ``algo`` ("max" / "most_recent") and ``margin``; then
    each history rolls one step with a zero in slot 0 (scaling.h). One launch on CUDA."""
    check_fp8_dtype("delayed_scaling_update", fp8_dtype)
    if not amax_histories:
        return
    c = core()
    if algo not in ("max", "most_recent"):
        raise ValueError("delayed_scaling_update: algo must be 'max' or 'most_recent', "
                         f"got {algo!r}")
    c.delayed_scaling_update([raw(h) for h in amax_histories], [raw(s) for s in scales],
                             [raw(s) for s in scale_invs],
                             fp8_dtype=te_dtype(fp8_dtype), algo=getattr(c.AmaxComputeAlgo, algo),
                             margin=margin, stream=stream_of(amax_histories[0]))


@delayed_scaling_update.register_fake
def _(amax_histories, scales, scale_invs, fp8_dtype, algo, margin):
    return None
