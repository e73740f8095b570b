"""Lossless speculative decoding: greedy identity, exact sampling distribution, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from util import PROMPTS, assert_greedy_grid

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.spec_decode.sampling import params_to_tensors, process_logits


@pytest.mark.parametrize("drafter", ["model", "ngram", "early-exit"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_equals_plain(ckpt_dir, draft_dir, plain, drafter, k):
    eng = Engine.from_pretrained(
        ckpt_dir,
        draft_dir if drafter == "model" else None,
        speculation=SpeculationConfig(
            drafter=drafter, k=k, k_policy="constant", early_exit_layers=2 if drafter == "early-exit" else None
        ),
    )
    assert_greedy_grid(eng, plain, drafter, k)
    s = eng.stats()
    assert s["drafted"] > 0
    if drafter == "model":  # the perturbed draft agrees often but not always: both paths ran
        assert 0.2 < s["acceptance_rate"] < 1.0


def test_adaptive_k_greedy_identity_and_stats(ckpt_dir, draft_dir, plain):
    eng = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3)
    )  # the measured policy (the K tuner)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    assert [o.token_ids for o in outs] == plain
    st = outs[0].stats
    assert st["target_passes"] >= 1 and st["drafted"] >= st["accepted"] >= 0
    assert all(r is None or 0 <= r <= 1 for r in st["per_position_acceptance"])
    s = eng.stats()
    total_passes = sum(o.stats["target_passes"] for o in outs)
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / total_passes)
    assert s["target_passes_per_token"] == pytest.approx(total_passes / sum(len(o.token_ids) for o in outs))


def test_stop_conditions_inside_an_accepted_run(ckpt_dir, draft_dir, plain):
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k=8, k_policy="constant"))
    ref = plain[1]
    # max_new_tokens cuts the run exactly
    out = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=7))[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    # a stop string: the text stops before it, tokens end with the one completing it
    full = eng.tokenizer.decode(ref)
    stop = full[10:13]
    out = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.find(stop)]
    assert stop in eng.tokenizer.decode(out.token_ids) and stop not in eng.tokenizer.decode(out.token_ids[:-1])
    # eos inside a run: nothing after it
    eos = eng.config.eos_token_ids[0]
    for p, r in zip(PROMPTS, plain):
        if eos in r:
            out = eng.generate([p], SamplingParams(max_new_tokens=40))[0]
            assert out.token_ids == r[: r.index(eos) + 1] and out.finish_reason == "stop"


# ---------------------------------------------------------------- the sampling distribution
def _exact_joint(eng: Engine, prompt: list[int], sp: SamplingParams) -> np.ndarray:
    """P(t1, t2) from the target's logits, processed like the engine does: [V, V]."""
    V = eng.vocab
    with torch.no_grad():
        t, k, p = params_to_tensors([sp], "cpu")
        q1 = process_logits(eng.logits([prompt])[:, -1], t, k, p)[0]  # [V]
        rows = torch.tensor([prompt + [a] for a in range(V)])
        q2 = process_logits(eng.logits(rows)[:, -1], t.expand(V), k.expand(V), p.expand(V))  # [V, V]
    return (q1[:, None] * q2).double().numpy()


def sampled_joint(
    eng: Engine, prompt: list[int], sp: SamplingParams, n: int, batch: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """The first two generated tokens of n samples counted [V, V], their exact joint [V, V] and the chi-square
    p-value of the counts against it (the cells expecting fewer than 5 pooled into one)."""
    exact = _exact_joint(eng, prompt, sp)
    V = eng.vocab
    counts = np.zeros((V, V))
    for _ in range(n // batch):
        for o in eng.generate([prompt] * batch, sp):
            counts[o.token_ids[0], o.token_ids[1]] += 1
    e, c = exact.ravel() * n, counts.ravel()
    keep = e >= 5
    obs, exp = np.append(c[keep], c[~keep].sum()), np.append(e[keep], e[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return counts, exact, chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_new_tokens=3, temperature=1.0),
        SamplingParams(max_new_tokens=3, temperature=1.5, top_k=10, top_p=0.85),
    ],
    ids=["t1.0", "t1.5-k10-p0.85"],
)
def test_joint_distribution_of_two_tokens_matches_target(tiny_pair, sp):
    eng = Engine.from_pretrained(*tiny_pair, speculation=SpeculationConfig(k=2, k_policy="constant"))
    counts, exact, pvalue = sampled_joint(eng, [1, 2, 3], sp, 40_000, 4_000)
    assert counts[exact == 0].sum() == 0, "a token of zero target probability was produced"
    assert 0.05 < eng.stats()["acceptance_rate"] < 0.95  # both paths of the acceptance rule ran
    assert pvalue > 1e-4


# ---------------------------------------------------------------- reproducibility
def test_seeded_output_is_the_same_alone_and_in_a_batch(tiny_pair):
    eng = Engine.from_pretrained(*tiny_pair, speculation=SpeculationConfig(k=3))
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1234)
    alone = eng.generate([[1, 2, 3]], sp)[0].token_ids
    again = eng.generate([[1, 2, 3]], sp)[0].token_ids
    assert alone == again
    mixed = [
        SamplingParams(max_new_tokens=24, temperature=1.0),
        sp,
        SamplingParams(max_new_tokens=10, temperature=0.7, seed=7),
        SamplingParams(max_new_tokens=30, temperature=1.2),
    ]
    outs = eng.generate([[4, 5], [1, 2, 3], [9], [1, 2, 3]], mixed)
    assert outs[1].token_ids == alone
    other_seed = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=24, temperature=1.0, seed=99))[0]
    assert other_seed.token_ids != alone
    # unseeded requests get independent streams
    free = [o.token_ids for o in eng.generate([[1, 2, 3]] * 6, SamplingParams(max_new_tokens=24, temperature=1.0))]
    assert len({tuple(f) for f in free}) > 1
    assert all(t < eng.vocab for f in free for t in f)


def test_stream_concatenates_to_the_text(ckpt_dir, draft_dir):
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k=4))
    sp = SamplingParams(max_new_tokens=30, temperature=0.8, seed=5)
    pieces = list(eng.stream("The quick brown", sp))
    assert "".join(pieces) == eng.generate("The quick brown", sp)[0].text
    assert all(pieces)
