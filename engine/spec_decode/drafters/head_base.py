"""What the drafters of trained heads share (engine/spec_decode/drafters/medusa.py, eagle.py, eagle_attn.py).

They propose from the target's feature at the position that scored the last committed token, which the
round hands them after each verify pass (``FeatureNeed.LAST``; ``Committed.features``). A sequence has none
before its first verify pass (its prefill): such a row proposes nothing that round, like an n-gram lookup that
finds nothing.

The draft distribution p of a draft is the head's logits processed like the target's (temperature, top-k,
top-p: ``RowProcessing``), over the reduced draft vocabulary when the head has one and zero elsewhere; the
acceptance rule is the same exact rule as for a draft model (the residual covers the tokens outside the draft
vocabulary). Greedy batches return no distributions. The heads score with the target's own LM head (its rows
of the draft vocabulary: ``draft_lm_head``), on the kernel the kernels layer chose (``DraftKernels.scorer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from engine.spec_decode.drafter import Committed, DraftBatch, DrafterContext, FeatureNeed, LoadedHead, SeqStates
from engine.spec_decode.heads.modules import draft_lm_head
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.sampling import sample_from_probs

if TYPE_CHECKING:
    from engine.core.model import Transformer
    from engine.spec_decode.seq import Seq


@dataclass
class _LastFeature:
    """The target's feature at the position that scored the sequence's last committed token (None: not yet)."""

    feature: Tensor | None = None


class HeadDrafter:
    """Features in, drafts and their distributions out (the head kinds subclass it)."""

    features = FeatureNeed.LAST
    samples = True

    def __init__(self, head: LoadedHead, target: Transformer, scorer: nn.Module) -> None:
        """``scorer``: the target's LM head rows of the draft vocabulary (``draft_lm_head``), maybe on a kernel."""
        self.head, self.cfg, self.vocab_ids = head.module, head.config, head.vocab_ids
        self.loaded, self.target, self.lm_head = head, target, scorer
        self.head_weight: Tensor = scorer.weight  # type: ignore[assignment]
        self.feature_dtype = target.dtype  # the target's compute dtype (the scorer may store its rows narrower)
        self.max_drafts: int | None = self.cfg.max_drafts
        self._last = SeqStates(_LastFeature)

    @staticmethod
    def scorer_for(ctx: DrafterContext) -> tuple[LoadedHead, nn.Linear, nn.Module]:
        """(the loaded head, its plain scorer, that scorer on the chosen kernel)."""
        assert ctx.head is not None, "the entry loads a head"
        plain = draft_lm_head(ctx.target_module, ctx.head.vocab_ids)
        return ctx.head, plain, ctx.kernels.scorer(plain)

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass  # a head keeps no cache

    def commit(self, seq: Seq, outcome: Committed) -> None:
        if outcome.features is not None:
            self._last(seq).feature = outcome.features

    def share_prefill(self, src: Seq, dst: list[Seq], length: int) -> None:
        pass  # the round hands each sequence the feature of the shared prefill after its first round

    def catch_up(self, seqs: list[Seq], scratch_pos: int) -> int:
        return 0  # it reads the target's features, handed to it after each round

    def scores(self, f: Tensor) -> Tensor:
        """Features [..., H] -> logits over the draft vocabulary [..., V']."""
        return self.lm_head(f)

    def _features(self, seqs: list[Seq], dev: torch.device) -> tuple[Tensor, list[bool]]:
        feats = [self._last(s).feature for s in seqs]
        zero = torch.zeros(self.cfg.hidden_size, dtype=self.feature_dtype, device=dev)
        return torch.stack([f if f is not None else zero for f in feats]), [f is not None for f in feats]

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
        prev = torch.stack(drafts, 1) if drafts and batch.processing.reads_drafts else None
        p = batch.processing.probs_at(logits[:, None, : batch.vocab], prev, i)[:, 0]
        assert batch.noise is not None
        return sample_from_probs(p, batch.noise[:, i]), p

    @staticmethod
    def _result(drafts: Tensor, probs: list[Tensor], have: list[bool], k: int, asked: int) -> Proposal:
        """The chain of every row (none for a row without a feature)."""
        counts = None if all(have) and k == asked else [k if h else 0 for h in have]
        return Proposal.chain(drafts, torch.stack(probs, 1) if probs else None, counts)
