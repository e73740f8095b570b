"""The EAGLE-3 head: the target's hidden states at three layers fused, one decoder layer, a reduced vocabulary.

Entry p of a sequence is (the feature at p, the token at p + 1), as for the EAGLE head with attention
(heads/eagle_attn.py); what differs is EAGLE-3's (Li et al., 2025; the layer of the EAGLE authors, SpecForge,
vLLM's ``llama_eagle3.py`` and ``speculators``):

- the target's feature at p is ``fc([h_a; h_b; h_c])`` (3H -> H): the hidden states entering the target's layers
  a, b, c (default 2, L // 2, L - 3), captured in the verify pass itself (``Transformer.use_feature_layers``);
- the decoder layer (``midlayer``) reads ``[input_layernorm(e); hidden_norm(f)]`` (2H) in its q/k/v projections,
  with f as the residual (``norm_before_residual``: the normed f), then the usual post-attention norm and MLP;
- its output g (before the head's own ``norm``) is the feature of the next entry: later drafts feed g back
  without the fc; ``lm_head(norm(g))`` scores the next token over the draft vocabulary, whose ids in the
  target's are ``arange(V') + d2t`` (``t2d``: the target's ids that are in it).

Parameter names are the EAGLE authors' (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, optional ``embed_tokens``),
so their checkpoints load as they are (heads/eagle3_formats.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.attention import sdpa_attention
from engine.core.config import ModelConfig
from engine.core.forward import KVCache, TreeMask
from engine.core.model import MLP, Attention, RMSNorm, rope_cos_sin, rope_inv_freq
from engine.spec_decode.heads.config import HeadConfig
from engine.spec_decode.heads.eagle_attn import EagleAttnHead, entry_context


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers for a target of ``n_layers``: a low, a middle and a high one (2, L // 2, L - 3)."""
    return (2, n_layers // 2, n_layers - 3)


def eagle3_model_config(target_cfg: ModelConfig, cfg: HeadConfig) -> ModelConfig:
    """The decoder layer's shape: the head's heads, head size, MLP width, eps and rotary settings (None: the
    target's); one layer, no sliding window, no biases but the fc's."""
    return replace(
        target_cfg,
        num_hidden_layers=1,
        intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=cfg.attention_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta if cfg.rope_theta is None else cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling if cfg.rope_theta is None else cfg.rope_scaling,
        attention_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
    )


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(e); norm(f)] (2H in), f the residual, then the MLP."""

    def __init__(self, mcfg: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        H, eps = mcfg.hidden_size, mcfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(mcfg)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * H, a.n_heads * a.head_dim, bias=False)
        a.k_proj = nn.Linear(2 * H, a.n_kv * a.head_dim, bias=False)
        a.v_proj = nn.Linear(2 * H, a.n_kv * a.head_dim, bias=False)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(mcfg)

    def inputs(self, f: Tensor, e: Tensor) -> tuple[Tensor, Tensor]:
        """(features f, embeddings e [..., H]) -> (the attention's input [..., 2H], the residual [..., H])."""
        if self.norm_before_residual:
            f = self.hidden_norm(f)
            return torch.cat([self.input_layernorm(e), f], -1), f
        return torch.cat([self.input_layernorm(e), self.hidden_norm(f)], -1), f

    def finish(self, residual: Tensor, attn_out: Tensor) -> Tensor:
        """The attention's output added to the residual, then the MLP block: the layer's output."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """(fused features f [B, T, H], embeddings of the next tokens e [B, T, H]) at positions -> next features."""

    def __init__(self, mcfg: ModelConfig, cfg: HeadConfig, feature_width: int) -> None:
        """``mcfg``: the layer's shape (``eagle3_model_config``); ``feature_width``: the target's captured
        features' width (3 H)."""
        super().__init__()
        H = mcfg.hidden_size
        self.mcfg, self.cfg = mcfg, cfg
        self.fc = nn.Linear(feature_width, H, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(mcfg, cfg.norm_before_residual)
        self.norm = RMSNorm(H, mcfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab or cfg.vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.own_embedding else None
        self.inv_freq = rope_inv_freq(mcfg)  # fp32 (not a buffer: a cast of the head to fp16 leaves it)

    def init_weights(self, target_norm: Tensor, g: torch.Generator) -> None:
        """fc: the mean of the three hidden states; the layer small and random with o_proj and down_proj zero
        (the layer starts as the identity on f); norm from the target's final norm; lm_head small."""
        H = self.mcfg.hidden_size
        with torch.no_grad():
            k = self.fc.weight.shape[1] // H
            self.fc.weight.copy_(torch.cat([torch.eye(H) / k] * k, 1))
            if self.fc.bias is not None:
                self.fc.bias.zero_()
            for name, p in self.midlayer.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                elif name.startswith(("self_attn.o_proj", "mlp.down_proj")):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            self.norm.weight.copy_(target_norm.detach().float())
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=g) / math.sqrt(H))

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The GEMM weights a C++ step copies (engine/kernels/cpu_head.py ``Eagle3HeadKernel``): q, k, v, o, gate,
        up, down and the LM head's, as ``gemm`` (the kernel's reader) gives them, None for one it cannot read."""
        a, m = self.midlayer.self_attn, self.midlayer.mlp
        mods = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj, self.lm_head]
        return [gemm(x) for x in mods]

    def fuse(self, feats: Tensor) -> Tensor:
        """The target's captured hidden states [..., 3H] -> the head's features [..., H]."""
        return self.fc(feats)

    def logits(self, g: Tensor) -> Tensor:
        """The head's outputs [..., H] -> scores over the draft vocabulary [..., V']."""
        return self.lm_head(self.norm(g))

    def new_cache(self, max_batch: int, max_seq_len: int, device: torch.device) -> KVCache:
        return KVCache(self.mcfg, max_batch, max_seq_len, self.norm.weight.dtype, device)

    def _rope(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != pos.device:
            self.inv_freq = self.inv_freq.to(pos.device)
        return rope_cos_sin(self.inv_freq, pos, dtype)

    def forward(
        self,
        f: Tensor,  # [B, T, H] the entries' (fused or the head's own) features
        e: Tensor,  # [B, T, H] the embeddings of the tokens after them
        pos: Tensor,  # [B, T] int64 positions (padding: a scratch slot no entry reads)
        cache: KVCache,
        kv_len: int,
        rows: Tensor | None = None,
        tree: TreeMask | None = None,  # a draft tree's entries: their own slots and mask (None: by position)
    ) -> Tensor:
        """The layer's outputs [B, T, H] (the next entries' features, before ``norm``); keys and values into
        ``cache``."""
        x, residual = self.midlayer.inputs(f, e)
        cos, sin = self._rope(pos, x.dtype)
        prefix = rows is None
        if rows is None:
            rows = torch.arange(x.shape[0], device=x.device)
        ctx = entry_context(pos, rows, prefix, kv_len, tree)
        a = self.midlayer.self_attn(x, cos, sin, sdpa_attention, (cache.k[0], cache.v[0]), ctx)
        return self.midlayer.finish(residual, a)

    def unrolled(self, f: Tensor, e: Tensor, depth: int) -> Tensor:
        """Training-time test: every round from every root at once (``EagleAttnHead.unrolled``'s masks).

        f [B, T, H]: the fused target features at 0..T-1; e: the embeddings of the tokens at 1..T. Returns
        g [B, depth, T, H]: g[:, j, p] scores draft j + 1 of the round rooted at p - j (valid for p >= j).
        Depth j >= 1 reads depth j - 1's own outputs (shifted by one position), never the target's."""
        B, T, _ = f.shape
        dev = f.device
        pos = torch.arange(T, device=dev)
        cos, sin = self._rope(pos[None], f.dtype)
        q_pos, k_pos = pos[:, None], pos[None, :]
        kv: list[tuple[Tensor, Tensor]] = []
        out = []
        feat = f
        for j in range(depth):
            x, residual = self.midlayer.inputs(feat, e)
            masks = [k_pos <= q_pos - j] + [k_pos == q_pos - j + i for i in range(1, j + 1)]
            mask = torch.cat(masks, 1)
            mask[:j] = False  # rows without a root: keep every query's softmax defined
            diag = torch.arange(min(j, T), device=dev)
            mask[diag, diag] = True
            a = EagleAttnHead._attend(self.midlayer, x, cos, sin, kv, mask)  # type: ignore[arg-type]
            g = self.midlayer.finish(residual, a)
            out.append(g)
            feat = F.pad(g[:, :-1], (0, 0, 1, 0))  # depth j + 1's entry p reads depth j's output at p - 1
        return torch.stack(out, 1)


def init_eagle3(cfg: HeadConfig, target_cfg: ModelConfig, target_norm: Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh EAGLE-3 head for a target (``init_weights``), fusing ``cfg.feature_layers`` (3 of them)."""
    head = Eagle3Head(eagle3_model_config(target_cfg, cfg), cfg, len(cfg.feature_layers) * target_cfg.hidden_size)
    head.init_weights(target_norm, torch.Generator().manual_seed(seed))
    return head
