"""Prompt lookup (n-gram): the tokens that followed the latest earlier occurrence of the last n tokens. No model."""

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
    max_drafts: int | None = None

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    @classmethod
    def build(cls, ctx: DrafterContext) -> NGramDrafter:
        return cls()

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, batch: DraftBatch) -> Proposal:
        props = [self.lookup(s.tokens, batch.k) for s in batch.seqs]
        out = torch.zeros(len(props), batch.k, dtype=torch.long)
        for b, p in enumerate(props):
            if p:
                out[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Proposal.chain(out.to(batch.device), None, [len(p) for p in props])

    def commit(self, seq: Seq, outcome: Committed) -> None:
        pass  # no state: it reads the tokens

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return None  # a lookup in Python lists: nothing a device timer sees
