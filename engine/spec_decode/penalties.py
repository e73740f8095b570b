"""History-dependent logits processing: min_tokens, repetition, presence and frequency penalties.

Applied to raw logits before temperature / top-k / top-p / min-p, in vLLM's order and with its
semantics (the repetition penalty of transformers' ``RepetitionPenaltyLogitsProcessor`` over the
prompt and the output; OpenAI's presence and frequency penalties over the output only):

1. min_tokens: while fewer than ``min_tokens`` tokens are generated, the stop tokens (eos unless
   ``ignore_eos``, and ``stop_token_ids``) get -inf;
2. repetition: a logit of a token seen in the prompt or the output is divided by the penalty when
   positive and multiplied by it otherwise;
3. ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``, count in the output.

Speculation stays exact because the draft and the target apply the same processing at each draft
position: position i of a round sees the committed output plus drafts d_0 .. d_{i-1} of the same
round (as plain decoding would have generated them), so both distributions of the acceptance rule
are the ones plain sampling would use after that prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class PenaltyParams(Protocol):
    """The fields of ``SamplingParams`` (engine/spec_decode/sampling.py) this module reads."""

    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool


def needs_history(p: PenaltyParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.min_tokens > 0


@dataclass(frozen=True)
class Penalties:
    """The per-row state of one round ([B] rows) for ``apply``."""

    counts: Tensor  # [B, V] float32 occurrences of each token in the output so far
    prompt_seen: Tensor  # [B, V] bool tokens of the prompt
    repetition: Tensor  # [B] float32 (1 = off)
    presence: Tensor  # [B] float32
    frequency: Tensor  # [B] float32
    short: Tensor  # [B] int64 tokens still to generate before a stop token may come (min_tokens - len(output))
    banned: Tensor  # [B, V] bool the row's stop tokens (banned while short)
    use_repetition: bool
    use_ban: bool

    @classmethod
    def of(
        cls,
        rows: Sequence[tuple[Sequence[int], Sequence[int], PenaltyParams]],
        eos: Sequence[int],
        vocab: int,
        device: torch.device | str,
    ) -> Penalties | None:
        """rows: (prompt, output so far, params) per batch row; None when no row needs any of this."""
        if not any(needs_history(p) for _, _, p in rows):
            return None
        B, V = len(rows), vocab
        dev = torch.device(device)

        def bag(lists: list[list[int]]) -> Tensor:  # [B, V] counts (V is the padding column, cut off)
            n = max((len(x) for x in lists), default=0)
            ids = torch.full((B, max(n, 1)), V, dtype=torch.long)
            for b, x in enumerate(lists):
                if x:
                    ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            out = torch.zeros(B, V + 1, dtype=torch.float32)
            out.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
            return out[:, :V].to(dev)

        use_rep = any(p.repetition_penalty != 1.0 for _, _, p in rows)
        counts = bag([list(g) if needs_history(p) else [] for _, g, p in rows])
        prompt_seen = bag([list(pr) if p.repetition_penalty != 1.0 else [] for pr, _, p in rows]) > 0
        stops = [
            [t for t in ((() if p.ignore_eos else tuple(eos)) + tuple(p.stop_token_ids)) if 0 <= t < V]
            if p.min_tokens > len(g)
            else []
            for _, g, p in rows
        ]
        banned = bag(stops) > 0

        def col(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        short = torch.tensor([max(0, p.min_tokens - len(g)) for _, g, p in rows], dtype=torch.long, device=dev)
        return cls(
            counts,
            prompt_seen,
            col([p.repetition_penalty for _, _, p in rows]),
            col([p.presence_penalty for _, _, p in rows]),
            col([p.frequency_penalty for _, _, p in rows]),
            short,
            banned,
            use_rep,
            any(stops),
        )

    def apply(self, logits: Tensor, drafts: Tensor | None, start: int) -> Tensor:
        """logits [B, P, V] at draft positions start .. start+P-1 -> processed logits [B, P, V] float32.

        drafts [B, >= start+P-1] int64: the round's drafted ids; position j sees drafts[:, :j]
        (entries a row did not draft only reach positions that row does not score).
        """
        B, P, V = logits.shape
        x = logits.float()
        dev = x.device
        cnt = self.counts[:, None, :].expand(B, P, V)
        n = start + P - 1
        if n > 0:
            assert drafts is not None and drafts.shape[1] >= n
            oh = torch.zeros(B, n, V, device=dev).scatter_(2, drafts[:, :n, None].clamp(0, V - 1), 1.0)
            before = torch.cat([torch.zeros(B, 1, V, device=dev), oh.cumsum(1)], 1)  # [B, n+1, V]
            cnt = cnt + before[:, start : start + P]
        if self.use_repetition:
            seen = self.prompt_seen[:, None, :] | (cnt > 0)
            r = self.repetition[:, None, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - self.frequency[:, None, None] * cnt - self.presence[:, None, None] * (cnt > 0).float()
        if self.use_ban:
            under = (start + torch.arange(P, device=dev))[None, :] < self.short[:, None]  # [B, P]
            x = x.masked_fill(under[:, :, None] & self.banned[:, None, :], float("-inf"))
        return x
