"""A sequence's state in the decode loop (``Seq``), its counters (``SeqStats``) and an emitted token's
log-probabilities (``TokenLogprob``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.spec_decode.adaptive import KController
from engine.spec_decode.sampling import SamplingParams
from engine.spec_decode.structured.grammar import GrammarState


@dataclass
class SeqStats:
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    pos_tried: list[int] = field(default_factory=list)  # rounds that tested draft position i
    pos_accepted: list[int] = field(default_factory=list)  # rounds that accepted draft position i
    accepted_hist: list[int] = field(default_factory=list)  # rounds with drafts, by drafts accepted (0, 1, ...)
    prefill_tokens: int = 0  # prompt tokens the target computed for this sequence
    prefill_shared: int = 0  # prompt tokens whose keys/values were copied from a sibling's prefill instead
    forced: int = 0  # drafts that were tokens the request's grammar forced (structured outputs)
    forced_accepted: int = 0
    mask_seconds: float = 0.0  # time computing the grammar's masks
    tree_rounds: int = 0  # rounds that verified this sequence's drafts as a tree (the tree attention mask)

    def record(self, k: int, a: int) -> None:
        self.drafted += k
        self.accepted += a
        self.target_passes += 1
        need = k
        if len(self.pos_tried) < need:
            self.pos_tried += [0] * (need - len(self.pos_tried))
            self.pos_accepted += [0] * (need - len(self.pos_accepted))
        for i in range(min(a + 1, k)):
            self.pos_tried[i] += 1
        for i in range(a):
            self.pos_accepted[i] += 1
        if k > 0:
            self.accepted_hist += [0] * (a + 1 - len(self.accepted_hist))
            self.accepted_hist[a] += 1

    def to_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_passes": self.target_passes,
            "prefill_tokens": self.prefill_tokens,
            "prefill_shared": self.prefill_shared,
            "tree_rounds": self.tree_rounds,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # draft positions tested (accepted ones + one per round that rejected): accepted / trials is the
            # per-token acceptance a of the cost model (accepted / drafted is biased low for K > 1)
            "draft_trials": sum(self.pos_tried),
            "per_position_acceptance": [a / t if t else None for a, t in zip(self.pos_accepted, self.pos_tried)],
            "accepted_length_rounds": list(self.accepted_hist),
            "forced_drafts": self.forced,
            "forced_accepted": self.forced_accepted,
            "mask_seconds": self.mask_seconds,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's raw distribution (log-softmax of its logits,
    before temperature and penalties) and the top alternatives, whether the token was drafted or not."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    row: int = 0
    k_ctl: KController | None = None
    tokens: list[int] = field(default_factory=list)
    tlen: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_cut: int | None = None  # where a stop string (or a stop token's text) starts in the generated text
    stats: SeqStats = field(default_factory=SeqStats)
    text: str = ""  # the generated text so far, decoded incrementally (only with stop strings)
    decoder: Any = None  # its TextStream (engine/core/tokenizer.py)
    stop_token: bool = False  # ended by a stop_token_ids token: its text is not part of the output
    logprobs: list[TokenLogprob] | None = None  # one per generated token when params.logprobs is set
    failure: str | None = None  # why its own step raised (it ended alone with finish_reason "error")
    grammar: GrammarState | None = None  # params.structured's matcher over the committed output (set by the loop)
    # prefill sharing (loop.py): the sequence of the same prompt whose prefill this one waits for (it
    # takes no part in rounds until that prefill's keys/values are copied into its row), then the target's
    # (logits, feature | None) at the prompt's last position, which score its first round
    prefill_from: Seq | None = None
    first_scores: tuple[Tensor, Tensor | None] | None = None
    # chunked prefill (chunked_prefill.py): the target's features of the prompt positions prefilled in chunks, for
    # a drafter that reads every position's (handed to it with the rest when the prefill finishes)
    prompt_features: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, reason


def token_logprobs(logits: Tensor, out: Tensor, rows: dict[int, int]) -> dict[int, list[TokenLogprob]]:
    """Per requested row b: the log-probabilities of out[b] at each scored position (and the top ones)."""
    idx = torch.tensor(list(rows), device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), -1)  # [b', K+1, V]
    chosen = lp.gather(-1, out[idx].unsqueeze(-1)).squeeze(-1)  # [b', K+1]
    n = max(rows.values())
    top_v, top_i = lp.topk(n, dim=-1) if n else (lp[..., :0], lp[..., :0].long())
    ch, tv, ti = chosen.tolist(), top_v.tolist(), top_i.tolist()
    return {
        b: [
            TokenLogprob(t, ch[j][p], list(zip(ti[j][p][: rows[b]], tv[j][p][: rows[b]])))
            for p, t in enumerate(out[b].tolist())
        ]
        for j, b in enumerate(rows)
    }


def waiting_for_prefill(seqs: list[Seq]) -> dict[int, list[Seq]]:
    """The sequences waiting for another's prefill, by that one's id. When a source can no longer share (it
    ended, it is past its prefill, it is not in this round), the first of its waiting sequences prefills
    instead, for the others."""
    running = {id(s): s for s in seqs if not s.finished and s.prefill_from is None}
    heirs: dict[int, Seq] = {}  # a source that cannot share -> the waiting sequence that prefills instead
    out: dict[int, list[Seq]] = {}
    for s in seqs:
        src = s.prefill_from
        if src is None or s.finished:
            continue
        if src.prompt != s.prompt:
            s.prefill_from = None
            continue
        if running.get(id(src)) is not src or src.tlen >= len(src.prompt):  # (a chunked prefill is not past it)
            heir = heirs.setdefault(id(src), s)
            s.prefill_from = None if heir is s else heir
            if heir is s:
                continue
            src = heir
        out.setdefault(id(src), []).append(s)
    return out
