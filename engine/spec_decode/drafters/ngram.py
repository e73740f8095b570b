"""Prompt lookup (n-gram): the tokens that followed the latest earlier occurrence of the last n tokens. No model.

With ``branches`` > 1 the continuations of up to that many earlier occurrences (latest first, the longest n
that matches) are merged into one draft tree (a trie: shared prefixes once, siblings distinct), within the
row's node budget; the latest occurrence's continuation is the first branch, so one branch is the chain.

A chain's length follows its evidence: how far the match reaches back (the n tokens matched, extended backwards
while the tokens before both occurrences agree, up to ``MATCH_CAP``) predicts how many of the copied tokens the
target accepts. ``MatchAcceptance`` learns, per match length m and draft position i, the share of chains that
drafted at least i tokens and had their first i accepted, over greedy rows; a round's ``DraftBatch.min_accept`` (the
acceptance a draft token must reach to pay for its verification at the running batch, engine/runtime/draft_cost.py)
cuts each greedy row's chain before its first position below it. A sampled row drafts its whole copy and teaches the
table nothing (measured: cutting sampled rows served no faster than whole copies at temperature 0.7;
docs/performance.md, "The cut as a switch"). Drafting depends only on the committed tokens and past rounds, never on
this round's draws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import TYPE_CHECKING

import torch

from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed, SeqStates
from engine.spec_decode.proposal import Proposal

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq

MATCH_CAP = 16  # a match is measured back this far at most


class MatchAcceptance:
    """Per match length m (1..MATCH_CAP) and draft position i (1..positions): of the chains that drafted at least i
    tokens, the share whose first i were accepted. A cell starts optimistic (``prior`` pseudo-chains all
    accepted), so a cell is drafted until its own chains say it does not pay. The counts fade by 1 / ``window`` per
    round (``age``), whether or not the cell drafted: a cell the cut turned off drifts back to the prior and is
    tried again (the rarer its chains, the sooner), so the estimate follows the text."""

    def __init__(self, positions: int = 16, prior: float = 4.0, window: float = 500.0) -> None:
        self.positions, self.prior, self.window = positions, prior, window
        self._tried = [[0.0] * (positions + 1) for _ in range(MATCH_CAP + 1)]  # [m][i]
        self._hit = [[0.0] * (positions + 1) for _ in range(MATCH_CAP + 1)]

    def estimate(self, m: int, i: int) -> float:
        """The chance that a chain of match length m has its first i drafts accepted."""
        m, i = min(m, MATCH_CAP), min(i, self.positions)
        return (self._hit[m][i] + self.prior) / (self._tried[m][i] + self.prior)

    def chains(self, m: int, i: int) -> float:
        """The (faded) count of verified chains of match length m that drafted at least i tokens."""
        return self._tried[min(m, MATCH_CAP)][min(i, self.positions)]

    def length(self, m: int, k: int, min_accept: float) -> int:
        """The drafts (at most k) whose estimates all reach ``min_accept``."""
        n = 0
        while n < k and (min_accept <= 0.0 or self.estimate(m, n + 1) >= min_accept):
            n += 1
        return n

    def record(self, m: int, drafted: int, accepted: int) -> None:
        """A verified chain of ``drafted`` tokens at match length m, its first ``accepted`` accepted."""
        m, d = min(m, MATCH_CAP), min(drafted, self.positions)
        for i in range(1, d + 1):
            self._tried[m][i] += 1.0
            self._hit[m][i] += float(i <= accepted)

    def age(self) -> None:
        """One round passed: every count fades by 1 / window."""
        keep = 1.0 - 1.0 / self.window
        for table in (self._tried, self._hit):
            for row in table:
                row[:] = [x * keep for x in row]


class NGramDrafter:
    """Deterministic drafts (p one-hot): a copy of what followed the context's latest match, fewer than k or none."""

    features = FeatureNeed.NONE
    samples = False  # (proposes fixed tokens)
    max_drafts: int | None = None

    def __init__(self, n_max: int = 3, n_min: int = 1, branches: int = 1) -> None:
        self.n_max, self.n_min, self.branches = n_max, n_min, branches
        self.acceptance = MatchAcceptance()  # the greedy rows' chains
        self._chain: SeqStates[list[int]] = SeqStates(lambda: [0, 0])  # per row: [match length, drafts] proposed
        self._trees = False  # whether the last round proposed trees (a tree's path teaches the chains nothing)

    @classmethod
    def build(cls, ctx: DrafterContext) -> NGramDrafter:
        return cls(branches=ctx.options.get("tree_branches", 1))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix (n_max..n_min tokens)."""
        return self.match(tokens, k)[1]

    def _occurrences(self, tokens: list[int]) -> Iterator[tuple[int, int]]:
        """(n, start) of each earlier occurrence of the longest suffix of n_max..n_min tokens that occurred, latest
        first."""
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail, found = tokens[L - n :], False
            for start in range(L - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    found = True
                    yield n, start
            if found:
                return

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(the match length, the continuation of at most k tokens): the latest earlier occurrence of the longest
        suffix of n_max..n_min tokens, its match extended backwards up to MATCH_CAP tokens; (0, []) where none."""
        L = len(tokens)
        for n, start in self._occurrences(tokens):
            m = n
            while m < MATCH_CAP and start - (m - n) > 0 and tokens[start - (m - n) - 1] == tokens[L - m - 1]:
                m += 1
            return m, tokens[start + n : start + n + k]
        return 0, []

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        """What followed up to ``branches`` earlier occurrences of the longest matching suffix, latest first."""
        return [tokens[st + n : st + n + k] for n, st in islice(self._occurrences(tokens), self.branches)]

    def propose(self, batch: DraftBatch) -> Proposal:
        self.acceptance.age()
        self._trees = batch.tree and self.branches > 1
        if self._trees:
            return self._propose_tree(batch)
        props = []
        for s, kb in zip(batch.seqs, batch.ks):
            m, cont = self.match(s.tokens, kb)
            if s.params.greedy:  # cut where it does not pay, and what its commit teaches (a sampled row: whole copy)
                cont = cont[: self.acceptance.length(m, len(cont), batch.min_accept)]
                self._chain(s)[:] = [m, len(cont)]
            props.append(cont)
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
        """A verified chain teaches the match-length estimate (a tree's round, or none drafted, teaches nothing)."""
        chain = None if self._trees else self._chain.get(seq)  # (set for greedy rows only)
        if chain is not None and outcome.drafted:
            self.acceptance.record(chain[0], min(chain[1], outcome.verified), outcome.accepted)
            chain[:] = [0, 0]

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return 0  # it reads the tokens when it drafts

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return None  # a lookup in Python lists: nothing a device timer sees
