"""The train-draft tool's held-out evaluation (engine/train/heldout.py): greedy rounds simulated on text
the target generated, checked against exact cases and against the engine's own rounds for every kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.spec_decode.heads.checkpoint import load_head
from engine.train.data import prompt_starts
from engine.train.distill import RunOptions, TrainOptions, train_draft
from engine.train.heldout import heldout_acceptance, heldout_data, heldout_starts, simulate_rounds

N_HELD, K = 6, 3


def test_rounds_hop_by_the_accepted_drafts_plus_one() -> None:
    # the first round (index 0) accepts 2 and commits 3 tokens, the next starts at index 3 and accepts 3,
    # the next at index 7 accepts 0, the last at index 8
    lead = torch.tensor([2, 9, 9, 3, 9, 9, 9, 0, 1])
    assert simulate_rounds(lead) == [2, 3, 0, 1]
    assert simulate_rounds(torch.zeros(5, dtype=torch.long)) == [0] * 5
    assert simulate_rounds(torch.zeros(0, dtype=torch.long)) == []


def test_heldout_prompts_lie_apart_from_the_training_prompts() -> None:
    opts = TrainOptions(kind="eagle", samples=40, prompt_len=8, gen_len=24, seed=3)
    held = heldout_starts(5000, 30, opts)
    train = prompt_starts(5000, 40, 8, 3)
    assert len(set(held)) == 30 and all(0 <= s <= 5000 - 8 for s in held)
    assert min(abs(h - t) for h in held for t in train) >= 8 + 24
    fewer = heldout_starts(5000, 4000, opts)  # all the text leaves: fewer than asked
    assert 30 < len(fewer) < 4000 and min(abs(h - t) for h in fewer for t in train) >= 8 + 24
    assert heldout_starts(200, 8, TrainOptions(kind="eagle", samples=40, prompt_len=8, gen_len=24)) == []


@pytest.fixture(scope="module")
def evaluated(tiny_demo: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Medusa and EAGLE heads trained in seconds on the tiny demo target (their reports), the held-out data
    of a head and of a draft model (the same prompts), and the tiny pair's own draft model's figures."""
    from engine.core.checkpoint import load_model

    target, draft = tiny_demo
    d = tmp_path_factory.mktemp("eval")
    train = (target.parent / "calib.txt").read_text(encoding="utf-8")
    out: dict[str, Any] = {"target": target, "draft": draft, "dirs": {}, "reports": {}}
    for name in ("medusa", "eagle", "eagle-attn"):
        kind = name.removesuffix("-attn")
        opts = TrainOptions(
            kind=kind, attention=name != kind, steps=150, samples=48, prompt_len=16, gen_len=64, heads=K
        )
        run = RunOptions(progress=False, heldout=N_HELD, eval_k=K)
        out["reports"][name] = train_draft(target, d / name, opts, train, run)
        out["dirs"][name] = d / name
    eng = Engine.from_pretrained(target)
    ids = eng.tokenizer.encode(train)
    opts = TrainOptions(kind="model", samples=48, prompt_len=16, gen_len=64)
    out["held_model"] = heldout_data(eng, ids, N_HELD, opts, progress=False)
    opts = TrainOptions(kind="eagle", samples=48, prompt_len=16, gen_len=64, heads=K)
    out["held_head"] = heldout_data(eng, ids, N_HELD, opts, progress=False)
    out["reports"]["model"] = {
        "heldout": heldout_acceptance("model", load_model(draft), eng.target, out["held_model"], K, None, None)
    }
    out["eng"] = eng
    return out


def test_the_target_as_its_own_draft_accepts_everything_and_a_reversed_scorer_nothing(
    evaluated: dict[str, Any],
) -> None:
    eng = evaluated["eng"]
    own = heldout_acceptance("model", eng.target, eng.target, evaluated["held_model"], 4, None, None)
    assert own["sequences"] == N_HELD and own["rounds"] > N_HELD
    assert own["acceptance"] >= 0.99 and own["mean_accepted_length"] >= 4.95
    head, _, _ = load_head(evaluated["dirs"]["eagle"], eng.target, eng.tokenizer.vocab(), "eagle")
    lm_w = eng.target.lm_head.weight.detach().float()
    held = evaluated["held_head"]
    never = heldout_acceptance("eagle", head.float(), eng.target, held, 4, -lm_w, None)  # argmin, never argmax
    assert never["acceptance"] == 0.0 and never["mean_accepted_length"] == 1.0 and never["first_draft_acceptance"] == 0
    with pytest.raises(InvalidConfigError, match="kind='tree' is invalid"):
        heldout_acceptance("tree", head, eng.target, held, 4, lm_w, None)


@pytest.mark.parametrize("name", ["model", "medusa", "eagle", "eagle-attn"])
def test_heldout_figures_agree_with_the_engines_rounds(evaluated: dict[str, Any], name: str) -> None:
    """The simulated greedy rounds at K = 3 against the engine decoding the same held-out prompts with the
    draft at K = 3: the same text, and the same accepted drafts but for each sequence's last rounds (the
    simulation stops where fewer than K tokens remain) and rare fp16 rounding of the draft's step."""
    kind = name.removesuffix("-attn")
    sim = evaluated["reports"][name]["heldout"]
    assert sim["k"] == K and sim["sequences"] == N_HELD
    assert sim["acceptance"] > 0.1 and sim["first_draft_acceptance"] > 0.3  # drafts that often match
    held = evaluated["held_model" if kind == "model" else "held_head"]
    source = evaluated["draft"] if kind == "model" else evaluated["dirs"][name]
    spec = SpeculationConfig(drafter=kind, k=K, k_policy="constant")
    eng = Engine.from_pretrained(evaluated["target"], source, speculation=spec)
    P = held.prompt_len
    prompts = [held.tokens[r, :P].tolist() for r in range(N_HELD)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=held.tokens.shape[1] - P))
    for r, o in enumerate(outs):
        n = int(held.lengths[r])
        assert list(o.token_ids)[: n - P] == held.tokens[r, P:n].tolist()
    st = eng.stats()
    sim_accepted = round(sim["acceptance"] * K * sim["rounds"])
    assert -2 <= st["accepted"] - sim_accepted <= K * N_HELD, (st, sim)
    assert abs(st["acceptance_rate"] - sim["acceptance"]) < 0.02, (st, sim)


@pytest.mark.parametrize("kw, needle", [({"heldout": -1}, "heldout=-1"), ({"eval_k": 0}, "eval_k=0")])
def test_bad_evaluation_options_are_refused_before_any_work(tmp_path: Path, kw: dict[str, int], needle: str) -> None:
    with pytest.raises(InvalidConfigError, match=needle):
        train_draft(tmp_path / "missing", tmp_path / "out", TrainOptions(kind="eagle"), "text", RunOptions(**kw))
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["model", "medusa", "eagle", "eagle-attn"])
def test_every_kind_trains_on_cuda(evaluated: dict[str, Any], tmp_path: Path, name: str) -> None:
    """--device cuda: the target generates and labels on the GPU and the draft trains there (its data, LM head
    rows and embedding on the device). The draft written from the GPU drafts as well as the CPU-trained one
    and greedy decoding with it on the CPU equals plain decoding."""
    kind = name.removesuffix("-attn")
    target = evaluated["target"]
    train = (target.parent / "calib.txt").read_text(encoding="utf-8")
    vocab = 256 if name == "eagle" else None  # the reduced draft vocabulary's rows and positions on the device
    opts = TrainOptions(
        kind=kind, attention=name != kind, steps=150, samples=48, prompt_len=16, gen_len=64, heads=K, draft_vocab=vocab
    )
    run = RunOptions(device="cuda", progress=False, heldout=N_HELD, eval_k=K)
    rep = train_draft(target, tmp_path, opts, train, run)
    assert rep["heldout"]["first_draft_acceptance"] > 0.3, rep["heldout"]
    if kind != "model" and vocab is None:  # trained alike on the CPU by the fixture
        cpu = evaluated["reports"][name]["heldout"]
        assert rep["heldout"]["first_draft_acceptance"] > cpu["first_draft_acceptance"] - 0.15, (rep, cpu)
    spec = SpeculationConfig(drafter=kind, k=K, k_policy="constant")
    eng = Engine.from_pretrained(target, tmp_path, speculation=spec)
    plain = evaluated["eng"]
    prompts = ["The ", "def f(x):"]
    sp = SamplingParams(max_new_tokens=24)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
