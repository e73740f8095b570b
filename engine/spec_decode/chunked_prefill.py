"""Chunked prefill: a joining prompt's prefill split over rounds in which the running requests decode.

A prompt that joins a running batch prefills before the batch's next decode step; a 300-token prompt on a
small CPU holds every running stream for the time of a 300-token forward. With a budget of prompt tokens
(the scheduler's: engine/runtime/admission.py ``PrefillPace``), each round prefills at most that many
(``split_prefill``): a prompt whose rest fits finishes its prefill in the round's joining step (and samples its
first token there); one that does not fit computes the keys and values of its next ``budget`` tokens
(``prefill_chunk`` below) and joins a later round. Nothing is sampled from a chunk, so outputs are those of an
unchunked prefill. Prompts whose prefill shares another's (the ``n`` samples of one prompt) follow their source:
they start from its copy in the round its prefill finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from engine.core.forward import CachedForward, KVCache
from engine.spec_decode.drafter import FeatureNeed
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.seq import Seq, waiting_for_prefill
from engine.spec_decode.verify import verify, verify_batch


@dataclass
class PrefillSplit:
    """What a round does with the sequences still in their prefill."""

    finish: list[Seq] = field(default_factory=list)
    """Sequences whose prefill ends this round (their first token sampled), with those that share it."""
    chunks: list[tuple[Seq, int]] = field(default_factory=list)
    """(sequence, prompt tokens) prefilled in part this round."""


def split_prefill(new: list[Seq], budget: int | None) -> PrefillSplit:
    """This round's share of each prefill in ``new`` (in order): the whole rest where it fits in what is left of
    ``budget`` prompt tokens (None: no limit), else a chunk of what is left; what gets nothing waits a round."""
    waiting = waiting_for_prefill(new)  # (a waiting sequence whose source is gone becomes one)
    split, left = PrefillSplit(), budget
    for s in sorted(new, key=lambda s: s.tlen == 0):  # a prefill begun first: one prompt in chunks at a time
        if s.finished or s.prefill_from is not None:
            continue
        rest = len(s.prompt) - s.tlen
        if left is None or rest <= left:
            split.finish += [s, *waiting.get(id(s), [])]
            left = None if left is None else left - rest
        elif left > 0:
            split.chunks.append((s, left))
            left = 0
    return split


def prefill_chunk(
    target: CachedForward, cache: KVCache, chunks: list[tuple[Seq, int]], need: FeatureNeed
) -> list[Tensor | None]:
    """The target's keys and values of each sequence's next ``n`` prompt tokens, in one verify pass with no
    drafts (its one scored column per row is not used). Returns each row's features of those positions [n, H]
    for a drafter that reads every position's (FeatureNeed.ALL), else None; the caller moves ``tlen``."""
    seqs = [s for s, _ in chunks]
    dev = target.device
    tokens = [s.tokens[: s.tlen + n] for s, n in chunks]
    vb = verify_batch(tokens, [s.tlen for s in seqs], Proposal.empty(len(seqs), dev), [s.row for s in seqs],
                      cache.max_seq_len - 1, need)  # fmt: skip
    scores = verify(target, cache, vb)
    if need is not FeatureNeed.ALL:
        return [None] * len(chunks)
    assert scores.features is not None
    every = scores.prefix if scores.prefix is not None else scores.features  # (every chunk of one token: [B, 1, H])
    return [every[b, :n] for b, (_, n) in enumerate(chunks)]
