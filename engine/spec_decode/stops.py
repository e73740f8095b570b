"""Where a round's accepted run ends: eos and stop tokens, max_new_tokens, stop strings, a complete grammar."""

from __future__ import annotations

from engine.core.tokenizer import Tokenizer
from engine.spec_decode.seq import Seq
from engine.spec_decode.structured.masks import GrammarRound


class StopChecker:
    """Cuts a sequence's new tokens where it stops and finishes it; decodes its final text."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_ids)
        self.eos_sorted = sorted(self.eos)

    def cut(self, s: Seq, new: list[int]) -> list[int]:
        """The accepted run cut at a stop token, max_new_tokens or a stop string; finishes the sequence.

        Stop strings are searched in the text decoded incrementally (the cost is the new tokens'), and
        only once min_tokens tokens are out; the text keeps nothing of a stop token or a stop string.
        """
        sp = s.params
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos)
        remaining = sp.max_new_tokens - len(s.generated)
        stops, done = sp.stop, len(s.generated)
        if stops and s.decoder is None:
            s.decoder = self.tokenizer.decode_stream()
        longest = max((len(x) for x in stops), default=0)
        kept: list[int] = []
        for t in new:
            kept.append(t)
            if t in stop_ids:
                s.stop_token = t in sp.stop_token_ids
                if stops and s.stop_token:
                    s.stop_cut = len(s.text)
                s.finish("stop")
                return kept
            if stops and self._stop_string(s, t, longest, done + len(kept) >= sp.min_tokens):
                return kept
            if len(kept) >= remaining:
                s.finish("length")
                return kept
        return kept

    def _stop_string(self, s: Seq, token: int, longest: int, may_stop: bool) -> bool:
        """Decode ``token`` onto the sequence's text; True (finished) when a stop string is complete in it."""
        piece = self.tokenizer.step(s.decoder, token)
        if not piece:
            return False
        start = max(0, len(s.text) - longest + 1)
        s.text += piece
        if not may_stop:
            return False
        hits = [i for i in (s.text.find(x, start) for x in s.params.stop) if i >= 0]
        if not hits:
            return False
        s.stop_cut = min(hits)
        s.finish("stop")
        return True

    def final_text(self, s: Seq) -> str:
        """The output text (decoded once, at the end, unless stop strings had it decoded on the way)."""
        if s.params.stop:
            return s.text if s.stop_cut is None else s.text[: s.stop_cut]
        return self.tokenizer.decode(s.generated[:-1] if s.stop_token else s.generated)


def grammar_cut(s: Seq, g: GrammarRound, b: int, new: list[int], a: int) -> list[int]:
    """Row b (``s``) of a round with grammars: its matcher takes the round's tokens (``a`` drafts accepted); the
    request ends where its grammar is complete (the tokens up to there are returned)."""
    assert s.grammar is not None
    s.stats.mask_seconds += g.seconds[b]
    if g.forced[b]:
        s.stats.forced += len(g.forced[b])
        s.stats.forced_accepted += min(a, len(g.forced[b]))
    n, err = (0, "its grammar allows no continuation") if g.dead[b] else s.grammar.commit(new)
    if err is not None:
        raise RuntimeError(f"structured output: {err}")
    if s.grammar.stopped:
        s.finish("stop")
    return new[:n]
