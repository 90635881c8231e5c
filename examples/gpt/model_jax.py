"""The GPT in JAX/Flax: a stack of transformer_engine.jax.flax.TransformerLayer, and its runner.

    bytes -> nn.Embed -> [TransformerLayer (causal, RoPE)] x layers -> LayerNorm -> DenseGeneral

Under ``fp8_autocast`` every GEMM of the layers runs in FP8; the output head stays in high
precision, as is usual in FP8 training (its gradient, that of a mean over every token's
logits, is the smallest, and its errors reach the loss directly). With
delayed scaling the FP8 state is the ``fp8_metas`` collection: ``jax.value_and_grad`` over
``(params, fp8_metas)`` returns, as the gradient of ``fp8_metas``, the state of the next step,
which ``update_collections`` puts in place (as jax/examples/train_mlp_fp8.py does).
"""

from __future__ import annotations

import functools
import resource
import sys
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common import recipe

from .data import VOCAB
from .loop import CLIP_NORM

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID,
                                             amax_history_len=16, amax_compute_algo="max"),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
_NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
# te.TransformerLayer's default initialization (PyTorch), used for the Flax layers too.
_INIT_STD = 0.023
# TE's activations by the PyTorch names; a pair is a gated unit (act(x W1) * (x W2)).
_ACTIVATIONS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}


def _normal(std: float):
    """N(0, std^2) drawn in float32 and rounded to the parameter's dtype, as torch's
    ``normal_`` draws for a bf16 tensor (flax's ``initializers.normal`` drawn in bf16 takes
    only 128 distinct values). The TE modules draw their kernels this way themselves."""
    def init(key, shape, dtype=jnp.float32):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return init


def default_device() -> str:
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def versions() -> dict:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "transformer_engine": te.__version__}


def device_name(device: str) -> str:
    chip = jax.devices("cpu" if device == "cpu" else None)[0]
    return f"{chip.device_kind} ({chip.platform})"


class GPT(nn.Module):
    """A byte-level decoder-only Transformer (``size`` as in train_gpt.SIZES)."""

    size: Any
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, decode: bool = False) -> jax.Array:
        size = self.size
        x = nn.Embed(VOCAB, size.hidden, embedding_init=_normal(0.02),
                     dtype=self.dtype, param_dtype=self.dtype, name="embed")(tokens)
        for i in range(size.layers):
            x = te_flax.TransformerLayer(
                hidden_size=size.hidden, mlp_hidden_size=size.ffn,
                num_attention_heads=size.heads, layernorm_type=_NORMS[size.normalization],
                mlp_activations=_ACTIVATIONS[size.activation], hidden_dropout=0.0,
                attention_dropout=0.0, intermediate_dropout=0.0, self_attn_mask_type="causal",
                enable_relative_embedding=False, enable_rotary_pos_emb=True,
                transpose_batch_sequence=False, dtype=self.dtype,
                # The PyTorch model's attention and initialization (te.TransformerLayer's
                # defaults), not Flax's: logits scaled by 1/sqrt(head_dim), kernels
                # N(0, 0.023^2). Flax's defaults (unscaled logits with a scaled query init,
                # fan-in kernels) train this model to a clearly higher loss.
                scale_attn_logits=True, scaled_query_init=False,
                mha_kernel_init=nn.initializers.normal(_INIT_STD),
                mlp_kernel_init=nn.initializers.normal(_INIT_STD),
                name=f"layer_{i}")(x, deterministic=True, decode=decode)
        # fp32 norm parameters (the module's default dtype); it computes in x's dtype.
        x = te_flax.LayerNorm(layernorm_type=_NORMS[size.normalization], name="norm")(x)
        # Small output weights: the first logits are near zero, the loss near ln(256). The
        # head runs in high precision.
        with te.fp8_autocast(enabled=False):
            return te_flax.DenseGeneral(VOCAB, use_bias=False,
                                        kernel_init=nn.initializers.normal(0.02),
                                        dtype=self.dtype, name="head")(x)


def build(size, device: str, seed: int) -> dict:
    """The initial variables (from ``seed``), made inside an FP8 autocast of the delayed
    recipe so that they hold the ``fp8_metas`` collection too; each run takes what it needs."""
    if device == "cuda" and jax.default_backend() != "gpu":
        raise RuntimeError(f"train_gpt: --device cuda needs jax with a GPU backend, got "
                           f"{jax.default_backend()!r}")
    if device == "cpu":  # jax would otherwise place everything on its default (a GPU)
        jax.config.update("jax_default_device", jax.devices("cpu")[0])
    dtype = jnp.bfloat16 if device == "cuda" else jnp.float32
    model = GPT(size, dtype)
    tokens = jnp.zeros((1, size.seq), jnp.int32)
    with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
        variables = model.init(jax.random.PRNGKey(seed), tokens)
    return {"model": model, "variables": variables}


def check_fp8() -> tuple[bool, str]:
    return True, f"FP8 through the core's XLA custom calls on {jax.default_backend()}"


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class Runner:
    """The model trained with optax AdamW, in FP8 under ``fp8_recipe`` or in high precision."""

    def __init__(self, built: dict, fp8_recipe, device: str, weight_decay: float = 0.1):
        self.model, self.recipe = built["model"], fp8_recipe
        others, params = flax.core.pop(built["variables"], "params")
        # FP8 state only where the recipe keeps one (delayed scaling); high precision has none.
        keep = fp8_recipe is not None and fp8_recipe.delayed()
        self.others = {k: v for k, v in others.items() if keep and k == te.FP8_COLLECTION}
        # Copies: the step donates its inputs, and the other run starts from the same arrays.
        self.params = jax.tree_util.tree_map(jnp.copy, params)
        self.others = jax.tree_util.tree_map(jnp.copy, self.others)
        decay = jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
        self.tx = optax.chain(
            optax.clip_by_global_norm(CLIP_NORM),
            optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.95,
                                                  weight_decay=weight_decay, mask=decay))
        self.opt_state = self.tx.init(params)
        self._step = jax.jit(self._train_step, donate_argnums=(0, 1, 2))
        self._eval = jax.jit(self._eval_loss)

    def _autocast(self):
        return te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe)

    def _loss(self, params, others, batch):
        logits = self.model.apply({"params": params, **others}, batch[:, :-1])
        return _cross_entropy(logits, batch[:, 1:])

    def _train_step(self, params, others, opt_state, batch, lr):
        with self._autocast():
            loss, (grads, other_grads) = jax.value_and_grad(self._loss, argnums=(0, 1))(
                params, others, batch)
        opt_state[1].hyperparams["learning_rate"] = lr
        norm = optax.global_norm(grads)  # what clip_by_global_norm compares with CLIP_NORM
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        others = te.update_collections(other_grads, others) if others else others
        return jnp.stack([loss, norm]).astype(jnp.float32), params, others, opt_state

    def _eval_loss(self, params, others, batch):
        with self._autocast():
            return self._loss(params, others, batch)

    def step(self, batch: np.ndarray, lr: float):
        loss, self.params, self.others, self.opt_state = self._step(
            self.params, self.others, self.opt_state, jnp.asarray(batch), jnp.float32(lr))
        return loss

    def read(self, handles: list) -> np.ndarray:
        return np.asarray(jax.device_get(handles), np.float64).reshape(-1, 2)

    def sync(self) -> None:
        jax.block_until_ready(self.params)

    def evaluate(self, batches: list) -> float:
        return float(np.mean([float(self._eval(self.params, self.others, jnp.asarray(b)))
                              for b in batches]))

    def peak_memory(self) -> tuple[int | None, str]:
        chip = jax.config.jax_default_device or jax.devices()[0]
        stats = chip.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            # No reset in jax: the second run's figure covers the first run too.
            return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use, whole process"
        scale = 1 if sys.platform == "darwin" else 1024
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
                "process peak RSS so far (CPU)")

    def sample(self, prompts: np.ndarray, new_tokens: int, temperature: float,
               seed: int) -> np.ndarray:
        """Decodes with ``decode=True``: the prompts go through the layers once, then one
        token at a time; each call appends its keys and values to the 'cache' collection and
        attends to all of it."""
        batch, length = prompts.shape
        total = length + new_tokens
        with self._autocast():
            shapes = jax.eval_shape(functools.partial(self.model.init, decode=True),
                                    jax.random.PRNGKey(0), jnp.zeros((batch, total), jnp.int32))
        cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
        step = jax.jit(self._decode_step)
        key = jax.random.PRNGKey(seed)
        logits, cache = step(self.params, self.others, cache, jnp.asarray(prompts))
        out = []
        for i in range(new_tokens):
            key, sub = jax.random.split(key)
            token = _pick(logits[:, -1].astype(jnp.float32), temperature, sub)
            out.append(np.asarray(token))
            if i + 1 < new_tokens:
                logits, cache = step(self.params, self.others, cache, token)
        return np.concatenate(out, axis=1)

    def _decode_step(self, params, others, cache, token):
        with self._autocast():
            logits, mutated = self.model.apply({"params": params, **others, "cache": cache},
                                               token, decode=True, mutable=["cache"])
        return logits, mutated["cache"]


def _pick(logits: jax.Array, temperature: float, key) -> jax.Array:
    """The next token of each row [b, VOCAB] -> [b, 1]: greedy at temperature 0."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)[:, None]
    return jax.random.categorical(key, logits / temperature, axis=-1)[:, None]
