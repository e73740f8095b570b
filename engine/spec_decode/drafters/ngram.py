"""Prompt lookup (n-gram): the tokens that followed the latest earlier occurrence of the last n tokens. No model.

With ``branches`` > 1 the continuations of up to that many earlier occurrences (latest first, the longest n
that matches) are merged into one draft tree (a trie: shared prefixes once, siblings distinct), within the
row's node budget; the latest occurrence's continuation is the first branch, so one branch is the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed
from engine.spec_decode.proposal import Proposal

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq


class NGramDrafter:
    """Deterministic drafts (p one-hot): a copy of what followed the context's latest match, fewer than k or none."""

    features = FeatureNeed.NONE
    samples = False  # (proposes fixed tokens)
    max_drafts: int | None = None

    def __init__(self, n_max: int = 3, n_min: int = 1, branches: int = 1) -> None:
        self.n_max, self.n_min, self.branches = n_max, n_min, branches

    @classmethod
    def build(cls, ctx: DrafterContext) -> NGramDrafter:
        return cls(branches=ctx.options.get("tree_branches", 1))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        """What followed up to ``branches`` earlier occurrences of the longest matching suffix, latest first."""
        L, found = len(tokens), []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    found.append(tokens[start + n : start + n + k])
                    if len(found) == self.branches:
                        return found
            if found:
                return found
        return found

    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.tree and self.branches > 1:
            return self._propose_tree(batch)
        props = [self.lookup(s.tokens, batch.k) for s in batch.seqs]
        out = torch.zeros(len(props), batch.k, dtype=torch.long)
        for b, p in enumerate(props):
            if p:
                out[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Proposal.chain(out.to(batch.device), None, [len(p) for p in props])

    def _propose_tree(self, batch: DraftBatch) -> Proposal:
        """Each row's continuations merged into a trie of at most ks[b] nodes, filled depth by depth (every
        continuation's next token before any goes deeper), so node order is topological."""
        B, k = len(batch.seqs), batch.k
        tokens = torch.zeros(B, k, dtype=torch.long)
        parents = torch.full((B, k), -1, dtype=torch.long)
        counts = []
        for b, s in enumerate(batch.seqs):
            conts = self.continuations(s.tokens, batch.ks[b])
            nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node
            at = [-1] * len(conts)  # each continuation's node so far (None once cut by the budget)
            for d in range(max((len(c) for c in conts), default=0)):
                for i, c in enumerate(conts):
                    if d >= len(c) or at[i] is None:
                        continue
                    node = nodes.get((at[i], c[d]))
                    if node is None and len(nodes) < batch.ks[b]:
                        node = nodes[(at[i], c[d])] = len(nodes)
                        tokens[b, node], parents[b, node] = c[d], at[i]
                    at[i] = node
            counts.append(len(nodes))
        return Proposal(tokens.to(batch.device), None, counts, parents.to(batch.device))

    def commit(self, seq: Seq, outcome: Committed) -> None:
        pass  # no state: it reads the tokens

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return 0  # it reads the tokens when it drafts

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return None  # a lookup in Python lists: nothing a device timer sees
