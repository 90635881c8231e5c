"""A/B of the first-step rule's cost in compiled graphs (first_step.py): the 4-block FP8 stack
of bench_model.py at hidden 1024, eager and torch.compile default mode, as shipped ("gate") and
with the compiled graphs' gated first-step launches left out ("nogate": a compiled first step
then uses the stored scale of 1, as before the rule). Writes results/ab_<variant>.json.

    python benchmarks/ab_first_step_gate.py gate
    python benchmarks/ab_first_step_gate.py nogate
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _without_compiled_gate() -> None:
    import torch

    from transformer_engine.pytorch import (
        first_step,
        layernorm_linear_fn,
        layernorm_mlp_fn,
        linear_fn,
        quantization,
    )

    real = first_step.step_scales

    def step_scales(scales, index, history, column, *args, **kwargs):
        if torch.compiler.is_compiling():
            return scales
        return real(scales, index, history, column, *args, **kwargs)

    for module in (quantization, linear_fn, layernorm_linear_fn, layernorm_mlp_fn):
        module.step_scales = step_scales


if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "gate"
    if variant not in ("gate", "nogate"):
        raise SystemExit(f"variant must be 'gate' or 'nogate', got {variant!r}")
    if variant == "nogate":
        _without_compiled_gate()
    sys.argv = ["bench_model.py", "--hidden", "1024", "--variants",
                "te_mha_mlp/fp8_delayed/compile", "te_mha_mlp/fp8_delayed/eager", "--steps", "5",
                "--module-iters", "0", "--name", "ab_" + variant]
    runpy.run_path(str(HERE / "bench_model.py"), run_name="__main__")
