"""Prompt lookup first, a drafter otherwise (engine/spec_decode/drafters/lookup.py): the target's output is
unchanged (greedy identity over prompts x K x batch for a draft model and a trained head; the exact two-token
joint when sampled, with rows of one round taking either path); the wrapped drafter's state stays that of the
committed tokens after rounds it did not draft; the option is checked and kept in profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_heads import random_head
from test_speculative import sampled_joint
from util import PROMPTS, assert_greedy_grid

from engine import Engine, SamplingParams
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.core.errors import InvalidConfigError
from engine.core.model import KVCache
from engine.spec_decode.drafter import Committed, FeatureNeed
from engine.spec_decode.drafters.lookup import LookupFirst
from engine.spec_decode.proposal import Proposal
from quant.plan_io import plan_from_dict


def lookup(drafter: str | None, k: int, n_min: int = 2) -> SpeculationConfig:
    return SpeculationConfig(drafter=drafter, k=k, k_policy="constant", prompt_lookup_min=n_min)


def spy_lookups(monkeypatch, drafter: LookupFirst) -> list[bool]:
    """Whether each row's lookup found a match, one entry per row and round."""
    found: list[bool] = []
    orig = drafter.ngram.lookup

    def spy(tokens: list[int], k: int) -> list[int]:
        out = orig(tokens, k)
        found.append(bool(out))
        return out

    monkeypatch.setattr(drafter.ngram, "lookup", spy)
    return found


@pytest.fixture(scope="module")
def heads(ckpt_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lookup")
    return {
        "eagle": random_head(ckpt_dir, d / "eagle", "eagle"),
        "eagle-attn": random_head(ckpt_dir, d / "eagle-attn", "eagle", attention=True),
        "medusa": random_head(ckpt_dir, d / "medusa", "medusa"),
    }


def count_rounds(monkeypatch, drafter: LookupFirst) -> dict[str, int]:
    """Rounds the wrapper drafted and rounds its inner drafter ran (fewer: every row of a round copied)."""
    n = {"rounds": 0, "inner": 0}
    for obj, key in ((drafter, "rounds"), (drafter.inner, "inner")):

        def counted(batch, orig=obj.propose, key=key):
            n[key] += 1
            return orig(batch)

        monkeypatch.setattr(obj, "propose", counted)
    return n


GRID = [(k, "copy-first") for k in (1, 3, 6)] + [(3, "adaptive")]


@pytest.mark.parametrize("k, rule", GRID)
@pytest.mark.parametrize("drafter", ["model", "early-exit", "medusa", "eagle", "eagle-attn"])
def test_greedy_equals_plain(ckpt_dir, draft_dir, heads, plain, drafter, k, rule, monkeypatch):
    """copy-first: every row with a copy takes it, so rounds mix copied and drafted rows and some rounds skip the
    drafter; adaptive: the drafter's rule."""
    draft = {"model": draft_dir, **heads}.get(drafter)
    eng = Engine.from_pretrained(ckpt_dir, draft, speculation=lookup(drafter.removesuffix("-attn"), k))
    assert isinstance(eng.drafter, LookupFirst)
    if rule == "copy-first":
        monkeypatch.setattr(eng.drafter, "prefers_copy", lambda rec: True)
    found = spy_lookups(monkeypatch, eng.drafter)
    n = count_rounds(monkeypatch, eng.drafter)
    assert_greedy_grid(eng, plain, drafter, k, rule)
    s = eng.stats()
    assert s["drafted"] > 0 and 0 < s["acceptance_rate"] < 1
    assert 0 < sum(found) < len(found), "rows with a copy and rows without"
    if rule == "copy-first":
        assert 0 < n["inner"] < n["rounds"], n


def test_draft_cache_holds_the_committed_tokens(ckpt_dir, draft_dir, monkeypatch):
    """Before every round the draft model drafts, its cache's first dlen positions are the draft model's keys and
    values of the committed tokens, also after rounds it did not draft (every row copied) and rounds whose
    accepted drafts were copies, not its own."""
    from engine.api.options import KernelOptions

    eng = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=lookup("model", 4, 1), kernels=KernelOptions(cpu_pack=False)
    )
    monkeypatch.setattr(eng.drafter, "prefers_copy", lambda rec: True)
    inner, draft = eng.drafter.inner, eng.draft_model
    found = spy_lookups(monkeypatch, eng.drafter)
    orig, checked = inner.propose, []

    def propose(batch):
        for s in batch.seqs:
            n = inner.cached_length(s)
            if n:
                ref = KVCache(draft.config, 1, inner.cache.max_seq_len, inner.cache.k.dtype, "cpu")
                with torch.no_grad():
                    draft(torch.tensor([s.tokens[:n]]), torch.arange(n)[None], ref, n)
                for got, want in ((inner.cache.k, ref.k), (inner.cache.v, ref.v)):
                    torch.testing.assert_close(got[:, s.row, :, :n], want[:, 0, :, :n], rtol=1e-4, atol=1e-5)
                checked.append(n)
        return orig(batch)

    monkeypatch.setattr(inner, "propose", propose)
    n = count_rounds(monkeypatch, eng.drafter)
    for p in PROMPTS[:8]:  # one at a time: a round with a copy skips the draft model
        eng.generate([p], SamplingParams(max_new_tokens=30))
    eng.generate(PROMPTS[:8], SamplingParams(max_new_tokens=30))  # and a batch mixing copied and drafted rows
    assert len(checked) > 10 and 0 < sum(found) < len(found)
    assert 0 < n["inner"] < n["rounds"] - 5, n


def _sampled_joint_matches(eng: Engine, monkeypatch) -> None:
    """The exact two-token joint after a prompt that repeats [1, 2] (its first round finds a copy); the second
    round finds one where the first token recurs in the context."""
    found = spy_lookups(monkeypatch, eng.drafter)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0)  # 3: a second round drafts the second token
    counts, exact, pvalue = sampled_joint(eng, [1, 2, 3, 1, 2], sp, 30_000, 3_000)
    assert counts[exact == 0].sum() == 0
    assert 0.05 < eng.stats()["acceptance_rate"] < 0.95
    assert 0.05 < np.mean(found) < 0.95, "rows with a copy and rows without in the same rounds"
    assert pvalue > 1e-4


@pytest.mark.parametrize("drafter, rule", [("model", "copy-first"), ("eagle", "copy-first"), ("eagle", "adaptive")])
def test_sampled_output_matches_the_target_distribution(tiny_pair, drafter, rule, monkeypatch, tmp_path):
    """copy-first: every row with a copy takes it (the first round copies, the second mixes copies and drafts);
    adaptive: the drafter's rule, which takes a copy after copies drafted better, or where the drafter has
    nothing (the head's first round, before any feature)."""
    target, draft = tiny_pair
    if drafter == "eagle":
        draft = random_head(target, tmp_path / "eagle", "eagle", scale=1.0)
    eng = Engine.from_pretrained(target, draft, speculation=lookup(drafter, 2, 1))
    if rule == "copy-first":
        monkeypatch.setattr(eng.drafter, "prefers_copy", lambda rec: True)
    _sampled_joint_matches(eng, monkeypatch)


def test_option_checked_and_kept_in_profiles(ckpt_dir, draft_dir):
    for bad in (0, 9, "2", True):
        with pytest.raises(InvalidConfigError, match="speculation.prompt_lookup_min"):
            SpeculationConfig(drafter="model", prompt_lookup_min=bad)
    for drafter, draft in (("ngram", None), (None, None)):
        with pytest.raises(InvalidConfigError, match="prompt_lookup_min=2 needs a drafter to fall back on"):
            Engine.from_pretrained(ckpt_dir, draft, speculation=lookup(drafter, 3))
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=lookup(None, 3))  # None + a draft: "model"
    assert isinstance(eng.drafter, LookupFirst)
    cfg = SpeculationConfig(drafter="model", k=3, k_max=8, k_policy="constant", prompt_lookup_min=2)
    assert SpeculationConfig.from_profile(cfg.to_profile()) == cfg
    assert "prompt_lookup_min" not in SpeculationConfig(drafter="model").to_profile()


def test_profile_and_server_with_prompt_lookup(tiny_demo, tmp_path):
    """build_profile --prompt-lookup calibrates with it and keeps it; the profile's engine and the server's
    --prompt-lookup draft with it, greedy output unchanged; without a draft the option is refused in one line."""
    from engine.cli.build_profile import main
    from engine.cli.serve import build_parser, load

    target, draft = tiny_demo
    texts = ["--eval-text", str(target.parent / "heldout.txt"), "--calib-text", str(target.parent / "calib.txt")]
    args = ["--gpu", "a100", "--target", str(target), "--device", "cpu", "--quiet", *texts, "--max-eval-tokens", "2048"]
    out = tmp_path / "p.json"
    assert main([*args, "--draft", str(draft), "--prompt-lookup", "2", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    spec = prof["speculation"]
    assert spec["drafter"] == "model" and spec["prompt_lookup_min"] == 2 and 0 < spec["acceptance"] < 1
    eng = Engine.from_profile(out)
    assert isinstance(eng.drafter, LookupFirst) and eng.drafter.ngram.n_min == 2
    calib = (target.parent / "calib.txt").read_text()
    planned = Engine.from_pretrained(target, precision=PrecisionConfig(plan_from_dict(prof["plan"]), calib))
    prompts = ["The with statement", "import sys\nimport os\nimport sys\n"]
    sp = SamplingParams(max_new_tokens=32)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in planned.generate(prompts, sp)]
    ref = [o.token_ids for o in Engine.from_pretrained(target).generate(prompts, sp)]
    served, _, _ = load(
        build_parser().parse_args(["--target", str(target), "--draft", str(draft), "--prompt-lookup", "3"])
    )
    assert isinstance(served.drafter, LookupFirst) and served.drafter.ngram.n_min == 3
    assert [o.token_ids for o in served.generate(prompts, sp)] == ref
    assert served.stats()["prompt_lookup_min"] == 3 and eng.stats()["prompt_lookup_min"] == 2
    with pytest.raises(InvalidConfigError, match="--k, --prompt-lookup invalid with --profile"):
        load(build_parser().parse_args(["--profile", str(out), "--k", "0", "--prompt-lookup", "3"]))
    assert main([*args, "--prompt-lookup", "2", "--out", str(tmp_path / "q.json")]) != 0
    assert not (tmp_path / "q.json").exists()


class Fixed:
    """A greedy drafter of known drafts: the next k tokens of ``truth``, or wrong ones."""

    probabilistic = True
    features = FeatureNeed.NONE
    samples = False
    max_drafts = None

    def __init__(self, truth: list[int], right: bool, empty_first: bool = False) -> None:
        self.truth, self.right, self.proposed, self.after = truth, right, [], []
        self.empty_first = empty_first  # nothing to draft in the first round (a head before its first feature)

    def propose(self, batch):
        n = len(batch.seqs[0].tokens)
        self.proposed.append(n)
        drafts = torch.tensor([self.truth[n : n + batch.k] if self.right else [0] * batch.k])
        return Proposal.chain(drafts, None, [0] if self.empty_first and len(self.proposed) == 1 else None)

    def commit(self, seq, outcome):
        if outcome.drafted:  # the rounds it ran
            self.after.append((outcome.n_before, outcome.accepted))


def run_rounds(drafter: LookupFirst, truth: list[int], start: int, rounds: int, k: int = 4) -> list[int]:
    """Greedy rounds along the text ``truth`` (its tokens are the target's) -> each round's start."""
    from types import SimpleNamespace

    from engine.spec_decode.seq import Seq

    seq = Seq(truth[:start], SamplingParams(), torch.Generator())
    starts = []
    for _ in range(rounds):
        n = len(seq.tokens)
        starts.append(n)
        batch = SimpleNamespace(seqs=[seq], k=k, ks=[k], vocab=100, device=torch.device("cpu"))
        proposal = drafter.propose(batch)
        drafts, num = proposal.tokens, proposal.counts
        d = drafts[0, : (num or [k])[0]].tolist()
        a = next((i for i, (x, t) in enumerate(zip(d, truth[n:])) if x != t), len(d))
        drafter.commit(seq, Committed(n, a, k, True))
        seq.tokens += truth[n : n + a + 1]
    return starts


def test_copies_or_drafts_whichever_drafted_better():
    """Text whose repeats mislead copies: a right drafter keeps every round. Periodic text and a wrong drafter:
    copies take over once the copies the drafter's rounds left are seen to match."""
    twisted = [t for i in range(60) for t in (1, 2, 3 + i % 7)]  # the copy after [1, 2] is always the last twist
    right = Fixed(twisted, right=True)
    starts = run_rounds(LookupFirst(right, 2), twisted, 8, 20)
    assert right.proposed == starts and [a for _, a in right.after] == [4] * 20
    periodic = [1, 2, 3, 4, 5] * 40
    wrong = Fixed(periodic, right=False)
    starts = run_rounds(LookupFirst(wrong, 2), periodic, 7, 20)
    # both means start at 0: the drafter first, committing one token a round, until the first untaken copy's
    # 4 tokens are committed and count 4 for copies
    assert wrong.proposed == starts[:4] == [7, 8, 9, 10] and [a for _, a in wrong.after] == [0] * 4
    assert starts[-1] - starts[4] == 15 * 5  # then copies: 4 drafts and the bonus token a round


def test_a_forced_copy_leaves_the_next_round_to_the_drafter():
    """A drafter with nothing in its first round (a head) has that round copied; the copy's good result does not
    hand the sequence to copies before the drafter has had a round of its own."""
    periodic = [1, 2, 3, 4, 5] * 40
    right = Fixed(periodic, right=True, empty_first=True)
    starts = run_rounds(LookupFirst(right, 2), periodic, 7, 6)
    # round 1 copied (4 accepted) though the drafter was asked; round 2 is the drafter's all the same
    assert right.proposed[:2] == starts[:2] and right.after[:2] == [(7, 0), (12, 4)]


class Uniform:
    """A probabilistic drafter over a vocabulary of ``vocab`` tokens: token 0 with p uniform, k per row."""

    probabilistic = True
    features = FeatureNeed.NONE
    samples = False
    max_drafts = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, batch):
        B, k = len(batch.seqs), batch.k
        return Proposal.chain(torch.zeros(B, k, dtype=torch.long), torch.full((B, k, self.vocab), 1 / self.vocab))


def test_a_copy_fits_the_rows_k_and_the_drafters_vocabulary():
    """Each row's copy is at most its own K_b (not the batch's largest K), with a one-hot p; a copy stops before a
    token the drafter has no p for, and one left empty is not taken (the drafter's drafts stay)."""
    from types import SimpleNamespace

    from engine.spec_decode.seq import Seq

    rows = [[1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 3, 9, 5, 1, 2], [1, 2, 9, 3, 4, 1, 2], [7, 6]]
    seqs = [Seq(t, SamplingParams(temperature=1.0), torch.Generator()) for t in rows]
    d = LookupFirst(Uniform(8), 2)
    d.prefers_copy = lambda rec: True
    batch = SimpleNamespace(seqs=seqs, k=4, ks=[2, 4, 4, 4, 4], vocab=8, device=torch.device("cpu"))
    proposal = d.propose(batch)  # the last row has no copy: the drafter runs, p is needed
    drafts, probs, num = proposal.tokens, proposal.probs, proposal.counts
    assert num == [2, 4, 1, 4, 4]
    assert drafts[0, :2].tolist() == [3, 4] and drafts[1].tolist() == [3, 4, 5, 6] and drafts[2, 0] == 3
    for b in (3, 4):
        assert drafts[b].tolist() == [0, 0, 0, 0] and torch.equal(probs[b], torch.full((4, 8), 1 / 8))
    for b, n in enumerate(num[:3]):
        assert torch.equal(probs[b, :n], torch.nn.functional.one_hot(drafts[b, :n], 8).float())
