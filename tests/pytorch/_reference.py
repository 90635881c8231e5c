"""Independent references for the PyTorch tests: FP8 quantization by torch's own float8
dtypes, the block layouts by reshapes, GEMMs in float64, and delayed scaling as a plain
Python model of the recipe's documented rule (recipe.py, scaling.h).

None of this calls the core; it is written from the documented semantics: the scaled value
``x * scale`` is computed in fp32, clipped to the format's finite range when finite (the core
saturates finite values and keeps infinities non-finite) and rounded to nearest even by
torch's cast.
"""

from __future__ import annotations

import math

import torch

FP8 = {"float8_e4m3": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}
FLT_MAX = torch.finfo(torch.float32).max


def fp8_round(v: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """fp32 values rounded to the FP8 grid (finite values saturating), returned as fp32; +-Inf
    stays non-finite (torch's cast: Inf in E5M2, NaN in E4M3)."""
    native, fmax = FP8[fp8_dtype]
    v = v.float()
    return torch.where(v.isinf(), v, v.clamp(-fmax, fmax)).to(native).float()


def quantize_tensor(x: torch.Tensor, scale: float, fp8_dtype: str) -> torch.Tensor:
    """Per-tensor: the dequantized values fp8(x * scale) / scale, float64."""
    s = torch.tensor(scale, dtype=torch.float32)
    q = fp8_round(x.float() * s, fp8_dtype)
    return q.double() * (1.0 / s).double()


def current_scale(amax: float, fp8_dtype: str, pow2: bool = False, eps: float = 0.0) -> float:
    """Current scaling, quantize.h: fp8_max / max(amax, eps); inf -> FLT_MAX; 0/NaN -> 1."""
    a = torch.tensor(max(amax, eps), dtype=torch.float32)
    if not (math.isfinite(a.item()) and a.item() > 0):
        return 1.0
    s = (torch.tensor(FP8[fp8_dtype][1], dtype=torch.float32) / a).item()
    s = min(s, FLT_MAX)
    if pow2:
        s = 2.0 ** math.floor(math.log2(s))
    return s


def quantize_current(x: torch.Tensor, fp8_dtype: str, pow2: bool = False) -> torch.Tensor:
    return quantize_tensor(x, current_scale(x.abs().max().item(), fp8_dtype, pow2), fp8_dtype)


def quantize_blocks(x: torch.Tensor, rows: int, cols: int, fp8_dtype: str,
                    pow2: bool = True) -> torch.Tensor:
    """Blocks of rows x cols (1x128 or 128x128) of a matrix, each with its current scale;
    returns the dequantized values, float64."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.float64)
    for r in range(0, m, rows):
        for c in range(0, k, cols):
            block = x[r:r + rows, c:c + cols].float()
            scale = current_scale(block.abs().max().item(), fp8_dtype, pow2)
            out[r:r + rows, c:c + cols] = quantize_tensor(block, scale, fp8_dtype)
    return out


def matmul_tn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a @ b^T`` in float64 and its magnitude ``|a| @ |b|^T`` (for the tolerance)."""
    a, b = a.double().cpu(), b.double().cpu()
    return a @ b.t(), a.abs() @ b.abs().t()


class DelayedScalingModel:
    """Delayed scaling of one te.Linear, written from the recipe's documented rule.

    Forward: the amaxes of input and weight go into slot 0 of the forward history; the
    autocast exit updates the forward scales. Backward: grad_output's amax goes into the
    backward history, whose scale is updated right away. Update: amax = max(history) (or
    history[0]); if finite and > 0, scale = (fp8_max / amax) / 2^margin (inf -> FLT_MAX),
    else unchanged; scale_inv = 1/scale; history rolls up one row, a zero row enters at 0.
    """

    def __init__(self, history_len: int, fwd_max: float, bwd_max: float, algo: str = "max",
                 margin: int = 0):
        self.algo, self.margin = algo, margin
        self.fwd_max, self.bwd_max = fwd_max, bwd_max
        self.history_fwd = [[0.0, 0.0] for _ in range(history_len)]
        self.history_bwd = [[0.0] for _ in range(history_len)]
        self.scale_fwd, self.scale_bwd = [1.0, 1.0], [1.0]

    def _update(self, history, scale, fp8_max):
        f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
        for col in range(len(scale)):
            column = [row[col] for row in history]
            amax = max(column) if self.algo == "max" else column[0]
            if math.isfinite(amax) and amax > 0:
                s = f32(f32(fp8_max) / f32(amax)) / 2.0**self.margin
                scale[col] = FLT_MAX if math.isinf(s) or s > FLT_MAX else f32(s)
        history.append(history.pop(0))
        history[0] = [0.0] * len(scale)
        return [f32(1.0 / s) for s in scale]

    def forward(self, amax_input: float, amax_weight: float) -> None:
        row = self.history_fwd[0]
        row[0], row[1] = max(row[0], amax_input), max(row[1], amax_weight)

    def autocast_exit(self) -> list:
        return self._update(self.history_fwd, self.scale_fwd, self.fwd_max)

    def backward(self, amax_grad: float) -> list:
        self.history_bwd[0][0] = max(self.history_bwd[0][0], amax_grad)
        return self._update(self.history_bwd, self.scale_bwd, self.bwd_max)


# ---------------------------------------------------------------- the fused blocks, unfused


def norm64(x: torch.Tensor, gamma: torch.Tensor, beta, norm: str, eps: float,
           zero_centered_gamma: bool = False) -> torch.Tensor:
    """torch's own LayerNorm / RMSNorm in float64 (gamma stored as g - 1 when zero-centered)."""
    x, g = x.double(), gamma.double() + (1.0 if zero_centered_gamma else 0.0)
    n = x.shape[-1]
    if norm == "layernorm":
        return torch.nn.functional.layer_norm(x, (n,), g, beta.double(), eps)
    return torch.nn.functional.rms_norm(x, (n,), g, eps)


_ACT64 = {
    "gelu": lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "qgelu": lambda h: h * torch.sigmoid(1.702 * h),
    "srelu": lambda h: torch.relu(h).square(),
    "sigmoid": torch.sigmoid,  # GLU's gate
}
GATED = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu", "qgeglu": "qgelu",
         "sreglu": "srelu", "glu": "sigmoid"}


def act64(h: torch.Tensor, act: str) -> torch.Tensor:
    """The activations of activation.h by torch ops; gated ones take [a, b] halves."""
    if act in GATED:
        a, b = h.chunk(2, dim=-1)
        return _ACT64[GATED[act]](a) * b
    return _ACT64[act](h)


def mlp64(x, gamma, beta, w1, b1, w2, b2, norm: str, act: str, eps: float,
          zero_centered_gamma: bool = False):
    """(output, ln_out, fc1_out, act_out) of the MLP block, unfused, in float64."""
    ln = norm64(x, gamma, beta, norm, eps, zero_centered_gamma)
    h = torch.nn.functional.linear(ln, w1.double(), None if b1 is None else b1.double())
    a = act64(h, act)
    out = torch.nn.functional.linear(a, w2.double(), None if b2 is None else b2.double())
    return out, ln, h, a


def cross_entropy64(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                    label_smoothing: float = 0.0, ignore_idx: int = -100,
                    z_loss_weight: float = 0.0):
    """torch's F.cross_entropy (reduction "none", its label smoothing and ignore_index) plus
    ``z_loss_weight * logsumexp**2`` on the tokens not ignored, in float64 from the values of
    the [..., V] logits ``x``. Returns the loss of each token; the gradient in ``x`` of
    ``sum(weight * loss)``; the loss's magnitude, ``|lse| + max|x| + z lse^2 + 1``; the
    gradient's, its terms before they cancel: ``(p (1 + 2 z |lse|) + eps / V + [target])
    |weight|``. The magnitudes are 0 on ignored tokens, whose loss and gradient are 0."""
    import torch.nn.functional as F

    v, eps, z = x.shape[-1], label_smoothing, z_loss_weight
    x64 = x.detach().double().reshape(-1, v).requires_grad_()
    t = target.reshape(-1).long()
    kept = (t != ignore_idx).double()
    lse = torch.logsumexp(x64, dim=-1)
    loss = F.cross_entropy(x64, t, reduction="none", label_smoothing=eps,
                           ignore_index=ignore_idx) + z * lse.square() * kept
    w = weight.reshape(-1).to(x64)  # (given on the CPU by tests of any device)
    (loss * w).sum().backward()
    with torch.no_grad():
        onehot = F.one_hot(t.clamp(0, v - 1), v).double()
        grad_mag = (torch.softmax(x64, dim=-1) * (1 + 2 * z * lse.abs()).unsqueeze(1)
                    + eps / v + onehot) * (w.abs() * kept).unsqueeze(1)
        loss_mag = (lse.abs() + x64.abs().amax(dim=-1) + z * lse.square() + 1) * kept
    lead = x.shape[:-1]
    return (loss.detach().reshape(lead), x64.grad.reshape(x.shape), loss_mag.reshape(lead),
            grad_mag.reshape(x.shape))
