"""No request can break another inside the engine: values checked in the types the round uses, a raising round
re-run without the rows that caused it, detokenization that never raises, vocabularies checked at load and seeded
outputs that do not depend on the load window."""

from __future__ import annotations

import json

import pytest
from util import make_checkpoint, wait_for

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.errors import InvalidRequestError, VocabMismatchError
from engine.core.tokenizer import Tokenizer
from engine.runtime.scheduler import RequestFailedError
from engine.runtime.telemetry import GpuReading, LoadGovernor, LoadWindow

TIMEOUT = 120


def _jobs() -> list[tuple[list[int], SamplingParams]]:
    return [
        ([5, 6, 7, 8], SamplingParams(max_new_tokens=30)),
        ([9, 10, 11], SamplingParams(max_new_tokens=24, temperature=0.9, seed=3)),
        ([12, 13], SamplingParams(max_new_tokens=20, temperature=1.1, top_p=0.9, seed=4, stop=["e"])),
        ([14, 15, 16, 17, 18], SamplingParams(max_new_tokens=26, temperature=0.8, top_k=30, seed=5)),
    ]


@pytest.fixture(scope="module")
def eng(ckpt_dir, draft_dir):
    return Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=8)
    )


@pytest.fixture(scope="module")
def solo(eng):
    return [eng.generate([p], sp)[0].token_ids for p, sp in _jobs()]


# ---------------------------------------------------------------- values in the round's types
def test_top_k_beyond_int64_runs_beside_others(eng, solo):
    """top_k = 2**63 once overflowed the round's int64 tensor and failed every request in the batch."""
    jobs = _jobs()
    huge = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=2**63, seed=9)
    assert huge.top_k == 2**31 - 1  # above any vocabulary: the same as the vocabulary
    same = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=eng.vocab, seed=9)
    outs = eng.generate([p for p, _ in jobs] + [[3, 4]], [sp for _, sp in jobs] + [huge])
    assert [o.token_ids for o in outs[:-1]] == solo
    assert outs[-1].token_ids == eng.generate([[3, 4]], same)[0].token_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e-50),  # 0.0 in float32: NaN probabilities
        ("temperature", 1e39),  # inf in float32
        ("temperature", 10**400),  # beyond a float: OverflowError
        ("repetition_penalty", 1e-50),  # a division by zero in float32
        ("repetition_penalty", 1e7),
        ("min_p", 1e-50),
        ("presence_penalty", 10**400),
        ("top_p", float("nan")),
    ],
)
def test_values_that_break_in_float32_are_refused_and_named(field, value):
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field}=.*allowed"):
        SamplingParams(max_new_tokens=4, **{field: value})


def test_stop_token_ids_and_tensor_ids_are_checked_against_the_vocabulary(eng):
    import torch

    with pytest.raises(InvalidRequestError, match="stop_token_ids.*allowed token ids"):
        eng.submit([1, 2], SamplingParams(max_new_tokens=4, stop_token_ids=[eng.vocab]))
    with pytest.raises(InvalidRequestError, match="outside"):
        eng.logits(torch.tensor([[1, eng.vocab]]))
    with pytest.raises(InvalidRequestError, match="integer ids"):
        eng.logits(torch.tensor([[1.0, 2.0]]))
    assert eng.logits(torch.tensor([[1, 2]])).shape == (1, 2, eng.vocab)


# ---------------------------------------------------------------- a raising round
@pytest.mark.parametrize("stage", ["verify", "commit"])
def test_a_row_that_raises_ends_alone_and_the_others_equal_their_solo_runs(eng, solo, stage, caplog):
    jobs = _jobs()
    poison = jobs[1][0]
    eng.loop.inject_fault = lambda s, where: where == stage and s.prompt == poison and len(s.generated) >= 3
    before = eng.scheduler.snapshot()["totals"]
    try:
        reqs = eng.submit_many([p for p, _ in jobs], [sp for _, sp in jobs])
        with pytest.raises(RequestFailedError, match="injected fault"):
            reqs[1].result(timeout=TIMEOUT)
        outs = [r.result(timeout=TIMEOUT).token_ids for i, r in enumerate(reqs) if i != 1]
    finally:
        eng.loop.inject_fault = None
    assert outs == [t for i, t in enumerate(solo) if i != 1]
    assert reqs[1].tokens_so_far() == solo[1][: len(reqs[1].tokens_so_far())]
    after = eng.scheduler.snapshot()["totals"]
    assert after.failed == before.failed + 1
    eng.check_health()  # a request's fault is not the engine's
    assert eng.generate([poison], jobs[1][1])[0].token_ids == solo[1]


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "lookup+model", "medusa", "eagle", "eagle-attn"])
def test_every_drafter_reruns_a_failed_round_exactly(ckpt_dir, draft_dir, tmp_path, kind):
    """The drafters keep nothing from a proposal whose round failed: the re-run rows equal their solo runs."""
    from test_heads import random_head

    if kind in ("medusa", "eagle", "eagle-attn"):
        head = random_head(ckpt_dir, tmp_path / "h", kind.split("-")[0], attention=kind == "eagle-attn")
        eng = Engine.from_pretrained(ckpt_dir, head, speculation=SpeculationConfig(drafter=kind.split("-")[0], k=3))
    elif kind == "lookup+model":
        eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, prompt_lookup_min=1))
    else:
        eng = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter=kind, k=3))
    jobs = _jobs()
    want = [eng.generate([p], sp)[0].token_ids for p, sp in jobs]
    poison = jobs[3][0]
    eng.loop.inject_fault = lambda s, where: where == "verify" and s.prompt == poison and len(s.generated) >= 5
    try:
        reqs = eng.submit_many([p for p, _ in jobs], [sp for _, sp in jobs])
        with pytest.raises(RequestFailedError):
            reqs[3].result(timeout=TIMEOUT)
        got = [r.result(timeout=TIMEOUT).token_ids for r in reqs[:3]]
    finally:
        eng.loop.inject_fault = None
    assert got == want[:3]


def test_rounds_where_nothing_runs_make_the_engine_unhealthy(eng):
    """A fault of the engine itself fails every row, even alone: health says so after 3 such rounds."""
    eng.loop.inject_fault = lambda s, where: where == "verify"
    try:
        for i in range(3):
            with pytest.raises(RequestFailedError):
                eng.generate([[4, 5, 6 + i]], SamplingParams(max_new_tokens=4))
        with pytest.raises(Exception, match="decode rounds failed"):
            eng.check_health()
    finally:
        eng.loop.inject_fault = None
    eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=4))
    eng.check_health()


# ---------------------------------------------------------------- detokenization
class _FlakyStream:
    """tokenizers' DecodeStream that raises at its third step, as it does on some byte sequences (a stream
    rebuilt over the ids seen so far, as the reset makes it, does not)."""

    def __init__(self, **kw):
        from tokenizers.decoders import DecodeStream

        self.inner, self.calls, self.flaky = DecodeStream(**kw), 0, "ids" not in kw

    def step(self, tok, ids):
        self.calls += 1
        if self.calls == 3 and self.flaky:
            raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what tokenizers raises
        return self.inner.step(tok, ids)


def test_a_failing_decode_stream_is_reset_and_loses_no_text(ckpt_dir, monkeypatch):
    import engine.core.tokenizer as tokenizer_module

    tok = Tokenizer(ckpt_dir)
    ids = tok.encode("def f(x):\n    return x * 2\n")
    monkeypatch.setattr(tokenizer_module, "DecodeStream", _FlakyStream)
    stream = tok.decode_stream()
    pieces = [tok.step(stream, t) or "" for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert stream.resets == 1


def test_a_request_with_stop_strings_survives_a_failing_decode_stream(eng, solo, monkeypatch):
    import engine.core.tokenizer as tokenizer_module

    p, sp = _jobs()[2]
    want = eng.generate([p], sp)[0]
    monkeypatch.setattr(tokenizer_module, "DecodeStream", _FlakyStream)
    got = eng.generate([p], sp)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert "".join(eng.stream(p, sp)) == want.text


# ---------------------------------------------------------------- vocabularies at load
def _add_tokens(model_dir, n: int) -> None:
    """Add n tokens to the checkpoint's tokenizer (ids past its rows, as a tokenizer with added tokens has)."""
    from tokenizers import Tokenizer as HF

    tok = HF.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(n)])
    tok.save(str(model_dir / "tokenizer.json"))


def test_tokenizer_ids_beyond_the_embedding_rows_are_refused_at_load(tmp_path):
    t = make_checkpoint(tmp_path / "t", vocab_size=300, hidden_size=32, num_hidden_layers=1)
    _add_tokens(t, 4)
    with pytest.raises(VocabMismatchError, match="ids up to 303.*300 embedding rows"):
        Engine.from_pretrained(t)


def test_a_draft_with_fewer_rows_than_the_tokenizer_is_refused(tmp_path):
    kw = dict(hidden_size=32, num_hidden_layers=1)
    t = make_checkpoint(tmp_path / "t", vocab_size=320, **kw)
    d = make_checkpoint(tmp_path / "d", vocab_size=300, **kw)
    # one tokenizer for both: 300 ids + 10 added, within the target's 320 rows, past the draft's 300
    _add_tokens(d, 10)
    (t / "tokenizer.json").write_text((d / "tokenizer.json").read_text())
    with pytest.raises(VocabMismatchError, match=f"draft {d}.*ids up to 309.*300 embedding rows"):
        Engine.from_pretrained(t, d)


def test_a_draft_whose_missing_rows_are_padding_is_accepted(tmp_path):
    kw = dict(hidden_size=32, num_hidden_layers=1)
    t = make_checkpoint(tmp_path / "t", vocab_size=320, **kw)
    d = make_checkpoint(tmp_path / "d", vocab_size=310, **kw)
    (t / "tokenizer.json").write_text((d / "tokenizer.json").read_text())  # 300 ids: rows past them are padding
    assert json.loads((t / "config.json").read_text())["vocab_size"] == 320
    eng = Engine.from_pretrained(t, d)
    assert eng.vocab == 310
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))[0].token_ids) == 5


# ---------------------------------------------------------------- seeds under memory pressure
class _FakeReader:
    """A GPU memory reader that always reads 90% used."""

    source = "fake"

    def read(self) -> GpuReading:
        return GpuReading(900, 1000, 50.0)


def test_a_seeded_request_gives_the_same_tokens_under_memory_pressure(eng, solo):
    jobs = _jobs()
    sched = eng.scheduler
    sched.governor = LoadGovernor(_FakeReader(), LoadWindow(eng.policy.k_max, 8), interval_s=0.0)
    try:
        outs = eng.generate([p for p, _ in jobs], [sp for _, sp in jobs])
        assert wait_for(lambda: sched.k_cap < eng.policy.k_max)  # the window capped K
    finally:
        sched.governor, sched.k_cap, sched.batch_cap = None, 1 << 30, sched.max_batch
    assert [o.token_ids for o in outs] == solo
