"""Draft heads on the target's own hidden state: Medusa heads and an EAGLE-style head (the EAGLE head with
attention: engine/spec_decode/heads/eagle_attn.py).

Both read the target's *feature*: the final-norm output h_t at position t (the LM head's input,
``lm_head(h_t)`` scores the token at t + 1), which the verify pass returns beside its logits.
Both score with the target's LM head (the rows of ``vocab_ids`` only, with a reduced draft
vocabulary), so a head adds no embedding or output matrix of its own.

- ``MedusaHeads``: head i (0-based) maps h_t to a feature whose LM-head scores predict the token
  at t + 2 + i, through ``layers`` residual blocks h + SiLU(W h + b) (W = 0 at init: the identity).
  The K drafts of a round come from h of the last committed token's position, all at once.
- ``EagleHead``: autoregressive over features: (f_t, embedding of the token at t + 1) -> f_{t+1}
  (a projection of [f_t; norm(e)] to the hidden size, ``layers`` SwiGLU MLP blocks, a final RMSNorm),
  scored by the LM head. The first step reads the target's feature, later ones the head's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.errors import CheckpointError
from engine.core.model import RMSNorm, StoredLinear, Transformer
from engine.spec_decode.heads.config import HEAD_KINDS, HeadConfig
from engine.spec_decode.heads.eagle3 import init_eagle3
from engine.spec_decode.heads.eagle_attn import EagleAttnHead, head_model_config


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``layers`` residual SiLU blocks each, evaluated together."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        H, M, L = cfg.hidden_size, cfg.num_heads, cfg.layers
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(L, M, H, H))  # [layer, head, out, in]: 0 -> the identity
        self.bias = nn.Parameter(torch.zeros(L, M, H))

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The tensors of the heads' C++ step (engine/kernels/cpu_head.py): the stacked weight and bias (no
        Linear modules: ``gemm`` is not needed)."""
        return [self.weight, self.bias]

    def forward(self, h: Tensor, n: int | None = None) -> Tensor:
        """h [..., H] -> features [..., n, H] of the first n heads (default all)."""
        n = self.cfg.num_heads if n is None else n
        x = h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])
        for w, b in zip(self.weight[:, :n], self.bias[:, :n]):
            x = x + F.silu(torch.einsum("...mi,moi->...mo", x, w) + b)
        return x


class EagleHead(nn.Module):
    """(feature f_t, token embedding e_{t+1}) -> f_{t+1}."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size or cfg.hidden_size
        self.cfg = cfg
        self.embed_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.layers))
        self.gate_up = nn.ModuleList(nn.Linear(H, 2 * inter, bias=False) for _ in range(cfg.layers))
        self.down = nn.ModuleList(nn.Linear(inter, H, bias=False) for _ in range(cfg.layers))
        self.out_norm = RMSNorm(H, cfg.rms_norm_eps)

    def kernel_weights(self, gemm: Callable[[nn.Module], Tensor | None]) -> list[Tensor | None]:
        """The tensors of the head's C++ step (engine/kernels/cpu_head.py) in its order: embed_norm, fc, per
        block norm, gate_up, down, then out_norm; each Linear's weight as ``gemm`` (the kernel's reader) gives it,
        None for one the step cannot read."""
        blocks = [t for n, gu, d in zip(self.norms, self.gate_up, self.down) for t in (n.weight, gemm(gu), gemm(d))]
        return [self.embed_norm.weight, gemm(self.fc), *blocks, self.out_norm.weight]

    def forward(self, f: Tensor, e: Tensor) -> Tensor:
        """f, e [..., H] -> the next feature [..., H]."""
        x = self.fc(torch.cat([f, self.embed_norm(e)], -1))
        for norm, gu, down in zip(self.norms, self.gate_up, self.down):
            g, u = gu(norm(x)).chunk(2, -1)
            x = x + down(F.silu(g) * u)
        return self.out_norm(x)


def draft_features(head: nn.Module, f: Tensor, emb: Tensor | None, k: int) -> Tensor:
    """The features of a round's k drafts from the target's feature f [S, H] -> [S, k, H], teacher forced:
    Medusa's first k heads at once; EAGLE chained, step j reading emb[:, j] [S, k, H], the embedding of the
    token before draft j (None for Medusa)."""
    if isinstance(head, MedusaHeads):
        return head(f, k)
    if isinstance(head, EagleAttnHead):
        raise TypeError("the EAGLE head with attention drafts over a sequence: EagleAttnHead.unrolled")
    assert emb is not None
    steps = []
    for j in range(k):
        f = head(f, emb[:, j])
        steps.append(f)
    return torch.stack(steps, 1)


def init_head(cfg: HeadConfig, target: Transformer, seed: int = 0) -> nn.Module:
    """A fresh head for ``target``: medusa at the identity, eagle with the fc near [I, 0] (f_{t+1} ~ f_t),
    small random MLPs and the output norm from the target's final norm."""
    if cfg.kind not in HEAD_KINDS:
        raise CheckpointError(f"kind={cfg.kind!r} is invalid: allowed {', '.join(HEAD_KINDS)}")
    g = torch.Generator().manual_seed(seed)
    if cfg.kind == "medusa":
        return MedusaHeads(cfg)
    if cfg.kind == "eagle3":
        return init_eagle3(cfg, target.config, target.norm.weight, seed)
    if cfg.attention:
        attn = EagleAttnHead(head_model_config(target.config, cfg), cfg)
        attn.init_weights(target.norm.weight, g)
        return attn
    head = EagleHead(cfg)
    H = cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.randn(H, H, generator=g) / math.sqrt(H)], 1))
        for gu, down in zip(head.gate_up, head.down):
            gu.weight.copy_(torch.randn(gu.weight.shape, generator=g) / math.sqrt(H))
            down.weight.zero_()
        head.out_norm.weight.copy_(target.norm.weight.detach().float())
    return head


def draft_lm_head(target: Transformer, vocab_ids: Tensor | None) -> nn.Linear | StoredLinear:
    """The heads' scorer: a bias-free Linear on the target's LM head weight (shared, not copied) or, with a
    reduced draft vocabulary, on its rows ``vocab_ids`` (a copy of V' rows); a StoredLinear (widened per call)
    where the target stores its LM head narrower than it computes (a CPU plan's fp16 verifier)."""
    w = target.lm_head.weight
    if vocab_ids is not None:
        w = nn.Parameter(w.detach()[vocab_ids].contiguous(), requires_grad=False)
    elif not isinstance(w, nn.Parameter):
        w = nn.Parameter(w.detach(), requires_grad=False)
    if w.dtype != target.dtype:  # stored narrower than the target computes (whatever kernel runs the target's)
        return StoredLinear(w, None)
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = w
    return lin
