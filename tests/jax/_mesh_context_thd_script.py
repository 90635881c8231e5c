"""Context parallelism of packed (thd) sequences over a 4-device CPU mesh against the unsplit
thd attention of the same sequences back to back: outputs and dq, dk, dv, and the compiled
step's collectives. Prints one JSON object on the last line of stdout.

Run by ``test_context_parallel_thd.py`` in a process of its own (the host platform's device
count must be set before jax is imported). ``python _mesh_context_thd_script.py [case ...]``
runs the named cases (default: all).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _mesh_compare import collectives  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import transformer_engine.jax as te  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    fused_attn,
    inverse_reorder_thd_load_balancing,
    reorder_thd_load_balancing,
)
from transformer_engine.jax.sharding import MeshResource  # noqa: E402

# Sequences of 0 and 13 tokens padded 2 * cp rows more than needed (so row 0 is padding: the
# rows that index nothing point there), one shorter than a chunk, one that fills its padding;
# and spare rows after the last.
LENGTHS = (0, 13, 5, 24)
HEADS, DIM = 4, 8

# mask-cp-kv heads[-tp2][-ring]: tp2 splits the heads over a second axis beside cp;
# ring asks for the ring strategy (thd gathers instead, with a warning)
CASES = ["padding_causal-cp4-2", "padding-cp4-4", "padding_causal-cp2-4", "padding-cp2-1",
         "padding_causal-cp2-2-tp2", "causal-cp4-1-ring"]


def padded_lengths(cp: int) -> list[int]:
    return [-(-n // (2 * cp)) * 2 * cp + (2 * cp if i < 2 else 0)
            for i, n in enumerate(LENGTHS)]


def cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def token_rows(cp: int) -> np.ndarray:
    """The padded packing's row of each token of the back-to-back packing."""
    starts = cumulative(padded_lengths(cp))
    return np.concatenate([starts[i] + np.arange(n) for i, n in enumerate(LENGTHS)])


def attention_case(name: str) -> dict:
    mask, cp, groups, *rest = name.split("-")
    cp, groups = int(cp[2:]), int(groups)
    tp = 2 if "tp2" in rest else 1
    rows = sum(padded_lengths(cp)) + 2 * cp  # room for more tokens
    cu, cu_padded = cumulative(LENGTHS), cumulative(padded_lengths(cp))
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    tokens = sum(LENGTHS)
    q = jax.random.normal(keys[0], (tokens, HEADS, DIM), jnp.float32)
    k, v = (jax.random.normal(key, (tokens, groups, DIM), jnp.float32) for key in keys[1:3])
    w = jax.random.normal(keys[3], (tokens, HEADS, DIM), jnp.float32)  # the loss's weights

    offsets = dict(cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)

    def loss(q, k, v, w, split):
        o = fused_attn(q, k, v, qkv_layout="thd", attn_mask_type=mask, cu_seqlens_q=cu,
                       cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS),
                       context_parallel_strategy="ring" if "ring" in rest else "default",
                       **(offsets if split else {}))
        return jnp.sum(o * w), o

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    # the reference: the sequences back to back on one device, no padding
    (r_dq, r_dk, r_dv), r_o = jax.jit(grad, static_argnums=4)(q, k, v, w, False)

    at = token_rows(cp)

    def padded(t):  # the tokens at their rows of the padded packing, NaN in the padding rows
        out = jnp.full((rows, *t.shape[1:]), jnp.nan, t.dtype).at[at].set(t)
        return reorder_thd_load_balancing(out, cu_padded, cp)

    axes = ("cp", "tp") if tp > 1 else ("cp",)
    mesh = jax.make_mesh((cp, tp) if tp > 1 else (cp,), axes,
                         axis_types=(AxisType.Auto,) * len(axes))
    resource = MeshResource(cp_resource="cp", tp_resource="tp" if tp > 1 else None)
    with te.autocast(mesh_resource=resource), jax.set_mesh(mesh), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = NamedSharding(mesh, PartitionSpec("cp", "tp" if tp > 1 else None))
        args = [jax.device_put(padded(t), split) for t in (q, k, v)]
        # the loss weights are 0 on the padding rows (their NaNs would reach the sum)
        args.append(jax.device_put(jnp.nan_to_num(padded(w)), split))
        step = jax.jit(grad, static_argnums=4, out_shardings=((split,) * 3, split))
        compiled = step.lower(*args, True).compile()
        (dq, dk, dv), o = compiled(*args)
        hlo = compiled.as_text()
    out = {}
    for label, want, got in (("o", r_o, o), ("dq", r_dq, dq), ("dk", r_dk, dk),
                             ("dv", r_dv, dv)):
        got = np.asarray(inverse_reorder_thd_load_balancing(got, cu_padded, cp))
        want = np.asarray(want)
        pad = np.ones(rows, bool)
        pad[at] = False
        out[label] = {"equal": bool(np.array_equal(want, got[at])),
                      "max_abs_diff": float(np.max(np.abs(want - got[at]))),
                      "ref_max_abs": float(np.max(np.abs(want))),
                      "padding_zero": bool(np.all(got[pad] == 0))}
    return {"arrays": out, "collectives": collectives(hlo), "rows": rows, "cp": cp, "tp": tp,
            "groups": groups, "warnings": [str(x.message) for x in caught]}


def refused() -> dict:
    """The errors of bad thd calls under context parallelism (cp = 2), and the warning of the
    ring strategy."""
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(AxisType.Auto,))
    x = jnp.ones((16, 2, 4))
    cu = jnp.array([0, 5, 11], jnp.int32)
    good = jnp.array([0, 8, 16], jnp.int32)
    base = dict(qkv_layout="thd", attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                max_seqlen_q=6, max_seqlen_kv=6)
    calls = {
        "not_multiple": dict(cu_seqlens_q_padded=jnp.array([0, 6, 12], jnp.int32),
                             cu_seqlens_kv_padded=good),
        "missing_q": dict(cu_seqlens_kv_padded=good),
        "missing_kv": dict(cu_seqlens_q_padded=good),
        "bottom_right": dict(cu_seqlens_q_padded=good, cu_seqlens_kv_padded=good,
                             attn_mask_type="padding_causal_bottom_right"),
        "window": dict(cu_seqlens_q_padded=good, cu_seqlens_kv_padded=good,
                       window_size=(2, 0)),
    }
    errors = {}
    with te.autocast(mesh_resource=MeshResource(cp_resource="cp")), jax.set_mesh(mesh):
        for name, kw in calls.items():
            try:
                fused_attn(x, x, x, **{**base, **kw})
                errors[name] = None
            except (NotImplementedError, ValueError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
    return errors


def heads_split() -> dict:
    """Plain thd attention (no context parallelism) with the heads split over tp = 4, against
    one device: whether outputs and gradients are equal (or the error)."""
    cu = jnp.asarray(cumulative(LENGTHS))
    x = jax.random.normal(jax.random.PRNGKey(5), (sum(LENGTHS), HEADS, DIM), jnp.float32)

    def loss(q):
        o = fused_attn(q, q, q, qkv_layout="thd", attn_mask_type="padding_causal",
                       cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=24, max_seqlen_kv=24)
        return jnp.sum(o * o), o

    want = jax.jit(jax.grad(loss, has_aux=True))(x)
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,))
    with te.autocast(mesh_resource=MeshResource(tp_resource="tp")), jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "tp")))
        try:
            got = jax.jit(jax.grad(loss, has_aux=True))(xs)
        except Exception as e:  # noqa: BLE001 (the test shows what went wrong)
            return {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
    return {name: bool(np.array_equal(np.asarray(a), np.asarray(b)))
            for name, a, b in zip(("dq", "o"), want, got, strict=True)}


CHECKS = {"refused": refused, "heads_split": heads_split}


def main(names) -> None:
    names = names or [*CASES, *CHECKS]
    results = {}
    for name in names:
        results[name] = CHECKS[name]() if name in CHECKS else attention_case(name)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
