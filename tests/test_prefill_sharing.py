"""The n samples of one prompt share its prefill: outputs equal the same requests run alone, the prompt is
computed once (the others start from a copy of its keys/values), and the edge cases fall back correctly."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.model import KVCache
from engine.spec_decode.heads.checkpoint import save_head
from engine.spec_decode.heads.config import HeadConfig, target_fingerprint
from engine.spec_decode.heads.modules import init_head

PROMPT = [10, 11, 12, 10, 11, 12, 40, 41, 10, 11]  # repetitive: the n-gram lookup finds drafts
DRAFTERS = ["model", "ngram", "early-exit", "eagle", None]


@pytest.fixture(scope="module")
def eagle_dir(ckpt_dir, tmp_path_factory):
    """An untrained EAGLE head for the test target (drafts are accepted sometimes, not always)."""
    eng = Engine.from_pretrained(ckpt_dir)
    target, c = eng.target, eng.config
    fp = target_fingerprint(target, eng.tokenizer.vocab())
    cfg = HeadConfig(kind="eagle", hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=3, target=fp)
    out = tmp_path_factory.mktemp("eagle") / "head"
    save_head(init_head(cfg, target, seed=0), cfg, None, out)
    return out


@pytest.fixture(scope="module")
def engines(ckpt_dir, draft_dir, eagle_dir):
    made: dict[str | None, Engine] = {}

    def get(drafter: str | None) -> Engine:
        if drafter not in made:
            draft = {"model": draft_dir, "eagle": eagle_dir}.get(drafter or "")
            spec = SpeculationConfig(
                drafter=drafter,
                k=3,
                k_policy="heuristic",  # K follows the sequence's own acceptance: alone == together
                early_exit_layers=2 if drafter == "early-exit" else None,
            )
            made[drafter] = Engine.from_pretrained(ckpt_dir, draft, speculation=spec, limits=Limits(max_batch=8))
        return made[drafter]

    return get


def _params(mode: str, n: int, max_new: int = 20) -> list[SamplingParams]:
    if mode == "greedy":
        return [SamplingParams(max_new_tokens=max_new)] * n
    return [SamplingParams(max_new_tokens=max_new, temperature=0.9, top_p=0.95, seed=7 + j) for j in range(n)]


def _alone(eng: Engine, prompt: list[int], params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    """Each request run by itself: its outputs and the prompt tokens computed in all."""
    eng.reset_stats()
    outs = [eng.generate([prompt], sp)[0].token_ids for sp in params]
    return outs, eng.stats()["prefill_tokens"]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("drafter", DRAFTERS, ids=str)
def test_n_samples_share_the_prefill_and_equal_their_solo_runs(engines, drafter, n, mode):
    eng = engines(drafter)
    params = _params(mode, n)
    refs, solo_prefill = _alone(eng, PROMPT, params)
    assert solo_prefill == n * len(PROMPT)
    if mode == "seeded":
        assert len({tuple(r) for r in refs}) > 1  # distinct seeds: distinct samples (a copied output would differ)
    eng.reset_stats()
    outs = eng.generate([PROMPT] * n, params)
    assert [o.token_ids for o in outs] == refs
    s = eng.stats()
    assert s["prefill_tokens"] == len(PROMPT) and s["prefill_shared"] == (n - 1) * len(PROMPT)
    assert [o.stats["prefill_tokens"] for o in outs] == [len(PROMPT)] + [0] * (n - 1)
    if drafter is not None:
        assert s["drafted"] > 0


@pytest.mark.parametrize("drafter", ["model", "eagle", None], ids=str)
def test_groups_among_other_requests_and_logprobs(engines, drafter):
    """Two prompts with 3 samples each between unrelated requests, one sample asking for logprobs, one that
    ends in its prefill round (max_new_tokens=1): everything equals the solo runs, each prompt computed once."""
    eng = engines(drafter)
    other = [5, 6, 7, 8]
    jobs = [
        (other, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)),
        (PROMPT, SamplingParams(max_new_tokens=1, temperature=0.8, seed=1)),
        (PROMPT, SamplingParams(max_new_tokens=15, temperature=0.8, seed=2, logprobs=2)),
        (PROMPT, SamplingParams(max_new_tokens=15)),
        ([9, 8, 7], SamplingParams(max_new_tokens=10, temperature=1.2, seed=4)),
        ([9, 8, 7], SamplingParams(max_new_tokens=10, temperature=1.2, seed=5)),
        ([9, 8, 7], SamplingParams(max_new_tokens=10, temperature=1.2, seed=6)),
    ]
    solo = [eng.generate([p], sp)[0] for p, sp in jobs]
    eng.reset_stats()
    outs = eng.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [o.token_ids for o in outs] == [o.token_ids for o in solo]
    assert outs[1].token_ids and len(outs[1].token_ids) == 1
    got, want = outs[2].logprobs, solo[2].logprobs
    assert got is not None and want is not None and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert eng.stats()["prefill_tokens"] == len(other) + len(PROMPT) + 3
    assert eng.stats()["prefill_shared"] == 2 * len(PROMPT) + 2 * 3


def test_a_failed_prefill_lets_the_others_prefill_themselves(engines):
    """NaN logits in the first sample's prefill end it with 'error'; the others (which would have copied
    its keys/values) prefill themselves and equal their solo runs."""
    eng = engines("model")
    params = _params("seeded", 3)
    refs, _ = _alone(eng, PROMPT, params)
    first: list = []
    eng.loop.inject_nan = lambda s: (first or first.append(s) or True) and s is first[0] and not s.generated
    try:
        eng.reset_stats()
        outs = eng.generate([PROMPT] * 3, params)
    finally:
        eng.loop.inject_nan = None
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == refs[1:]
    s = eng.stats()
    assert s["prefill_shared"] == len(PROMPT) and s["prefill_tokens"] == 3 * len(PROMPT) - len(PROMPT)


def test_a_group_larger_than_the_free_rows(ckpt_dir, draft_dir):
    """max_batch 2 and 5 samples: they run in turns, sharing within each admission, same outputs."""
    eng = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=2)
    )
    params = _params("seeded", 5, max_new=8)
    refs, _ = _alone(eng, PROMPT, params)
    eng.reset_stats()
    assert [o.token_ids for o in eng.generate([PROMPT] * 5, params)] == refs
    assert eng.stats()["prefill_tokens"] < 5 * len(PROMPT)


def test_kv_cache_copy_rows(ckpt_dir):
    cfg = Engine.from_pretrained(ckpt_dir).config
    c = KVCache(cfg, 4, 16, torch.float32, "cpu")
    c.k.normal_()
    c.v.normal_()
    k0, v0 = c.k.clone(), c.v.clone()
    c.copy_rows(1, [0, 3], 5)
    for t, t0 in ((c.k, k0), (c.v, v0)):
        assert torch.equal(t[:, 0, :, :5], t0[:, 1, :, :5]) and torch.equal(t[:, 3, :, :5], t0[:, 1, :, :5])
        assert torch.equal(t[:, 0, :, 5:], t0[:, 0, :, 5:]) and torch.equal(t[:, 3, :, 5:], t0[:, 3, :, 5:])
        assert torch.equal(t[:, 1:3], t0[:, 1:3])
