"""INT8 quantization primitives and the padded ``torch._int_mm`` call.

Symmetric, per row: ``scale = absmax / 127`` in float32 (one per output channel
of a weight, one per token of an activation), ``q = clamp(round(t / scale),
-127, 127)`` (round half to even). -128 is never produced, so the range is
symmetric. A zero row gets the smallest normal float32 as its scale and
quantizes to zeros; no input that is finite gives NaN or inf.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import rowwise_scale

INT8_MAX = 127.0


def quantize_int8(t: Tensor, scale: Tensor) -> Tensor:
    """``t`` [..., C] divided by ``scale`` [...] (one per row), rounded to nearest and saturated to int8."""
    q = torch.round(t.float() / scale.unsqueeze(-1))
    return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_int8_rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8: ``(q int8 like t, scale float32 of shape t.shape[:-1])``."""
    scale = rowwise_scale(t, INT8_MAX)
    return quantize_int8(t, scale), scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize_int8_rowwise` (product in float32, then ``dtype``)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def int_mm(a: Tensor, b_t: Tensor) -> Tensor:
    """int8 ``a`` [M, K] @ int8 ``b_t`` [N, K]^T -> int32 [M, N] through ``torch._int_mm``.

    On the CPU ``_int_mm`` takes any shape. On CUDA it needs M > 16 and K, N
    multiples of 8; the operands are zero-padded to that (zeros add nothing to
    the dot products) and the result is cut back to [M, N].
    """
    M, K = a.shape
    N = b_t.shape[0]
    if a.device.type != "cuda":
        return torch._int_mm(a, b_t.t())
    Mp, Kp, Np = max(17, _round_up(M, 8)), _round_up(K, 8), _round_up(N, 8)
    if (Mp, Kp) != (M, K):
        a = F.pad(a, (0, Kp - K, 0, Mp - M))
    if (Np, Kp) != (N, K):
        b_t = F.pad(b_t, (0, Kp - K, 0, Np - N))
    return torch._int_mm(a, b_t.t())[:M, :N]


def int8_linear_reference(x: Tensor, w: Tensor) -> Tensor:
    """W8A8 ``x @ w.T`` (per-token x scales, per-channel w scales), int32 accumulate, float32 out."""
    xq, xs = quantize_int8_rowwise(x)
    wq, ws = quantize_int8_rowwise(w)
    return int_mm(xq, wq).float() * xs[:, None] * ws[None, :]
