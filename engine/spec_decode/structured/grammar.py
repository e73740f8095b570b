"""The grammar engine: llguidance compiles a ``StructuredOutput`` and walks a request's output through it.

llguidance (the optional ``structured`` extra, imported on first use) is the engine: a Rust library without
Python dependencies that computes a token mask in tens of microseconds for a 50k vocabulary, rolls a matcher back
by any number of tokens (what a rejected draft needs) and reports the tokens a grammar forces next
(``compute_ff_tokens``). It reads JSON schemas, Rust regexes and Lark grammars; GBNF is converted to Lark.

``GrammarCompiler`` validates and compiles once per constraint (an LRU cache with a bound, shared by request
threads and the engine's worker). ``GrammarState`` is one request's matcher over its committed output.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.core.errors import InvalidRequestError
from engine.spec_decode.structured.spec import StructuredOutput

# JSON the way json.dumps writes it: ", " and ": ", no other whitespace (free whitespace lets a model loop on it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept (least recently used out first)
_BIT_VALUES = (1 << torch.arange(8)).to(torch.uint8)  # [8] bit i of a byte


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text, validated against the tokenizer."""

    spec: StructuredOutput
    text: str


def unpack(bitmask: Tensor, vocab: int) -> Tensor:
    """llguidance's bitmask [..., W] int32 (bit i of word w: token 32w + i allowed) -> bool [..., vocab], on the
    bitmask's device (little-endian bytes: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7)."""
    bytes_ = bitmask.contiguous().view(torch.uint8)  # [..., 4W]
    bits = bytes_.unsqueeze(-1) & _BIT_VALUES.to(bitmask.device)  # [..., 4W, 8]
    return (bits != 0).flatten(-2)[..., :vocab]


def _refuse(so: StructuredOutput, why: str) -> InvalidRequestError:
    first = why.strip().splitlines()[0] if why.strip() else "invalid"
    return InvalidRequestError(f"SamplingParams.structured.{so.kind} is invalid: {first[:300]}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once each (thread-safe, bounded)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int], capacity: int = CACHE_SIZE) -> None:
        """``tokenizer_json``: the tokenizer's ``tokenizer.json`` text; ``vocab``: the logits' width (ids past the
        tokenizer's are never allowed); ``eos_ids``: the tokens that end a completed output (none: the tokenizer's)."""
        self._tokenizer_json, self.vocab, self._eos = tokenizer_json, vocab, list(eos_ids)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Grammar] = OrderedDict()
        self._tok: Any = None

    @staticmethod
    def _llg() -> Any:
        try:
            import llguidance
        except ImportError:
            raise InvalidRequestError(
                "SamplingParams.structured needs the grammar engine llguidance, which is not installed: "
                "pip install 'specmix[structured]'"
            ) from None
        return llguidance

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._tok is None:
                llg = self._llg()
                self._tok = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab, eos_token=self._eos or None)
            return self._tok

    def compile(self, so: StructuredOutput) -> Grammar:
        """The compiled grammar of ``so``; InvalidRequestError naming what is wrong with it (including a grammar
        that accepts no text at all)."""
        with self._lock:
            hit = self._cache.get(so)
            if hit is not None:
                self._cache.move_to_end(so)
                return hit
        llg, tok = self._llg(), self._tokenizer()
        text = self._grammar_text(llg, so)
        try:
            is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tok)
            if is_error:
                raise _refuse(so, messages[0] if messages else "invalid")
            probe = llg.LLMatcher(tok, text, log_level=0)
        except (ValueError, TypeError, RuntimeError, OverflowError) as e:  # the engine's refusals of odd input
            raise _refuse(so, f"{type(e).__name__}: {e}") from None
        mask = torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if probe.is_error() or not bool(mask.any()):
            raise _refuse(so, "the grammar accepts no text")
        grammar = Grammar(so, text)
        with self._lock:
            self._cache[so] = grammar
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def _grammar_text(llg: Any, so: StructuredOutput) -> str:
        try:
            if so.kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(so.spec, defaults=JSON_OPTIONS)
            if so.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if so.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(so.spec)
            if so.kind == "choice":
                options = json.loads(so.spec)
                return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
            lark = llg.gbnf_to_lark(so.spec) if "::=" in so.spec else so.spec
            return llg.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, KeyError, IndexError, AssertionError) as e:  # the converters' refusals
            raise _refuse(so, f"{type(e).__name__}: {e}") from None

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher for one request's output."""
        llg, tok = self._llg(), self._tokenizer()
        return GrammarState(lambda: llg.LLMatcher(tok, grammar.text, log_level=0), self.vocab)


class GrammarState:
    """One request's matcher, at its committed output. Draft prefixes are walked and rolled back; a draft prefix
    that reaches a dead end leaves llguidance's matcher in its error state for good, so the matcher is then made
    again from the grammar and the output."""

    def __init__(self, make: Callable[[], Any], vocab: int) -> None:
        self._make, self.vocab = make, vocab
        self._m = make()
        self._output: list[int] = []
        self.words = (vocab + 31) // 32  # int32 words of a bitmask

    def _healthy(self) -> Any:
        if self._m.is_error():
            self._m = self._make()
            self._m.consume_tokens(self._output)
        return self._m

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (its forced text, tokenized canonically)."""
        return list(self._healthy().compute_ff_tokens())[:limit] if limit > 0 else []

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar accepts from here."""
        return int(self._healthy().validate_tokens(list(tokens))) if tokens else 0

    def masks(self, prefixes: Sequence[Sequence[int]]) -> tuple[Tensor, bool]:
        """Allowed tokens after each draft prefix as a bitmask [len(prefixes), W] int32 (``unpack``; all allowed
        after a refused one, a position no verdict reads), and whether the committed state has no continuation."""
        bitmask = torch.full((len(prefixes), self.words), -1, dtype=torch.int32)
        dead = False
        for i, prefix in enumerate(prefixes):
            m = self._healthy()
            n = m.try_consume_tokens([int(t) for t in prefix]) if prefix else 0
            if n == len(prefix):
                row = bitmask[i]
                m.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
                if m.is_error() or not bool(row.any()):  # a dead end: no text continues it
                    row.fill_(-1)
                    dead = dead or not prefix
            if n and not m.is_error():
                m.rollback(n)
        return bitmask, dead

    def commit(self, tokens: Sequence[int]) -> tuple[int, str | None]:
        """Consume committed tokens up to the grammar's completion: how many belong to the output (those after it
        are the end-of-sequence token its mask allowed) and the matcher's error when one is not allowed."""
        m = self._healthy()
        for n, t in enumerate(tokens):
            if m.is_stopped():
                return n, None
            if m.try_consume_tokens([int(t)]) != 1:
                return n, m.get_error() or f"token {int(t)} is not allowed by the grammar"
            self._output.append(int(t))
        return len(tokens), None

    @property
    def stopped(self) -> bool:
        """The output is complete: the grammar allows no more text."""
        return bool(self._m.is_stopped())
