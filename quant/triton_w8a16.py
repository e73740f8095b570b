"""The CUDA W8A16 GEMM in Triton: int8 weights read as int8 and dequantized in registers.

y[M, N] = x[M, K] @ (q[N, K] * s)^T for fp16 / bf16 ``x``; ``s`` is one float32 scale per output
channel ([N], applied to the fp32 accumulator) or per group of ``group`` input channels ([N, K / group],
applied to the weight tile before the dot, as the dequantized reference rounds it). A step reads the
int8 weight once per block of M rows, half the bytes of an fp16 weight, which is what a memory-bound
decode or verify step pays for. Imported only where CUDA and Triton are present
(quant/matmul_kernels.py chooses it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m[:, None] < M, offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk[None, :] < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok & k_ok, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_ok & k_ok, other=0)
        if GROUP > 0:
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + kk[None, :] // GROUP, mask=n_ok & k_ok, other=0.0)
            wt = (w.to(tl.float32) * s).to(x.dtype)
        else:
            wt = w.to(x.dtype)  # int8 values are exact in fp16 and bf16
        acc += tl.dot(x, tl.trans(wt))
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=m_ok & (offs_n[None, :] < N))


def _blocks(m: int, n: int, sms: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): M padded to the dot's 16 rows; narrower N blocks when the grid would leave SMs idle."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 64 if triton.cdiv(m, bm) * triton.cdiv(n, 64) >= sms else 32
    return bm, bn


def w8a16_matmul(x: Tensor, q: Tensor, scale: Tensor, group: int | None) -> Tensor:
    """x [M, K] fp16/bf16, q [N, K] int8, scale float32 [N] or [N, ceil(K / group)] -> y [M, N] in x's dtype.

    CUDA tensors; CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter)."""
    assert x.dim() == 2 and q.dim() == 2 and x.shape[1] == q.shape[1] and x.dtype in (torch.float16, torch.bfloat16)
    x, q, scale = x.contiguous(), q.contiguous(), scale.float().contiguous()
    (m, k), n = x.shape, q.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1  # 1: the interpreter
    bm, bn = _blocks(m, n, sms)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    stride_sn = scale.stride(0)
    _w8a16_kernel[grid](
        x, q, scale, y, m, n, k, x.stride(0), q.stride(0), stride_sn, y.stride(0),
        GROUP=group or 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=4, num_stages=4,
    )  # fmt: skip
    return y
