"""Prompt lookup first, a drafter otherwise: ``LookupFirst`` wraps a draft model, the early-exit layers or a
trained head.

A row whose last n tokens (``n_min`` <= n <= ``n_max``) occurred earlier in its context drafts the tokens that
followed them there, as the n-gram drafter does; every other row drafts with the wrapped drafter. Generated
text that repeats its context (code, lists, quotes, a model's own loops) is copied at almost no cost, and the
drafter covers the rest. The choice reads only committed tokens, never this round's random draws, so the
exact rejection rule keeps the target's distribution: a copied draft's p is one-hot at the copied token.

When every row of a round finds a match, the wrapped drafter does not run that round; its state catches up
the next time it drafts (a draft model's cache from ``Seq.dlen``, the attention head's from ``Seq.hlen``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.spec.drafters import DraftBatch, Drafter, NGramDrafter

if TYPE_CHECKING:
    from engine.spec.seq import Seq


class LookupFirst:
    """The n-gram drafter's lookup where it finds a match, ``inner`` elsewhere (the same interface as both)."""

    def __init__(self, inner: Drafter, n_min: int, n_max: int = 3) -> None:
        self.inner = inner
        self.ngram = NGramDrafter(n_max=max(n_max, n_min), n_min=n_min)
        self.probabilistic = inner.probabilistic
        # the loop's questions to a head drafter (engine/spec/head_drafters.py) are the inner's
        self.needs_features: bool = getattr(inner, "needs_features", False)
        self.needs_all_features: bool = getattr(inner, "needs_all_features", False)
        self.step_fn = getattr(inner, "step_fn", None)  # the cost of a draft step is the inner's
        # this round: rows the inner drafted for -> whether its drafts were kept (False: overridden by a copy)
        self._inner_rows: dict[int, bool] = {}

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        seqs, k = batch.seqs, batch.k
        copies = [self.ngram.lookup(s.tokens, k) for s in seqs]
        found = [bool(c) for c in copies]
        dev = batch.target_cache.k.device
        if all(found):
            self._inner_rows = {}
            drafts, probs = torch.zeros(len(seqs), k, dtype=torch.long), None
            num = [0] * len(seqs)
        else:
            drafts, probs, num_inner = self.inner.propose(batch)
            self._inner_rows = {id(s): not f for s, f in zip(seqs, found)}
            num = list(num_inner) if num_inner is not None else [k] * len(seqs)
            drafts = drafts.clone()
        for b, c in enumerate(copies):
            if not c:
                continue
            drafts[b, : len(c)] = torch.tensor(c, dtype=torch.long)
            num[b] = len(c)
            if probs is not None:  # p of a copied token: one-hot (a deterministic draft)
                probs[b] = 0
                probs[b, torch.arange(len(c)), torch.tensor(c)] = 1
        return drafts.to(dev), probs, (None if all(n == k for n in num) else num)

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        kept = self._inner_rows.get(id(seq))
        if kept is not None:  # the inner drafted for this row: its state holds its own drafts, not the copies
            self.inner.after_verify(seq, n_before, accepted if kept else 0, k)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        self.inner.ensure_cache(max_batch, max_seq_len)

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        self.inner.share_prefill(src, dst, length)
