"""An EAGLE-style head: autoregressive over features, the last committed token and its feature in, k drafts out."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from engine.spec_decode.drafter import DraftBatch, DrafterContext, LoadedHead
from engine.spec_decode.drafters.head_base import HeadDrafter
from engine.spec_decode.drafters.head_tree import dynamic_tree, tree_proposal
from engine.spec_decode.drafters.spine_tree import sampled_trees, spine_trees
from engine.spec_decode.proposal import Proposal

if TYPE_CHECKING:
    from engine.core.model import Transformer


class EagleDrafter(HeadDrafter):
    """f_{t+1} = g(f_t, e(x_{t+1})), scored by the target's LM head rows, from the target's feature."""

    @classmethod
    def build(cls, ctx: DrafterContext) -> HeadDrafter:
        if ctx.head is not None and ctx.head.config.attention:  # decoder layers with a KV cache of their own
            from engine.spec_decode.drafters.eagle_attn import EagleAttnDrafter

            return EagleAttnDrafter.build(ctx)
        head, plain, scorer = cls.scorer_for(ctx)
        d = cls(head, ctx.target_module, scorer)
        d.branches = ctx.options.get("tree_branches", 1)
        graphed = ctx.kernels.graph_step(d.step, "eagle head step", 0)
        if graphed is not None:  # (graphs capture the PyTorch step)
            d.runner = graphed
            return d
        embed = ctx.target_module.embed_tokens.weight
        kernel = ctx.kernels.eagle_step(head.module, embed, plain, head.vocab_ids, head.config.rms_norm_eps)
        if kernel is not None:
            d.runner, d.greedy = kernel, kernel.greedy
        return d

    def __init__(self, head: LoadedHead, target: Transformer, scorer: nn.Module) -> None:
        super().__init__(head, target, scorer)
        self.runner: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = self.step
        self.greedy: Callable[[Tensor, Tensor, int], Tensor] | None = None  # all k greedy drafts in one call
        self.branches = 1  # > 1: trees: EAGLE-2's for greedy batches (head_tree.py), i.i.d. ones else (spine_tree.py)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        f, have = self._features(batch.seqs, batch.device)
        tok = torch.tensor([s.tokens[-1] for s in batch.seqs], dtype=torch.long, device=batch.device)
        if batch.processing.mode == "greedy" and batch.tree and self.branches > 1:
            toks, parents, _ = dynamic_tree(self.runner, f, tok, batch.k, self.branches, self.vocab_ids)
            return tree_proposal(toks, parents, have)
        if batch.processing.mode == "greedy" and self.greedy is not None:
            return self._result(self.greedy(f, tok, batch.k), [], have, batch.k, batch.k)
        if spine_trees(batch, self.branches):
            return sampled_trees(batch, self.branches, lambda b: self._chain(f, tok, have, b))
        return self._chain(f, tok, have, batch)

    def _chain(self, f: Tensor, tok: Tensor, have: list[bool], batch: DraftBatch) -> Proposal:
        """A chain of ``batch.k`` drafts, each drawn from the head's processed distribution (argmax: greedy)."""
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        for _ in range(batch.k):
            f, logits = self.runner(f, tok)
            tok, p = self._draw(logits, batch, drafts)
            drafts.append(tok)
            if p is not None:
                probs.append(p)
        return self._result(torch.stack(drafts, 1), probs, have, batch.k, batch.k)

    def step(self, f: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
        """(features [B, H], the tokens they precede [B]) -> (the next features, their logits [B, V'])."""
        f = self.head(f, self.target.embed_tokens(tok))
        return f, self.scores(f)

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        w = self.head_weight
        f = torch.randn(batch, self.cfg.hidden_size, dtype=self.feature_dtype, device=w.device)
        tok = torch.zeros(batch, dtype=torch.long, device=w.device)
        greedy = self.greedy
        if greedy is not None:  # a draft step as greedy rounds run it
            return lambda: greedy(f, tok, 1)
        return lambda: self.runner(f, tok)[1].argmax(-1)
