"""The CUDA W8A16 GEMM in Triton: int8 weights read as int8 and dequantized in registers.

y[M, N] = x[M, K] @ (q[N, K] * s)^T for fp16 / bf16 ``x``; ``s`` is one float32 scale per output
channel ([N], applied to the fp32 accumulator) or per group of ``group`` input channels ([N, ceil(K /
group)], applied to the weight tile in fp32 before the product; the dot form rounds the scaled tile to
``x``'s dtype, as the dequantized reference does).
A step reads the int8 weight once per block of M rows, half the bytes of an fp16 weight, which is what a
memory-bound decode or verify step pays for. The same kernels read FP8 weight-only Linears
(:func:`fp8_weight_matmul`: e4m3 bytes with one scale per output channel, decoded exactly in registers), for
GPUs without FP8 arithmetic.

Two forms:
- ``gemv`` (one row): no matrix unit; each program reduces BLOCK_N weight rows against the row in fp32.
- ``dot`` (more rows): tiles of BLOCK_M x BLOCK_N through ``tl.dot``.
Narrow weight tiles (2 to 32 rows) give a decode step enough programs in flight to keep the memory
system busy. :func:`config_for` picks the form and tile per row count; :class:`Config` lets a tuning run
(engine/cli/gpu_w8a16_tune.py) try others. Imported only where CUDA and Triton are present
(quant/matmul_kernels.py chooses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class Config:
    """One launch configuration of the W8A16 GEMM."""

    form: str
    """``gemv`` (one row, no matrix unit) or ``dot`` (tl.dot over BLOCK_M-row tiles)."""
    block_n: int
    """Output channels (weight rows) per program."""
    block_k: int
    """Input channels per loop step (a power of two). Group sizes that neither divide it nor are a multiple of it
    read each weight's scale by a gather."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop."""


@triton.jit
def _e4m3(bits):
    """e4m3fn bytes (loaded as uint8) -> their values in fp32, exactly: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN (e4m3fn has no infinity)."""
    b = bits.to(tl.int32) & 0xFF
    e, m = (b >> 3) & 0xF, b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e - 7) * (1 + m / 8)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # 2^-9
    v = tl.where((e == 15) & (m == 7), float("nan"), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _widen(w, FP8: tl.constexpr):
    """A loaded weight tile in fp32: int8 values, or e4m3 bytes decoded."""
    if FP8:
        return _e4m3(w)
    return w.to(tl.float32)


@triton.jit
def _scaled_tile(w, s_ptr, offs_n, k0, n, n_groups, stride_sn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """The fp32 weight tile [BLOCK_N, BLOCK_K] (input channels k0...) times its group scales."""
    if GROUP % BLOCK_K == 0:  # the step lies in one group (k0 < K): one scale per row
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=offs_n < n, other=0.0)
        return w * s[:, None]
    elif BLOCK_K % GROUP == 0:  # whole groups: one scale per row and group
        PER: tl.constexpr = BLOCK_K // GROUP
        gi = k0 // GROUP + tl.arange(0, PER)
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + gi[None, :],
                    mask=(offs_n[:, None] < n) & (gi[None, :] < n_groups), other=0.0)  # fmt: skip
        wf = tl.reshape(w, (BLOCK_N, PER, GROUP)) * s[:, :, None]
        return tl.reshape(wf, (BLOCK_N, BLOCK_K))
    else:  # a group size that does not tile the step: each weight's scale gathered
        gi = (k0 + tl.arange(0, BLOCK_K)) // GROUP
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + gi[None, :],
                    mask=(offs_n[:, None] < n) & (gi[None, :] < n_groups), other=0.0)  # fmt: skip
        return w * s


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, N, K, n_groups, stride_wn, stride_sn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=(offs_n[:, None] < N) & (kk[None, :] < K),
                    other=0)  # fmt: skip
        wf = _widen(w, FP8)
        if GROUP > 0:
            wf = _scaled_tile(wf, s_ptr, offs_n, k0, N, n_groups, stride_sn, GROUP, BLOCK_N, BLOCK_K)
        acc += wf * x[None, :]
    y = tl.sum(acc, axis=1)
    if GROUP == 0:
        y = y * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _dot_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, n_groups, stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
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
            wt = _scaled_tile(_widen(w, FP8), s_ptr, offs_n, k0, N, n_groups, stride_sn, GROUP, BLOCK_N, BLOCK_K)
            wt = wt.to(x.dtype)
        else:
            wt = _widen(w, FP8).to(x.dtype)  # int8 and e4m3 values are exact in fp16 and bf16
        acc += tl.dot(x, tl.trans(wt))
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=m_ok & (offs_n[None, :] < N))


def block_m(m: int) -> int:
    """The dot form's rows per tile: M padded to the matrix unit's 16 rows, at most 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def config_for(m: int, group: int | None) -> Config:
    """The launch configuration for ``m`` rows: the fastest of engine/cli/gpu_w8a16_tune.py's sweep on an H200
    over the Llama-2-7B Linear shapes (profiles/gpu-results.md)."""
    if m == 1:
        return Config("gemv", 4, 1024, num_warps=2) if group and group < 128 else Config("gemv", 2, 1024, num_warps=1)
    if m <= 16:
        return Config("dot", 32, 128, num_warps=4, num_stages=4) if group and m <= 8 else Config("dot", 32, 256)
    if m <= 32:
        return Config("dot", 16, 256) if group is None else Config("dot", 16, 512)
    return Config("dot", 32, 256)


def _check(cfg: Config, m: int) -> None:
    if cfg.form not in ("gemv", "dot"):
        raise ValueError(f"form must be 'gemv' or 'dot', not {cfg.form!r}")
    if cfg.form == "gemv" and m != 1:
        raise ValueError(f"the gemv form takes one row, not {m}")


def w8a16_matmul(x: Tensor, q: Tensor, scale: Tensor, group: int | None, cfg: Config | None = None) -> Tensor:
    """x [M, K] fp16/bf16, q [N, K] int8, scale float32 [N] or [N, ceil(K / group)] -> y [M, N] in x's dtype.

    CUDA tensors; CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter). ``cfg`` overrides
    :func:`config_for` (a one-row form needs one row)."""
    assert q.dtype == torch.int8
    return _matmul(x, q, scale, group, cfg, fp8=False)


def fp8_weight_matmul(x: Tensor, q: Tensor, scale: Tensor, cfg: Config | None = None) -> Tensor:
    """x [M, K] fp16/bf16, q [N, K] e4m3 (float8_e4m3fn), scale float32 [N] -> y [M, N] in x's dtype: FP8
    weight-only, the e4m3 bytes read and decoded in registers (the same forms and tiles as per-channel int8)."""
    assert q.dtype == torch.float8_e4m3fn
    return _matmul(x, q.view(torch.uint8), scale, None, cfg, fp8=True)


def _matmul(x: Tensor, q: Tensor, scale: Tensor, group: int | None, cfg: Config | None, fp8: bool) -> Tensor:
    assert x.dim() == 2 and q.dim() == 2 and x.shape[1] == q.shape[1] and x.dtype in (torch.float16, torch.bfloat16)
    x, q, scale = x.contiguous(), q.contiguous(), scale.float().contiguous()
    (m, k), n = x.shape, q.shape[0]
    cfg = cfg or config_for(m, group)
    _check(cfg, m)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    n_groups = scale.shape[1] if scale.dim() == 2 else 1
    opts = dict(GROUP=group or 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=fp8, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)  # fmt: skip
    if cfg.form == "gemv":
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, q, scale, y, n, k, n_groups, q.stride(0), scale.stride(0), **opts
        )
        return y
    bm = block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, cfg.block_n))
    _dot_kernel[grid](
        x, q, scale, y, m, n, k, n_groups, x.stride(0), q.stride(0), scale.stride(0), y.stride(0), BLOCK_M=bm, **opts
    )  # fmt: skip
    return y
