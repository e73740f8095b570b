"""Chunked prefill: a prompt that joins while others decode prefills a budget of tokens per round, in passes of
its own, and samples its first token when its prefill ends. Outputs equal the solo (unchunked) runs for every
drafter, greedy and seeded; a drafter of every position's features gets the whole prompt's; the n samples of a
chunked prompt still share its prefill; a chunk that fails ends its request alone."""

from __future__ import annotations

import pytest
import torch
from test_eagle3 import native_head
from util import CountedForward

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.runtime.admission import PrefillPace
from engine.runtime.scheduler import RequestFailedError
from engine.spec_decode.chunked_prefill import split_prefill
from engine.spec_decode.k_caps import NO_CAP
from engine.spec_decode.seq import Seq

SHORT = [[5, 6, 7], [9, 10, 11, 12]]
LONG = [(7 * j) % 280 + 3 for j in range(40)]  # a 40-token prompt that arrives while the short ones decode
CHUNK = 8  # prompt tokens per decoded token: at most 8 x (K + 1) = 32 < 40 a round
TIMEOUT = 120


def _seq(n: int, tlen: int = 0, row: int = 0) -> Seq:
    return Seq(prompt=list(range(1, n + 1)), params=SamplingParams(), generator=torch.Generator(), row=row, tlen=tlen)


def test_each_round_prefills_at_most_the_budget_a_begun_prefill_first():
    a, b, c = _seq(10, row=0), _seq(50, row=1), _seq(30, row=2)
    split = split_prefill([a, b, c], 40)
    assert split.finish == [a] and split.chunks == [(b, 30)]  # c waits: nothing left of the 40
    b.tlen = 30
    d = _seq(5, row=3)
    split = split_prefill([c, b, d], 40)  # b, begun, comes first: its 20 finish, then 20 of c's 30
    assert split.finish == [b] and split.chunks == [(c, 20)]
    assert split_prefill([a, b, c], None).finish == [b, a, c]  # no budget: every prefill whole


def test_the_budget_is_the_chunk_per_token_each_decoding_row_was_given():
    pace, free = PrefillPace(16, decay=0.5), NO_CAP
    assert pace.budget(free) == 16  # before any round
    pace.record(4, 4)  # plain rounds: one token a row
    assert pace.budget(free) == 16
    pace.record(4, 12)  # three a row: the mean (1 x 0.5 + 3) / 1.5
    assert pace.budget(free) == round(16 * 3.5 / 1.5) and pace.budget(1) == 32  # the load window's cap 1: 2 a row
    pace.record(0, 0)  # no decoding row: nothing learnt
    assert pace.budget(free) == round(16 * 3.5 / 1.5)
    for _ in range(30):
        pace.record(8, 8)
    assert pace.budget(free) == 16  # back to the chunk, never below it
    pace.record(2, 0)  # rows that ended committed nothing: still at least the chunk
    assert pace.budget(free) == 16 and pace.budget(0) == 16 and PrefillPace(None).budget(free) is None


@pytest.mark.parametrize("chunk, decay", [(0, 0.8), (-1, 0.8), (8, 1.0), (8, -0.1)])
def test_a_bad_pace_is_named(chunk, decay):
    with pytest.raises(ValueError, match="chunk=|decay="):
        PrefillPace(chunk, decay)


def test_the_samples_of_a_prompt_follow_their_source():
    src, other = _seq(50), _seq(50, row=1)
    other.prefill_from = src
    split = split_prefill([src, other], 20)
    assert split.chunks == [(src, 20)] and split.finish == []  # the sample waits while its source is in chunks
    src.tlen = 40
    split = split_prefill([src, other], 20)
    assert split.finish == [src, other] and other.prefill_from is src


def _engine(ckpt_dir, draft, drafter, chunk: int | None = CHUNK) -> Engine:
    spec = SpeculationConfig(drafter=drafter, k=3, k_max=3, k_policy="heuristic")  # K from the row's acceptance
    return Engine.from_pretrained(ckpt_dir, draft, speculation=spec, limits=Limits(max_batch=8, prefill_chunk=chunk))


def _join_late(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """SHORT decode; ``prompts`` join at the third round. Returns every request's handle."""
    reqs = [eng.submit(p, sp) for p, sp in zip(SHORT, params)]
    rounds = {"n": 0}

    def late() -> None:
        rounds["n"] += 1
        if rounds["n"] == 3:
            reqs.extend(eng.submit_many(prompts, params[2 : 2 + len(prompts)]))

    eng.scheduler.on_round = late
    [r.result(timeout=TIMEOUT) for r in reqs[:2]]
    eng.scheduler.on_round = None
    assert len(reqs) == 2 + len(prompts)  # they joined before the short ones ended
    return reqs


@pytest.fixture(scope="module")
def eagle3_dir(ckpt_dir, tmp_path_factory):
    """A random EAGLE-3 head: it reads the target's features at every prompt position."""
    return native_head(ckpt_dir, tmp_path_factory.mktemp("e3") / "h", (2, 2, 1), 64, seed=1, scale=0.3)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("drafter", [None, "ngram", "model", "eagle3"])
def test_a_prompt_joining_in_chunks_keeps_every_output(ckpt_dir, draft_dir, eagle3_dir, drafter, mode):
    draft = {"model": draft_dir, "eagle3": eagle3_dir}.get(drafter or "")
    seeded = mode == "seeded"
    params = [SamplingParams(max_new_tokens=24, temperature=0.9 if seeded else 0, seed=3 + i) for i in range(3)]
    solo_eng = _engine(ckpt_dir, draft, drafter, None)
    solo = [solo_eng.generate([p], sp)[0] for p, sp in zip([*SHORT, LONG], params)]
    eng = _engine(ckpt_dir, draft, drafter)
    counted = CountedForward(eng.loop.target)
    eng.loop.target = counted
    pace = eng.scheduler.pace
    budgets, budget = [], pace.budget  # each round's while others decode
    pace.budget = lambda cap: (budgets.append(budget(cap)), budgets[-1])[1]
    decoded, record = [], pace.record  # (rows, tokens) of each decode round
    pace.record = lambda rows, n: (decoded.append((rows, n)), record(rows, n))[1]
    chunks, prefill = [], eng.loop.prefill  # (LONG's?, tokens, the round's budget) of each chunk
    eng.loop.prefill = lambda c: (chunks.append([(s.prompt == LONG, n, budgets[-1]) for s, n in c]), prefill(c))[1]
    reqs = _join_late(eng, [LONG], params)
    got = [r.result(timeout=TIMEOUT) for r in reqs]
    assert [o.token_ids for o in got] == [o.token_ids for o in solo]
    # the same drafts as unchunked (a head of every position's features read the whole prompt's)
    assert [(o.stats["drafted"], o.stats["accepted"]) for o in got] == [
        (o.stats["drafted"], o.stats["accepted"]) for o in solo
    ]
    assert got[2].stats["prefill_tokens"] == len(LONG)
    # each round's budget in a chunk, the rest (at most the budget) with its first token; CHUNK per token each
    # decoding row was given: CHUNK in plain rounds, up to (K + 1) CHUNK
    assert chunks and all(len(c) == 1 and c[0][0] and c[0][1] == c[0][2] for c in chunks)
    assert 0 < len(LONG) - sum(c[0][1] for c in chunks) <= budgets[-1]
    assert all(CHUNK <= b <= 4 * CHUNK for b in budgets) and (drafter is not None or set(budgets) == {CHUNK})
    assert drafter != "model" or max(budgets) > CHUNK  # its drafts are accepted: more prompt tokens a round
    # decode rounds of the 3 rows at most, each row at most K + 1 tokens
    assert decoded and all(1 <= rows <= 3 and 0 < n <= 4 * rows for rows, n in decoded)
    assert (1, chunks[0][0][1]) in counted.widths and not any(w[1] >= len(LONG) for w in counted.widths)


def test_prompts_prefill_in_the_order_they_came_not_by_row(ckpt_dir):
    """p2 waits in row 3 behind p1's chunks; p3 comes later into row 0 (freed by a short request): p2 goes first."""
    eng = Engine.from_pretrained(ckpt_dir, limits=Limits(max_batch=4, prefill_chunk=CHUNK))
    p1, p2, p3 = ([(7 * j + d) % 280 + 3 for j in range(40)] for d in (0, 1, 2))
    order, prefill = [], eng.loop.prefill  # each prompt the first time a chunk of it runs
    eng.loop.prefill = lambda c: ([order.append(s.prompt) for s, _ in c if s.prompt not in order], prefill(c))[1]
    reqs, steps, short_done, begun = {}, {"n": 0}, [], []  # begun: the prompts in their prefill when p3 came

    def late() -> None:  # before each step: the short one ends in the 4th (its 4th token)
        steps["n"] += 1
        if steps["n"] == 2:
            reqs["p1"], reqs["p2"] = eng.submit_many([p1, p2], [SamplingParams(max_new_tokens=2)] * 2)
        if steps["n"] == 5:  # p3 takes row 0, below p2's, while p1 is in its chunks
            short_done.append(reqs["short"].done())
            begun.append(list(order))
            reqs["p3"] = eng.submit(p3, SamplingParams(max_new_tokens=2))

    eng.scheduler.on_round = late
    both = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=40)]
    reqs["short"], reqs["long"] = eng.submit_many(SHORT, both)
    reqs["long"].result(timeout=TIMEOUT)
    eng.scheduler.on_round = None
    assert short_done == [True] and begun == [[p1]]
    assert all(r.result(timeout=TIMEOUT).finish_reason == "length" for r in reqs.values())
    assert order == [p1, p2, p3]  # (by row, p3 in row 0 would go before p2 in row 3)


def test_the_samples_of_a_chunked_prompt_share_its_prefill(ckpt_dir, draft_dir):
    params = [SamplingParams(max_new_tokens=16, temperature=0.9, seed=11 + i) for i in range(5)]
    solo_eng = _engine(ckpt_dir, draft_dir, "model", None)
    solo = [solo_eng.generate([p], sp)[0].token_ids for p, sp in zip([*SHORT, LONG, LONG, LONG], params)]
    eng = _engine(ckpt_dir, draft_dir, "model")
    reqs = _join_late(eng, [LONG] * 3, params)
    assert [r.result(timeout=TIMEOUT).token_ids for r in reqs] == solo
    assert eng.stats()["prefill_shared"] == 2 * len(LONG)


def test_a_chunk_that_fails_ends_its_request_alone(ckpt_dir, draft_dir):
    params = [SamplingParams(max_new_tokens=24)] * 3
    eng = _engine(ckpt_dir, draft_dir, "model")
    solo = [eng.generate([p], params[0])[0].token_ids for p in [*SHORT, LONG]]
    eng.loop.inject_fault = lambda s, where: where == "prefill" and s.prompt == LONG
    try:
        reqs = _join_late(eng, [LONG], params)
        with pytest.raises(RequestFailedError, match="injected fault in a prefill chunk"):
            reqs[2].result(timeout=TIMEOUT)
    finally:
        eng.loop.inject_fault = None
    assert [r.result(timeout=TIMEOUT).token_ids for r in reqs[:2]] == solo[:2]
    assert _join_late(eng, [LONG], params)[2].result(timeout=TIMEOUT).token_ids == solo[2]  # it serves on


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_bad_chunk_is_named(value):
    with pytest.raises(InvalidConfigError, match="limits.prefill_chunk"):
        Limits(prefill_chunk=value)
