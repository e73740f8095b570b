"""min_p, repetition/presence/frequency penalties, min_tokens, stop_token_ids, ignore_eos, logprobs:
transformers' processors as the oracle, and speculation exact for each (chi-square at K = 1 and 4)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from util import make_checkpoint

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.errors import InvalidRequestError
from engine.spec_decode.sampling import RowProcessing

ALPHA = 1e-4


def reference_probs(
    logits: torch.Tensor, prompt: list[int], gen: list[int], sp: SamplingParams, eos: list[int]
) -> torch.Tensor:
    """One row's sampling distribution after ``prompt + gen``, built from transformers' processors (presence and
    frequency, which transformers lacks, by OpenAI's formula), in the engine's order: penalties, temperature,
    top-k, top-p, min-p."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt + gen])
    x = logits.float().clone()[None]
    stops = ([] if sp.ignore_eos else list(eos)) + list(sp.stop_token_ids)
    if sp.min_tokens and stops:
        x = MinNewTokensLengthLogitsProcessor(len(prompt), sp.min_tokens, stops)(ids, x)
    if sp.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, x)
    cnt = (
        torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=x.shape[-1]).float()[None]
        if gen
        else torch.zeros_like(x)
    )
    x = x - sp.frequency_penalty * cnt - sp.presence_penalty * (cnt > 0).float()
    if sp.temperature == 0:
        return torch.zeros_like(x[0]).scatter_(0, x[0].argmax()[None], 1.0)
    x = TemperatureLogitsWarper(sp.temperature)(ids, x)
    if sp.top_k:
        x = TopKLogitsWarper(sp.top_k)(ids, x)
    if sp.top_p < 1.0:
        x = TopPLogitsWarper(sp.top_p)(ids, x)
    if sp.min_p > 0:
        x = MinPLogitsWarper(sp.min_p)(ids, x)
    return x.softmax(-1)[0]


CASES = {
    "penalties": SamplingParams(
        max_new_tokens=5, temperature=1.0, repetition_penalty=1.6, presence_penalty=0.9, frequency_penalty=0.7
    ),
    "min_p": SamplingParams(max_new_tokens=5, temperature=1.5, min_p=0.2),
    "greedy-rows": SamplingParams(max_new_tokens=5, temperature=0.0, repetition_penalty=1.4, presence_penalty=1.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_processing_equals_transformers(name):
    g = torch.Generator().manual_seed(0)
    V, eos = 40, [0]
    sp = CASES[name]
    sp_min = SamplingParams(max_new_tokens=8, temperature=0.8, min_tokens=4, stop_token_ids=[5, 7])
    rows = [([1, 2, 3], [4, 4, 9]), ([8], []), ([3, 3], [2, 5, 1, 1])]
    for params in (sp, sp_min):
        proc = RowProcessing.of([params] * 3, "cpu", history=rows, eos=eos, vocab=V)
        logits = torch.randn(3, 1, V, generator=g) * 3
        got = proc.probs_at(logits, None, 0)[:, 0]
        for b, (p, gen) in enumerate(rows):
            assert torch.allclose(got[b], reference_probs(logits[b, 0], p, gen, params, eos), atol=1e-6)


def test_drafts_of_the_round_count_like_generated_tokens():
    """Position j of a round is processed as if drafts d_0..d_{j-1} were already generated."""
    g = torch.Generator().manual_seed(1)
    V, sp = 30, CASES["penalties"]
    prompt, gen, drafts = [1, 2], [3, 4], [4, 7, 7]
    proc = RowProcessing.of([sp], "cpu", history=[(prompt, gen)], eos=[], vocab=V)
    logits = torch.randn(1, 4, V, generator=g) * 3
    got = proc.probs_at(logits, torch.tensor([drafts]), 0)[0]
    for j in range(4):
        assert torch.allclose(got[j], reference_probs(logits[0, j], prompt, gen + drafts[:j], sp, []), atol=1e-6)
    for i in range(1, 4):  # the drafter's step i sees the same
        step = proc.probs_at(logits[:, i : i + 1], torch.tensor([drafts[:i]]), i)[0, 0]
        assert torch.allclose(step, got[i], atol=1e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", "3"),
        ("ignore_eos", 1),
        ("min_tokens", -1),
        ("min_tokens", 100),
        ("logprobs", 21),
    ],
)
def test_bad_controls_are_named(field, value):
    with pytest.raises(InvalidRequestError, match=field.split("[")[0]):
        SamplingParams(max_new_tokens=10, **{field: value})


# ---------------------------------------------------------------- speculation stays exact
def _exact_joint3(eng: Engine, prompt: list[int], sp: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) of plain sampling with ``sp`` (the transformers-built reference), flattened [V**3]."""
    V = eng.vocab
    q = {}
    with torch.no_grad():
        for n in range(3):
            prefixes = list(itertools.product(range(V), repeat=n))
            logits = eng.logits([prompt + list(p) for p in prefixes])[:, -1]
            for p, row in zip(prefixes, logits):
                q[p] = reference_probs(row, prompt, list(p), sp, []).double().numpy()
    joint = np.zeros((V, V, V))
    for a, b in itertools.product(range(V), repeat=2):
        joint[a, b] = q[()][a] * q[(a,)][b] * q[(a, b)]
    return joint.ravel()


def pooled_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` against ``probs``, the cells expecting fewer than 5 pooled into one."""
    e = probs * counts.sum()
    keep = e >= 5
    obs, exp = np.append(counts[keep], counts[~keep].sum()), np.append(e[keep], e[~keep].sum())
    ok = exp > 0
    return chisquare(obs[ok], exp[ok] * obs[ok].sum() / exp[ok].sum()).pvalue


SPEC_CASES = {
    "penalties": {"temperature": 1.0, "repetition_penalty": 1.8, "presence_penalty": 1.0, "frequency_penalty": 0.8},
    "min_p": {"temperature": 1.0, "min_p": 0.5},
    "min_tokens": {"temperature": 1.0, "min_tokens": 2},  # stop_token_ids: the likeliest first token (below)
}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_speculative_distribution_equals_plain_sampling(pair8, case, k):
    eng = Engine.from_pretrained(
        *pair8, speculation=SpeculationConfig(k=k, k_policy="constant"), limits=Limits(max_batch=1000)
    )
    prompt = [1, 2, 3]
    kw = dict(SPEC_CASES[case])
    if case == "min_tokens":
        kw["stop_token_ids"] = [int(eng.logits([prompt])[0, -1].argmax())]
    sp = SamplingParams(max_new_tokens=5, **kw)
    exact = _exact_joint3(eng, prompt, sp)
    unprocessed = _exact_joint3(eng, prompt, SamplingParams(max_new_tokens=5, temperature=kw["temperature"]))
    V = eng.vocab
    n, batch = 24_000, 4_000
    counts = np.zeros(V**3)
    for _ in range(n // batch):
        for o in eng.generate([prompt] * batch, sp):
            t = o.token_ids
            assert len(t) >= 3 or t[-1] in sp.stop_token_ids
            if len(t) >= 3:
                counts[(t[0] * V + t[1]) * V + t[2]] += 1
    assert counts[exact == 0].sum() == 0, "a sequence of zero probability was produced"
    st = eng.stats()
    assert st["drafted"] > 0 and 0.05 < st["acceptance_rate"] < 0.98
    if k == 4:
        assert len(st_pos := eng.scheduler.snapshot()["totals"].pos_tried) >= 3 and st_pos[2] > 0

    assert pooled_pvalue(counts, exact) > ALPHA
    assert pooled_pvalue(counts, unprocessed) < ALPHA  # power: ignoring the control is detected


def test_greedy_with_penalties_is_token_identical_to_plain(ckpt_dir, draft_dir):
    spec = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k=4, k_policy="constant"))
    plain = Engine.from_pretrained(ckpt_dir)
    prompts = [[5, 6, 7], [9, 9, 9, 9], [100, 20, 30, 40, 50]]
    sp = SamplingParams(
        max_new_tokens=40, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_tokens=10
    )
    a = [o.token_ids for o in spec.generate(prompts, sp)]
    b = [o.token_ids for o in plain.generate(prompts, sp)]
    assert a == b
    assert a != [o.token_ids for o in plain.generate(prompts, SamplingParams(max_new_tokens=40))]
    assert spec.stats()["accepted"] > 0


def test_stop_token_ids_ignore_eos_and_min_tokens(ckpt_dir):
    e = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=3))
    ref = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30))[0]
    stop = ref.token_ids[4]
    first = ref.token_ids.index(stop)
    out = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.text == e.tokenizer.decode(ref.token_ids[:first])  # the stop token's text is not output
    late = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop], min_tokens=first + 2))[0]
    assert stop not in late.token_ids[: first + 2]


def test_ignore_eos(ckpt_dir, tmp_path):
    ref = Engine.from_pretrained(ckpt_dir).generate([[5, 6, 7]], SamplingParams(max_new_tokens=30))[0]
    eos = ref.token_ids[3]  # the same weights with a token of this output as eos
    e = Engine.from_pretrained(
        make_checkpoint(tmp_path / "c", "llama", num_hidden_layers=4, eos_token_id=eos),
        speculation=SpeculationConfig(drafter="ngram", k=3),
    )
    out = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30))[0]
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(eos) + 1] and out.finish_reason == "stop"
    full = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert full.token_ids == ref.token_ids and full.finish_reason == "length"
    late = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, min_tokens=8))[0]
    assert eos not in late.token_ids[:8]
