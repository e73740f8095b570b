"""A round where a new sequence prefills beside sequences that decode runs its prefill apart (the scheduler steps
the new sequences first, then the others), and a step over rows of different widths runs a pass per group of
similar width (one padded pass would compute short rows at the longest one's width), in the target and in a draft
model: outputs equal the solo runs, for every drafter, and the split happens."""

from __future__ import annotations

import pytest
from util import CountedForward

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.spec_decode.width_groups import width_groups

SHORT = [[5, 6, 7], [9, 10, 11, 12]]
LONG = list(range(20, 60))  # a 40-token prompt that arrives while the short ones decode


@pytest.mark.parametrize("drafter", ["model", "ngram", None])
def test_a_prefill_beside_decoding_rows_splits_and_keeps_outputs(ckpt_dir, draft_dir, drafter):
    spec = SpeculationConfig(drafter=drafter, k=3, k_policy="heuristic")
    eng = Engine.from_pretrained(ckpt_dir, draft_dir if drafter == "model" else None, speculation=spec)
    params = SamplingParams(max_new_tokens=24)
    solo = [eng.generate([p], params)[0].token_ids for p in [*SHORT, LONG]]
    counted = CountedForward(eng.loop.target)  # the target passes of each round: (rows, width)
    eng.loop.target = counted
    widths = counted.widths
    drafts = CountedForward(eng.loop.drafter.model) if drafter == "model" else None  # the draft model's passes
    if drafts is not None:
        eng.loop.drafter.model = drafts
    reqs = [eng.submit(p, params) for p in SHORT]
    rounds = {"n": 0}

    def late() -> None:  # the long prompt joins on the third round, the short ones decoding
        rounds["n"] += 1
        if rounds["n"] == 3:
            reqs.append(eng.submit(LONG, params))

    eng.scheduler.on_round = late
    first = [r.result().token_ids for r in reqs[:2]]  # the long one joined before these finished
    assert len(reqs) == 3
    assert first == solo[:2] and reqs[2].result().token_ids == solo[2]
    # one pass of the prefilling row at its width and one of the decoding rows at theirs, never 3 rows at 40+
    assert any(w[0] == 1 and w[1] >= len(LONG) for w in widths)
    assert not any(w[0] == 3 and w[1] >= len(LONG) for w in widths)
    if drafts is not None:  # the draft model catches the prompt up alone too
        assert any(w[0] == 1 and w[1] >= len(LONG) - 1 for w in drafts.widths)
        assert not any(w[0] > 1 and w[1] >= len(LONG) - 1 for w in drafts.widths)


def test_a_row_starting_from_a_shared_prefill_beside_a_new_prompt(ckpt_dir):
    """Round 2: one sample of a shared prefill starts (nothing to compute: its scores were kept) while a new
    prompt prefills; no drafter, so it has no token to run: the round is the prompt's pass alone."""
    eng = Engine.from_pretrained(ckpt_dir)
    params = [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=6)]
    solo = [eng.generate([SHORT[1]], p)[0].token_ids for p in params] + [
        eng.generate([LONG], SamplingParams(max_new_tokens=6))[0].token_ids
    ]
    counted = CountedForward(eng.loop.target)
    eng.loop.target = counted
    widths = counted.widths
    reqs = eng.submit_many([SHORT[1], SHORT[1]], params)  # admitted together: the first prefills for both
    rounds = {"n": 0}

    def late() -> None:
        rounds["n"] += 1
        if rounds["n"] == 1:  # admitted for round 2, as the second sample starts
            reqs.append(eng.submit(LONG, SamplingParams(max_new_tokens=6)))

    eng.scheduler.on_round = late
    first = [r.result().token_ids for r in reqs[:2]]
    assert first == solo[:2] and reqs[2].result().token_ids == solo[2]
    assert eng.stats()["prefill_shared"] == len(SHORT[1])
    assert all(w[1] > 0 for w in widths)  # the starting sample has nothing to run: no empty pass


@pytest.mark.parametrize("drafter", ["model", None])
def test_prompts_of_different_lengths_prefill_in_passes_of_their_own(ckpt_dir, draft_dir, drafter):
    """Admitted together, an 8-token and a 40-token prompt prefill in a pass each (one padded pass would compute
    the short one at 40 positions); the draft model catches them up the same way; outputs equal the solo runs."""
    spec = SpeculationConfig(drafter=drafter, k=3, k_policy="heuristic")
    eng = Engine.from_pretrained(ckpt_dir, draft_dir if drafter == "model" else None, speculation=spec)
    params = SamplingParams(max_new_tokens=12)
    prompts = [LONG[:8], LONG]
    solo = [eng.generate([p], params)[0].token_ids for p in prompts]
    counted = CountedForward(eng.loop.target, packs=False)  # the padded passes (PyTorch's layers, CUDA)
    eng.loop.target = counted
    drafts = CountedForward(eng.loop.drafter.model) if drafter == "model" else None
    if drafts is not None:
        eng.loop.drafter.model = drafts
    reqs = eng.submit_many(prompts, [params, params])
    assert [r.result().token_ids for r in reqs] == solo
    first = counted.widths[:2]  # the first round (no drafts): the long prompt's pass, then the short one's
    assert sorted(first) == [(1, 8), (1, len(LONG))]
    assert not any(w[0] == 2 and w[1] >= len(LONG) for w in counted.widths)
    if drafts is not None:  # the second round: each prompt (its first token but) alone, then both rows at one token
        assert sorted(drafts.widths[:2]) == [(1, 8), (1, len(LONG))] and drafts.widths[2] == (2, 1)


def test_width_groups_bound_each_rows_padding():
    widths = [4, 4, 40, 5, 100, 95, 1]
    groups = width_groups(widths)
    assert sorted(b for g in groups for b in g) == list(range(len(widths)))  # every row once
    assert [[widths[b] for b in g] for g in groups] == [[100, 95], [40], [5, 4, 4, 1]]
    assert width_groups([]) == [] and width_groups([7]) == [[0]]


@pytest.mark.parametrize("drafter", ["model", "eagle-attn"])
def test_the_drafter_catches_up_before_the_timed_round_with_the_same_drafts(ckpt_dir, draft_dir, tmp_path, drafter):
    """A row's first round drafts nothing; the drafter feeds its prompt before the row's next round, outside the
    step the K tuner times (``Drafter.catch_up``): the draft model's cache holds every row's prompt when it is next
    asked to draft (a row that starts from a shared prefill too), and the drafts equal those of a drafter left to
    catch up inside that round."""
    from test_heads import random_head

    draft = draft_dir if drafter == "model" else random_head(ckpt_dir, tmp_path / "h", "eagle", attention=True)
    spec = SpeculationConfig(drafter="model" if drafter == "model" else "eagle", k=3, k_policy="constant")
    prompts, params = [SHORT[0], LONG[:8], LONG, LONG], SamplingParams(max_new_tokens=12)  # LONG's prefill shared
    drafts: dict[bool, list[list[int]]] = {}
    for early in (True, False):
        eng = Engine.from_pretrained(ckpt_dir, draft, speculation=spec)
        d, log = eng.loop.drafter, drafts.setdefault(early, [])
        propose = d.propose

        def recorded(batch, d=d, propose=propose, log=log, early=early):
            if early and drafter == "model":
                assert all(d.cached_length(s) > 0 for s in batch.seqs), "a row's prompt was not fed before"
            prop = propose(batch)
            log.extend(t[:n] for t, n in zip(prop.tokens.tolist(), prop.row_counts()))
            return prop

        d.propose = recorded
        if not early:
            d.catch_up = lambda seqs, scratch_pos: 0
        eng.generate(prompts, params)
        assert eng.stats()["prefill_shared"] == len(LONG)
    assert drafts[True] == drafts[False] and len(drafts[True]) > len(prompts)
