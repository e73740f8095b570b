"""Suffix trees for suffix decoding (SuffixDecoding, arXiv 2411.04975), on Arctic Inference's C++ suffix tree.

Arctic Inference (``pip install 'specmix[suffix]'``, imported lazily; a missing package is a
``SuffixDecodingUnavailableError`` at load, never a silent fallback) keeps a path-compressed suffix tree of
depth ``max_depth``: every suffix of every sequence, cut to its first ``max_depth`` tokens, with a count per
node (the number of occurrences of the node's string). Appending n tokens to a sequence costs O(n * max_depth)
in C++; removing a sequence costs the same for its length; nodes are O(tokens). ``speculate`` walks the
context's suffixes of length 1 .. len(context) - 1 from the root (O(m) each) and, for each match, grows a tree
of continuations best-first: a child's probability is its parent's times count(child) / count(parent), nodes
below ``min_token_prob`` are not taken, at most min(budget, match_len * max_spec_factor + max_spec_offset)
nodes (the paper's adaptive length); the match whose tree has the highest sum of probabilities wins.

``RequestSuffixIndex``: one request's prompt + output, caught up with its tokens as they are committed.
``GlobalSuffixIndex``: the outputs of recent requests, at most ``max_tokens`` tokens, whole requests evicted
in least-recently-used order (an add or an extend uses a request); every method holds its lock, so threads
may add and evict while the scheduler's thread speculates.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.errors import EngineError

INSTALL = "pip install 'specmix[suffix]' (arctic-inference>=0.3)"
MAX_SEQ_ID = 0x7FFFFFFF  # Arctic's sequence ids are int32


class SuffixDecodingUnavailableError(EngineError, ImportError):
    """The suffix drafter needs Arctic Inference's suffix tree, which is not installed (the ``suffix`` extra)."""


def suffix_tree_class() -> Any:
    """Arctic Inference's ``SuffixTree`` (C++), or ``SuffixDecodingUnavailableError`` naming the extra."""
    try:
        return importlib.import_module("arctic_inference.suffix_decoding._C").SuffixTree
    except ImportError as e:
        raise SuffixDecodingUnavailableError(
            f"the suffix drafter needs Arctic Inference's suffix tree: {INSTALL} ({e})"
        ) from None


@dataclass(frozen=True)
class SpecParams:
    """How a tree of continuations is grown (the paper's and Arctic Inference's defaults)."""

    max_spec_factor: float = 1.0
    """At most match_len * max_spec_factor + max_spec_offset nodes: a longer match drafts more."""
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    """Nodes whose estimated probability falls below this are not proposed (the adaptive length's threshold)."""


@dataclass(frozen=True)
class Draft:
    """A tree of continuations: nodes in topological order, ``parents[n]`` -1 for a child of the root."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    """Each node's estimated probability (the product of count ratios along its path)."""
    score: float
    """The sum of ``probs``: the expected number of accepted nodes."""
    match_len: int
    """The length of the context's suffix that matched (0: none)."""

    @classmethod
    def none(cls) -> Draft:
        return cls([], [], [], 0.0, 0)


def speculate(tree: Any, context: Sequence[int], budget: int, params: SpecParams, as_tree: bool) -> Draft:
    """The best-scoring tree (``as_tree``) or path of at most ``budget`` nodes after a suffix of ``context``."""
    if budget <= 0 or len(context) < 2:
        return Draft.none()
    d = tree.speculate(
        list(context), budget, params.max_spec_factor, params.max_spec_offset, params.min_token_prob, as_tree
    )
    return Draft(list(d.token_ids), list(d.parents), list(d.probs), float(d.score), int(d.match_len))


class RequestSuffixIndex:
    """One request's suffix tree over its prompt + output so far (used by one thread: the scheduler's)."""

    def __init__(self, max_depth: int) -> None:
        self._tree = suffix_tree_class()(max_depth)
        self.length = 0
        """Tokens indexed so far."""

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Index ``tokens[length:]``: the tokens committed since the last call (``tokens`` only grows)."""
        if len(tokens) > self.length:
            self._tree.extend(0, list(tokens[self.length :]))
            self.length = len(tokens)

    def speculate(self, context: Sequence[int], budget: int, params: SpecParams, as_tree: bool) -> Draft:
        return speculate(self._tree, context, budget, params, as_tree)


class GlobalSuffixIndex:
    """Recent requests' outputs in one suffix tree, at most ``max_tokens`` tokens, evicted LRU (thread-safe)."""

    def __init__(self, max_depth: int = 64, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} is invalid: allowed >= 1")
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self._tree = suffix_tree_class()(max_depth)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, list[int]] = OrderedDict()  # key -> [seq_id, tokens]; LRU first
        self._ids: set[int] = set()  # the sequence ids in use
        self._tokens = 0
        self._next_id = 0

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Index a request's tokens (its last ``max_tokens`` at most), replacing any under ``key``; evict LRU."""
        tokens = list(tokens[-self.max_tokens :])
        with self._lock:
            self._remove(key)
            if tokens:
                self._entries[key] = [self._new_id(), 0]
                self._append(key, tokens)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to an indexed request (used: it moves to the back of the LRU order); unknown: added."""
        tokens = list(tokens)
        with self._lock:
            if key not in self._entries:
                if not tokens:
                    return
                self._entries[key] = [self._new_id(), 0]
            self._entries.move_to_end(key)
            self._append(key, tokens)

    def evict(self, key: Hashable) -> bool:
        """Drop a request's tokens; False if it was not indexed."""
        with self._lock:
            return self._remove(key)

    def speculate(self, context: Sequence[int], budget: int, params: SpecParams, as_tree: bool) -> Draft:
        with self._lock:
            if not self._entries:
                return Draft.none()
            return speculate(self._tree, context, budget, params, as_tree)

    def keys(self) -> list[Hashable]:
        """The indexed requests, least recently used first."""
        with self._lock:
            return list(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens indexed (<= max_tokens)."""
        return self._tokens

    def check(self) -> None:
        """AssertionError unless the tree's sequences, the entries and the token count agree (for tests)."""
        with self._lock:
            assert self._tree.num_seqs() == len(self._entries), (self._tree.num_seqs(), len(self._entries))
            assert self._tokens == sum(n for _, n in self._entries.values()) <= self.max_tokens
            assert {i for i, _ in self._entries.values()} == self._ids and len(self._ids) == len(self._entries)
            assert all(n > 0 for _, n in self._entries.values())
            # (not Arctic's check_integrity: it inserts empty sequences for the ids below its count that it lacks)

    def _append(self, key: Hashable, tokens: list[int]) -> None:
        """Under the lock: room made by evicting other requests first, then the tokens indexed."""
        entry = self._entries[key]
        over = entry[1] + len(tokens) - self.max_tokens
        if over > 0:  # one request longer than the bound: it starts again from its tail
            self._remove(key)
            self._entries[key] = entry = [self._new_id(), 0]
            tokens = tokens[-self.max_tokens :]
        while self._tokens + len(tokens) > self.max_tokens:
            self._remove(next(k for k in self._entries if k != key))
        if tokens:
            self._tree.extend(entry[0], tokens)
            entry[1] += len(tokens)
            self._tokens += len(tokens)

    def _remove(self, key: Hashable) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if entry[1]:
            self._tree.remove(entry[0])
        self._ids.discard(entry[0])
        self._tokens -= entry[1]
        return True

    def _new_id(self) -> int:
        while self._next_id in self._ids:
            self._next_id = (self._next_id + 1) & MAX_SEQ_ID
        seq_id, self._next_id = self._next_id, (self._next_id + 1) & MAX_SEQ_ID
        self._ids.add(seq_id)
        return seq_id
