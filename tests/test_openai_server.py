"""The OpenAI-compatible server, driven by the official openai client over 127.0.0.1 (uvicorn, live)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from engine import Engine, SamplingParams  # noqa: E402
from engine.api.options import Limits, SpeculationConfig  # noqa: E402
from engine.server.openai_app import OpenAIServer, create_app  # noqa: E402
from engine.server.options import AccessOptions, RequestLimits  # noqa: E402
from engine.server.served_engine import ServedEngine  # noqa: E402

TIMEOUT = 120
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


class Live:
    """A uvicorn server in a thread on a free port of 127.0.0.1."""

    def __init__(
        self,
        engine: ServedEngine,
        name: str = "m",
        defaults: dict | None = None,
        limits: RequestLimits | None = None,
        access: AccessOptions | None = None,
        api_key: str = "none",
        wrap: Callable[[Any], Any] | None = None,
    ) -> None:
        app = create_app(OpenAIServer(engine, name, defaults, limits=limits), access)
        app = app if wrap is None else wrap(app)  # an ASGI middleware of the test's
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < end and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _chat_checkpoint(src: Path, out: Path) -> Path:
    """A copy of a test checkpoint whose tokenizer adds BOS and that has a chat template (saved by transformers)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(out / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token=bos, eos_token=bos)
    hf.chat_template = TEMPLATE
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def eng(ckpt_dir, draft_dir):
    return Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=8)
    )


@pytest.fixture(scope="module")
def live(eng):
    srv = Live(eng)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def chat_dir(ckpt_dir, tmp_path_factory):
    return _chat_checkpoint(ckpt_dir, tmp_path_factory.mktemp("chat") / "ckpt")


# ---------------------------------------------------------------- completions
def test_completions_equal_engine_generate(live, eng):
    c = live.client
    greedy = c.completions.create(model="m", prompt="The quick brown", max_tokens=20, temperature=0)
    ref = eng.generate("The quick brown", SamplingParams(max_new_tokens=20))[0]
    assert greedy.choices[0].text == ref.text and greedy.choices[0].finish_reason == ref.finish_reason
    assert greedy.usage.completion_tokens == len(ref.token_ids) and greedy.usage.prompt_tokens == 3
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    seeded = c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=24, temperature=0.9, top_p=0.95, seed=7, n=3)
    for j, ch in enumerate(seeded.choices):  # choice j samples with seed + j
        want = eng.generate([[5, 6, 7]], SamplingParams(**{**sp.__dict__, "seed": 7 + j}))[0]
        assert ch.index == j and ch.text == want.text
    assert seeded.usage.completion_tokens == sum(
        len(eng.generate([[5, 6, 7]], SamplingParams(**{**sp.__dict__, "seed": 7 + j}))[0].token_ids) for j in range(3)
    )
    short = c.completions.create(model="m", prompt="The quick brown", max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    stop = ref.text[6:8]
    cut = c.completions.create(model="m", prompt="The quick brown", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == ref.text[: ref.text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_n_choices_share_one_prefill(live, eng):
    """n=3 with a seed: the choices are the lone requests of seeds 7, 8, 9, and the prompt is computed once
    (the other two choices start from a copy of its keys/values)."""
    prompt = [5, 6, 7, 8, 9, 5, 6]
    kw = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95}
    want = [
        eng.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7 + j))[0].text
        for j in range(3)
    ]
    assert len(set(want)) > 1
    names = ("prompt_tokens_total", "prompt_tokens_shared_total")
    before = [_metric(live.url, m) for m in names]
    out = live.client.completions.create(model="m", prompt=prompt, n=3, seed=7, **kw)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want
    after = [_metric(live.url, m) for m in names]
    assert after[0] - before[0] == len(prompt) and after[1] - before[1] == 2 * len(prompt)
    streamed = live.client.completions.create(model="m", prompt=prompt, n=3, seed=7, stream=True, **kw)
    texts = ["", "", ""]
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == want
    assert _metric(live.url, names[0]) - after[0] == len(prompt)


def test_completion_stream_and_usage(live, eng):
    ref = eng.generate("The quick brown", SamplingParams(max_new_tokens=30, temperature=0.8, seed=3))[0]
    chunks = list(
        live.client.completions.create(
            model="m",
            prompt="The quick brown",
            max_tokens=30,
            temperature=0.8,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_usage_reports_the_requests_speculation(live, eng):
    """usage.speculation: the drafts verified and accepted and the rounds of the request, as Completion.stats."""
    sp = SamplingParams(max_new_tokens=24, temperature=0.8, seed=11)
    want = [eng.generate([[7, 8, 9]], SamplingParams(**{**sp.__dict__, "seed": 11 + j}))[0].stats for j in range(2)]
    spec = {
        "drafted": sum(w["drafted"] for w in want),
        "accepted": sum(w["accepted"] for w in want),
        "rounds": sum(w["target_passes"] for w in want),
    }
    assert spec["drafted"] > 0
    kw = dict(model="m", prompt=[7, 8, 9], max_tokens=24, temperature=0.8, seed=11, n=2)
    whole = live.client.completions.create(**kw)
    assert whole.usage.model_extra["speculation"] == spec
    chunks = list(live.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["speculation"] == spec


def test_logprobs_are_the_targets(live, eng):
    import torch

    out = live.client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=8, temperature=0, logprobs=2)
    ref = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))[0]
    lp = out.choices[0].logprobs
    exact = torch.log_softmax(eng.logits([[5, 6, 7] + ref.token_ids])[0, 2:-1].float(), -1)  # [8, V]
    for i, t in enumerate(ref.token_ids):
        assert math.isclose(lp.token_logprobs[i], exact[i, t].item(), abs_tol=1e-4)
        top = exact[i].topk(2)  # (the legacy shape is a dict by token text: two tokens may share a text)
        assert lp.top_logprobs[i] == pytest.approx(
            {
                eng.tokenizer.decode([t], skip_special_tokens=False): v
                for t, v in reversed(list(zip(top.indices.tolist(), top.values.tolist())))
            },
            abs=1e-4,
        )
        assert lp.tokens[i] == eng.tokenizer.decode([t], skip_special_tokens=False)


# ---------------------------------------------------------------- chat
def test_chat_template_matches_transformers_and_adds_no_second_bos(chat_dir):
    from transformers import AutoTokenizer

    e = Engine.from_pretrained(chat_dir)
    hf = AutoTokenizer.from_pretrained(chat_dir)
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert e.chat_template.render(MESSAGES) == text
    ids = e.chat_prompt(MESSAGES)
    assert ids == hf.encode(text, add_special_tokens=False)
    bos = e.tokenizer.token_to_id("<|endoftext|>")
    assert ids.count(bos) == 1 and e.tokenizer.encode(text).count(bos) == 2  # the plain encode adds one more
    assert (
        e.chat(MESSAGES, SamplingParams(max_new_tokens=6)).token_ids
        == e.generate([ids], SamplingParams(max_new_tokens=6))[0].token_ids
    )


def test_chat_endpoint_stream_and_not(chat_dir):
    e = Engine.from_pretrained(chat_dir, speculation=SpeculationConfig(drafter="ngram", k=2))
    srv = Live(e, "chat-model")
    try:
        ref = e.chat(MESSAGES, SamplingParams(max_new_tokens=16))
        r = srv.client.chat.completions.create(
            model="chat-model", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2
        )
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
        assert r.usage.prompt_tokens == len(e.chat_prompt(MESSAGES))
        assert len(r.choices[0].logprobs.content) == len(ref.token_ids)
        assert all(len(x.top_logprobs) == 2 for x in r.choices[0].logprobs.content)
        chunks = list(
            srv.client.chat.completions.create(
                model="chat-model",
                messages=MESSAGES,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": "chat-model", "messages": [{"role": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        srv.close()


def test_a_chat_without_max_tokens_holds_the_cache_it_uses(chat_dir):
    """The openai client's default chat (no max_tokens: the server gives it the rest of the context) takes one
    cache row of the positions it reached, not max_batch rows of the model's context."""
    e = Engine.from_pretrained(chat_dir, speculation=SpeculationConfig(drafter="ngram", k=2))
    srv = Live(e, "chat-model")
    try:
        r = srv.client.chat.completions.create(model="chat-model", messages=MESSAGES, temperature=0)
        used = r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.completion_tokens > 0 and used <= e.max_seq_len
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.close()
    cache = e.loop.cache
    assert cache is not None and cache.max_batch == 1 and used <= cache.max_seq_len
    gauge = re.search(r"^specmix:kv_cache_bytes\{[^}]*\} (\S+)$", metrics, re.M)
    assert gauge is not None and float(gauge.group(1)) == cache.nbytes


def test_chat_without_template_is_a_clear_400_and_completions_still_work(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="m", messages=MESSAGES)
    assert "no chat template" in e.value.body["message"]
    assert live.client.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------- errors, models, health, metrics
BAD = [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "", "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [1, 999]}, 400, "prompt"),
    ({"prompt": "x", "beam": 4}, 400, "beam"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
    ({"prompt": [1] * 500, "max_tokens": 20}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 9}, 400, "logprobs"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live):
    for body, status, param in BAD:
        r = httpx.post(live.url + "/v1/completions", json=dict({"model": "m"}, **body) if "model" not in body else body)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param, (body, r.text)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="nope", prompt="x")
    assert live.client.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_models_health_metrics(live):
    assert [m.id for m in live.client.models.list().data] == ["m"]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    live.client.completions.create(model="m", prompt="abc", max_tokens=5, stream=True).close()
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_num_accepted_tokens_per_pos_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
    ):
        assert re.search(rf'^specmix:{name}{{[^}}]*model_name="m"', text, re.MULTILINE), name


def test_overload_is_503_with_retry_after_and_a_failed_round_is_500(ckpt_dir, draft_dir):
    small = Engine.from_pretrained(
        ckpt_dir,
        draft_dir,
        speculation=SpeculationConfig(k=2, k_policy="constant"),
        limits=Limits(max_batch=1, max_waiting=0),
    )
    srv = Live(small)
    small.scheduler.on_round = lambda: time.sleep(0.005)
    try:
        h = small.submit([1, 2, 3], SamplingParams(max_new_tokens=200))
        r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert (
            r.status_code == 503 and r.headers["retry-after"] == "1" and "max_waiting=0" in r.json()["error"]["message"]
        )
        h.cancel()
        h.result(timeout=TIMEOUT)

        def boom() -> None:
            raise RuntimeError("injected round failure")

        small.scheduler.on_round = boom
        r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 500 and "injected round failure" in r.json()["error"]["message"]
        small.scheduler.on_round = None
        assert srv.client.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        small.scheduler.on_round = None
        srv.close()


def test_health_asks_the_engine(live, eng):
    """A stalled decode round, or rounds that keep failing, make /health answer 503 (a probe restarts the server)."""
    from engine.core.errors import UnhealthyError

    release, entered = threading.Event(), threading.Event()

    def stall() -> None:
        entered.set()
        release.wait(60)

    eng.scheduler.on_round = stall
    try:
        req = eng.submit("The quick brown", SamplingParams(max_new_tokens=4))
        assert entered.wait(60)
        time.sleep(0.3)
        with pytest.raises(UnhealthyError, match="decode round has run"):
            eng.check_health(stall_s=0.2)
        r = httpx.get(live.url + "/health")  # the server's default stall limit (120 s) is not reached
        assert r.status_code == 200
        release.set()
        req.result()
        eng.check_health(stall_s=0.2)

        def fail() -> None:
            raise RuntimeError("device lost")

        eng.scheduler.on_round = fail
        for i in range(3):
            with pytest.raises(Exception, match="device lost"):
                eng.generate("x", SamplingParams(max_new_tokens=2))
            if i < 2:
                eng.check_health()
        with pytest.raises(UnhealthyError, match="last 3 decode rounds failed"):
            eng.check_health()
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and "last 3 decode rounds failed" in r.json()["error"]
        eng.scheduler.on_round = None
        eng.generate("x", SamplingParams(max_new_tokens=2))  # a good round: healthy again
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    finally:
        release.set()
        eng.scheduler.on_round = None


def _metric(url: str, name: str) -> float:
    for ln in httpx.get(url + "/metrics").text.splitlines():
        if ln.startswith(f"specmix:{name}{{"):
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(name)


# ---------------------------------------------------------------- load: 64 streaming clients, 8 disconnect
def test_64_streaming_clients_8_disconnect(ckpt_dir, draft_dir):
    e = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=16)
    )
    prompts = [[(11 * i + 7 * j) % 290 + 1 for j in range(2 + i % 9)] for i in range(64)]
    solo = [e.generate([p], SamplingParams(max_new_tokens=24))[0] for p in prompts]
    srv = Live(e)
    leavers = set(range(3, 64, 8))
    e.scheduler.on_round = lambda: time.sleep(0.002)  # keep streams open long enough to leave mid-way

    async def client(i: int, http: httpx.AsyncClient) -> str | None:
        body = {"model": "m", "prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True}
        text = ""
        async with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if i in leavers:
                        return None  # leaves mid-stream: the connection closes
        return text

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*[client(i, http) for i in range(64)])

    c0 = e.scheduler.snapshot()["totals"].finished["cancelled"]
    try:
        got = asyncio.run(run())
        for i, text in enumerate(got):
            if i not in leavers:
                assert text == solo[i].text, i
        end = time.monotonic() + 30
        while _metric(srv.url, "num_requests_running") != 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert _metric(srv.url, "num_requests_running") == 0
        cancelled = e.scheduler.snapshot()["totals"].finished["cancelled"] - c0
        assert 1 <= cancelled <= len(leavers)  # a leaver whose last round already ran finishes normally
    finally:
        e.scheduler.on_round = None
        srv.close()
