"""A mixture-of-experts router (NVIDIA's path ``transformer_engine.jax.router``): each token's
top-k experts by a score function, with their probabilities, and the load-balancing loss.

* :func:`fused_topk_with_score_function`: ``score_function(logits)`` (softmax, sigmoid or
  sqrt(softplus)), the top k (optionally within the best groups of experts, optionally steered
  by an expert bias), the chosen probabilities normalised and scaled; or, with
  ``compute_aux_scores``, the dense scores of the load-balancing loss.
* :func:`fused_moe_aux_loss`: that loss from the scores and the tokens per expert.

jnp under jit, differentiated by jax, in float32 whatever the logits' dtype (the PyTorch
package's ``transformer_engine.pytorch.router`` computes the same). sqrt(softplus(x)) has its
derivative written out: the chain rule through the square root gives NaN where softplus
underflows to 0.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import jax
import jax.numpy as jnp

__all__ = ["ScoreFunction", "RoutingMapFormat", "fused_topk_with_score_function",
           "fused_moe_aux_loss"]

# Added to the sum that normalises sigmoid / sqrtsoftplus scores (a row of zeros gives zeros,
# not NaN) and to 2 * sqrtsoftplus(x) in its derivative.
_EPS = 1e-20


class ScoreFunction(enum.IntEnum):
    """How logits become scores."""

    SOFTMAX = 0
    SIGMOID = 1
    SQRTSOFTPLUS = 2


class RoutingMapFormat(enum.IntEnum):
    """Layout of the routing map: ``BYTEMAP`` bool ``[tokens, experts]``; ``BITMAP_U8`` uint8
    ``[tokens, ceil(experts / 8)]``, bit ``e % 8`` of byte ``e // 8`` set when the token goes to
    expert ``e`` (least significant bit first)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


def _enum(op: str, name: str, kind, value):
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool) and value in set(kind):
        return kind(value)
    raise ValueError(f"{op}: {name} must be one of "
                     f"{[m.lower() for m in kind.__members__]}, a {kind.__name__} or its int, "
                     f"got {value!r}")


@jax.custom_jvp
def _sqrtsoftplus(x):
    return jnp.sqrt(jax.nn.softplus(x))


@_sqrtsoftplus.defjvp
def _sqrtsoftplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    a = _sqrtsoftplus(x)
    return a, dx * jax.nn.sigmoid(x) / (2.0 * a + _EPS)


def _scores(x, score_function: ScoreFunction):
    """The per-expert scores of sigmoid or sqrtsoftplus (softmax is taken where it applies)."""
    return jax.nn.sigmoid(x) if score_function == ScoreFunction.SIGMOID else _sqrtsoftplus(x)


def _normalised(a):
    return a / (jnp.sum(a, axis=-1, keepdims=True) + _EPS)


def _top(scores, topk: int, num_groups: int, group_topk: int):
    """Indices [tokens, topk] of the highest scores, highest first; with groups, only among
    the group_topk groups (of consecutive experts) whose topk / group_topk highest scores add
    up to the most."""
    if group_topk > 0:
        tokens, experts = scores.shape
        size = experts // num_groups
        grouped = scores.reshape(tokens, num_groups, size)
        group_scores = jnp.sum(jax.lax.top_k(grouped, topk // group_topk)[0], axis=-1)
        chosen = jax.lax.top_k(group_scores, group_topk)[1]
        keep = jnp.zeros((tokens, num_groups), bool).at[
            jnp.arange(tokens)[:, None], chosen].set(True)
        scores = jnp.where(jnp.repeat(keep, size, axis=1), scores, -jnp.inf)
    return jax.lax.top_k(scores, topk)[1]


def _routing_map(index, experts: int, fmt: RoutingMapFormat):
    tokens = index.shape[0]
    rows = jnp.arange(tokens)[:, None]
    chosen = jnp.zeros((tokens, experts), bool).at[rows, index].set(True)
    if fmt == RoutingMapFormat.BYTEMAP:
        return chosen
    padded = jnp.pad(chosen, ((0, 0), (0, -experts % 8))).reshape(tokens, -1, 8)
    weights = jnp.left_shift(jnp.uint8(1), jnp.arange(8, dtype=jnp.uint8))
    return jnp.sum(padded.astype(jnp.uint8) * weights, axis=-1, dtype=jnp.uint8)


def _check(op: str, logits, topk, num_groups, group_topk, scaling_factor) -> None:
    if not jnp.issubdtype(jnp.result_type(logits), jnp.floating) or jnp.ndim(logits) < 1 \
            or jnp.shape(logits)[-1] == 0:
        raise ValueError(f"{op}: logits must be a floating-point [tokens, experts] array, got "
                         f"{jnp.result_type(logits)} of shape {tuple(jnp.shape(logits))}")
    experts = jnp.shape(logits)[-1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"{op}: topk must be an int in [1, experts={experts}], got {topk!r}")
    if group_topk > 0 and not (num_groups > 0 and experts % num_groups == 0
                               and group_topk <= num_groups and topk % group_topk == 0
                               and topk // group_topk <= experts // num_groups):
        raise ValueError(f"{op}: num_groups must divide experts={experts}, group_topk divide "
                         f"topk={topk} and be at most num_groups, topk / group_topk at most "
                         f"experts / num_groups; got num_groups={num_groups}, "
                         f"group_topk={group_topk}")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
        raise TypeError(f"{op}: scaling_factor must be a Python float (it is a constant of "
                        f"the trace), got {type(scaling_factor).__name__}")


def fused_topk_with_score_function(
    logits: jax.Array,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: Union[str, ScoreFunction] = ScoreFunction.SOFTMAX,
    expert_bias: Optional[jax.Array] = None,
    compute_aux_scores: bool = False,
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts: ``(probs, routing_map)``.

    ``logits`` [tokens, experts] (or [..., experts]). ``score_function`` ``"softmax"``: with
    ``use_pre_softmax`` the softmax over all experts, then its top k; else the top k logits,
    then the softmax of those k. ``"sigmoid"`` / ``"sqrtsoftplus"``: the scores, their top k
    (chosen on the scores plus ``expert_bias`` [experts], which does not enter the
    probabilities and gets no gradient), divided by their sum when ``topk > 1``. With
    ``group_topk`` > 0 the experts form ``num_groups`` groups of consecutive experts, a
    group's score is the sum of its ``topk / group_topk`` best, and the top k come from the
    ``group_topk`` best groups. ``scaling_factor`` multiplies the probabilities.

    ``probs`` has the logits' shape and dtype, zero for the experts not chosen. With
    ``compute_aux_scores`` the load-balancing loss's scores instead: the softmax over all
    experts, or the sigmoid / sqrtsoftplus scores divided by their sum, dense, float32, with
    the routing map of their top k (bias, groups and scaling do not apply there).
    ``routing_map_format``: ``"bytemap"`` (bool [tokens, experts]) or ``"bitmap_u8"``."""
    op = "fused_topk_with_score_function"
    _check(op, logits, topk, num_groups, group_topk, scaling_factor)
    score_function = _enum(op, "score_function", ScoreFunction, score_function)
    fmt = _enum(op, "routing_map_format", RoutingMapFormat, routing_map_format)
    experts = jnp.shape(logits)[-1]
    x = jnp.reshape(logits, (-1, experts)).astype(jnp.float32)
    lead = jnp.shape(logits)[:-1]
    if compute_aux_scores:
        if score_function == ScoreFunction.SOFTMAX:
            scores = jax.nn.softmax(x, axis=-1)
        else:
            scores = _normalised(_scores(x, score_function))
        index = jax.lax.top_k(scores, topk)[1]
        routing_map = _routing_map(index, experts, fmt)
        return (scores.reshape(*lead, experts),
                routing_map.reshape(*lead, routing_map.shape[-1]))
    if expert_bias is not None:
        if score_function == ScoreFunction.SOFTMAX:
            raise ValueError(f"{op}: expert_bias must be None with score_function 'softmax' "
                             "(it is for 'sigmoid' and 'sqrtsoftplus'), got an array")
        if tuple(jnp.shape(expert_bias)) != (experts,):
            raise ValueError(f"{op}: expert_bias must be [experts={experts}], got shape "
                             f"{tuple(jnp.shape(expert_bias))}")
    if score_function == ScoreFunction.SOFTMAX and use_pre_softmax:
        scores = jax.nn.softmax(x, axis=-1)
        index = _top(jax.lax.stop_gradient(scores), topk, num_groups, group_topk)
        chosen = jnp.take_along_axis(scores, index, axis=1)
    elif score_function == ScoreFunction.SOFTMAX:
        index = _top(jax.lax.stop_gradient(x), topk, num_groups, group_topk)
        chosen = jax.nn.softmax(jnp.take_along_axis(x, index, axis=1), axis=-1)
    else:
        scores = _scores(x, score_function)
        biased = jax.lax.stop_gradient(scores)
        if expert_bias is not None:
            biased = biased + jax.lax.stop_gradient(expert_bias).astype(jnp.float32)
        index = _top(biased, topk, num_groups, group_topk)
        chosen = jnp.take_along_axis(scores, index, axis=1)
        if topk > 1:
            chosen = _normalised(chosen)
    chosen = (chosen * float(scaling_factor)).astype(logits.dtype)
    rows = jnp.arange(x.shape[0])[:, None]
    probs = jnp.zeros(x.shape, logits.dtype).at[rows, index].set(chosen)
    routing_map = _routing_map(index, experts, fmt)
    return probs.reshape(*lead, experts), routing_map.reshape(*lead, routing_map.shape[-1])


def fused_moe_aux_loss(probs: jax.Array, tokens_per_expert: jax.Array, topk: int,
                       coeff: float) -> jax.Array:
    """The switch load-balancing loss ``experts * coeff / (topk * tokens**2) *
    sum_e(sum_t probs[t, e] * tokens_per_expert[e])`` with ``tokens, experts =
    probs.shape``: a 0-d array in the probabilities' dtype (float32 sums), differentiable in
    ``probs``."""
    op = "fused_moe_aux_loss"
    if jnp.ndim(probs) != 2 or not jnp.issubdtype(jnp.result_type(probs), jnp.floating):
        raise ValueError(f"{op}: probs must be a floating-point [tokens, experts] array, got "
                         f"{jnp.result_type(probs)} of shape {tuple(jnp.shape(probs))}")
    tokens, experts = jnp.shape(probs)
    if tuple(jnp.shape(tokens_per_expert)) != (experts,):
        raise ValueError(f"{op}: tokens_per_expert must be [experts={experts}], got shape "
                         f"{tuple(jnp.shape(tokens_per_expert))}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"{op}: topk must be a positive int, got {topk!r}")
    constant = experts * float(coeff) / topk / tokens / tokens
    per_expert = jnp.sum(probs.astype(jnp.float32), axis=0)
    loss = jnp.sum(per_expert * jnp.asarray(tokens_per_expert, jnp.float32)) * constant
    return loss.astype(probs.dtype)
