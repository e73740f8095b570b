"""Suffix decoding: the suffix trees against brute-force counts, the global index's bound and LRU order under
threads, the draft trees' structure, and greedy identity with plain decoding through the Engine."""

from __future__ import annotations

import gc
import importlib
import random
import threading

import pytest
import torch
from util import assert_greedy_grid

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.spec_decode.drafter import DraftBatch
from engine.spec_decode.drafters.suffix import SuffixDrafter
from engine.spec_decode.drafters.suffix_index import (
    GlobalSuffixIndex,
    RequestSuffixIndex,
    SpecParams,
    SuffixDecodingUnavailableError,
)
from engine.spec_decode.seq import Seq

try:
    importlib.import_module("arctic_inference.suffix_decoding._C")
    HAVE_ARCTIC = True
except ImportError:
    HAVE_ARCTIC = False
arctic = pytest.mark.skipif(not HAVE_ARCTIC, reason="needs the suffix extra: pip install 'specmix[suffix]'")

ALL = SpecParams(max_spec_factor=1e6, min_token_prob=0.0)  # every continuation, whatever the match length


def occurrences(seqs: list[list[int]], p: list[int]) -> int:
    return sum(1 for s in seqs for i in range(len(s) - len(p) + 1) if s[i : i + len(p)] == p)


def node_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's tokens from the root; AssertionError unless topological with distinct siblings."""
    paths: list[list[int]] = []
    for n, (t, p) in enumerate(zip(tokens, parents)):
        assert -1 <= p < n, (n, p)
        paths.append((paths[p] if p >= 0 else []) + [t])
    assert len({tuple(x) for x in paths}) == len(paths), "siblings repeat a token"
    return paths


def brute_tree(seqs: list[list[int]], base: list[int], depth: int) -> dict[tuple[int, ...], float]:
    """Every continuation of ``base`` (within the trees' depth) and its probability count(base+path)/count(base)."""
    n, out = occurrences(seqs, base), {}
    for s in seqs:
        for i in range(len(s) - len(base) + 1):
            if s[i : i + len(base)] == base:
                for L in range(1, depth - len(base) + 1):
                    if i + len(base) + L <= len(s):
                        path = s[i + len(base) : i + len(base) + L]
                        out[tuple(path)] = occurrences(seqs, base + path) / n
    return out


def check_against_brute_force(index, seqs: list[list[int]], contexts: list[list[int]], depth: int) -> int:
    """The index's trees and paths for each context equal the counts in ``seqs``; returns the contexts matched."""
    matched = 0
    for ctx in contexts:
        d = index.speculate(ctx, 10_000, ALL, True)
        matches = [m for m in range(1, len(ctx)) if occurrences(seqs, ctx[-m:])]
        best = max((sum(brute_tree(seqs, ctx[-m:], depth).values()) for m in matches), default=0.0)
        assert d.score == pytest.approx(best, rel=1e-5, abs=1e-6), ctx
        if not d.tokens:
            continue
        matched += 1
        assert 1 <= d.match_len < len(ctx)
        want = brute_tree(seqs, ctx[-d.match_len :], depth)
        got = dict(zip(map(tuple, node_paths(d.tokens, d.parents)), d.probs))
        assert got.keys() == want.keys() and all(got[p] == pytest.approx(want[p], rel=1e-5) for p in want), ctx
        path = index.speculate(ctx, 10_000, ALL, False)  # the best path: a most frequent child at each step
        cont = brute_tree(seqs, ctx[-path.match_len :], depth) if path.tokens else {}
        for i, tok in enumerate(path.tokens):
            assert path.parents[i] == i - 1
            sib = {p[-1]: pr for p, pr in cont.items() if p[:-1] == tuple(path.tokens[:i])}
            assert path.probs[i] == pytest.approx(sib[tok], rel=1e-5) == pytest.approx(max(sib.values()), rel=1e-5)
    return matched


@arctic
def test_trees_equal_brute_force_counts_and_eviction_forgets():
    rng = random.Random(0)
    depth = 7
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    index = GlobalSuffixIndex(depth, max_tokens=10_000)
    for i, s in enumerate(seqs):
        index.add(f"r{i}", s)
    contexts = [s[max(0, e - rng.randrange(2, 9)) : e] for s in seqs for e in range(2, len(s) + 1, 3)]
    contexts += [[rng.randrange(5) for _ in range(6)] for _ in range(20)]  # 4 never occurs
    assert check_against_brute_force(index, seqs, contexts, depth) > len(contexts) // 2
    for gone in ("r1", "r4"):
        assert index.evict(gone)
    index.check()
    left = [s for i, s in enumerate(seqs) if i not in (1, 4)]
    assert check_against_brute_force(index, left, contexts, depth) > 0


@arctic
def test_a_request_index_caught_up_in_pieces_equals_its_tokens():
    rng = random.Random(1)
    tokens = [rng.randrange(3) for _ in range(80)]
    req = RequestSuffixIndex(6)
    for end in (5, 6, 30, 31, 80):
        req.catch_up(tokens[:end])
    assert req.length == 80
    contexts = [tokens[e - 5 : e] for e in range(5, 81, 2)]
    assert check_against_brute_force(req, [tokens], contexts, 6) == len(contexts)


@arctic
def test_global_index_keeps_its_bound_evicting_least_recently_used():
    index = GlobalSuffixIndex(8, max_tokens=100)
    for key in "abcd":
        index.add(key, [ord(key)] * 25)
    assert index.keys() == list("abcd") and index.tokens == 100
    index.extend("a", [1, 2, 3])  # a used: b, the least recently used, goes
    assert index.keys() == ["c", "d", "a"] and index.tokens == 78
    index.add("e", list(range(40)))  # c goes (75 + 40 > 100 until it does)
    assert index.keys() == ["d", "a", "e"] and index.tokens == 93
    index.add("f", list(range(500)))  # longer than the bound: its last 100 tokens, alone
    assert index.keys() == ["f"] and index.tokens == 100
    assert index.speculate([498, 499], 4, ALL, False).tokens == []  # the tail's end: nothing follows
    assert index.speculate([450, 451], 3, ALL, False).tokens == [452, 453, 454]
    index.check()
    assert not index.evict("zz") and index.evict("f") and index.tokens == 0 and index.keys() == []
    index.check()


def make_seq(prompt: list[int], out: list[int] = ()) -> Seq:
    s = Seq(list(prompt), SamplingParams(max_new_tokens=100), torch.Generator())
    s.tokens.extend(out)
    return s


def draft_batch(seqs: list[Seq], ks: list[int]) -> DraftBatch:
    return DraftBatch(seqs, None, None, max(ks), ks, None, 300, 0, None, torch.device("cpu"))  # type: ignore[arg-type]


@arctic
def test_threads_add_and_evict_while_the_scheduler_proposes():
    index = GlobalSuffixIndex(16, max_tokens=2_000)
    drafter = SuffixDrafter(tree=True, max_depth=16, max_match=8, index=index)
    rng = random.Random(2)
    seqs = [make_seq([rng.randrange(6) for _ in range(40)]) for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        r = random.Random(w)
        try:
            for _ in range(300):
                key = (w, r.randrange(30))
                op = r.random()
                if op < 0.5:
                    index.add(key, [r.randrange(6) for _ in range(r.randrange(1, 120))])
                elif op < 0.8:
                    index.extend(key, [r.randrange(6) for _ in range(r.randrange(0, 20))])
                else:
                    index.evict(key)
                assert index.tokens <= 2_000
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def proposer() -> None:
        try:
            while not stop.is_set():
                prop = drafter.propose(draft_batch(seqs, [8, 3, 5, 8]))
                for b, n in enumerate(prop.row_counts()):
                    assert n <= [8, 3, 5, 8][b]
                    node_paths(prop.tokens[b, :n].tolist(), prop.parents[b, :n].tolist())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    reader = threading.Thread(target=proposer)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    assert not errors, errors
    index.check()
    assert 0 < index.tokens <= 2_000


def branching(weights: dict[int, int]) -> list[int]:
    """A context ending in 7 3 4 that before was followed by each token ``weights`` times, then by a new token."""
    out: list[int] = []
    for j, tok in enumerate(t for t, n in weights.items() for _ in range(n)):
        out += [100 + j, 7, 3, 4, tok, 150 + j]
    return out + [7, 3, 4]


@arctic
def test_proposals_are_trees_within_budget_and_the_threshold():
    rep = [5, 6, 7, 8, 9, 10, 11, 12]
    seqs = [
        make_seq(rep * 4 + rep[:3]),  # a strong match: the budget fills
        make_seq(list(range(20, 40))),  # nothing repeats: no drafts
        make_seq(branching({50 + i: 2 for i in range(10)})),  # 10 continuations of 2/21 each: under 0.1
        make_seq(branching({60: 5, 61: 3, 62: 2})),  # 5/11, 3/11, 2/11; their children 1/11: under 0.1
    ]
    drafter = SuffixDrafter(tree=True, max_depth=16, max_match=8)
    prop = drafter.propose(draft_batch(seqs, [6, 6, 6, 6]))
    assert prop.parents is not None and prop.row_counts() == [6, 0, 0, 3]
    assert prop.tokens[0, :6].tolist() == [8, 9, 10, 11, 12, 5] and prop.parents[0, :6].tolist() == [-1, 0, 1, 2, 3, 4]
    assert prop.tokens[3, :3].tolist() == [60, 61, 62] and prop.parents[3, :3].tolist() == [-1, -1, -1]
    low = SuffixDrafter(tree=True, max_depth=16, max_match=8, params=SpecParams(min_token_prob=0.0))
    assert low.propose(draft_batch(seqs[2:3], [6])).row_counts() == [3]  # the match 7 3 4: the factor caps at 3
    wide = SuffixDrafter(tree=True, max_depth=16, max_match=8, params=SpecParams(5.0, 0.0, 0.0))
    p = wide.propose(draft_batch(seqs[2:4], [7, 7]))
    assert p.row_counts() == [7, 7] and p.parents[0].tolist() == [-1] * 7  # 7 of the 10 siblings, the best
    assert len(set(p.tokens[0].tolist())) == 7 and set(p.tokens[0].tolist()) <= set(range(50, 60))
    paths = node_paths(p.tokens[1].tolist(), p.parents[1].tolist())  # 3 siblings, then children of 1/11
    assert paths[:3] == [[60], [61], [62]] and all(len(x) == 2 for x in paths[3:])
    chain = SuffixDrafter(tree=False, max_depth=16, max_match=8).propose(draft_batch(seqs, [6, 6, 6, 6]))
    assert chain.is_chain and chain.row_counts() == [6, 0, 0, 1] and chain.tokens[3, 0] == 60
    assert chain.tokens[0, :6].tolist() == [8, 9, 10, 11, 12, 5]
    assert SuffixDrafter(tree=True).propose(draft_batch(seqs, [2, 0, 6, 1])).row_counts() == [2, 0, 0, 1]


@arctic
def test_finished_outputs_feed_other_requests():
    drafter = SuffixDrafter(tree=False, max_depth=16, max_match=8)
    done = make_seq([1, 2, 3], [40, 41, 42, 43, 44, 45, 46])
    drafter.propose(draft_batch([done], [4]))
    late = make_seq([9, 9], [70, 71, 72, 73, 74, 75])
    drafter.propose(draft_batch([late], [4]))
    asker = make_seq([40, 41, 42, 43])
    assert drafter.propose(draft_batch([asker], [3])).row_counts() == [0]  # nothing finished yet
    done.finish("stop")
    prop = drafter.propose(draft_batch([asker], [3]))
    assert prop.tokens[0].tolist() == [44, 45, 46] and drafter.index.tokens == 7  # its output, not its prompt
    del late
    gc.collect()  # a request dropped unfinished: its output still goes in (once)
    assert drafter.index.tokens == 13 and len(drafter.index.keys()) == 2


def test_without_the_extra_the_drafter_refuses_at_load(monkeypatch):
    real = importlib.import_module

    def no_arctic(name: str, *a):
        if name.startswith("arctic_inference"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", no_arctic)
    with pytest.raises(SuffixDecodingUnavailableError, match=r"specmix\[suffix\]"):
        SuffixDrafter()
    with pytest.raises(ImportError):
        GlobalSuffixIndex()


@arctic
@pytest.mark.parametrize("branches", [None, 3], ids=["chain", "tree"])
def test_greedy_equals_plain(ckpt_dir, plain, branches):
    spec = SpeculationConfig(drafter="suffix", k=6, k_policy="constant", tree_branches=branches)
    eng = Engine.from_pretrained(ckpt_dir, speculation=spec)
    assert isinstance(eng.drafter, SuffixDrafter) and eng.drafter.tree == (branches is not None)
    assert_greedy_grid(eng, plain, "suffix", branches)
    assert eng.stats()["accepted"] > 0
    eng.drafter.retire_finished()
    gc.collect()
    assert len(eng.drafter.index.keys()) > 0
