"""What a drafter proposes: a draft tree per row of the batch. A chain is the one-branch tree.

Node n of row b is the token ``tokens[b, n]``; its parent is ``parents[b, n]`` (-1: the root, the row's last
committed token), so its depth is one more than its parent's; ``probs[b, n]`` is the draft distribution it was
drawn from (None: one-hot at the token, a deterministic drafter). Rows may have fewer nodes than the batch's
widest (``counts``); entries past a row's count are padding. Nodes are in topological order (a parent before
its children), which every chain is; siblings are distinct tokens, except where they are independent draws from
their parent's distribution (a sampled tree: ``probs`` given; drafters/spine_tree.py). The verify pass
(engine/spec_decode/verify.py) scores every node in one target pass (a tree attention mask, engine/spec_decode/tree.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.spec_decode.tree import depths


@dataclass(frozen=True)
class Proposal:
    """A batch's draft trees (chains unless ``parents`` is given)."""

    tokens: Tensor
    """[B, N] int64 draft token ids, node n of row b (padding past ``counts[b]``)."""
    probs: Tensor | None = None
    """[B, N, V] float32 draft distribution of each node (after the target's processing); None: one-hot."""
    counts: list[int] | None = None
    """Nodes per row (<= N); None: N for every row."""
    parents: Tensor | None = None
    """[B, N] int64 parent node of each node (-1: the root); None: a chain, node n's parent is n - 1."""

    @classmethod
    def chain(cls, tokens: Tensor, probs: Tensor | None = None, counts: list[int] | None = None) -> Proposal:
        """K drafts per row in order: d_1 .. d_K, each the child of the one before."""
        return cls(tokens, probs, counts)

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> Proposal:
        """No drafts for any row."""
        return cls(torch.zeros(rows, 0, dtype=torch.long, device=device), None, [0] * rows)

    @property
    def width(self) -> int:
        """N: nodes of the widest row."""
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def row_counts(self) -> list[int]:
        """Nodes per row."""
        return list(self.counts) if self.counts is not None else [self.width] * self.tokens.shape[0]

    def depth(self) -> Tensor:
        """[B, N] int64 depth of each node (1: a child of the root)."""
        B, N = self.tokens.shape
        if self.parents is None:
            return torch.arange(1, N + 1, device=self.tokens.device).expand(B, N)
        return depths(self.parents)

    def cut(self, ks: list[int]) -> Proposal:
        """At most ks[b] nodes per row, the first in order (a tree stays a tree: parents come first), and the
        width cut to the widest row."""
        counts = [min(k, n) for k, n in zip(ks, self.row_counts())]
        width = max(counts, default=0)
        probs = None if self.probs is None else self.probs[:, :width]
        parents = None if self.parents is None or width == 0 else self.parents[:, :width]
        return Proposal(self.tokens[:, :width], probs, counts, parents)

    def simplified(self) -> Proposal:
        """The same drafts without ``parents`` when every row's tree is a chain in node order (node n's parent
        n - 1): the chain layout is the cheaper verify (no tree mask; the one-call CPU step takes it)."""
        if self.parents is None:
            return self
        chain = torch.arange(-1, self.width - 1, device=self.parents.device).expand_as(self.parents)
        counts = torch.tensor(self.row_counts(), device=self.parents.device)
        real = torch.arange(self.width, device=self.parents.device)[None] < counts[:, None]
        if bool(((self.parents == chain) | ~real).all()):
            return Proposal(self.tokens, self.probs, self.counts)
        return self

    def first_branches(self, rows: list[int]) -> Proposal:
        """The tree with ``rows`` cut to their first branch (from the root, each node's first child), laid out as
        a chain in node order 0, 1, ..: for rows whose processing reads the drafts in chain order (penalties)."""
        if self.parents is None or not rows:
            return self
        tokens, parents, counts = self.tokens.clone(), self.parents.clone(), self.row_counts()
        probs = None if self.probs is None else self.probs.clone()
        par = self.parents.tolist()
        for b in rows:
            path, cur = [], -1
            for n in range(counts[b]):
                if par[b][n] == cur:
                    path.append(n)
                    cur = n
            idx = torch.tensor(path, dtype=torch.long, device=tokens.device)
            tokens[b, : len(path)] = self.tokens[b, idx]
            if probs is not None:
                probs[b, : len(path)] = self.probs[b, idx]  # type: ignore[index]
            parents[b] = torch.arange(-1, self.width - 1, device=tokens.device)
            counts[b] = len(path)
        return Proposal(tokens, probs, counts, parents)
