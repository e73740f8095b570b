"""Service-grade Engine: many threads, continuous batching, cancel, fault isolation, admission, HTTP, soak."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from util import long_prompt, wait_for

from engine import Engine, EngineError, SamplingParams
from engine.api.options import KernelOptions, Limits, SpeculationConfig
from engine.core.errors import InvalidConfigError, InvalidRequestError, OverloadedError
from engine.core.forward import KVCache
from engine.runtime.kv_growth import CacheUse, grown_size
from engine.runtime.scheduler import RequestFailedError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds: a hung worker fails the test instead of the suite


def _prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j) % 290 + 1 for j in range(2 + i % 13)]


def _params(i: int) -> SamplingParams:
    n = 4 + (i * 7) % 29
    kind = i % 4
    if kind == 0:
        return SamplingParams(max_new_tokens=n)
    if kind == 1:
        return SamplingParams(max_new_tokens=n, temperature=1.0, seed=i)
    if kind == 2:
        return SamplingParams(max_new_tokens=n, temperature=0.7, top_k=20, top_p=0.9, seed=1000 + i)
    return SamplingParams(max_new_tokens=n, temperature=1.3, top_p=0.8, seed=i, stop=["e"])


@pytest.fixture(scope="module")
def eng(ckpt_dir, draft_dir):
    # heuristic K: each sequence's K depends only on its own acceptance, so solo == batched for seeds too
    return Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=8)
    )


def test_16_threads_x_8_requests_equal_their_solo_runs(eng):
    n_threads, per = 16, 8
    jobs = [(_prompt(i), _params(i)) for i in range(n_threads * per)]
    solo = [eng.generate([p], sp)[0] for p, sp in jobs]
    got: dict[int, tuple[list[int] | None, str]] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(t * per, (t + 1) * per):
                p, sp = jobs[i]
                mode = (i + t) % 3
                if mode == 0:
                    o = eng.generate([p], sp)[0]
                    got[i] = (o.token_ids, o.text)
                elif mode == 1:
                    got[i] = (None, "".join(eng.stream(p, sp)))
                else:
                    o = eng.submit(p, sp).result(timeout=TIMEOUT)
                    got[i] = (o.token_ids, o.text)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    wall = time.perf_counter() - t0
    assert not any(th.is_alive() for th in threads), "requests did not finish within the timeout"
    assert not errors, errors
    for i, o in enumerate(solo):
        ids, text = got[i]
        assert text == o.text, i
        if ids is not None:
            assert ids == o.token_ids, i
    toks = sum(len(o.token_ids) for o in solo)
    logging.getLogger(__name__).info("16x8: %d tokens in %.2f s (%.0f tok/s)", toks, wall, toks / wall)
    assert eng.scheduler.running() == 0 and eng.scheduler.queue_length() == 0


# ---------------------------------------------------------------- bad input and options
@pytest.mark.parametrize(
    "opt,value", [("max_batch", 0), ("max_batch", 2.5), ("max_waiting", -1), ("max_seq_len", 513), ("max_seq_len", 1)]
)
def test_bad_engine_options(ckpt_dir, opt, value):
    with pytest.raises(InvalidConfigError, match=opt):
        Engine.from_pretrained(ckpt_dir, limits=Limits(**{opt: value}))


BAD = [
    ("submit empty prompt", lambda e: e.submit("", SamplingParams()), "empty"),
    ("submit bad token id", lambda e: e.submit([1, 300]), r"prompts\[0\]\[1\]=300"),
    ("submit wrong type", lambda e: e.submit(3.5), "prompts"),
    ("stream too long", lambda e: list(e.stream([1] * 500, SamplingParams(max_new_tokens=20))), "520.*512"),
    ("stream bad params", lambda e: list(e.stream("hi", {"max_new_tokens": 3})), "params"),
]


@pytest.mark.parametrize("name,call,match", BAD, ids=[b[0] for b in BAD])
def test_bad_submissions_then_engine_still_works(eng, name, call, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        call(eng)
    assert isinstance(e.value, EngineError)
    assert (
        eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6))[0].token_ids
        == eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6))[0].token_ids
    )


def test_max_seq_len_limit_is_named(ckpt_dir):
    e = Engine.from_pretrained(
        ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=2), limits=Limits(max_seq_len=64)
    )
    with pytest.raises(InvalidRequestError, match="max_seq_len=64.*k_max"):
        e.generate([[1] * 40], SamplingParams(max_new_tokens=30))
    assert len(e.generate([[1] * 40], SamplingParams(max_new_tokens=24))[0].token_ids) >= 1
    assert e.loop.cache is not None and e.loop.cache.max_seq_len <= 128


# ---------------------------------------------------------------- the KV cache
def test_the_cache_grows_to_what_is_used_doubling_within_the_batch_and_the_reach():
    def use(rows: int, positions: int, reach: int = 10_000) -> CacheUse:
        return CacheUse(rows, positions, reach)

    assert grown_size((0, 0), use(1, 310, 374), 64) == (1, 384)  # the first: what its row uses, in 128s
    assert grown_size((1, 384), use(1, 300), 64) is None
    assert grown_size((1, 384), use(2, 300), 64) == (2, 384)  # rows double
    assert grown_size((4, 384), use(5, 300), 64) == (8, 384)
    assert grown_size((8, 384), use(9, 300), 12) == (12, 384)  # within max_batch
    assert grown_size((2, 384), use(2, 400), 64) == (2, 768)  # positions double
    assert grown_size((2, 384), use(2, 400, 420), 64) == (2, 512)  # within the reach, in 128s
    assert grown_size((2, 384), use(2, 900), 64) == (2, 1024)  # more than double: what is used
    assert grown_size((2, 384), use(3, 900), 64) == (4, 1024)  # both
    assert grown_size((0, 0), use(3, 100), 64) == (4, 128)  # rows in powers of two (CUDA graphs' batch buckets)


def test_a_cache_that_cannot_grow_fails_the_requests_that_needed_it_and_the_others_go_on(
    ckpt_dir, draft_dir, monkeypatch
):
    e = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=4)
    )
    short, longer = [5, 6, 7], [(5 * j) % 290 + 1 for j in range(300)]
    want = e.generate([short], SamplingParams(max_new_tokens=20))[0].token_ids
    target, draft = e.loop.cache, e.drafter.cache
    assert target is not None and (target.max_batch, target.max_seq_len) == (1, 128)
    grow = KVCache.grow

    def no_memory_for_the_draft(self: KVCache, rows: int, seq_len: int) -> None:
        if self is draft:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        grow(self, rows, seq_len)

    monkeypatch.setattr(KVCache, "grow", no_memory_for_the_draft)
    a, b = e.submit_many([short, longer], [SamplingParams(max_new_tokens=20)] * 2)
    with pytest.raises(RequestFailedError, match="could not grow"):
        b.result(timeout=TIMEOUT)
    assert a.result(timeout=TIMEOUT).token_ids == want  # it fitted: it went on
    # the drafter's cache grows first: the target's did not grow past it (its scratch slot is the drafter's too)
    assert (target.max_batch, target.max_seq_len) == (draft.max_batch, draft.max_seq_len) == (1, 128)
    monkeypatch.undo()
    assert e.generate([longer], SamplingParams(max_new_tokens=4))[0].finish_reason == "length"  # serving goes on


def test_a_longer_request_joins_the_running_batch_and_the_cache_grows_under_it(ckpt_dir, draft_dir):
    """A request longer than the cache joins while another runs (no waiting for the batch to drain): the cache
    and the draft model's grow between rounds keeping every row, so both outputs equal their solo runs."""
    spec, limits = SpeculationConfig(k=3, k_policy="heuristic"), Limits(max_batch=4)
    ref = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=spec, limits=limits)
    first = long_prompt(ref, 160)
    longer = [(5 * j) % 290 + 1 for j in range(300)]
    sp_first, sp_longer = SamplingParams(max_new_tokens=160), SamplingParams(max_new_tokens=8, temperature=0.8, seed=5)
    want_first = ref.generate([first], sp_first)[0].token_ids
    want_longer = ref.generate([longer], sp_longer)[0].token_ids
    e = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=spec, limits=limits)
    e.scheduler.on_round = lambda: time.sleep(0.002)  # keep the first request running while the second joins
    try:
        a = e.submit(first, sp_first)
        assert wait_for(lambda: len(a.tokens_so_far()) > 0)
        cache = e.loop.cache
        assert cache is not None and cache.max_batch == 1 and cache.max_seq_len < len(longer)  # the first's size
        b = e.submit(longer, sp_longer)
        assert b.result(timeout=TIMEOUT).token_ids == want_longer
        assert not a.done()  # the second did not wait for the first to end
        assert a.result(timeout=TIMEOUT).token_ids == want_first
    finally:
        e.scheduler.on_round = None
    draft_cache = e.drafter.cache
    assert (cache.max_batch, cache.max_seq_len) == (2, 384)  # grown in place: rows doubled, positions to 300 + 13
    assert (draft_cache.max_batch, draft_cache.max_seq_len) == (2, 384)


def test_the_cache_holds_what_requests_use_not_what_they_may_use(ckpt_dir):
    """A request that may run to the end of the context (a chat without max_tokens) but stops early holds
    the positions it used, in one row; a longer run grows the cache a few times, doubling."""
    e = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=4))
    prompt = [(7 * j) % 290 + 1 for j in range(20)]
    stop = e.generate([prompt], SamplingParams(max_new_tokens=12))[0].token_ids[-1]
    out = e.generate([prompt], SamplingParams(max_new_tokens=e.max_seq_len - len(prompt), stop_token_ids=[stop]))
    assert out[0].finish_reason == "stop" and len(out[0].token_ids) <= 12, out[0]
    cache = e.loop.cache
    assert cache is not None and (cache.max_batch, cache.max_seq_len) == (1, 128)
    seen = set()
    e.scheduler.on_round = lambda: seen.add(e.loop.cache.max_seq_len)
    try:
        e.generate([prompt], SamplingParams(max_new_tokens=400, temperature=1.0, seed=1, ignore_eos=True))
    finally:
        e.scheduler.on_round = None
    assert sorted(seen) == [128, 256, 512], seen  # 20 + 400 tokens + K headroom: two growths


# ---------------------------------------------------------------- cancel
def test_cancel_mid_stream_frees_the_slot(eng):
    sched = eng.scheduler
    p = long_prompt(eng, 150)
    other_p, other_sp = _prompt(3), SamplingParams(max_new_tokens=60, temperature=1.0, seed=3)
    other_ref = eng.generate([other_p], other_sp)[0].token_ids
    before = sched.snapshot()["totals"].finished["cancelled"]
    sched.on_round = lambda: time.sleep(0.002)  # keep the long request running while we read
    try:
        other = eng.submit(other_p, other_sp)
        it = eng.stream(p, SamplingParams(max_new_tokens=150))
        assert next(it)
        it.close()  # GeneratorExit -> cancel
        assert wait_for(lambda: sched.snapshot()["totals"].finished["cancelled"] == before + 1)
        # a handle's cancel(): at most one round (the one already under way) still holds it
        h = eng.submit(p, SamplingParams(max_new_tokens=150))
        held_after_cancel: list[int] = []

        def hook() -> None:
            time.sleep(0.002)
            if h.cancelled and h in sched._running:
                held_after_cancel.append(1)

        sched.on_round = hook
        assert wait_for(lambda: len(h._tokens) > 0)
        h.cancel()
        out = h.result(timeout=TIMEOUT)
        assert out.finish_reason == "cancelled" and len(out.token_ids) < 150
        assert len(held_after_cancel) <= 1
        assert other.result(timeout=TIMEOUT).token_ids == other_ref
    finally:
        sched.on_round = None
    assert wait_for(lambda: sched.running() == 0)
    assert eng.generate([other_p], other_sp)[0].token_ids == other_ref


# ---------------------------------------------------------------- faults
def test_injected_nan_ends_only_its_request(eng, caplog):
    jobs = [(_prompt(i), _params(i)) for i in (20, 21, 22, 23)]
    refs = [eng.generate([p], sp)[0].token_ids for p, sp in jobs]
    poison = jobs[1][0]
    n0 = eng.scheduler.snapshot()["totals"].nonfinite
    eng.loop.inject_nan = lambda s: s.prompt == poison and len(s.generated) >= 2
    try:
        with caplog.at_level(logging.WARNING, logger="engine.spec_decode.loop"):
            outs = eng.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    finally:
        eng.loop.inject_nan = None
    assert outs[1].finish_reason == "error" and outs[1].token_ids == refs[1][: len(outs[1].token_ids)]
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [r for i, r in enumerate(refs) if i != 1]
    assert any("non-finite" in r.message for r in caplog.records)
    assert eng.scheduler.snapshot()["totals"].nonfinite == n0 + 1
    assert f'specmix:request_errors_total{{kind="nonfinite"}} {n0 + 1}' in eng.metrics_text()
    assert eng.generate([jobs[1][0]], jobs[1][1])[0].token_ids == refs[1]


def test_a_nonfinite_row_is_cleared_before_the_next_sequence_uses_it(ckpt_dir):
    """NaN k/v left in a cache row past a later sequence's length must not reach it (math attention
    reads a bucket of masked slots there, and 0 * NaN is NaN)."""
    import torch

    eng = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(attention="math"))
    sp = SamplingParams(max_new_tokens=6)
    ref = eng.generate([[4, 5, 6]], sp)[0].token_ids
    for t in (eng.loop.cache.k, eng.loop.cache.v):  # as if a failed sequence's forward had made NaN k/v
        t[:, 0, :, 20:30] = float("nan")
    eng.loop.inject_nan = lambda s: True  # its round fails: the row is cleared
    try:
        assert eng.generate([[7, 8, 9]], sp)[0].finish_reason == "error"  # short: slots 20..29 stay NaN
    finally:
        eng.loop.inject_nan = None
    assert torch.isfinite(eng.loop.cache.k).all() and torch.isfinite(eng.loop.cache.v).all()
    out = eng.generate([[4, 5, 6]], sp)[0]  # reads slots 0..31 of row 0, masked past its length
    assert out.finish_reason == "length" and out.token_ids == ref


def test_failed_round_fails_its_requests_and_the_engine_keeps_serving(eng):
    ref = eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=10))[0].token_ids
    calls = []

    def boom() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected round failure")

    eng.scheduler.on_round = boom
    try:
        with pytest.raises(RequestFailedError, match="injected round failure"):
            eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=10))
    finally:
        eng.scheduler.on_round = None
    assert eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=10))[0].token_ids == ref
    assert "specmix:round_failures_total 1" in eng.metrics_text()


# ---------------------------------------------------------------- admission
def test_overload_refuses_some_and_the_rest_complete(ckpt_dir, draft_dir):
    e = Engine.from_pretrained(
        ckpt_dir,
        draft_dir,
        speculation=SpeculationConfig(k=2, k_policy="constant"),
        limits=Limits(max_batch=1, max_waiting=2),
    )
    e.scheduler.on_round = lambda: time.sleep(0.001)
    jobs = [(_prompt(i), SamplingParams(max_new_tokens=30, temperature=0.9, seed=i)) for i in range(12)]
    handles, refused = [], 0
    for p, sp in jobs:
        try:
            handles.append((e.submit(p, sp), p, sp))
        except OverloadedError as err:
            assert "max_waiting=2" in str(err) and isinstance(err, EngineError)
            refused += 1
    assert refused >= 1 and len(handles) >= 3
    e.scheduler.on_round = None
    for h, p, sp in handles:
        assert h.result(timeout=TIMEOUT).token_ids == e.generate([p], sp)[0].token_ids
    assert f"specmix:request_rejected_overload_total {refused}" in e.metrics_text()


# ---------------------------------------------------------------- metrics
def test_metrics_text_is_prometheus(eng):
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))
    text = eng.metrics_text()
    names = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    for n in (
        "request_finished_total",
        "generation_tokens_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_draft_acceptance_rate",
        "spec_decode_mean_accepted_length",
        "spec_decode_draft_acceptance_rate_per_pos",
        "num_requests_waiting",
        "num_requests_running",
        "request_errors_total",
    ):
        assert f"specmix:{n}" in names, n
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            float(ln.rsplit(" ", 1)[1])
    assert 'specmix:spec_decode_draft_acceptance_rate_per_pos{position="1"}' in text


# ---------------------------------------------------------------- soak
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_soak_500_requests_8_threads_rss_stable(tiny_demo):
    e = Engine.from_pretrained(
        *tiny_demo, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=8)
    )
    words = ["The with statement", "def f(x):", "import os", "class A:", "for i in range", "Return the"]
    jobs = [
        (words[i % 6] + " " * (i % 3), SamplingParams(max_new_tokens=4 + i % 9, temperature=(i % 3) * 0.5, seed=i))
        for i in range(500)
    ]
    errors: list[BaseException] = []

    def run(chunk: list[int]) -> None:
        try:
            for i in chunk:
                p, sp = jobs[i]
                if i % 5 == 0:
                    "".join(e.stream(p, sp))
                else:
                    e.generate([p], sp)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    def flood(idx: list[int]) -> float:
        ths = [threading.Thread(target=run, args=(idx[t::8],)) for t in range(8)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join(TIMEOUT)
        assert not any(th.is_alive() for th in ths)
        return time.perf_counter() - t0

    flood(list(range(0, 500, 5)))  # warm-up: the cache at its final size, allocator pools filled
    gc.collect()
    warm = _rss()
    wall = flood(list(range(500)))
    gc.collect()
    after = _rss()
    assert not errors, errors[:3]
    st = e.stats()
    assert st["errors"] == 0
    logging.getLogger(__name__).info(
        "soak: 500 requests in %.1f s; RSS %.1f -> %.1f MB", wall, warm / 2**20, after / 2**20
    )
    assert abs(after - warm) <= 0.05 * warm, (warm, after)
