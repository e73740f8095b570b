"""A drafter is one class and one registry entry: a toy drafter defined in this file alone runs through the
Engine (greedy identity, the exact sampled joint), the OpenAI server and the bench's runner; the registry is the
one list of drafters the options, the tools' choices, draft training and the README read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_speculative import sampled_joint
from util import PROMPTS, assert_greedy_grid

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.spec_decode.drafter import Committed, DraftBatch, FeatureNeed
from engine.spec_decode.heads.config import HEAD_KINDS
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.registry import DRAFTERS, DrafterEntry, Loads

ROOT = Path(__file__).resolve().parents[1]


class RepeatLast:
    """Drafts each row's last committed token K times: deterministic (p one-hot), no model, no state."""

    probabilistic = False
    features = FeatureNeed.NONE
    samples = False
    max_drafts = None

    def __init__(self) -> None:
        self.rounds = 0
        self.accepted: list[int] = []

    def propose(self, batch: DraftBatch) -> Proposal:
        self.rounds += 1
        last = torch.tensor([s.tokens[-1] for s in batch.seqs], device=batch.device)
        return Proposal.chain(last[:, None].expand(-1, batch.k).contiguous())

    def ensure_cache(self, max_batch: int, max_seq_len: int) -> None:
        pass

    def commit(self, seq, outcome: Committed) -> None:
        self.accepted.append(outcome.accepted)

    def share_prefill(self, src, dst, length: int) -> None:
        pass

    def catch_up(self, seqs, scratch_pos: int) -> int:
        return 0

    def cost_step(self, batch: int):
        return None


TOYS = DRAFTERS.extended(DrafterEntry("repeat-last", "the last token again", lambda ctx: RepeatLast()))


def toy_engine(ckpt: Path, k: int = 3, **kw) -> Engine:
    spec = SpeculationConfig(drafter="repeat-last", k=k, k_policy="constant", registry=TOYS)
    return Engine.from_pretrained(ckpt, speculation=spec, **kw)


def test_a_drafter_defined_here_keeps_the_targets_greedy_output(ckpt_dir, plain):
    for k in (1, 4):
        eng = toy_engine(ckpt_dir, k)
        assert_greedy_grid(eng, plain, "repeat-last", k)
        toy = eng.drafter
        assert isinstance(toy, RepeatLast) and toy.rounds > 0 and len(toy.accepted) > 0
        s = eng.stats()
        assert s["drafter"] == "repeat-last" and s["drafted"] > 0
        assert sum(toy.accepted) == s["accepted"]  # it was told every row's outcome of every round


def test_a_drafter_defined_here_samples_the_targets_joint(tiny_pair):
    target, _ = tiny_pair
    eng = toy_engine(Path(target), 2)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0)  # 3: the first round drafts none, the second one token
    counts, exact, pvalue = sampled_joint(eng, [1, 2, 2, 2], sp, 12_000, 2_000)
    assert counts[exact == 0].sum() == 0
    assert pvalue > 1e-3
    assert eng.stats()["accepted"] > 0  # a repeated token is often the target's next: some drafts were taken


def test_a_drafter_defined_here_serves_and_benches(ckpt_dir, plain):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_openai_server import Live

    from engine.cli.bench_modes import spec_runner

    eng = toy_engine(ckpt_dir)
    live = Live(eng)
    try:
        got = live.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=40, temperature=0)
        want = eng.tokenizer.decode(plain[0])
        assert got.choices[0].text == want
    finally:
        live.close()
    outputs: list[list[int]] = []
    tokens, seconds = spec_runner(eng, [eng.tokenizer.decode(p) for p in PROMPTS[:2]], 16, None, outputs)()
    assert tokens == sum(len(o) for o in outputs) > 0 and seconds > 0
    assert eng.drafter.rounds > 0


def test_the_registry_is_the_one_list_of_drafters():
    names = DRAFTERS.names()
    assert names == ("model", "ngram", "early-exit", "medusa", "eagle", "eagle3", "suffix")
    assert set(DRAFTERS.loading(Loads.HEAD)) == set(HEAD_KINDS)  # every head drafter loads a head architecture
    from engine.cli.serve import build_parser
    from engine.train.distill import KINDS

    assert KINDS == DRAFTERS.trainable() == ("model", "medusa", "eagle", "eagle3")
    drafter_arg = next(a for a in build_parser()._actions if a.dest == "drafter")
    assert tuple(drafter_arg.choices) == names
    with pytest.raises(InvalidConfigError, match="registered twice"):
        DRAFTERS.extended(DrafterEntry("ngram", "again", lambda ctx: RepeatLast()))
    with pytest.raises(
        InvalidConfigError, match="allowed model, ngram, early-exit, medusa, eagle, eagle3, suffix or None"
    ):
        SpeculationConfig(drafter="repeat-last")  # not in the default registry
    with pytest.raises(InvalidConfigError, match="early_exit_layers=2 needs speculation.drafter='early-exit'"):
        SpeculationConfig(drafter="repeat-last", registry=TOYS, early_exit_layers=2)


def test_the_readme_lists_every_drafter_of_the_registry():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| ([^|]+) \| ([^|]+) \|$", text, re.MULTILINE)
    table = {name: (loads.strip(), summary.strip()) for name, loads, summary in rows}
    assert {n: table.get(n) for n in DRAFTERS.names()} == {e.name: (e.loads.value, e.summary) for e in DRAFTERS}


# RepeatLast without ``samples``: a drafter written before the protocol had it
_NoSamples = type("_NoSamples", (), {k: v for k, v in vars(RepeatLast).items() if k not in ("samples", "__dict__")})


def test_a_drafter_missing_a_protocol_member_is_refused_at_load(ckpt_dir):
    assert not hasattr(_NoSamples(), "samples") and hasattr(RepeatLast(), "samples")
    registry = DRAFTERS.extended(DrafterEntry("partial", "no samples attribute", lambda ctx: _NoSamples()))
    spec = SpeculationConfig(drafter="partial", k=2, k_policy="constant", registry=registry)
    with pytest.raises(InvalidConfigError, match="'partial'.*Drafter.*samples"):
        Engine.from_pretrained(ckpt_dir, speculation=spec)
