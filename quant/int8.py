"""INT8 quantization primitives and the padded ``torch._int_mm`` call.

Symmetric, per row (or per group of input channels of a row: ``*_groupwise``):
``scale = absmax / 127`` in float32 (one per output channel
of a weight, one per token of an activation), ``q = clamp(round(t / scale),
-127, 127)`` (round half to even). -128 is never produced, so the range is
symmetric. A zero row gets the smallest normal float32 as its scale and
quantizes to zeros; no input that is finite gives NaN or inf.

``dequant_linear`` is the INT8 weight-only matmul of many rows: the weight dequantized a tile of output
rows at a time (``TILE_BYTES`` of fp32) into a buffer reused across the tiles, each tile one float GEMM,
so no dense copy of the weight outlives the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import rowwise_scale

INT8_MAX = 127.0
EXACT_FP32_K = 2**24 // 127**2  # 1040: float32 sums of this many int8 x int8 products are exact
TILE_BYTES = 1 << 20  # dequant_linear: fp32 bytes of weight dequantized at a time (stays in L2 for its GEMM)


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

    On the CPU any shape runs as it is. On CUDA it needs M > 16 and K, N
    multiples of 8; the operands are zero-padded to that (zeros add nothing to
    the dot products) and the result is cut back to [M, N].
    """
    M, K = a.shape
    N = b_t.shape[0]
    if a.device.type == "cpu":  # exact int32 on oneDNN: faster than float GEMMs here (docs/performance.md)
        return torch._int_mm(a.contiguous(), b_t.t())
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


def _dequantize_rows(q: Tensor, scale: Tensor, group_size: int | None, out: Tensor) -> Tensor:
    """``q * scale`` (rows of a weight, per-row or per-group scales) in float32 into ``out`` [rows, K]."""
    if group_size is None:
        return torch.mul(q, scale[:, None], out=out)
    n, k = q.shape
    g = scale.shape[1]
    if g * group_size == k:  # whole groups: one broadcast multiply
        return torch.mul(q.view(n, g, group_size), scale[:, :, None], out=out.view(n, g, group_size)).view(n, k)
    return out.copy_(dequantize_int8_groupwise(q, scale, group_size))


def dequant_linear(x: Tensor, q: Tensor, scale: Tensor, group_size: int | None, bias: Tensor | None = None) -> Tensor:
    """``x`` [M, K] @ (q * scale)^T (+ bias) in ``x``'s dtype: the weight dequantized a tile of output rows at a
    time into one buffer, each tile a GEMM into its columns of the output; no dense copy of the weight is kept.
    The same products q * scale (float32) as ``dequantize_int8`` / ``dequantize_int8_groupwise``."""
    n, k = q.shape
    rows = max(1, min(n, TILE_BYTES // (4 * max(k, 1))))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    buf = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = _dequantize_rows(q[n0:n1], scale[n0:n1], group_size, buf[: n1 - n0])
        torch.mm(x, w.t() if x.dtype == torch.float32 else w.t().to(x.dtype), out=out[:, n0:n1])
    return out if bias is None else out.add_(bias.to(out.dtype))
