"""Autoregressive decoding with te.TransformerLayer: the KV cache (te.InferenceParams) beside a
full recompute of the growing sequence at each new token, in bf16 and under fp8_autocast.

A small decoder: an embedding (vocabulary 32000, tied to the output head), 4 layers of
te.TransformerLayer (hidden 2048, 16 heads, ffn 8192, causal, bshd, RoPE through
te.RotaryPositionEmbedding, no dropout), a final LayerNorm; batch 8, a 128-token prompt,
128 new tokens chosen greedily. With the cache, the prompt runs once and each new token runs
alone against the cached keys and values; without it, every new token reruns the whole
sequence so far. Only the last position goes through the head in both. Decoding is
host-bound, so a generation is timed by wall clock between two synchronizations (the
harness's time_host), the contenders interleaved in rounds; tokens/s count the new tokens
of the whole batch (the prompt's pass is inside the time). As a sanity number, not an
assertion, the recompute replays the cached run's tokens and the last logits of the two are
compared.

    python benchmarks/bench_decode.py          # GPU: writes benchmarks/results/decode.json
    python benchmarks/bench_decode.py --smoke  # tiny CPU run of every path; writes nothing
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import OrderedDict

import torch

# vocab, hidden, heads, layers, batch, prompt, new tokens
CONFIG = dict(vocab=32000, hidden=2048, heads=16, layers=4, batch=8, prompt=128, new=128)
SMOKE_CONFIG = dict(vocab=64, hidden=64, heads=4, layers=2, batch=2, prompt=8, new=4)


class Decoder(torch.nn.Module):
    """Embedding, a stack of te.TransformerLayer with RoPE, final LayerNorm, tied head."""

    def __init__(self, cfg: dict, device, dtype):
        import transformer_engine.pytorch as te

        super().__init__()
        hidden, heads = cfg["hidden"], cfg["heads"]
        self.embed = torch.nn.Embedding(cfg["vocab"], hidden, device=device, dtype=dtype)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, heads, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                attn_input_format="bshd", layer_number=i + 1,
                                params_dtype=dtype, device=device)
            for i in range(cfg["layers"]))
        self.norm = te.LayerNorm(hidden, params_dtype=dtype, device=device)
        max_len = cfg["prompt"] + cfg["new"]
        self.register_buffer("freqs", te.RotaryPositionEmbedding(hidden // heads)(max_len)
                             .to(device), persistent=False)

    def forward(self, tokens, inference_params=None):
        """tokens [b, s] -> logits of the last position [b, vocab]."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, inference_params=inference_params, rotary_pos_emb=self.freqs)
        return self.norm(x[:, -1]) @ self.embed.weight.t()


@torch.no_grad()
def generate(model: Decoder, prompt, new: int, cached: bool, fp8_recipe=None, forced=None):
    """Greedy decoding of ``new`` tokens after ``prompt`` [b, s0] (or, with ``forced``
    [b, new], those tokens instead of the greedy ones): returns the tokens and the logits
    that chose the last one."""
    import transformer_engine.pytorch as te

    b, s0 = prompt.shape
    params = te.InferenceParams(b, s0 + new) if cached else None
    tokens, chosen, logits = prompt, [], None
    with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
        for i in range(new):
            if cached:
                step_in = prompt if i == 0 else chosen[-1]
                params.pre_step(OrderedDict((seq, step_in.shape[1]) for seq in range(b)))
                logits = model(step_in, inference_params=params)
            else:
                logits = model(tokens)
            token = (forced[:, i:i + 1] if forced is not None
                     else logits.argmax(-1, keepdim=True))
            chosen.append(token)
            if not cached:
                tokens = torch.cat((tokens, token), dim=1)
    return torch.cat(chosen, dim=1), logits


def time_generations(runs: dict, rounds: int, sync) -> dict:
    """Milliseconds per generation of every ``runs[name]()`` by wall clock, one of each per
    round in a rotating order (the device's clock drift falls on all alike); medians."""
    for run in runs.values():  # warm-up: first-call costs, FP8 state, cuDNN plans
        run()
    sync()
    names = list(runs)
    per_run = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            runs[name]()
            sync()
            per_run[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                   "batches": rounds, "calls_per_batch": 1} for name, v in per_run.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU, every path, write nothing")
    parser.add_argument("--name", default="decode")
    args = parser.parse_args()
    from transformer_engine.common import recipe

    cfg = SMOKE_CONFIG if args.smoke else CONFIG
    device = "cpu" if args.smoke else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Decoder(cfg, device, torch.bfloat16).eval()
    prompt = torch.randint(cfg["vocab"], (cfg["batch"], cfg["prompt"]), device=device)
    precisions = {"bf16": None, "fp8_delayed": recipe.DelayedScaling()}
    runs, rows, errors = {}, [], {}
    shape = [cfg["batch"], cfg["prompt"], cfg["new"], cfg["hidden"], cfg["heads"],
             cfg["layers"]]
    for precision, r in precisions.items():
        for cached in (True, False):
            name = f"{'kv_cache' if cached else 'recompute'} {precision}"
            run = functools.partial(generate, model, prompt, cfg["new"], cached, fp8_recipe=r)
            try:
                run()
                sync()
            except Exception as err:  # noqa: BLE001 (recorded in the result, never hidden)
                errors[name] = f"{type(err).__name__}: {err}"[:2000]
                print(f"{name:24s} FAILED: {errors[name][:300]}")
                continue
            runs[name] = run
    timed = time_generations(runs, rounds=2 if args.smoke else 5, sync=sync)
    new_tokens = cfg["batch"] * cfg["new"]
    for name in list(timed) + list(errors):
        row = {"op": "decode", "impl": name, "shape_bpnhal": shape}
        if name in errors:
            rows.append({**row, "error": errors[name]})
            continue
        t = timed[name]
        row.update(t, tokens_per_s=new_tokens / (t["median_ms"] * 1e-3))
        rows.append(row)
        print(f"{name:24s} {t['median_ms']:9.2f} ms per generation  "
              f"{row['tokens_per_s']:9.0f} tokens/s")
    for precision, r in precisions.items():
        cache, full = f"kv_cache {precision}", f"recompute {precision}"
        if cache not in timed or full not in timed:
            continue
        speedup = timed[full]["median_ms"] / timed[cache]["median_ms"]
        tokens, cached_logits = generate(model, prompt, cfg["new"], True, fp8_recipe=r)
        _, full_logits = generate(model, prompt, cfg["new"], False, fp8_recipe=r, forced=tokens)
        diff = (cached_logits.float() - full_logits.float()).abs().max().item()
        scale = full_logits.float().abs().max().item()
        greedy, _ = generate(model, prompt, cfg["new"], False, fp8_recipe=r)
        agree = (greedy == tokens).float().mean().item()
        rows.append({"op": "kv_cache_vs_recompute", "impl": precision, "shape_bpnhal": shape,
                     "speedup": speedup, "last_logits_max_abs_diff": diff,
                     "last_logits_max_abs": scale, "greedy_tokens_agreement": agree})
        print(f"  {precision}: KV cache {speedup:.2f}x recompute; last logits max |diff| "
              f"{diff:.3g} (max |logit| {scale:.3g}); greedy tokens agree {agree:.1%}")
    if args.smoke:
        return
    from harness import write_result

    write_result(args.name, {
        "description": "greedy decoding with te.TransformerLayer (bf16 parameters): the KV "
                       "cache (te.InferenceParams) beside recomputing the whole sequence per "
                       "new token; shape_bpnhal = (batch, prompt, new tokens, hidden, heads, "
                       "layers); a generation (prompt pass + new tokens) timed by wall clock; "
                       "tokens_per_s = batch x new tokens / time; speedup = recompute ms / "
                       "cache ms; last_logits_max_abs_diff compares the cache's last logits "
                       "with the recompute's on the same tokens",
        "config": {**cfg, "ffn": 4 * cfg["hidden"], "dtype": "bfloat16", "mask": "causal",
                   "format": "bshd", "rope": "te.RotaryPositionEmbedding(head_dim)",
                   "fp8_recipe": repr(precisions["fp8_delayed"])},
        "results": rows,
    })


if __name__ == "__main__":
    main()
