"""The EAGLE head with attention: decoder layers over the sequence's features, as EAGLE proper has.

Entry p of a sequence is (the feature at p, the token at p + 1): ``fc([f_p; norm(e(x_{p+1}))])``, run
through ``layers`` decoder layers of the target's attention shape (its heads, head size and rotary
settings; ``Block`` of engine/core/model.py) and a final RMSNorm, giving the feature predicted for
p + 1, which the target's LM head scores for the token at p + 2. At committed positions the feature
read is the target's; a round's later drafts read the head's own, so draft j + 1 (j >= 1) of a round
whose last committed entry is r is the entry r + j on the head's output at r + j - 1, attending over the
committed entries <= r and the round's own entries r + 1 .. r + j.

``forward`` runs entries through a static, position-indexed KV cache (a rejection only moves the head's
length back, like the target's), or a draft tree's entries in slots of their own under the tree's mask;
``unrolled`` runs a whole sequence at every draft depth at once under the mask that reproduces those rounds
from every root (the "training-time test" of EAGLE-3), for training and the held-out evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.attention import AttentionContext, position_mask, sdpa_attention
from engine.core.config import ModelConfig
from engine.core.forward import TreeMask
from engine.core.model import Block, KVCache, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


def head_model_config(target_cfg: ModelConfig, head_cfg: Any) -> ModelConfig:
    """The decoder layers' shape from the head's config (``HeadConfig``: layers, MLP width (0: the hidden size),
    heads, key/value heads, head size) and the target's rotary settings and biases; no sliding window."""
    return replace(
        target_cfg,
        num_hidden_layers=head_cfg.layers,
        intermediate_size=head_cfg.intermediate_size or target_cfg.hidden_size,
        num_attention_heads=head_cfg.attention_heads,
        num_key_value_heads=head_cfg.kv_heads,
        head_dim=head_cfg.head_dim,
        sliding_window=None,
    )


def entry_context(pos: Tensor, rows: Tensor, prefix: bool, kv_len: int, tree: TreeMask | None) -> AttentionContext:
    """The attention context of a head's entries: by position (each sees the slots up to its own), or a draft tree's
    (its entries in their own slots under its mask)."""
    if tree is None:
        return AttentionContext(pos, rows, prefix, kv_len, position_mask(pos, kv_len, None))
    return AttentionContext(pos, rows, prefix, kv_len, tree.mask, slots=tree.slots)


class EagleAttnHead(nn.Module):
    """(features f [B, T, H], embeddings of the next tokens e [B, T, H]) at positions -> next features."""

    def __init__(self, mcfg: ModelConfig, cfg: Any = None) -> None:
        """``mcfg``: the layers' shape (``head_model_config``); ``cfg``: the head's config (``HeadConfig``)."""
        super().__init__()
        H = mcfg.hidden_size
        self.mcfg, self.cfg = mcfg, cfg
        self.embed_norm = RMSNorm(H, mcfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(Block(mcfg) for _ in range(mcfg.num_hidden_layers))
        self.out_norm = RMSNorm(H, mcfg.rms_norm_eps)
        self.inv_freq = rope_inv_freq(mcfg)  # fp32 (not a buffer: a cast of the head to fp16 leaves it)

    def _rope(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != pos.device:
            self.inv_freq = self.inv_freq.to(pos.device)
        return rope_cos_sin(self.inv_freq, pos, dtype)

    def init_weights(self, target_norm: Tensor, g: torch.Generator) -> None:
        """fc near [I, 0] (the entry starts as its feature), small random layers whose outputs start at 0
        (o_proj and down_proj zero: each layer starts as the identity), the output norm from the target's."""
        H = self.mcfg.hidden_size
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([torch.eye(H), torch.randn(H, H, generator=g) / math.sqrt(H)], 1))
            for layer in self.layers:
                for name, p in layer.named_parameters():
                    if p.dim() == 1:
                        p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p))
                    elif name.startswith(("self_attn.o_proj", "mlp.down_proj")):
                        p.zero_()
                    else:
                        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            self.out_norm.weight.copy_(target_norm.detach().float())

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The GEMM weights the C++ step would copy (engine/kernels/cpu_head.py ``AttnHeadKernel``): fc and every
        layer projection's as ``gemm`` (the kernel's reader) gives them, None for one the step cannot read."""
        mods: list[nn.Module] = [self.fc]
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            mods += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        return [gemm(m) for m in mods]

    def entries(self, f: Tensor, e: Tensor) -> Tensor:
        """f, e [..., H] -> the decoder's inputs [..., H]."""
        return self.fc(torch.cat([f, self.embed_norm(e)], -1))

    def new_cache(self, max_batch: int, max_seq_len: int, device: torch.device) -> KVCache:
        # the compute dtype (a norm's: the plan's FP8 Linears hold float8 weights, never a cache's dtype)
        return KVCache(self.mcfg, max_batch, max_seq_len, self.out_norm.weight.dtype, device)

    def forward(
        self,
        f: Tensor,  # [B, T, H] the entries' features
        e: Tensor,  # [B, T, H] the embeddings of the tokens after them
        pos: Tensor,  # [B, T] int64 the entries' positions (padding: a scratch slot no entry reads)
        cache: KVCache,
        kv_len: int,  # slots attended over (> every position of the batch)
        rows: Tensor | None = None,  # [B] cache rows (None: 0..B-1)
        tree: TreeMask | None = None,  # a draft tree's entries: their own slots and mask (None: by position)
    ) -> Tensor:
        """The features predicted for positions pos + 1 [B, T, H]; the entries' keys and values go into ``cache``."""
        x = self.entries(f, e)
        B = x.shape[0]
        cos, sin = self._rope(pos, x.dtype)
        prefix = rows is None
        if rows is None:
            rows = torch.arange(B, device=x.device)
        ctx = entry_context(pos, rows, prefix, kv_len, tree)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, sdpa_attention, (cache.k[i], cache.v[i]), ctx)
        return self.out_norm(x)

    def unrolled(self, f: Tensor, e: Tensor, depth: int) -> Tensor:
        """Every round from every root at once, teacher forced along the sequence's tokens.

        f [B, T, H]: the target's features at positions 0..T-1; e [B, T, H]: the embeddings of the tokens at
        1..T. Returns g [B, depth, T, H]: g[:, j, p] is the feature draft j + 1 of the round rooted at
        r = p - j is scored from (it predicts the feature at p + 1, the token at p + 2); valid for p >= j.
        Depth j's entry p reads g[:, j - 1, p - 1] and attends over depth 0's entries <= p - j and depth
        i's entry p - j + i (i = 1..j)."""
        B, T, _ = f.shape
        dev = f.device
        pos = torch.arange(T, device=dev)
        cos, sin = self._rope(pos[None], f.dtype)
        q_pos, k_pos = pos[:, None], pos[None, :]
        kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]  # per layer, per depth: k, v
        out = []
        feat = f
        for j in range(depth):
            x = self.entries(feat, e)
            # depth 0's keys up to the root, then one key of each depth 1..j: the diagonal p - j + i
            masks = [k_pos <= q_pos - j] + [k_pos == q_pos - j + i for i in range(1, j + 1)]
            mask = torch.cat(masks, 1)  # [T, (j + 1) T]
            mask[:j] = False  # rows without a root: keep every query's softmax defined
            diag = torch.arange(min(j, T), device=dev)
            mask[diag, diag] = True
            for li, layer in enumerate(self.layers):
                x = x + self._attend(layer, layer.input_layernorm(x), cos, sin, kv[li], mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            g = self.out_norm(x)
            out.append(g)
            feat = F.pad(g[:, :-1], (0, 0, 1, 0))  # depth j + 1's entry p reads depth j's output at p - 1
        return torch.stack(out, 1)

    @staticmethod
    def _attend(
        layer: Block, x: Tensor, cos: Tensor, sin: Tensor, past: list[tuple[Tensor, Tensor]], mask: Tensor
    ) -> Tensor:
        """Layer ``layer``'s attention of x [B, T, H] over the keys of earlier depths ``past`` and its own
        (appended to ``past``) under ``mask`` [T, (depths) T]."""
        a = layer.self_attn
        B, T, _ = x.shape
        q = apply_rope(a.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        past.append((k, v))
        ks = torch.cat([p[0] for p in past], 2)
        vs = torch.cat([p[1] for p in past], 2)
        o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=a.n_heads != a.n_kv)
        return a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
