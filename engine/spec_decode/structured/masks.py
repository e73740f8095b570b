"""A round's grammar work: the masks of every drafted and verified position, forced drafts, copy drafts cut.

Exactness. Position j of a constrained row is processed (for the target and for a model drafter alike, through
``RowProcessing.probs_at``) with the tokens its grammar allows after the row's committed output and the round's
drafts d_0 .. d_{j-1}: the mask is one more history-dependent processor, applied after the penalties and before
temperature, top-k, top-p and min-p. A model drafter's drawn drafts are therefore always valid. An all-greedy batch
keeps its fast path: drafters take their unmasked argmax (deterministic, so cut like copies) and the target's
argmax is taken within the mask (``RowProcessing.greedy_at``). Deterministic drafts
(lookups) and forced drafts are functions of the committed tokens only, so cutting a row's drafts at their first
token the grammar refuses, or replacing them with the tokens the grammar forces, changes no random draw: the
acceptance rule (engine/spec_decode/rejection.py) stays exact and greedy output stays token-identical.

Masks are memoized per (row, draft prefix): the drafter's steps and the verify read the same ones, so a round
computes K + 1 masks per constrained row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.spec_decode.proposal import Proposal
from engine.spec_decode.structured.grammar import GrammarState, unpack


class GrammarRound:
    """The grammar side of one round over rows whose ``states`` are their matchers (None: unconstrained)."""

    def __init__(self, states: Sequence[GrammarState | None], ks: Sequence[int], vocab: int, device: torch.device):
        """``ks``: each row's K_b (forced drafts never exceed it: the round drew noise for K_b positions)."""
        self.states, self.vocab, self.device = list(states), vocab, device
        self.forced = [[] if st is None else st.forced(k) for st, k in zip(self.states, ks)]
        self.seconds = [0.0] * len(self.states)  # mask time per row this round
        self.dead = [False] * len(self.states)  # the committed state has no continuation
        self._memo: list[dict[tuple[int, ...], Tensor]] = [{} for _ in self.states]  # draft prefix -> bitmask
        self._paths: list[list[tuple[int, ...]] | None] = [None] * len(self.states)  # a tree row's column prefixes

    @property
    def all_forced(self) -> bool:
        """Every row is constrained and has forced tokens: the round needs no drafter."""
        return all(st is not None and f for st, f in zip(self.states, self.forced))

    def allowed(self, drafts: Tensor | None, start: int, positions: int) -> Tensor:
        """[B, P, V] bool: what each row may emit at draft positions start .. start+P-1 (drafts [B, >= start+P-1]:
        the round's drafts so far; a tree row's columns: after the root, then after each node's path); every token
        for unconstrained rows."""
        B, W = len(self.states), (self.vocab + 31) // 32
        bits = torch.full((B, positions, W), -1, dtype=torch.int32)  # all allowed
        rows = drafts.tolist() if drafts is not None and any(self.states) else [[] for _ in range(B)]
        for b, st in enumerate(self.states):
            if st is None:
                continue
            t0 = time.perf_counter()
            memo, paths = self._memo[b], self._paths[b]
            cols = range(start, start + positions)
            keys = [tuple(rows[b][:j]) if paths is None else paths[j] if j < len(paths) else () for j in cols]
            missing = list(dict.fromkeys(k for k in keys if k not in memo))
            if missing:
                masks, dead = st.masks(missing)
                memo.update(zip(missing, masks))
                self.dead[b] = self.dead[b] or dead
            bits[b] = torch.stack([memo[k] for k in keys])
            self.seconds[b] += time.perf_counter() - t0
        return unpack(bits.to(self.device), self.vocab)

    def constrain(self, prop: Proposal) -> Proposal:
        """``prop`` with each constrained row's drafts replaced by its forced tokens where the grammar forces any
        (``forced[b]``: the drafter's drafts for that row are not verified), else cut at their first refused token
        (deterministic drafts: before it; drawn ones, whose drafter masks its distribution and so never draws one:
        after it). A tree row (deterministic drafts) keeps the nodes whose path the grammar accepts, each branch
        walked alone."""
        prop, host = self._pruned(prop)
        counts = prop.row_counts()
        for b, st in enumerate(self.states):
            if st is None:
                continue
            if self.forced[b]:
                counts[b] = len(self.forced[b])
            elif self._paths[b] is None:
                valid = st.valid_prefix(host[b][: counts[b]])
                # a drawn draft the grammar refuses stays: q = 0 rejects it surely, and cutting on a draw is not exact
                counts[b] = valid if prop.probs is None else min(counts[b], valid + 1)
        width = max(counts, default=0)
        tokens, probs, parents = _resized(prop, width)
        for b, f in enumerate(self.forced):
            if f:
                tokens[b, : len(f)] = torch.tensor(f, dtype=tokens.dtype)
                self._paths[b] = None
                if probs is not None:
                    probs[b, : len(f)] = 0.0
                    idx = torch.arange(len(f), device=probs.device)
                    probs[b, idx, tokens[b, : len(f)].to(probs.device)] = 1.0
                if parents is not None:
                    parents[b] = torch.arange(-1, width - 1)
        dev = prop.tokens.device
        if parents is None or width == 0:
            return Proposal(tokens.to(dev), probs, counts)
        return Proposal(tokens.to(dev), probs, counts, parents.to(dev)).simplified()

    def _pruned(self, prop: Proposal) -> tuple[Proposal, list[list[int]]]:
        """A tree proposal with each constrained row's nodes whose path the grammar refuses (and so their subtrees)
        dropped, the rest renumbered in order; ``_paths`` set to each kept node's path (column n + 1). Also its
        tokens on the host."""
        tokens = prop.tokens.tolist()
        if prop.parents is None or prop.probs is not None:  # drawn trees: constrained rows took their first branch
            return prop, tokens
        parents, counts = prop.parents.tolist(), prop.row_counts()
        for b, st in enumerate(self.states):
            if st is None or self.forced[b]:
                continue
            path: dict[int, tuple[int, ...]] = {-1: ()}
            kept: list[int] = []
            for n in range(counts[b]):
                p = parents[b][n]
                if p in path and st.valid_prefix(path[p] + (tokens[b][n],)) == len(path[p]) + 1:
                    path[n] = path[p] + (tokens[b][n],)
                    kept.append(n)
            new = {old: i for i, old in enumerate(kept)}
            tokens[b][: len(kept)] = [tokens[b][n] for n in kept]
            parents[b][: len(kept)] = [new.get(parents[b][n], -1) for n in kept]
            counts[b] = len(kept)
            self._paths[b] = [()] + [path[n] for n in kept]
        dev = prop.tokens.device
        return Proposal(torch.tensor(tokens, device=dev), None, counts, torch.tensor(parents, device=dev)), tokens


def _resized(prop: Proposal, width: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Copies of the proposal's tokens (on the host), probs and parents, cut or zero-padded to ``width`` nodes."""
    B, N = prop.tokens.shape
    keep = min(N, width)
    tokens = torch.zeros(B, width, dtype=torch.long)
    tokens[:, :keep] = prop.tokens[:, :keep].cpu()
    probs = None
    if prop.probs is not None:
        probs = prop.probs.new_zeros(B, width, prop.probs.shape[-1])
        probs[:, :keep] = prop.probs[:, :keep]
    parents = None
    if prop.parents is not None:
        parents = torch.arange(-1, width - 1).repeat(B, 1)
        parents[:, :keep] = prop.parents[:, :keep].cpu()
    return tokens, probs, parents
