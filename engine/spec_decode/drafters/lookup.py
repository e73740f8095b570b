"""Prompt lookup or a drafter, whichever drafts better for the sequence: ``LookupFirst`` wraps a draft model,
the early-exit layers or a trained head.

A row whose last n tokens (``n_min`` <= n <= ``n_max``) occurred earlier in its context can draft the tokens
that followed them there (a copy, as the n-gram drafter's); every other row drafts with the wrapped drafter.
Where a copy exists, the row takes it if copies have been drafting better than the drafter for this sequence:
each sequence keeps running means of the drafts accepted per round by copies and by the drafter. A copy's mean is
also counted on the drafter's rounds: the copy it did not take is held against the tokens committed after it,
once they tell how many of its tokens the target would have accepted. Generated text that
repeats its context (code, lists, quotes, a small model's loops) is copied at almost no cost; a drafter that
predicts better keeps its rounds.

The choice reads only committed tokens and past rounds, never this round's random draws, so the exact
rejection rule keeps the target's distribution: a copied draft's p is one-hot at the copied token. When every
row of a round copies, the wrapped drafter does not run; its state catches up the next time it drafts (it is
told it did not draft: ``Committed.drafted``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from engine.spec_decode.drafter import Committed, DraftBatch, Drafter, SeqStates
from engine.spec_decode.drafters.ngram import NGramDrafter
from engine.spec_decode.proposal import Proposal

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq


ALPHA = 0.25  # weight of a round in the running means


@dataclass
class _Record:
    """One sequence's running means of the drafts accepted per round, by copies and by the drafter."""

    copy: float = 0.0
    inner: float = 0.0
    inner_rounds: int = 0  # the drafter's rounds counted in ``inner`` (copies are preferred only after one)
    untaken: list[tuple[int, list[int]]] = field(default_factory=list)  # (where, a copy the drafter's round left)
    # this round: (its copy or [], whether it took the copy, the inner's drafts for it, whether the inner ran)
    round: tuple[list[int], bool, int, bool] | None = None

    def settle(self, tokens: list[int]) -> None:
        """Count each untaken copy whose outcome the committed tokens now tell: its first mismatch, or all of it."""
        left = []
        for n, copy in self.untaken:
            got = tokens[n : n + len(copy)]
            m = next((i for i, (c, t) in enumerate(zip(copy, got)) if c != t), len(got))
            if m < len(got) or len(got) == len(copy):
                self.copy += ALPHA * (m - self.copy)
            else:
                left.append((n, copy))
        self.untaken = left


def _cut(copy: list[int], k: int, vocab: int) -> list[int]:
    """``copy``'s first ``k`` tokens, up to the first not below ``vocab``."""
    copy = copy[:k]
    return copy[: next((i for i, t in enumerate(copy) if t >= vocab), len(copy))]


def copies_drafted_better(rec: _Record) -> bool:
    """Copies have drafted better for this sequence, once the drafter has had a round (the drafter first)."""
    return rec.inner_rounds > 0 and rec.copy > rec.inner


class LookupFirst:
    """Copies where a lookup finds one and copies have drafted better than ``inner``; ``inner`` elsewhere."""

    def __init__(
        self, inner: Drafter, n_min: int, n_max: int = 3, rule: Callable[[_Record], bool] = copies_drafted_better
    ) -> None:
        """``rule``: whether a sequence's record prefers its copy (tests fix it: every copy taken)."""
        self.inner, self.prefers_copy = inner, rule
        self.ngram = NGramDrafter(n_max=max(n_max, n_min), n_min=n_min)
        self.features, self.max_drafts, self.samples = inner.features, inner.max_drafts, inner.samples
        self._records = SeqStates(_Record)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        seqs, k = batch.seqs, batch.k
        recs = [self._records(s) for s in seqs]
        for s, r in zip(seqs, recs):
            r.settle(s.tokens)
        # each row's own K_b: its copy is never longer, whatever the batch
        found = [self.ngram.lookup(s.tokens, kb) for s, kb in zip(seqs, batch.ks)]
        take = [bool(c) and self.prefers_copy(r) for c, r in zip(found, recs)]
        ran = not all(take)
        if ran:
            inner = self.inner.propose(batch)
            drafts, probs, num = inner.tokens.clone(), inner.probs, inner.row_counts()
            parents = None if inner.parents is None else inner.parents.clone()  # the drafter's trees
            # a row the drafter has nothing for (a head before the row's first feature) takes its copy
            take = [t or (bool(c) and not n) for t, c, n in zip(take, found, num)]
        else:
            drafts, probs, num = torch.zeros(len(seqs), k, dtype=torch.long), None, [0] * len(seqs)
            parents = None
        # a drafter may propose fewer than k (Medusa: one per head); a token outside the common vocabulary has
        # no p, so a copy stops before it (and, left empty, is not taken)
        found = [_cut(c, drafts.shape[1], batch.vocab) for c in found]
        copies = [c if t else [] for c, t in zip(found, take)]
        for r, c, n in zip(recs, found, num):
            r.round = (c, False, n, ran)
        for b, c in enumerate(copies):
            if not c:
                continue
            recs[b].round = (found[b], True, num[b], ran)
            drafts[b, : len(c)] = torch.tensor(c, dtype=torch.long)
            num[b] = len(c)
            if parents is not None:  # a copy is a chain in a batch of trees
                parents[b] = torch.arange(-1, parents.shape[1] - 1, device=parents.device)
            if probs is not None:  # p of a copied token: one-hot (a deterministic draft)
                probs[b] = 0
                probs[b, torch.arange(len(c)), torch.tensor(c)] = 1
        counts = None if all(n == k for n in num) else num
        return Proposal(drafts.to(batch.device), probs, counts, None if parents is None else parents.to(batch.device))

    def commit(self, seq: Seq, outcome: Committed) -> None:
        rec = self._records.get(seq)
        row = None if rec is None else rec.round
        if rec is None or row is None or not outcome.drafted:  # no round of ours: the inner keeps its state
            if rec is not None:
                rec.round = None  # a round that failed after proposing is not this one
            self.inner.commit(seq, replace(outcome, drafted=False))
            return
        rec.round = None
        copy, took, n_inner, ran = row
        if took:
            rec.copy += ALPHA * (outcome.accepted - rec.copy)
        elif n_inner:
            rec.inner += ALPHA * (outcome.accepted - rec.inner)
            rec.inner_rounds += 1
            if copy:
                rec.untaken.append((outcome.n_before, copy))
        # the inner's state holds its own drafts, not a copy's
        self.inner.commit(seq, replace(outcome, accepted=0 if took else outcome.accepted, drafted=ran))

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        self.inner.ensure_cache(max_batch, max_seq_len)

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        self.inner.share_prefill(src, dst, length)

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return self.inner.catch_up(seqs, scratch_pos)

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return self.inner.cost_step(batch)  # the cost model keeps the drafter's c
