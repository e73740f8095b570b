"""Attention backends of the decoder (engine/core/model.py) and the per-forward context they read.

An attention function takes q [B,H,T,D], k and v [B,Hkv,S,D], an optional bool mask [B,1,T,S] and
``causal``, and returns [B,H,T,D]. A backend may carry a ``with_cache(q, k_cache, v_cache, ctx, window)``
attribute that reads the static KV cache in place (``math_attention`` and engine/kernels/backends.py do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# attn_fn(q [B,H,T,D], k [B,Hkv,S,D], v [B,Hkv,S,D], mask [B,1,T,S] bool | None, causal) -> [B,H,T,D]
AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool], Tensor]


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """PyTorch SDPA; GQA handled by the kernel (no repeat of k/v). ``causal`` without a mask is aligned
    bottom-right as in flash-attn (query i of T sees keys <= S - T + i): a verify block at a cache offset
    passes no dense mask, so SDPA can pick its flash kernel (torch.nn.attention.bias.causal_lower_right)."""
    gqa = q.shape[1] != k.shape[1]
    T, S = q.shape[2], k.shape[2]
    if mask is None and causal and T != S:
        if T == 1:
            causal = False  # the one query sees every key
        elif gqa:  # CausalBias's flash dispatch takes no GQA: a small [T, S] mask instead
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        else:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Attention as two matmuls in the model's dtype around an fp32 softmax (scaled in fp32), with the
    same API and causal alignment as ``sdpa_attention``. With bf16 on the CPU (oneDNN) every query row
    comes out bit for bit the same whether it is one query over its own keys or one row of a verify
    block over more, masked, keys (tests/test_cpu_linear.py); SDPA's fused kernel does not give that.
    GQA: q is viewed as [B, Hkv, H/Hkv, T, D] against k [B, Hkv, 1, S, D] (broadcast by matmul)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if mask is None and causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    qg = q.view(B, Hkv, H // Hkv, T, D)
    # k @ q^T, transposed back: the same values as q @ k^T (checked bitwise) and faster with bf16 on
    # oneDNN, which otherwise re-lays out the transposed cache slice every call
    scores = torch.matmul(k.unsqueeze(2), qg.transpose(-1, -2)).transpose(-1, -2).float() * (D**-0.5)
    if mask is not None:
        scores = scores.masked_fill(~(mask if mask.dim() < 4 else mask.unsqueeze(2)), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v.unsqueeze(2))  # [B, Hkv, G, T, D]
    return out.view(B, H, T, D)


MATH_KEY_BUCKET = 32


def _math_with_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: _Ctx, window: int | None) -> Tensor:
    """``math_attention`` over the cache with the key count rounded up to a multiple of MATH_KEY_BUCKET
    (masked by position): oneDNN builds a kernel per matmul shape, and a key count that grows by one
    every step made each call pay for a new one."""
    B = q.shape[0]
    # never the cache's last slot (the loop's scratch, written by padding, never to be read) unless kv_len says so
    S = max(ctx.kv_len, min(-(-ctx.kv_len // MATH_KEY_BUCKET) * MATH_KEY_BUCKET, k_cache.shape[2] - 1))
    if ctx.rows_are_prefix:
        ks, vs = k_cache[:B, :, :S], v_cache[:B, :, :S]
    else:
        ks, vs = k_cache[ctx.rows, :, :S], v_cache[ctx.rows, :, :S]
    memo = getattr(ctx, "math_mask", None)  # one mask per forward, shared by the layers
    if memo is None or memo[0] != (S, window):
        memo = ctx.math_mask = ((S, window), position_mask(ctx.pos, S, window))
    return math_attention(q, ks.to(q.dtype), vs.to(q.dtype), memo[1], False)


math_attention.with_cache = _math_with_cache  # type: ignore[attr-defined]  (the backends' cache extension)


class _Ctx:
    """Per-forward indexing shared by all layers (built once, not per layer)."""

    def __init__(
        self,
        pos: Tensor,
        rows: Tensor,
        rows_are_prefix: bool,
        kv_len: int,
        mask: Tensor | None,
        start: int | None = None,
    ) -> None:
        self.pos, self.rows, self.rows_are_prefix, self.kv_len, self.mask = pos, rows, rows_are_prefix, kv_len, mask
        self.start = start  # set when rows 0..B-1 all hold positions start..start+T-1 (no padding)


def position_mask(pos: Tensor, kv_len: int, window: int | None) -> Tensor:
    """pos [B,T] -> bool mask [B,1,T,kv_len]: key j visible to the query at pos p iff j <= p (and p - j < window)."""
    j = torch.arange(kv_len, device=pos.device)[None, None, None, :]
    p = pos[:, None, :, None]
    m = j <= p
    if window is not None:
        m = m & (j > p - window)
    return m
