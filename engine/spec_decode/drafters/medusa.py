"""Medusa heads: head i proposes draft i + 1 from the same feature, all drafts at once: a chain, or with
``tree_branches`` > 1 a tree: for greedy rows each head's top tokens, the most probable paths kept (Medusa's candidate
tree, chosen per round by path probability through head_tree.py's dynamic tree); for sampled rows the sampled chain
with independent siblings (spine_tree.py)."""

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


class MedusaDrafter(HeadDrafter):
    """Head i proposes draft i + 1 from the feature of the last committed token."""

    @classmethod
    def build(cls, ctx: DrafterContext) -> MedusaDrafter:
        head, plain, scorer = cls.scorer_for(ctx)
        d = cls(head, ctx.target_module, scorer)
        d.branches = ctx.options.get("tree_branches", 1)
        graphed = ctx.kernels.graph_step(d.step, "medusa head step", 1)
        if graphed is not None:  # (graphs capture the PyTorch step)
            d.runner = graphed
            return d
        kernel = ctx.kernels.medusa_step(head.module, plain, head.vocab_ids, head.config.vocab_size)
        if kernel is not None:
            d.runner, d.greedy = kernel, kernel.greedy
        return d

    def __init__(self, head: LoadedHead, target: Transformer, scorer: nn.Module) -> None:
        super().__init__(head, target, scorer)
        self.runner: Callable[[Tensor, int], Tensor] = self.step
        self.greedy: Callable[[Tensor, int], Tensor] | None = None  # all k greedy drafts in one call
        self.branches = 1  # > 1: trees (the heads' top tokens for greedy batches, spine trees for sampled ones)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        f, have = self._features(batch.seqs, batch.device)
        k = min(batch.k, self.cfg.num_heads)
        if batch.processing.mode == "greedy" and batch.tree and self.branches > 1 and self.cfg.num_heads > 1:
            return self._tree(f, have, batch.k)
        if batch.processing.mode == "greedy" and self.greedy is not None:
            return self._result(self.greedy(f, k), [], have, k, batch.k)
        if spine_trees(batch, self.branches):  # (K <= the heads: max_drafts)
            return sampled_trees(batch, self.branches, lambda b: self._chain(f, have, b, b.k))
        return self._chain(f, have, batch, k)

    def _chain(self, f: Tensor, have: list[bool], batch: DraftBatch, k: int) -> Proposal:
        """Heads 1..k's drafts, each drawn from its processed distribution (k <= the heads)."""
        logits = self.runner(f, k)  # [B, k, V']
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        for i in range(k):
            d, p = self._draw(logits[:, i], batch, drafts)
            drafts.append(d)
            if p is not None:
                probs.append(p)
        return self._result(torch.stack(drafts, 1), probs, have, k, batch.k)

    def _tree(self, f: Tensor, have: list[bool], budget: int) -> Proposal:
        """Greedy rows' trees of up to ``budget`` nodes: depth d's children are head d's top tokens, whatever the
        path (Medusa heads read only the root's feature). The dynamic tree's step here looks up the heads' scores
        by (row, depth), which its features carry."""
        w, heads = self.branches, self.cfg.num_heads
        budget = max(1, min(budget, w * (heads - 1)))  # its depths stay within the heads
        logits = self.runner(f, heads)  # [B, heads, V']
        B = f.shape[0]
        where = torch.stack([torch.arange(B, device=f.device), torch.zeros(B, dtype=torch.long, device=f.device)], 1)

        def step(at: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:  # at [M, 2]: (row, depth)
            return at + torch.tensor([0, 1], device=at.device), logits[at[:, 0], at[:, 1]]

        toks, parents, _ = dynamic_tree(step, where, where[:, 0], budget, w, self.vocab_ids)
        return tree_proposal(toks, parents, have)

    def step(self, f: Tensor, n: int) -> Tensor:
        """Features [B, H] -> the first n heads' logits over the draft vocabulary [B, n, V']."""
        return self.scores(self.head(f, n))

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        w = self.head_weight
        f = torch.randn(batch, self.cfg.hidden_size, dtype=self.feature_dtype, device=w.device)
        greedy = self.greedy
        if greedy is not None:  # a draft step as greedy rounds run it
            return lambda: greedy(f, 1)
        return lambda: self.runner(f, 1).argmax(-1)
