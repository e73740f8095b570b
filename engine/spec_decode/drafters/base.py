"""Drafters: who proposes the K tokens the target verifies.

All drafters share one small interface. ``propose`` gets the batch (its
sequences, their cache rows, the per-row sampling tensors and up-front noise)
and returns the drafted ids, the draft distributions (None for a deterministic
drafter, whose p is one-hot) and how many drafts each row really has.

- ``ModelDrafter``: a small draft model with its own static KV cache.
- ``EarlyExitDrafter``: the first L layers of the target, with the target's final
  norm and LM head; it shares the target's cache (layers < L), because the
  verify pass rewrites the same positions with the same tokens.
- ``NGramDrafter``: prompt lookup; no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from engine.core.model import KVCache, Transformer
from engine.spec_decode.sampling import RowProcessing, sample_from_probs

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq

DRAFTERS = ("model", "ngram", "early-exit", "medusa", "eagle")  # the last two: spec/head_drafters.py


@dataclass
class DraftBatch:
    seqs: list[Seq]
    rows: Tensor | None  # [B] cache rows (None: rows 0..B-1)
    processing: RowProcessing  # per-row temperature / top-k / top-p, the same as the target's
    k: int  # drafts to propose per row (the batch's largest K_b)
    noise: Tensor | None  # [B, k, V] float32 Exp(1), one vector per draft step; None for an all-greedy batch
    vocab: int  # common vocabulary of draft and target (logits are cut to it)
    scratch_pos: int  # cache slot written by padding
    target_cache: KVCache  # the target's cache (the early-exit drafter writes its first layers)
    ks: list[int] | None = None  # each row's own K_b <= k (None: k for every row)


class Drafter(Protocol):
    probabilistic: bool

    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        """-> draft ids [B,k] int64, draft probs [B,k,V] float32 | None, drafts per row (None: k each)."""
        ...

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Make room for max_batch rows of max_seq_len positions (the same length as the target's cache)."""
        ...

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        """Called once per sequence after its round: n_before committed tokens, `accepted` drafts kept."""
        ...

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        """``src`` has just prefilled its prompt (``length`` tokens) and ``dst`` (same prompt) start from it: give
        them its state of those positions, or leave them as they are (fresh) to prefill themselves."""
        ...


def catch_up_batch(
    seqs: list[Seq], starts: list[int], scratch_pos: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Right-padded tokens [B,T] of seq.tokens[start:], their positions [B,T] (padding -> scratch),
    the last real index per row [B], and kv_len (1 + the largest real position)."""
    chunks = [s.tokens[st:] for s, st in zip(seqs, starts)]
    T = max(len(c) for c in chunks)
    toks = torch.zeros(len(seqs), T, dtype=torch.long)
    pos = torch.full((len(seqs), T), scratch_pos, dtype=torch.long)
    for b, (c, st) in enumerate(zip(chunks, starts)):
        toks[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        pos[b, : len(c)] = torch.arange(st, st + len(c))
    last = torch.tensor([len(c) - 1 for c in chunks], dtype=torch.long)
    kv_len = max(st + len(c) for c, st in zip(chunks, starts))
    return toks.to(device), pos.to(device), last.to(device), kv_len


class ModelDrafter:
    """A draft model (or the target's first layers) proposing by sampling its own distribution."""

    probabilistic = True

    def __init__(self, model: Transformer, cache: KVCache | None, n_layers: int | None = None) -> None:
        self.model, self.cache, self.n_layers = model, cache, n_layers

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        """(Re)allocate the draft's own static cache when it is missing or too small."""
        c = self.cache
        if c is None or c.max_batch < max_batch or c.max_seq_len != max_seq_len:
            w = self.model.embed_tokens.weight
            dtype = w.dtype if w.is_floating_point() else torch.float16
            self.cache = KVCache(self.model.config, max_batch, max_seq_len, dtype, w.device)

    def _start(self, seq: Seq) -> int:
        return seq.dlen

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        seqs, V = batch.seqs, batch.vocab
        dev = batch.target_cache.k.device
        starts = [self._start(s) for s in seqs]
        toks, pos, last, kv_len = catch_up_batch(seqs, starts, batch.scratch_pos, dev)
        cache = self.cache if self.cache is not None else batch.target_cache
        n_tok = [len(s.tokens) for s in seqs]
        greedy = batch.processing.mode == "greedy"  # p is one-hot at the argmax: no distribution to keep
        step = self.model.layer_step
        if greedy and step is not None and step.takes(toks, cache):  # the C++ step drafts all k in one call
            drafts = step.greedy(toks, pos, batch.rows, cache, kv_len, self.n_layers, last, batch.k, V)
            for s in seqs:
                s.dlen = len(s.tokens)
            return drafts, None, None
        aligned = batch.rows is None and len(set(starts)) == 1 and len(set(n_tok)) == 1  # no padding anywhere
        logits = self.model(
            toks,
            pos,
            cache,
            kv_len,
            batch.rows,
            logits_idx=last,
            n_layers=self.n_layers,
            start=starts[0] if aligned else None,
        )
        next_pos = torch.tensor(n_tok, device=dev)  # where d1 goes
        drafts, probs = [], []
        for i in range(batch.k):
            if greedy:
                d = logits[:, :V].argmax(-1)
            else:
                # penalties count this round's earlier drafts too
                prev = torch.stack(drafts, 1) if drafts and batch.processing.penalties is not None else None
                p = batch.processing.probs_at(logits[:, None, :V], prev, i)[:, 0]
                assert batch.noise is not None
                d = sample_from_probs(p, batch.noise[:, i])
                probs.append(p)
            drafts.append(d)
            if i + 1 < batch.k:
                kv_len += 1
                logits = self.model(
                    d[:, None],
                    (next_pos + i)[:, None],
                    cache,
                    kv_len,
                    batch.rows,
                    logits_idx=torch.zeros_like(d),
                    n_layers=self.n_layers,
                    start=n_tok[0] + i if aligned else None,
                )
        for s in seqs:
            s.dlen = len(s.tokens)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None), None

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        # fed: the committed tokens, then d1..d_{k-1}; the accepted ones stay valid
        seq.dlen = n_before + min(accepted, k - 1)

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        """Copy the draft cache's prompt positions but the last (fed again: its logits draft d1)."""
        n = min(src.dlen, length - 1)
        if self.cache is None or n <= 0:
            return
        self.cache.copy_rows(src.row, [s.row for s in dst], n)
        for s in dst:
            s.dlen = n


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first L layers write the target's own cache."""

    def __init__(self, target: Transformer, n_layers: int) -> None:
        super().__init__(target, None, n_layers)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass  # uses the target's cache

    def _start(self, seq: Seq) -> int:
        # a sequence whose prompt's keys/values were copied (tlen == len(tokens)) feeds its last token again
        return min(seq.tlen, len(seq.tokens) - 1)

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        pass  # the verify pass rewrote every position the drafter wrote

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # its cache is the target's, which the loop copies


class NGramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens."""

    probabilistic = False

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = tokens[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        props = [self.lookup(s.tokens, batch.k) for s in batch.seqs]
        out = torch.zeros(len(props), batch.k, dtype=torch.long)
        for b, p in enumerate(props):
            if p:
                out[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        return out.to(batch.target_cache.k.device), None, [len(p) for p in props]

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        pass

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # no state: it reads the tokens
