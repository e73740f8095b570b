"""Attention backends of the decoder (engine/core/model.py) and the per-forward context they read.

A backend (``AttentionBackend``) is called with q [B,H,T,D], k and v [B,Hkv,S,D], an optional bool mask
[B,1,T,S] and ``causal``, and returns [B,H,T,D]. Its ``with_cache(q, k_cache, v_cache, ctx, window)``
may read the static KV cache in place (math here, flash-attn in engine/kernels/backends.py) or return
None, and the model then gathers the cache's rows and calls the backend with the forward's mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class AttentionContext:
    """Per-forward indexing shared by all layers (built once per forward, not per layer)."""

    pos: Tensor
    """[B, T] int64 positions of the forward's tokens (padding: the cache's scratch slot)."""
    rows: Tensor | None
    """[B] int64 cache rows of the batch (None: no cache, or rows 0..B-1 with ``rows_are_prefix``)."""
    rows_are_prefix: bool
    """The batch's rows are the cache's rows 0..B-1 (a slice, no gather)."""
    kv_len: int
    """Cache slots attended over (> every position of the batch)."""
    mask: Tensor | None
    """[B, 1, T, kv_len] bool position mask, or None where a backend needs none."""
    start: int | None = None
    """Set when rows 0..B-1 all hold positions start..start+T-1 (no padding): the cache is written by slices."""
    masks: dict[tuple[int, int | None], Tensor] = field(default_factory=dict)
    """Masks a backend builds for other key counts, by (keys, window), shared by the layers of the forward."""
    slots: Tensor | None = None
    """[B, T] int64 cache slots the keys are written to when they are not ``pos`` (a draft tree); ``mask`` is
    then the tree's mask, the only one (backends that read the cache by position return None)."""

    @property
    def write_slots(self) -> Tensor:
        """[B, T] where the forward's keys go in the cache."""
        return self.pos if self.slots is None else self.slots

    def mask_for(self, keys: int, window: int | None) -> Tensor:
        """The mask over ``keys`` slots, built once per forward (a tree's: its mask, cut or padded with False)."""
        m = self.masks.get((keys, window))
        if m is None:
            if self.slots is not None:
                assert self.mask is not None, "a tree context carries its mask"
                have = self.mask.shape[-1]
                m = self.mask[..., :keys] if keys <= have else F.pad(self.mask, (0, keys - have), value=False)
            else:
                m = position_mask(self.pos, keys, window)
            self.masks[(keys, window)] = m
        return m


class AttentionBackend(Protocol):
    """What the decoder's layers need from an attention implementation."""

    name: str

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """Attention of q over k, v (``causal`` without a mask is aligned bottom-right)."""
        ...

    def with_cache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: AttentionContext, window: int | None
    ) -> Tensor | None:
        """Attention of q over the static cache read in place (new keys written), or None: the model gathers."""
        ...


class SdpaAttention:
    """PyTorch SDPA; GQA handled by the kernel (no repeat of k/v). ``causal`` without a mask is aligned
    bottom-right as in flash-attn (query i of T sees keys <= S - T + i): a verify block at a cache offset
    passes no dense mask, so SDPA can pick its flash kernel (torch.nn.attention.bias.causal_lower_right)."""

    name = "sdpa_attention"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
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
        causal = causal and mask is None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

    def with_cache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: AttentionContext, window: int | None
    ) -> Tensor | None:
        return None  # the model gathers the rows and passes its mask


MATH_KEY_BUCKET = 32


class MathAttention:
    """Attention as two matmuls in the model's dtype around an fp32 softmax (scaled in fp32), with the
    same API and causal alignment as ``SdpaAttention``. With bf16 on the CPU (oneDNN) every query row
    comes out bit for bit the same whether it is one query over its own keys or one row of a verify
    block over more, masked, keys (tests/test_cpu_linear.py); SDPA's fused kernel does not give that.
    GQA: q is viewed as [B, Hkv, H/Hkv, T, D] against k [B, Hkv, 1, S, D] (broadcast by matmul)."""

    name = "math_attention"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
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

    def with_cache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: AttentionContext, window: int | None
    ) -> Tensor | None:
        """The attention over the cache with the key count rounded up to a multiple of MATH_KEY_BUCKET
        (masked by position): oneDNN builds a kernel per matmul shape, and a key count that grows by one
        every step made each call pay for a new one."""
        B = q.shape[0]
        # never the cache's last slot (the loop's scratch, written by padding, never read) unless kv_len says so
        S = max(ctx.kv_len, min(-(-ctx.kv_len // MATH_KEY_BUCKET) * MATH_KEY_BUCKET, k_cache.shape[2] - 1))
        if ctx.rows_are_prefix or ctx.rows is None:
            ks, vs = k_cache[:B, :, :S], v_cache[:B, :, :S]
        else:
            ks, vs = k_cache[ctx.rows, :, :S], v_cache[ctx.rows, :, :S]
        return self(q, ks.to(q.dtype), vs.to(q.dtype), ctx.mask_for(S, window), False)


sdpa_attention = SdpaAttention()  # stateless: one instance serves every model
math_attention = MathAttention()


def position_mask(pos: Tensor, kv_len: int, window: int | None) -> Tensor:
    """pos [B,T] -> bool mask [B,1,T,kv_len]: key j visible to the query at pos p iff j <= p (and p - j < window)."""
    j = torch.arange(kv_len, device=pos.device)[None, None, None, :]
    p = pos[:, None, :, None]
    m = j <= p
    if window is not None:
        m = m & (j > p - window)
    return m
