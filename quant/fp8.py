"""FP8 (e4m3) quantization primitives.

Weights: one float32 scale per output channel (row of an ``[out, in]`` matrix).
Activations: one float32 scale per token (row of an ``[tokens, in]`` matrix),
computed at run time from the row's absolute maximum.

``scale = absmax / 448`` maps the row's largest magnitude onto the largest
finite e4m3 value; values are clamped to [-448, 448] before the cast (torch's
CPU cast happens to saturate, but the scalar c10 conversion maps out-of-range
values to NaN, so saturation is explicit here) and the cast itself rounds to
nearest even. A zero row gets the smallest normal float32
as its scale, so the quantized row is all zeros and nothing divides by zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normal values
FP8_REL_ERROR = 2.0**-4
FP8_MIN_NORMAL = 2.0**-6
_TINY = torch.finfo(torch.float32).tiny


def rowwise_scale(t: Tensor, qmax: float) -> Tensor:
    """float32 scale per row of ``t`` [..., C] -> [...]: absmax / qmax, never 0 (zero rows) or inf.

    Where the division rounded up, the scale is stepped down one ulp, so ``qmax * scale``
    never exceeds the row's absmax (the largest element then saturates by < 1 ulp).
    """
    amax = t.detach().abs().amax(dim=-1).float()
    scale = amax / qmax
    for _ in range(2):  # round down until qmax * scale <= amax: dequantizing never overflows to inf
        scale = torch.where(scale * qmax > amax, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    return scale.clamp(min=_TINY)


def quantize_fp8(t: Tensor, scale: Tensor) -> Tensor:
    """``t`` [..., C] divided by ``scale`` [...] (one per row), saturated and rounded to e4m3."""
    q = t.float() / scale.unsqueeze(-1)
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row (per-output-channel for weights, per-token for activations) e4m3 quantization.

    Returns ``(q, scale)``: ``q`` e4m3 with the shape of ``t``, ``scale`` float32 of shape ``t.shape[:-1]``.
    """
    scale = rowwise_scale(t, FP8_MAX)
    return quantize_fp8(t, scale), scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize_fp8_rowwise`; the product is formed in float32, then cast to ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
