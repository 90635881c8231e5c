"""NVIDIA's attention enums (``AttnMaskType``, ``AttnBiasType``, ``QKVLayout``, ``QKVFormat``)
and ``SequenceDescriptor`` (from :mod:`~transformer_engine.jax.sequence_descriptor`),
re-exported by :mod:`transformer_engine.jax.attention`.

The enums are ``str`` enums whose values are our option strings, so a member can be passed
wherever our modules and :func:`~transformer_engine.jax.attention.fused_attn` take a string
(``attn_mask_type=AttnMaskType.CAUSAL_MASK`` is ``attn_mask_type="causal"``). Members without
a counterpart in our attention carry NVIDIA's lower-case name as their value, and the calls
reject them as they reject any unknown string:

* the packed layouts ``BS3HD``, ``BSHD_BS2HD``, ``T3HD`` and ``THD_T2HD`` (q, k, v or k, v in
  one array): ``fused_attn`` takes q, k and v as separate arrays. The flax
  ``DotProductAttention`` accepts them (and NVIDIA's lower-case names) and takes the packed
  array apart before calling it.

``AttnSoftmaxType``'s values are the modules' ``softmax_type`` strings; ``fused_attn`` takes
the vanilla softmax only (the modules run a sink in jnp).

``AttnBiasType``'s values are the ``attn_bias_type`` strings of ``DotProductAttention``,
``MultiHeadAttention`` and ``TransformerLayer``; ``fused_attn`` takes no bias (the modules
run a biased attention in jnp).
"""

from __future__ import annotations

import enum

from transformer_engine.jax.sequence_descriptor import SequenceDescriptor

__all__ = ["AttnMaskType", "AttnBiasType", "AttnSoftmaxType", "QKVFormat", "QKVLayout",
           "SequenceDescriptor", "softmax_type_of"]


class AttnMaskType(str, enum.Enum):
    """The attention mask; values are our ``attn_mask_type`` strings."""

    NO_MASK = "no_mask"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"
    CAUSAL_BOTTOM_RIGHT_MASK = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = "padding_causal_bottom_right"

    def is_causal(self) -> bool:
        return "causal" in self.value

    def is_padding(self) -> bool:
        return self.value.startswith("padding")

    def is_bottom_right(self) -> bool:
        return self.value.endswith("bottom_right")


class AttnBiasType(str, enum.Enum):
    """Where a bias enters the attention scores; values are ``MultiHeadAttention``'s
    ``attn_bias_type`` strings."""

    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"


class AttnSoftmaxType(str, enum.Enum):
    """The attention softmax; values are the ``softmax_type`` strings of the flax
    ``DotProductAttention``, ``MultiHeadAttention`` and ``TransformerLayer``. With a sink
    (attention sinks), each row's denominator has one more term with no value: ``exp(0)``
    (off-by-one) or ``exp(s_h)``, one learned logit per query head (learnable)."""

    VANILLA_SOFTMAX = "vanilla"
    OFF_BY_ONE_SOFTMAX = "off-by-one"
    LEARNABLE_SOFTMAX = "learnable"


def softmax_type_of(op: str, value) -> str:
    """The ``softmax_type`` string of a string or :class:`AttnSoftmaxType` member (NVIDIA's
    ``"off_by_one"`` spelling too); ValueError naming ``op`` otherwise."""
    value = getattr(value, "value", value)
    value = {"off_by_one": "off-by-one"}.get(value, value)
    names = tuple(t.value for t in AttnSoftmaxType)
    if value not in names:
        raise ValueError(f"{op}: softmax_type must be one of {names} or an AttnSoftmaxType "
                         f"member, got {value!r}")
    return value


class QKVFormat(str, enum.Enum):
    """The layout of one of q, k, v; values are our ``qkv_layout`` strings."""

    BSHD = "bshd"
    SBHD = "sbhd"
    THD = "thd"


class QKVLayout(str, enum.Enum):
    """How q, k and v are laid out and packed. The separate layouts are our ``qkv_layout``
    strings; the packed ones keep NVIDIA's names (not accepted by our attention)."""

    BS3HD = "bs3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    BSHD_BSHD_BSHD = "bshd"
    T3HD = "t3hd"
    THD_T2HD = "thd_t2hd"
    THD_THD_THD = "thd"

    def get_qkv_format(self) -> QKVFormat:
        return QKVFormat.THD if self.is_thd() else QKVFormat.BSHD

    def is_qkvpacked(self) -> bool:
        return self in (QKVLayout.BS3HD, QKVLayout.T3HD)

    def is_kvpacked(self) -> bool:
        return self in (QKVLayout.BSHD_BS2HD, QKVLayout.THD_T2HD)

    def is_separate(self) -> bool:
        return self in (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD)

    def is_thd(self) -> bool:
        return self in (QKVLayout.T3HD, QKVLayout.THD_T2HD, QKVLayout.THD_THD_THD)
