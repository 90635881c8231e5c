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


@custom_op("transformer_engine::first_step_scale", mutates_args=())
def first_step_scale(stored: torch.Tensor, amax: torch.Tensor, fp8_dtype: str,
                     margin: int) -> torch.Tensor:
    """The scale [1] that the update makes from a one-step history holding ``amax`` [1] (the
    ``stored`` [1] scale where amax is 0 or not finite): the first-step rule's scale
    (first_step.py) as a functional op. A compiled graph takes it so, not as torch arithmetic:
    Inductor's fp32 division on CUDA is not correctly rounded, and a scale an ulp away from the
    eager step's moves FP8 roundings."""
    scale = stored.clone()
    # (a copy: the update rolls the history it is given)
    delayed_scaling_update([amax.reshape(1, 1).to(torch.float32, copy=True)], [scale],
                           [torch.empty_like(scale)], fp8_dtype, "max", margin)
    return scale


@first_step_scale.register_fake
def _(stored, amax, fp8_dtype, margin):
    return torch.empty_like(stored)
