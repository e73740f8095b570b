"""The train-draft tool's held-out evaluation (engine/demo/distill_eval.py): greedy rounds simulated on text
the target generated, checked against exact cases and against the engine's own rounds."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.demo.distill import TrainOptions, train_draft
from engine.demo.distill_eval import heldout_acceptance, heldout_data, simulate_rounds
from engine.spec.heads import load_head


def test_rounds_hop_by_the_accepted_drafts_plus_one():
    # lead[i] belongs to the round whose first draft is the token at i + 2; prompt_len 3: the prefill
    # commits token 3, the first round starts at 4 (index 2), accepts 2 and commits 3 tokens, so the next
    # starts at 7 (index 5), accepts 3 and moves to 11, past the last start (10)
    lead = torch.tensor([9, 9, 2, 0, 1, 3, 0, 0, 0])
    assert simulate_rounds(lead, 3) == [2, 3]
    assert simulate_rounds(torch.zeros(5, dtype=torch.long), 1) == [0] * 5  # starts 2 .. 6, one token each
    assert simulate_rounds(lead, 20) == []


@pytest.fixture(scope="module")
def tiny_eagle(tiny_demo, tmp_path_factory):
    """An EAGLE head trained in seconds on the tiny demo target, with its report and the held-out data."""
    target, _ = tiny_demo
    d = tmp_path_factory.mktemp("eval")
    train = (target.parent / "calib.txt").read_text(encoding="utf-8")
    opts = TrainOptions(kind="eagle", steps=150, samples=48, prompt_len=16, gen_len=64, heads=3)
    report = train_draft(target, d / "eagle", opts, train, progress=False, heldout=6, eval_k=3)
    eng = Engine.from_pretrained(target)
    held = heldout_data(eng, train, 6, opts, d / "held.pt", progress=False)  # the report's (deterministic)
    return target, d / "eagle", report, held, eng


def test_the_target_as_its_own_draft_accepts_everything_and_a_reversed_scorer_nothing(tiny_eagle):
    target, head_dir, _, held, eng = tiny_eagle
    k = 4
    own = heldout_acceptance("model", eng.target, eng.target, held, k, None, None)
    assert own["sequences"] == 6 and own["rounds"] > 6
    assert own["acceptance"] >= 0.99 and own["mean_accepted_length"] >= k + 0.95
    head, _, _ = load_head(head_dir, eng.target, eng.tokenizer.vocab(), "eagle")
    lm_w = eng.target.lm_head.weight.detach().float()
    never = heldout_acceptance("eagle", head.float(), eng.target, held, k, -lm_w, None)  # argmin: never the argmax
    assert never["acceptance"] == 0.0 and never["mean_accepted_length"] == 1.0 and never["first_draft_acceptance"] == 0


def test_heldout_figures_agree_with_the_engines_rounds(tiny_eagle):
    """The report's simulated greedy rounds at K = 3 against the engine decoding the same held-out prompts
    with the head at K = 3: the same text, and acceptance within the tail rounds and fp16 step rounding."""
    target, head_dir, report, held, _ = tiny_eagle
    sim = report["heldout"]
    assert sim["k"] == 3 and sim["sequences"] == 6
    assert sim["acceptance"] > 0.3  # a trained head: an off-by-one feature or token would score near 0
    eng = Engine.from_pretrained(
        target, head_dir, speculation=SpeculationConfig(drafter="eagle", k=3, k_policy="constant")
    )
    P = held.prompt_len
    prompts = [held.tokens[r, :P].tolist() for r in range(6)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=held.tokens.shape[1] - P))
    for r, o in enumerate(outs):
        n = int(held.lengths[r])
        assert list(o.token_ids)[: n - P] == held.tokens[r, P:n].tolist()
    st = eng.stats()
    # the engine's rounds are the simulated ones, plus each sequence's last (shorter) rounds
    sim_accepted = sim["acceptance"] * sim["k"] * sim["rounds"]
    assert abs(st["accepted"] - sim_accepted) <= 3 * 6, (st, sim)
    assert abs(st["acceptance_rate"] - sim["acceptance"]) < 0.08, (st, sim)
    assert abs(st["mean_accepted_length"] - sim["mean_accepted_length"]) < 0.25, (st, sim)


@pytest.mark.parametrize("kw, needle", [({"heldout": -1}, "heldout=-1"), ({"eval_k": 0}, "eval_k=0")])
def test_bad_evaluation_options_are_refused_before_any_work(tmp_path, kw, needle):
    with pytest.raises(InvalidConfigError, match=needle):
        train_draft(tmp_path / "missing", tmp_path / "out", TrainOptions(kind="eagle"), "text", **kw)
    assert not (tmp_path / "out").exists()
