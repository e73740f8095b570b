"""The drafters of trained heads: ``medusa`` and ``eagle`` (engine/spec_decode/heads/checkpoint.py holds the heads).

Both propose from the target's feature at the position that scored the last committed token
(``Seq.feature``, which the loop stores after each verify pass from the hidden states the target
returns beside its logits). A sequence has none before its first verify pass (its prefill): such a
row proposes nothing that round, like an n-gram lookup that finds nothing.

The draft distribution p of a draft is the head's logits processed like the target's (temperature,
top-k, top-p: ``RowProcessing``), over the reduced draft vocabulary when the head has one and zero
elsewhere; the acceptance rule is the same exact rule as for a draft model (the residual covers the
tokens outside the draft vocabulary). Greedy batches return no distributions.

A drafter's per-step computation is ``step`` (eagle: the head's forward and the shared LM head's scores,
medusa: every head's scores at once); ``runner`` (engine/kernels/head_graphs.py ``GraphedStep``, built
where the engine is assembled) replays it from CUDA graphs, called as ``runner(*tensors, static=(...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.core.errors import InvalidConfigError
from engine.core.model import KVCache, Transformer
from engine.spec_decode.drafters.base import DraftBatch
from engine.spec_decode.heads.checkpoint import EagleHead, HeadConfig, MedusaHeads, draft_lm_head
from engine.spec_decode.heads.eagle_attn import EagleAttnHead
from engine.spec_decode.sampling import sample_from_probs

if TYPE_CHECKING:
    from engine.spec_decode.seq import Seq


class HeadDrafter:
    """Shared by both kinds: features in, drafts and their distributions out."""

    probabilistic = True
    needs_features = True  # the loop asks the target for its hidden states and fills Seq.feature

    def __init__(
        self,
        head: nn.Module,
        cfg: HeadConfig,
        vocab_ids: Tensor | None,
        target: Transformer,
        runner: Callable[..., Any] | None = None,
        lm_head: nn.Module | None = None,
        greedy: Callable[..., Tensor] | None = None,
    ) -> None:
        self.head, self.cfg, self.target, self.vocab_ids, self.runner = head, cfg, target, vocab_ids, runner
        # greedy drafts in one call (engine/kernels/cpu_head.py), the drafts of ``step`` and argmax: eagle
        # (features [B, H], tokens [B], k) -> [B, k]; medusa (features [B, H], k) -> [B, k]; full-vocabulary ids
        self.greedy = greedy
        # the scorer: the target's LM head (shared: the verifier's precision) or its rows of the draft
        # vocabulary (heads.draft_lm_head); the engine may pass it on a faster kernel of the same weight
        self.lm_head = lm_head if lm_head is not None else draft_lm_head(target, vocab_ids)
        self.head_weight: Tensor = self.lm_head.weight  # type: ignore[assignment]

    def with_runner(self, runner: Callable[..., Any]) -> HeadDrafter:
        """The same drafter (the same head) whose steps run through ``runner`` (CUDA graphs of ``step``)."""
        return type(self)(self.head, self.cfg, self.vocab_ids, self.target, runner, self.lm_head, self.greedy)

    def step(self, *args: Any) -> Any:
        raise NotImplementedError

    def _step(self, *tensors: Tensor, static: tuple[Any, ...] = ()) -> Any:
        if self.runner is None:
            return self.step(*tensors, *static)
        return self.runner(*tensors, static=static)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass  # a head keeps no cache

    def after_verify(self, seq: Seq, n_before: int, accepted: int, k: int) -> None:
        pass  # the loop stores the new feature

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # no state: the loop hands each sequence the feature of the shared prefill

    def scores(self, f: Tensor) -> Tensor:
        """Features [..., H] -> logits over the draft vocabulary [..., V']."""
        return self.lm_head(f)

    def _features(self, seqs: list[Seq], dev: torch.device) -> tuple[Tensor, list[bool]]:
        have = [s.feature is not None for s in seqs]
        H = self.cfg.hidden_size
        zero = torch.zeros(H, dtype=self.head_weight.dtype, device=dev)
        return torch.stack([s.feature if s.feature is not None else zero for s in seqs]), have

    def _draw(self, logits: Tensor, batch: DraftBatch, drafts: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """The next draft of every row from logits [B, V'] -> (full-vocabulary ids [B], probs [B, V] or None),
        processed like the target's logits at that draft position (``probs_at``: penalties count the drafts)."""
        if batch.processing.mode == "greedy":
            d = logits.argmax(-1)
            return (d if self.vocab_ids is None else self.vocab_ids[d]), None
        i = len(drafts)
        if self.vocab_ids is not None:  # -inf outside the draft vocabulary: probability 0 there
            full = logits.new_full((logits.shape[0], batch.vocab), float("-inf"))
            logits = full.index_copy_(1, self.vocab_ids, logits)
        prev = torch.stack(drafts, 1) if drafts and batch.processing.penalties is not None else None
        p = batch.processing.probs_at(logits[:, None, : batch.vocab], prev, i)[:, 0]
        assert batch.noise is not None
        return sample_from_probs(p, batch.noise[:, i]), p

    def _result(
        self, drafts: Tensor, probs: list[Tensor], have: list[bool], k: int, asked: int
    ) -> tuple[Tensor, Tensor | None, list[int] | None]:
        """(drafts [B, k], their distributions [B, k, V] or None, each row's number of drafts or None: all k)."""
        num = None if all(have) and k == asked else [k if h else 0 for h in have]
        return drafts, (torch.stack(probs, 1) if probs else None), num

    def step_fn(self, batch: int = 1) -> Callable[[], object]:
        """One draft step on random features (for measuring the cost ratio c)."""
        raise NotImplementedError


class MedusaDrafter(HeadDrafter):
    """Head i proposes draft i + 1 from the same feature: one chain, all drafts at once."""

    head: MedusaHeads

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        dev = batch.target_cache.k.device
        f, have = self._features(batch.seqs, dev)
        k = min(batch.k, self.cfg.num_heads)
        if batch.processing.mode == "greedy" and self.greedy is not None:  # all k drafts in one call
            return self._result(self.greedy(f, k), [], have, k, batch.k)
        logits = self._step(f, static=(k,))  # [B, k, V']
        drafts, probs = [], []
        for i in range(k):
            d, p = self._draw(logits[:, i], batch, drafts)
            drafts.append(d)
            if p is not None:
                probs.append(p)
        return self._result(torch.stack(drafts, 1), probs, have, k, batch.k)

    def step(self, f: Tensor, n: int) -> Tensor:  # type: ignore[override]
        """Features [B, H] -> the first n heads' logits over the draft vocabulary [B, n, V']."""
        return self.scores(self.head(f, n))

    def step_fn(self, batch: int = 1) -> Callable[[], object]:
        w = self.head_weight
        f = torch.randn(batch, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        if self.greedy is not None:  # a draft step as greedy rounds run it
            return lambda: self.greedy(f, 1)  # type: ignore[misc]
        return lambda: self._step(f, static=(1,)).argmax(-1)


class EagleDrafter(HeadDrafter):
    """Autoregressive over features: the last committed token and its feature in, k drafts out."""

    head: EagleHead

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        dev = batch.target_cache.k.device
        f, have = self._features(batch.seqs, dev)
        tok = torch.tensor([s.tokens[-1] for s in batch.seqs], dtype=torch.long, device=dev)
        if batch.processing.mode == "greedy" and self.greedy is not None:  # all k drafts in one call
            return self._result(self.greedy(f, tok, batch.k), [], have, batch.k, batch.k)
        drafts, probs = [], []
        for _ in range(batch.k):
            f, logits = self._step(f, tok)
            tok, p = self._draw(logits, batch, drafts)
            drafts.append(tok)
            if p is not None:
                probs.append(p)
        return self._result(torch.stack(drafts, 1), probs, have, batch.k, batch.k)

    def step_fn(self, batch: int = 1) -> Callable[[], object]:
        w = self.head_weight
        f = torch.randn(batch, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        tok = torch.zeros(batch, dtype=torch.long, device=w.device)
        if self.greedy is not None:  # a draft step as greedy rounds run it
            return lambda: self.greedy(f, tok, 1)  # type: ignore[misc]
        return lambda: self._step(f, tok)[1].argmax(-1)

    def step(self, f: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """(features [B, H], the tokens they precede [B]) -> (the next features, their logits [B, V'])."""
        f = self.head(f, self.target.embed_tokens(tok))
        return f, self.scores(f)


class EagleAttnDrafter(HeadDrafter):
    """The EAGLE head with attention (engine/spec_decode/heads/eagle_attn.py): its own static KV cache, indexed by position.

    A round first runs the entries of the positions committed since the last (``Seq.new_features`` with the
    tokens after them, ``hlen`` on) into the cache; the last one's output scores the first draft. Each later
    draft is one entry more, on the head's own feature. Entries past the committed ones are overwritten by
    the next round's, so a rejection needs nothing undone."""

    head: EagleAttnHead
    needs_all_features = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: KVCache | None = None

    def with_runner(self, runner: Callable[..., Any]) -> HeadDrafter:
        """Refused: its step writes its own cache at per-row positions (the engine asks at load, so it fails there)."""
        raise InvalidConfigError(
            "CUDA graphs of the EAGLE head with attention are not built: cuda_graphs=False for this head"
        )

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        c = self.cache
        if c is None or c.max_batch < max_batch or c.max_seq_len != max_seq_len:
            self.cache = self.head.new_cache(max_batch, max_seq_len, self.head_weight.device)

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        # the features of the prompt but its last position (which each gets from the shared first scores)
        assert src.hlen == 0 and src.new_features
        prompt = torch.cat(src.new_features)[: length - 1]
        for s in dst:
            s.hlen, s.new_features = 0, [prompt]

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> tuple[Tensor, Tensor | None, list[int] | None]:
        seqs, dev, H = batch.seqs, batch.target_cache.k.device, self.cfg.hidden_size
        assert self.cache is not None, "ensure_cache first"
        cat = [torch.cat(s.new_features) if s.new_features else None for s in seqs]
        new = [n if n is not None and len(n) else None for n in cat]  # [m, H] per row, None: nothing to run
        have = [n is not None for n in new]
        width = max([len(n) for n in new if n is not None], default=1)
        B, scratch = len(seqs), batch.scratch_pos
        f = torch.zeros(B, width, H, dtype=self.head_weight.dtype, device=dev)
        nxt = torch.zeros(B, width, dtype=torch.long)
        pos = torch.full((B, width), scratch, dtype=torch.long)
        last = [0] * B
        for b, s in enumerate(seqs):
            n = new[b]
            if n is not None:
                m = len(n)
                f[b, :m] = n
                nxt[b, :m] = torch.tensor(s.tokens[s.hlen + 1 : s.hlen + m + 1])
                pos[b, :m] = torch.arange(s.hlen, s.hlen + m)
                last[b] = m - 1
                s.hlen, s.new_features = s.hlen + m, []
        nxt, pos = nxt.to(dev), pos.to(dev)
        # slots up to the last draft entry's (hlen + k - 2), padding's scratch slot aside
        kv_len = min(max([s.hlen + batch.k for s, h in zip(seqs, have) if h], default=1), self.cache.max_seq_len)
        last_t = torch.tensor(last, device=dev)
        logits, g = self._run(f, self.target.embed_tokens(nxt), pos, kv_len, batch.rows, last_t)
        at = torch.tensor([s.hlen if h else scratch for s, h in zip(seqs, have)], device=dev)  # next entry's
        drafts: list[Tensor] = []
        probs: list[Tensor] = []
        zero = torch.zeros_like(last_t)
        for j in range(batch.k):
            tok, p = self._draw(logits, batch, drafts)
            drafts.append(tok)
            if p is not None:
                probs.append(p)
            if j + 1 < batch.k:  # the entry (g, this draft) at the next position
                e = self.target.embed_tokens(tok)[:, None]
                logits, g = self._run(g[:, None], e, at[:, None], kv_len, batch.rows, zero)
                at = torch.where(at == scratch, at, at + 1)
        return self._result(torch.stack(drafts, 1), probs, have, batch.k, batch.k)

    def _run(
        self, f: Tensor, e: Tensor, pos: Tensor, kv_len: int, rows: Tensor | None, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Entries (features f, next tokens' embeddings e [B, T, H]) at pos [B, T] into the cache -> (scores over
        the draft vocabulary [B, V'], predicted features [B, H]) of each row's entry ``last`` [B]: on the C++
        kernel (``runner``: engine/kernels/cpu_head.py ``AttnHeadKernel``) or PyTorch's layers."""
        assert self.cache is not None
        if self.runner is not None:
            return self.runner(self.head.entries(f, e), pos, rows, self.cache, kv_len, last)
        out = self.head(f, e, pos, self.cache, kv_len, rows)
        g = out[torch.arange(len(out), device=out.device), last]
        return self.scores(g), g

    def step_fn(self, batch: int = 1) -> Callable[[], object]:
        """One draft entry at position 64 of a warm cache of its own (the head's per-draft work)."""
        w = self.head_weight
        drafter = type(self)(self.head, self.cfg, self.vocab_ids, self.target, self.runner, self.lm_head)
        drafter.cache = self.head.new_cache(batch, 128, w.device)  # the engine's cache stays as it is
        f = torch.randn(batch, 1, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        e = self.target.embed_tokens(torch.zeros(batch, 1, dtype=torch.long, device=w.device))
        pos = torch.full((batch, 1), 64, dtype=torch.long, device=w.device)
        last = torch.zeros(batch, dtype=torch.long, device=w.device)
        return lambda: drafter._run(f, e, pos, 65, None, last)[0].argmax(-1)


HEAD_DRAFTERS: dict[str, type[HeadDrafter]] = {"medusa": MedusaDrafter, "eagle": EagleDrafter}
