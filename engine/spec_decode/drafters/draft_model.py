"""A small draft model with its own static KV cache, proposing by sampling its own distribution."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.core.forward import CachedForward, ForwardCall, KVCache
from engine.spec_decode.costs import cached_forward
from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed, SeqStates
from engine.spec_decode.drafters.draft_tree import model_tree
from engine.spec_decode.drafters.spine_tree import sampled_trees, spine_trees
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.sampling import sample_from_probs
from engine.spec_decode.width_groups import width_groups

if TYPE_CHECKING:
    from engine.core.model import Transformer
    from engine.spec_decode.seq import Seq


def catch_up_batch(
    seqs: list[Seq], starts: list[int], scratch_pos: int, device: torch.device, ends: list[int] | None = None
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Right-padded tokens [B,T] of seq.tokens[start:end] (``ends`` None: to the end), their positions [B,T]
    (padding -> scratch), the last real index per row [B], and kv_len (1 + the largest real position)."""
    stops = ends if ends is not None else [len(s.tokens) for s in seqs]
    chunks = [s.tokens[st:e] for s, st, e in zip(seqs, starts, stops)]
    T = max(len(c) for c in chunks)
    toks = torch.zeros(len(seqs), T, dtype=torch.long)
    pos = torch.full((len(seqs), T), scratch_pos, dtype=torch.long)
    for b, (c, st) in enumerate(zip(chunks, starts)):
        toks[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        pos[b, : len(c)] = torch.arange(st, st + len(c))
    last = torch.tensor([len(c) - 1 for c in chunks], dtype=torch.long)
    kv_len = max(st + len(c) for c, st in zip(chunks, starts))
    return toks.to(device), pos.to(device), last.to(device), kv_len


@dataclass
class _Fed:
    """Committed tokens whose keys and values are in the drafter's cache (the rest are fed next round)."""

    dlen: int = 0
    tree: bool = False  # the last proposal was a tree (its slots are not kept)


class ModelDrafter:
    """A draft model (or the target's first layers: engine/spec_decode/drafters/early_exit.py)."""

    features = FeatureNeed.NONE
    samples = True
    max_drafts: int | None = None

    def __init__(self, model: CachedForward, module: Transformer, n_layers: int | None = None) -> None:
        """``model``: its forward (CUDA-graphed when graphs are on); ``module``: the model itself (cache shape
        and dtype, costs); ``n_layers``: run only the first n layers."""
        self.model, self.module, self.n_layers = model, module, n_layers
        self.cache: KVCache | None = None
        self._fed = SeqStates(_Fed)
        self.branches = 1  # > 1: trees: EAGLE-2's for greedy batches (draft_tree.py), i.i.d. ones else (spine_tree.py)

    @classmethod
    def build(cls, ctx: DrafterContext) -> ModelDrafter:
        assert ctx.draft_model is not None and ctx.draft_module is not None, "the entry loads a draft model"
        d = cls(ctx.draft_model, ctx.draft_module)
        d.branches = ctx.options.get("tree_branches", 1)
        return d

    def cached_length(self, seq: Seq) -> int:
        """Committed tokens of ``seq`` whose keys and values are in the draft cache."""
        return self._fed(seq).dlen

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate the draft's own static cache, or grow it keeping what its rows hold."""
        if self.cache is None:
            m = self.module  # the compute dtype (an FP8 draft's e4m3 tables and weights are storage only)
            self.cache = KVCache(m.config, max_batch, max_seq_len, m.dtype, m.device)
        else:
            self.cache.grow(max_batch, max_seq_len)

    def _start(self, seq: Seq) -> int:
        return self._fed(seq).dlen

    def _cache(self, batch: DraftBatch) -> KVCache:
        assert self.cache is not None, "ensure_cache first"
        return self.cache

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        seqs, V = batch.seqs, batch.vocab
        cache = self._cache(batch)
        starts = self._prefeed(batch, [self._start(s) for s in seqs], cache)
        toks, pos, last, kv_len = catch_up_batch(seqs, starts, batch.scratch_pos, batch.device)
        n_tok = [len(s.tokens) for s in seqs]
        greedy = batch.processing.mode == "greedy"  # p is one-hot at the argmax: no distribution to keep
        aligned = batch.rows is None and len(set(starts)) == 1 and len(set(n_tok)) == 1  # no padding anywhere
        call = ForwardCall(toks, pos, cache, kv_len, batch.rows, last, self.n_layers, starts[0] if aligned else None)
        tree = greedy and batch.tree and self.branches > 1 and self.n_layers is None
        for s in seqs:
            self._fed(s).tree = tree
        if tree:
            root = self.model.run(call).logits[:, :V]
            drafts, parents = model_tree(self.model, cache, batch.rows, root, n_tok, batch.k, self.branches)
            return Proposal(drafts, None, None, parents)
        if greedy:  # the C++ step drafts all k in one call where it runs this model
            head = ForwardCall(toks, pos, cache, kv_len, batch.rows, None, self.n_layers)
            drafts = self.model.greedy_draft(head, last, batch.k, V)
            if drafts is not None:
                return Proposal.chain(drafts)
        logits = self.model.run(call).logits

        def chain(b: DraftBatch) -> Proposal:
            drafts, probs = self._steps(b, logits, cache, kv_len, n_tok, aligned)
            return Proposal.chain(torch.stack(drafts, 1), torch.stack(probs, 1) if probs else None)

        if spine_trees(batch, self.branches) and self.n_layers is None:
            for s in seqs:  # the cache holds the spines: the next catch-up feeds the committed tokens over them
                self._fed(s).tree = True
            return sampled_trees(batch, self.branches, chain)
        return chain(batch)

    def _prefeed(self, batch: DraftBatch, starts: list[int], cache: KVCache) -> list[int]:
        """Rows with a prompt to catch up (more than a round's tokens) beside rows a round behind, or prompts of
        different lengths: the far rows' tokens but their last go into the cache first, a pass per group of similar
        width (engine/spec_decode/width_groups.py), so that the catch-up pass does not pad every row to a prompt's
        width. Returns the rows' starts after it (unchanged where it does not pay)."""
        seqs, B = batch.seqs, len(batch.seqs)
        behind = [len(s.tokens) - st for s, st in zip(seqs, starts)]
        far = [b for b in range(B) if behind[b] > batch.k + 1]
        if not far:  # every row a round behind at most (a decoding step)
            return starts
        groups = [[far[i] for i in g] for g in width_groups([behind[b] for b in far])]
        near_w = max((n for n in behind if n <= batch.k + 1), default=1)
        if len(groups) == 1 and (len(far) == B or (B - len(far)) * (max(behind) - near_w) <= B):
            return starts  # one group and little padding: the catch-up pass does it
        out = list(starts)
        for g in groups:
            ends = self._feed([seqs[b] for b in g], [starts[b] for b in g], batch.scratch_pos, cache)
            for b, e in zip(g, ends):
                out[b] = e
        return out

    def _feed(self, seqs: list[Seq], starts: list[int], scratch_pos: int, cache: KVCache) -> list[int]:
        """One pass feeding each row's tokens from its start but the last into ``cache``; returns the ends."""
        dev = self.module.device
        ends = [len(s.tokens) - 1 for s in seqs]
        toks, pos, _, kv_len = catch_up_batch(seqs, starts, scratch_pos, dev, ends)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        first = torch.zeros(len(seqs), dtype=torch.long, device=dev)  # one column scored (unused)
        self.model.run(ForwardCall(toks, pos, cache, kv_len, rows, first, self.n_layers))
        return ends

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        """Rows with nothing in the draft cache (the target has prefilled their prompts, nothing drafted yet): their
        tokens but the last go in now, a pass per group of similar width, ahead of their first draft round."""
        assert self.cache is not None, "ensure_cache first"
        new = [s for s in seqs if self._fed(s).dlen == 0 and len(s.tokens) > 2]
        for g in width_groups([len(s.tokens) for s in new]):
            sub = [new[i] for i in g]
            for s, end in zip(sub, self._feed(sub, [0] * len(sub), scratch_pos, self.cache)):
                self._fed(s).dlen = end
        return len(new)

    def _steps(
        self, batch: DraftBatch, logits: Tensor, cache: KVCache, kv_len: int, n_tok: list[int], aligned: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The k drafts from the catch-up pass's logits [B, V]: one one-token step per later draft."""
        greedy, V = batch.processing.mode == "greedy", batch.vocab
        next_pos = torch.tensor(n_tok, device=batch.device)  # where d1 goes
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        for i in range(batch.k):
            if greedy:
                d = logits[:, :V].argmax(-1)
            else:
                # penalties count this round's earlier drafts too
                prev = torch.stack(drafts, 1) if drafts and batch.processing.reads_drafts else None
                p = batch.processing.probs_at(logits[:, None, :V], prev, i)[:, 0]
                assert batch.noise is not None
                d = sample_from_probs(p, batch.noise[:, i])
                probs.append(p)
            drafts.append(d)
            if i + 1 < batch.k:
                kv_len += 1
                start = n_tok[0] + i if aligned else None
                step = ForwardCall(
                    d[:, None],
                    (next_pos + i)[:, None],
                    cache,
                    kv_len,
                    batch.rows,
                    torch.zeros_like(d),
                    self.n_layers,
                    start,
                )
                logits = self.model.run(step).logits
        return drafts, probs

    def commit(self, seq: Seq, outcome: Committed) -> None:
        if not outcome.drafted:  # it did not run for this row: its cache catches up when it next drafts
            return
        fed = self._fed(seq)  # a chain fed the committed tokens, then d1..d_{k-1}: the accepted ones stay valid
        fed.dlen = outcome.n_before + (0 if fed.tree else min(outcome.accepted, outcome.k - 1))

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # the source's first step drafts nothing, so its draft cache is empty: each row catches up (catch_up)

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        return cached_forward(self.module, 1, batch=batch)
