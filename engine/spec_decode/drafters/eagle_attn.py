"""The EAGLE head with attention (engine/spec_decode/heads/eagle_attn.py): its own static KV cache, by position.

A round first runs the entries of the positions committed since the last (the target's features the round
hands it: ``FeatureNeed.ALL``, with the tokens after them) into the cache; the last one's output scores the
first draft. Each later draft is one entry more, on the head's own feature. Entries past the committed ones
are overwritten by the next round's, so a rejection needs nothing undone. With ``tree_branches`` > 1 greedy rounds
draft EAGLE-2's dynamic tree (drafters/draft_tree.py): after the catch-up, each depth's most probable nodes run as
entries in slots of their own after the committed ones, under the tree's mask (on the one-call step where it runs),
each fed its parent's output; sampled rounds draft spine trees around their chain
(drafters/spine_tree.py). CUDA graphs of its step are not built: its step writes its own cache at per-row positions,
so asking for graphs fails at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.core.forward import KVCache, TreeMask
from engine.core.model import fuse_projections
from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed, LoadedHead, SeqStates
from engine.spec_decode.drafters.draft_tree import masked_tree
from engine.spec_decode.drafters.head_base import HeadDrafter
from engine.spec_decode.drafters.head_tree import tree_proposal
from engine.spec_decode.drafters.spine_tree import sampled_trees, spine_trees
from engine.spec_decode.heads.eagle_attn import EagleAttnHead
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.step_kernels import AttnStepKernel
from engine.spec_decode.width_groups import width_groups

if TYPE_CHECKING:
    from engine.core.model import Transformer
    from engine.spec_decode.seq import Seq


@dataclass
class _Entries:
    """The head's view of a sequence: ``hlen`` entries in its cache, the target's features after them."""

    hlen: int = 0
    pending: list[Tensor] = field(default_factory=list)  # [m, H] chunks of positions hlen.. (not yet read)


def tree_width(ctx: DrafterContext, vocab: int) -> int:
    """``tree_branches`` for a head of ``vocab`` draft tokens: a greedy depth's siblings are distinct tokens."""
    w: int = ctx.options.get("tree_branches", 1)
    if w > vocab:
        raise InvalidConfigError(
            f"speculation.tree_branches={w} is invalid with this head: allowed at most its draft vocabulary, {vocab}"
        )
    return w


def _pending(st: _Entries) -> int:
    """Entries waiting to be written into the head's cache."""
    return sum(len(p) for p in st.pending)


class EagleAttnDrafter(HeadDrafter):
    """Decoder layers over the sequence's features, drafting through a KV cache of its own."""

    head: EagleAttnHead
    features = FeatureNeed.ALL

    @classmethod
    def build(cls, ctx: DrafterContext) -> EagleAttnDrafter:
        if ctx.kernels.cuda_graphs:
            raise InvalidConfigError(
                "CUDA graphs of the EAGLE head with attention are not built: cuda_graphs=False for this head"
            )
        head, plain, _ = cls.scorer_for(ctx)
        fuse_projections(head.module)  # q/k/v and gate/up as one GEMM each, as the target's (the kernel's layout)
        kernel = ctx.kernels.attn_head_step(head.module, plain)
        d = cls(head, ctx.target_module, plain if kernel is not None else ctx.kernels.scorer(plain), kernel)
        d.branches = tree_width(ctx, plain.weight.shape[0])
        return d

    def __init__(
        self, head: LoadedHead, target: Transformer, scorer: nn.Module, kernel: AttnStepKernel | None = None
    ) -> None:
        """``kernel``: the head's layers as one C++ step (None: PyTorch's layers)."""
        super().__init__(head, target, scorer)
        self.cache: KVCache | None = None
        self._kernel = kernel
        self._entries = SeqStates(_Entries)
        self.branches = 1  # > 1: trees: EAGLE-2's for greedy batches (draft_tree.py), spine trees else (spine_tree.py)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        if self.cache is None:
            self.cache = self.head.new_cache(max_batch, max_seq_len, self.head_weight.device)
        else:
            self.cache.grow(max_batch, max_seq_len)  # its entries kept

    def commit(self, seq: Seq, outcome: Committed) -> None:
        st = self._entries(seq)
        if outcome.drafted:  # its proposal caught the head's cache up on the pending entries
            st.hlen, st.pending = st.hlen + _pending(st), []
        if outcome.features is not None:  # the committed positions' features, from hlen + the pending on
            st.pending.append(outcome.features)

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        # the features of the prompt but its last position (which each gets from the shared first scores)
        st = self._entries(src)
        assert st.hlen == 0 and st.pending
        prompt = torch.cat(st.pending)[: length - 1]
        for s in dst:
            self._entries.put(s, _Entries(0, [prompt]))

    def embed(self, tokens: Tensor) -> Tensor:
        """The embeddings the head reads (the target's)."""
        return self.target.embed_tokens(tokens)

    def _catch_up(
        self, seqs: list[Seq], scratch: int, dev: torch.device, hold: int = 0
    ) -> tuple[Tensor, Tensor, Tensor, list[int], list[bool]]:
        """Each row's entries committed since its last round but the last ``hold`` -> (features f [B, W, H], the next
        tokens [B, W], positions [B, W] (padding: the scratch slot), each row's last entry, which rows have any)."""
        H = self.cfg.hidden_size
        states = [self._entries(s) for s in seqs]
        new = [torch.cat(st.pending)[: _pending(st) - hold] if st.pending else None for st in states]
        new = [n if n is not None and len(n) else None for n in new]  # [m, H] per row, None: nothing to run
        width = max([len(n) for n in new if n is not None], default=1)
        B = len(seqs)
        f = torch.zeros(B, width, H, dtype=self.feature_dtype, device=dev)
        nxt = torch.zeros(B, width, dtype=torch.long)
        pos = torch.full((B, width), scratch, dtype=torch.long)
        last = [0] * B
        for b, (s, st, n) in enumerate(zip(seqs, states, new)):
            if n is not None:
                m = len(n)
                f[b, :m] = n
                nxt[b, :m] = torch.tensor(s.tokens[st.hlen + 1 : st.hlen + m + 1])
                pos[b, :m] = torch.arange(st.hlen, st.hlen + m)
                last[b] = m - 1
        return f, nxt.to(dev), pos.to(dev), last, [n is not None for n in new]

    @torch.no_grad()
    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        """Rows with nothing in the head's cache: their prompts' entries but the last go in now, a pass per group of
        similar width (the last one scores the first draft, in the row's first draft round)."""
        assert self.cache is not None, "ensure_cache first"
        fresh = [s for s in seqs if self._entries(s).hlen == 0 and _pending(self._entries(s)) > 1]
        dev = self.head_weight.device
        for g in width_groups([_pending(self._entries(s)) for s in fresh]):
            sub = [fresh[i] for i in g]
            f, nxt, pos, last, _ = self._catch_up(sub, scratch_pos, dev, hold=1)
            rows = torch.tensor([s.row for s in sub], device=dev)
            self._step(f, self.embed(nxt), pos, max(last) + 1, rows, torch.tensor(last, device=dev))
            for s, m in zip(sub, last):
                st = self._entries(s)
                st.hlen, st.pending = m + 1, [torch.cat(st.pending)[m + 1 :]]
        return len(fresh)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        w = self.branches
        if spine_trees(batch, w):
            return sampled_trees(batch, w, self._chain)
        if batch.processing.mode == "greedy" and batch.tree and w > 1 and not any(batch.chains or ()):
            return self._tree(batch, w)
        return self._chain(batch)  # (a row that reads its drafts in order takes a chain: the batch drafts chains)

    def _root(self, batch: DraftBatch, k: int) -> tuple[Tensor, Tensor, list[int], list[bool], int]:
        """The catch-up: each row's committed entries into the cache -> (the scores of its first draft [B, V'], the
        feature the next entry reads [B, H], its length after the catch-up, whether it has entries, the slots a
        chain of ``k`` drafts attends over)."""
        assert self.cache is not None, "ensure_cache first"
        f, nxt, pos, last, have = self._catch_up(batch.seqs, batch.scratch_pos, batch.device)
        hlens = [self._entries(s).hlen + _pending(self._entries(s)) for s in batch.seqs]  # after the catch-up
        # slots up to the last draft entry's (hlen + k - 2), padding's scratch slot aside
        kv_len = min(max([h + k for h, on in zip(hlens, have) if on], default=1), self.cache.max_seq_len)
        last_t = torch.tensor(last, device=batch.device)
        logits, g = self._step(f, self.embed(nxt), pos, kv_len, batch.rows, last_t)
        return logits, g, hlens, have, kv_len

    def _chain(self, batch: DraftBatch) -> Proposal:
        """The rows' chains of ``batch.k`` drafts: greedy, or drawn from the head's processed distributions."""
        logits, g, hlens, have, kv_len = self._root(batch, batch.k)
        scratch = batch.scratch_pos
        at = torch.tensor([h if on else scratch for h, on in zip(hlens, have)], device=batch.device)  # next entry's
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        zero = torch.zeros(len(batch.seqs), dtype=torch.long, device=batch.device)
        for j in range(batch.k):
            tok, p = self._draw(logits, batch, drafts)
            drafts.append(tok)
            if p is not None:
                probs.append(p)
            if j + 1 < batch.k:  # the entry (g, this draft) at the next position
                e = self.embed(tok)[:, None]
                logits, g = self._step(g[:, None], e, at[:, None], kv_len, batch.rows, zero)
                at = torch.where(at == scratch, at, at + 1)
        return self._result(torch.stack(drafts, 1), probs, have, batch.k, batch.k)

    def _tree(self, batch: DraftBatch, w: int) -> Proposal:
        """The rows' EAGLE-2 trees of ``batch.k`` nodes (``masked_tree``): the head's entries of each depth in the
        slots after the row's committed ones, each fed its parent's output."""
        logits, g, hlens, have, _ = self._root(batch, 1)
        B, H = g.shape
        r = torch.arange(B, device=g.device)[:, None]
        fed = [g[:, None].expand(B, w, H)]  # what each node of the newest layer is expanded with: its parent's output

        def expand(pick: Tensor, tokens: Tensor, pos: Tensor, kv_len: int, tree: TreeMask) -> Tensor:
            e = self.embed(self._target_ids(tokens))
            logits, out = self._entries_out(fed[-1][r, pick], e, pos, kv_len, batch.rows, tree)  # [B, wp, ..]
            fed.append(out[:, :, None].expand(*pick.shape, w, H).reshape(B, -1, H))
            return logits

        base = torch.tensor(hlens, device=g.device)  # each row's first free slot and its depth-1 position
        assert self.cache is not None and max(hlens) + batch.k < self.cache.max_seq_len, "the loop's K headroom"
        toks, parents = masked_tree(expand, logits, base, batch.k, w)
        return tree_proposal(self._target_ids(toks), parents, have)

    def _entries_out(
        self, f: Tensor, e: Tensor, pos: Tensor, kv_len: int, rows: Tensor | None, tree: TreeMask
    ) -> tuple[Tensor, Tensor]:
        """A tree's entries (f, e [B, T, H]) in its slots -> (the scores [B, T, V'], the outputs [B, T, H]) of every
        entry: on the C++ kernel (T entries scored per row) or PyTorch's layers."""
        assert self.cache is not None
        if self._kernel is not None:
            every = torch.arange(f.shape[1], device=f.device).expand(f.shape[0], -1)
            return self._kernel(f, e, pos, rows, self.cache, kv_len, every, tree)
        out = self.head(f, e, pos, self.cache, kv_len, rows, tree)
        return self.scores(out), out

    def _target_ids(self, t: Tensor) -> Tensor:
        """Draft-vocabulary indices -> the target's ids."""
        return t if self.vocab_ids is None else self.vocab_ids[t]

    def _step(
        self, f: Tensor, e: Tensor, pos: Tensor, kv_len: int, rows: Tensor | None, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Entries (features f, next tokens' embeddings e [B, T, H]) at pos [B, T] into the cache -> (scores over
        the draft vocabulary [B, V'], predicted features [B, H]) of each row's entry ``last`` [B]: on the C++
        kernel or PyTorch's layers."""
        assert self.cache is not None
        if self._kernel is not None:
            return self._kernel(f, e, pos, rows, self.cache, kv_len, last)
        out = self.head(f, e, pos, self.cache, kv_len, rows)
        g = out[torch.arange(len(out), device=out.device), last]
        return self.scores(g), g

    def cost_step(self, batch: int) -> Callable[[], object] | None:
        """One draft entry at position 64 of a warm cache of its own (the head's per-draft work)."""
        w = self.head_weight
        drafter = type(self)(self.loaded, self.target, self.lm_head, self._kernel)
        drafter.cache = self.head.new_cache(batch, 128, w.device)  # the engine's cache stays as it is
        f = torch.randn(batch, 1, self.cfg.hidden_size, dtype=self.feature_dtype, device=w.device)
        e = self.embed(torch.zeros(batch, 1, dtype=torch.long, device=w.device))
        pos = torch.full((batch, 1), 64, dtype=torch.long, device=w.device)
        last = torch.zeros(batch, dtype=torch.long, device=w.device)
        return lambda: drafter._step(f, e, pos, 65, None, last)[0].argmax(-1)
