"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft trees of the continuations seen after the context's
suffix, in the request's own prompt + output and in recent requests' outputs. No model.

Each request has a suffix tree over its prompt and committed output (``RequestSuffixIndex``), caught up with the
tokens committed since its last round when it drafts; a finished request's output goes into the drafter's
``GlobalSuffixIndex`` (bounded in tokens, least recently used requests evicted; shared by threads). A row matches
the last ``max_match`` tokens of its context in both trees and takes the higher-scoring tree of continuations
(engine/spec_decode/drafters/suffix_index.py: frequency-scored, best-first within the row's K_b nodes, cut at
``min_token_prob`` and at match_len * ``max_spec_factor``); ``tree=False`` takes the best path, a chain. A row
with no match drafts nothing. Drafts are deterministic: p is one-hot at each node.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed
from engine.spec_decode.drafters.suffix_index import (
    Draft,
    GlobalSuffixIndex,
    RequestSuffixIndex,
    SpecParams,
    suffix_tree_class,
)
from engine.spec_decode.proposal import Proposal

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """One live request: its suffix tree, and its token list (the ``Seq``'s own list: read at retirement)."""

    key: int
    index: RequestSuffixIndex
    tokens: list[int]
    prompt_len: int
    retired: bool = False


class SuffixDrafter:
    """Deterministic draft trees (or chains) from suffix trees of the request and of recent outputs."""

    features = FeatureNeed.NONE
    samples = False  # (proposes fixed tokens)
    max_drafts: int | None = None

    def __init__(
        self,
        tree: bool = True,
        max_depth: int = 64,
        max_match: int = 32,
        max_tokens: int = 1 << 20,
        params: SpecParams = SpecParams(),
        index: GlobalSuffixIndex | None = None,
    ) -> None:
        """``tree``: draft trees (else the best path); ``max_depth``: the suffix trees' depth (a match plus its
        continuation); ``max_match``: the longest context suffix matched; ``max_tokens``: the global index's bound
        (0: no global index, each request drafts from its own tokens only; ignored with ``index``, a global index
        to share). Refuses at once without the ``suffix`` extra."""
        suffix_tree_class()  # SuffixDecodingUnavailableError naming the extra
        if not 1 <= max_match < max_depth:
            raise ValueError(f"max_match={max_match} is invalid: allowed 1..max_depth-1 ({max_depth - 1})")
        self.tree, self.max_depth, self.max_match, self.params = tree, max_depth, max_match, params
        self.index = index if index is not None or max_tokens == 0 else GlobalSuffixIndex(max_depth, max_tokens)
        self._live: weakref.WeakKeyDictionary[Seq, _Request] = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()  # guards _live; finalizers retire requests from any thread
        self._keys = itertools.count()

    @classmethod
    def build(cls, ctx: DrafterContext) -> SuffixDrafter:
        """The registry's factory: trees when ``tree_branches`` > 1 (their shape is the counts'), else chains."""
        shared = ctx.options.get("suffix_global_tokens")
        return cls(tree=ctx.options.get("tree_branches", 1) > 1, max_tokens=1 << 20 if shared is None else shared)

    def propose(self, batch: DraftBatch) -> Proposal:
        self.retire_finished()
        B, k = len(batch.seqs), batch.k
        tokens = torch.zeros(B, k, dtype=torch.long)
        parents = torch.full((B, k), -1, dtype=torch.long)
        counts, tree = [], self.tree and batch.tree
        for b, s in enumerate(batch.seqs):
            d = self.draft(s, min(batch.ks[b], k), tree)
            n = len(d.tokens)
            if n:
                tokens[b, :n] = torch.tensor(d.tokens, dtype=torch.long)
                parents[b, :n] = torch.tensor(d.parents, dtype=torch.long)
            counts.append(n)
        if not tree:
            return Proposal.chain(tokens.to(batch.device), None, counts)
        return Proposal(tokens.to(batch.device), None, counts, parents.to(batch.device))

    def draft(self, s: Seq, budget: int, tree: bool) -> Draft:
        """The row's tree (a path where ``tree`` is False) of at most ``budget`` nodes: the request's or the global
        one, the higher score."""
        req = self._request(s)
        req.index.catch_up(s.tokens)
        context = s.tokens[-(self.max_match + 1) :]  # matches of 1 .. max_match tokens are tried
        own = req.index.speculate(context, budget, self.params, tree)
        if self.index is None:
            return own
        other = self.index.speculate(context, budget, self.params, tree)
        return own if own.score >= other.score else other

    def commit(self, seq: Seq, outcome: Committed) -> None:
        """The request's tree catches up with its committed tokens (this round's come at its next draft)."""
        req = self._live.get(seq)
        if req is not None:
            req.index.catch_up(seq.tokens)

    def retire_finished(self) -> None:
        """Move finished requests' outputs into the global index (a request dropped earlier goes when collected)."""
        with self._lock:
            done = [(s, r) for s, r in self._live.items() if s.finished]
            for s, _ in done:
                del self._live[s]
        for _, r in done:
            self._retire(r)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # each request's tree is built from its own tokens when it drafts

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return 0  # likewise

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return None  # C++ lookups on the host: nothing a device timer sees

    def _request(self, s: Seq) -> _Request:
        with self._lock:
            req = self._live.get(s)
            if req is None:
                req = _Request(next(self._keys), RequestSuffixIndex(self.max_depth), s.tokens, len(s.prompt))
                self._live[s] = req
                fin = weakref.finalize(s, self._retire, req)
                fin.atexit = False
            return req

    def _retire(self, req: _Request) -> None:
        """A finished (or collected) request's output into the global index, once."""
        with self._lock:
            if req.retired:
                return
            req.retired = True
        out = req.tokens[req.prompt_len :]
        if out and self.index is not None:
            self.index.add(req.key, out)
            log.debug("suffix index: request %d's %d output tokens added", req.key, len(out))
