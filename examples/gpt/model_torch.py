"""The GPT in PyTorch: a stack of te.TransformerLayer with rotary embeddings, and its runner.

    bytes -> embedding -> [TransformerLayer (causal, RoPE)] x layers -> norm -> te.Linear -> logits

Under ``te.fp8_autocast`` every GEMM of the layers runs in FP8; the output head (the layer
whose gradient, that of a mean over every token's logits, is the smallest and whose errors
reach the loss directly), the embedding lookup, softmax-cross-entropy and optimizer stay in
high precision, as is usual in FP8 training.
"""

from __future__ import annotations

import copy
import resource
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

from .data import VOCAB
from .loop import CLIP_NORM

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID,
                                             amax_history_len=16, amax_compute_algo="max"),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
_NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def versions() -> dict:
    return {"torch": torch.__version__, "transformer_engine": te.__version__}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({torch.get_num_threads()} threads)"


class GPT(torch.nn.Module):
    """A byte-level decoder-only Transformer (``size`` as in train_gpt.SIZES)."""

    def __init__(self, size, device, dtype):
        super().__init__()
        head_dim = size.hidden // size.heads
        self.embed = torch.nn.Embedding(VOCAB, size.hidden, device=device, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.rope = te.RotaryPositionEmbedding(head_dim).to(device)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(size.hidden, size.ffn, size.heads, layer_number=i + 1,
                                self_attn_mask_type="causal", attn_input_format="bshd",
                                hidden_dropout=0.0, attention_dropout=0.0,
                                normalization=size.normalization, activation=size.activation,
                                params_dtype=dtype, device=device)
            for i in range(size.layers))
        self.norm = _NORMS[size.normalization](size.hidden, params_dtype=dtype, device=device)
        # Small output weights: the first logits are near zero, the loss near ln(256).
        self.head = te.Linear(size.hidden, VOCAB, bias=False, params_dtype=dtype, device=device,
                              init_method=lambda w: torch.nn.init.normal_(w, std=0.02))

    def forward(self, tokens: torch.Tensor, inference_params=None,
                max_positions: int | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, VOCAB]. With ``inference_params`` the layers read
        and extend its KV cache; the rotary angles then cover ``max_positions`` positions and
        the layers pick the rows of the tokens' positions."""
        x = self.embed(tokens)
        freqs = self.rope(max_positions or tokens.shape[1])
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs, inference_params=inference_params)
        with te.fp8_autocast(enabled=False):  # the output head in high precision
            return self.head(self.norm(x))


def build(size, device: str, seed: int) -> GPT:
    """The initial model (weights from ``seed``); each run trains its own copy."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return GPT(size, torch.device(device), dtype)


def check_fp8() -> tuple[bool, str]:
    return te.is_fp8_available(return_reason=True)


class Runner:
    """``model`` trained with AdamW, in FP8 under ``fp8_recipe`` or in high precision (None)."""

    def __init__(self, model: GPT, fp8_recipe, device: str, weight_decay: float = 0.1):
        self.recipe, self.device = fp8_recipe, torch.device(device)
        # What is allocated before this run (the initial weights both runs copy) is not its own.
        self.baseline = 0
        if self.device.type == "cuda":
            self.baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model = copy.deepcopy(model)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        other = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": other, "weight_decay": 0.0}],
                                     betas=(0.9, 0.95), eps=1e-8,
                                     fused=self.device.type == "cuda")

    def _autocast(self):
        return te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def _tensor(self, batch: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(batch).long().to(self.device, non_blocking=True)

    def step(self, batch: np.ndarray, lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss = self._loss(self._tensor(batch))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack([loss.detach(), norm.to(loss.dtype)])

    def read(self, handles: list) -> np.ndarray:
        return torch.stack(handles).cpu().numpy()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        return float(np.mean([self._loss(self._tensor(b)).item() for b in batches]))

    def peak_memory(self) -> tuple[int | None, str]:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self.baseline,
                    "torch.cuda.max_memory_allocated less the initial weights")
        # ru_maxrss is KiB on Linux, bytes on macOS; and it is the whole process's peak so far.
        scale = 1 if sys.platform == "darwin" else 1024
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
                "process peak RSS so far (CPU)")

    @torch.no_grad()
    def sample(self, prompts: np.ndarray, new_tokens: int, temperature: float,
               seed: int) -> np.ndarray:
        """The prompts go through the layers once, then one token at a time, each step
        attending to the keys and values cached in ``te.InferenceParams``."""
        self.model.eval()
        batch, length = prompts.shape
        total = length + new_tokens
        cache = te.InferenceParams(batch, total)
        # Sampling draws on the CPU from its own generator: the same text on every device.
        generator = torch.Generator().manual_seed(seed)
        step_input, out = self._tensor(prompts), []
        for _ in range(new_tokens):
            cache.pre_step(OrderedDict((b, step_input.shape[1]) for b in range(batch)))
            with self._autocast():
                logits = self.model(step_input, inference_params=cache, max_positions=total)
            step_input = _pick(logits[:, -1].float().cpu(), temperature, generator)
            out.append(step_input)
            step_input = step_input.to(self.device)
        self.model.train()
        return torch.cat(out, dim=1).numpy()


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """The next token of each row [b, VOCAB] -> [b, 1]: greedy at temperature 0."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
