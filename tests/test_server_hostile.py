"""The server as a hostile client meets it, live on 127.0.0.1: every malformed body is a 400 or 413 in
OpenAI's error JSON naming the field, a request that fails inside the server is a logged 500 (never a
traceback), a streaming client that leaves at any moment cancels its request, a relay that fails ends
its stream with an error event, and tokenization runs off the event loop."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_openai_server import TIMEOUT, Live, _chat_checkpoint  # noqa: E402

from engine import Engine  # noqa: E402
from engine.api.options import Limits, SpeculationConfig  # noqa: E402
from engine.server.options import MAX_DEPTH, RequestLimits  # noqa: E402

# content + strings: None + str is a TypeError (a template that trims or filters would not fail)
CONCAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LIMITS = RequestLimits(
    max_body_bytes=64 * 1024, max_prompts=4, max_n=3, max_stop=2, max_stop_chars=8, max_stop_token_ids=3
)
USER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def eng(ckpt_dir, tmp_path_factory):
    d = _chat_checkpoint(ckpt_dir, tmp_path_factory.mktemp("concat") / "ckpt")
    (d / "chat_template.jinja").write_text(CONCAT_TEMPLATE, encoding="utf-8")
    return Engine.from_pretrained(
        d, speculation=SpeculationConfig(drafter="ngram", k=2), limits=Limits(max_batch=8, max_seq_len=500)
    )


@pytest.fixture(scope="module")
def live(eng):
    srv = Live(eng, limits=LIMITS)
    yield srv
    srv.close()


def _err(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    return err


def _post(live: Live, body: object, chat: bool = False, timeout: float = TIMEOUT) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = json.dumps(body).encode()  # ASCII, so that a lone surrogate travels as its escape
    return httpx.post(live.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=timeout)


def _raw(live: Live, path: str, body: bytes) -> httpx.Response:
    return httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)


# ---------------------------------------------------------------- malformed bodies: 400 naming the field
FIELDS = [
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "seed": [1]}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "n": 2, "seed": 2**64 - 1}, "seed"),  # choice 1 would sample with seed 2**64
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "temperature": 1e-50}, "temperature"),  # 0 in float32, not greedy
    ({"prompt": "x", "top_k": 1.0}, "top_k"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "min_tokens": "3"}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 2**70}, "prompt"),  # prompt + max_tokens beyond max_seq_len
    ({"prompt": "x", "max_tokens": "9"}, "max_tokens"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "stream": 0}, "stream"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "echo": "no"}, "echo"),
    ({"prompt": "x", "best_of": "1"}, "best_of"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "model": ["m"]}, "model"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"prompt": "x", "stop": "\udfff"}, "stop"),
    # the limits
    ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
    ({"prompt": "x", "n": 4}, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ({"prompt": "x", "stop": "123456789"}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
]
CHAT_FIELDS = [
    ({"messages": 5}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [5]}, "messages"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": {"a": 1}}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),  # the template concatenates content
    ({"messages": USER, "logprobs": 1}, "logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": 600}, "messages"),  # prompt + max_tokens beyond max_seq_len
    ({"messages": USER, "metadata": "x"}, "metadata"),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("chat", [False, True])
def test_every_malformed_field_is_a_400_naming_it(live, chat):
    for body, param in CHAT_FIELDS if chat else FIELDS:
        r = _post(live, dict({"max_tokens": 2}, **body), chat)
        assert r.status_code == 400 and _err(r)["param"] == param, (body, r.text)
    ok = {"max_tokens": 3, "ignore_eos": True}  # sampled at the default temperature: an early eos would end it
    r = _post(live, {"messages": USER, **ok} if chat else {"prompt": "x", **ok}, chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


BODIES = [
    b"[" * 1000 + b"]" * 1000,  # beyond json's recursion: a RecursionError inside json.loads
    b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}",  # parses, deeper than MAX_DEPTH
    b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
    b'\xef\xbb\xbf{"prompt": "x"}',  # a UTF-8 byte order mark
    b'\xff\xfe{\x00"\x00',  # UTF-16
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": 1e999}',
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",  # beyond Python's int-from-string limit
    b'["prompt", "x"]',
    b'"x"',
    b"null",
    b"17",
    b"",
    b"{not json",
]


def test_malformed_json_is_a_400_and_the_server_keeps_serving(live):
    for chat in (False, True):
        for body in BODIES:
            r = _raw(live, "/v1/chat/completions" if chat else "/v1/completions", body)
            assert r.status_code == 400, (body[:40], r.text)
            _err(r)
    deep = {"prompt": "x", "user": None, "stop_token_ids": None}
    node: Any = [1]
    for _ in range(MAX_DEPTH):
        node = [node]
    r = _post(live, dict(deep, logit_bias={"a": node}))
    assert r.status_code == 400 and _err(r)["param"] == "logit_bias" and str(MAX_DEPTH) in _err(r)["message"]
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and _err(r)["type"] == "invalid_request_error"
    assert _post(live, {"prompt": "x", "max_tokens": 2}).status_code == 200


def _send_raw(port: int, head: bytes, body: bytes = b"") -> bytes:
    """An HTTP/1.1 request over a plain socket; the response bytes until the server closes or 10 s pass."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                    break
        except TimeoutError:
            pass
        return out


def test_a_body_beyond_the_limit_is_a_413_before_it_is_read(live):
    """A Content-Length beyond the limit is refused with nothing of the body sent; a chunked body is refused
    once it passes the limit, while the client has not finished sending it."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    out = _send_raw(live.port, head + b"Content-Length: 1000000000\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in out, out[:300]
    chunk = b"a" * 4096
    chunks = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * (LIMITS.max_body_bytes // len(chunk) + 1)
    out = _send_raw(live.port, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks)  # no final 0-chunk
    assert out.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in out, out[:300]
    body = json.dumps({"prompt": "x" * LIMITS.max_body_bytes}).encode()
    r = _raw(live, "/v1/completions", body)
    assert r.status_code == 413 and str(LIMITS.max_body_bytes) in _err(r)["message"]
    assert _post(live, {"prompt": "x", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------- faults inside the server
class Wrapped:
    """A ServedEngine that delegates to an Engine, with its tokenizer or its prompt encoding replaced."""

    def __init__(self, eng: Engine, tokenizer: Any = None, encode: Any = None) -> None:
        self.eng, self._tok, self._encode = eng, tokenizer or eng.tokenizer, encode or eng.encode_prompt

    @property
    def tokenizer(self) -> Any:
        return self._tok

    @property
    def max_seq_len(self) -> int:
        return self.eng.max_seq_len

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.eng.chat_prompt(messages, add_generation_prompt)

    def submit_many(self, prompts: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        return self.eng.submit_many(prompts, params)

    def check_health(self) -> None:
        self.eng.check_health()

    def metric_samples(self) -> list[Any]:
        return self.eng.metric_samples()


class FailingTokenizer:
    """The engine's tokenizer, except that incremental decoding (``step``) or whole decoding raises."""

    def __init__(self, tok: Any, fail_step: bool) -> None:
        self.tok, self.fail_step = tok, fail_step

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not self.fail_step:
            raise RuntimeError("injected decode failure")
        return self.tok.decode(ids, skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Any:
        return self.tok.decode_stream(skip_special_tokens)

    def step(self, stream: Any, ids: Any) -> str | None:
        if self.fail_step:
            raise RuntimeError("injected step failure")
        return self.tok.step(stream, ids)


def _cancelled(eng: Engine) -> int:
    return eng.scheduler.snapshot()["totals"].finished["cancelled"]


def _wait_idle(eng: Engine, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while eng.scheduler.snapshot()["running"] or eng.scheduler.snapshot()["waiting"]:
        assert time.monotonic() < end, "requests still running"
        time.sleep(0.02)


def test_an_exception_inside_the_server_is_a_logged_500(eng, caplog):
    def boom(text: str) -> list[int]:
        raise RuntimeError("injected encode failure")

    srv = Live(Wrapped(eng, encode=boom))
    try:
        with caplog.at_level(logging.ERROR, logger="engine.server.edge"):
            r = _post(srv, {"prompt": "x"})
        err = _err(r)
        assert r.status_code == 500 and err["type"] == "server_error" and "RuntimeError" in err["message"]
        assert "Traceback" not in r.text and "injected" not in r.text
        assert any("unhandled error" in rec.getMessage() and rec.exc_info for rec in caplog.records)
        assert _post(srv, {"prompt": [5, 6], "max_tokens": 2}).status_code == 200  # token ids need no encoding
    finally:
        srv.close()


@pytest.mark.parametrize("fail_step", [True, False], ids=["step", "decode"])
def test_a_failing_relay_ends_the_stream_with_an_error_event(eng, fail_step):
    """Incremental decoding (in the choice's relay task) or whole decoding (logprobs, in the event writer)
    raising: the client gets an error event and [DONE], not a hang, and the request is cancelled."""
    srv = Live(Wrapped(eng, tokenizer=FailingTokenizer(eng.tokenizer, fail_step)))
    c0 = _cancelled(eng)
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 1}
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["type"] == "server_error" and "injected" not in err["message"]
        _wait_idle(eng)
        assert _cancelled(eng) == c0 + 1
    finally:
        srv.close()


# ---------------------------------------------------------------- a client that leaves before the first chunk
def _leave_at_once(port: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + data)  # closed at once: not one byte of the response is read


def asgi_spec(version: str) -> Any:
    """An ASGI middleware that reports ``version`` of the ASGI spec to the app (uvicorn reports 2.3; from 2.4 on
    starlette's StreamingResponse no longer listens for the disconnect and waits for a send to fail)."""

    def wrap(app: Any) -> Any:
        async def reporting(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                scope = dict(scope, asgi=dict(scope.get("asgi", {}), spec_version=version))
            await app(scope, receive, send)

        return reporting

    return wrap


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("when", ["while-tokenizing", "at-once"])
def test_a_stream_whose_client_leaves_before_the_first_chunk_is_cancelled(eng, when, spec):
    """The client closes its socket right after sending (or while its prompt is still being tokenized): the
    request is cancelled in a few rounds, far from its 400 tokens, whatever ASGI spec the server speaks."""
    entered, release = threading.Event(), threading.Event()

    def slow(text: str) -> list[int]:
        entered.set()
        release.wait(30)
        return eng.encode_prompt(text)

    srv = Live(Wrapped(eng, encode=slow) if when == "while-tokenizing" else eng, wrap=asgi_spec(spec))
    eng.scheduler.on_round = lambda: time.sleep(0.02)  # 400 tokens take seconds
    c0, t0 = _cancelled(eng), time.monotonic()
    lengths0 = eng.scheduler.snapshot()["totals"].finished["length"]
    try:
        _leave_at_once(srv.port, {"prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True})
        if when == "while-tokenizing":
            assert entered.wait(10)
            time.sleep(0.2)  # the server has seen the disconnect
            release.set()
        end = time.monotonic() + 20
        while _cancelled(eng) == c0:
            assert time.monotonic() < end, "the request was not cancelled"
            time.sleep(0.01)
        _wait_idle(eng)
        assert eng.scheduler.snapshot()["totals"].finished["length"] == lengths0
        assert time.monotonic() - t0 < 20
    finally:
        release.set()
        eng.scheduler.on_round = None
        srv.close()


# ---------------------------------------------------------------- tokenization off the event loop
def test_tokenizing_a_prompt_does_not_block_other_clients(eng):
    """While one request's prompt is being tokenized (held here), /health and other requests are answered."""
    entered, release = threading.Event(), threading.Event()

    def held(text: str) -> list[int]:
        if text == "held":
            entered.set()
            release.wait(30)
        return eng.encode_prompt(text)

    srv = Live(Wrapped(eng, encode=held))
    result: list[httpx.Response] = []
    t = threading.Thread(target=lambda: result.append(_post(srv, {"prompt": "held", "max_tokens": 2})))
    try:
        t.start()
        assert entered.wait(10)
        assert httpx.get(srv.url + "/health", timeout=5).json() == {"status": "ok"}
        r = _post(srv, {"prompt": "other", "max_tokens": 2}, timeout=5)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert t.is_alive()
        release.set()
        t.join(30)
        assert result[0].status_code == 200
    finally:
        release.set()
        srv.close()
