"""INT8 quantization primitives and the padded ``torch._int_mm`` call.

Symmetric, per row (or per group of input channels of a row: ``*_groupwise``):
``scale = absmax / 127`` in float32 (one per output channel
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
EXACT_FP32_K = 2**24 // 127**2  # 1040: float32 sums of this many int8 x int8 products are exact


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

    On the CPU the product is float32 GEMMs over chunks of K that are exact (see the code).
    On CUDA it needs M > 16 and K, N
    multiples of 8; the operands are zero-padded to that (zeros add nothing to
    the dot products) and the result is cut back to [M, N].
    """
    M, K = a.shape
    N = b_t.shape[0]
    if a.device.type == "cpu":
        # torch._int_mm on the CPU runs ~30x slower than a float GEMM here (6 s for 512 x 1536 x 576 on one
        # core). A float32 GEMM over at most EXACT_FP32_K input channels is exact: every partial sum is an
        # integer of magnitude <= 127^2 * 1040 < 2^24, so no addition rounds; chunks add up in int32.
        out = torch.zeros(M, N, dtype=torch.int32)
        for k0 in range(0, K, EXACT_FP32_K):
            k1 = min(K, k0 + EXACT_FP32_K)
            out += (a[:, k0:k1].float() @ b_t[:, k0:k1].float().t()).to(torch.int32)
        return out
    if a.device.type != "cuda":
        return torch._int_mm(a, b_t.t())
    Mp, Kp, Np = max(17, _round_up(M, 8)), _round_up(K, 8), _round_up(N, 8)
    if (Mp, Kp) != (M, K):
        a = F.pad(a, (0, Kp - K, 0, Mp - M))
    if (Np, Kp) != (N, K):
        b_t = F.pad(b_t, (0, Kp - K, 0, Np - N))
    return torch._int_mm(a, b_t.t())[:M, :N]


def group_count(in_features: int, group_size: int) -> int:
    """Groups per row: ``ceil(in_features / group_size)`` (the last group may be shorter)."""
    return -(-in_features // group_size)


def quantize_int8_groupwise(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per group of ``group_size`` consecutive input channels of each row of ``w`` [N, K].

    Returns ``(q int8 [N, K], scale float32 [N, ceil(K / group_size)])``; a short last group is
    padded with zeros for its absmax only (zeros never raise it).
    """
    n, k = w.shape
    g = group_count(k, group_size)
    wp = F.pad(w.detach().float(), (0, g * group_size - k)).view(n, g, group_size)
    q, scale = quantize_int8_rowwise(wp)
    return q.view(n, g * group_size)[:, :k].contiguous(), scale


def dequantize_int8_groupwise(q: Tensor, scale: Tensor, group_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize_int8_groupwise`: ``q * scale`` per group in float32, then ``dtype``."""
    s = scale.repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    return (q.float() * s).to(dtype)
